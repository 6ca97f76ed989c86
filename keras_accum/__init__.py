"""keras_accum: exact gradient accumulation for Keras 3 on TensorFlow.

Train with the batch you can afford and get the updates of the batch you
want: micro-batch `b` with `accum_steps=N` is the same training as batch `N*b`.

```python
import keras_accum
model = keras_accum.AccumModel(inputs, outputs, accum_steps=4)
model = keras_accum.wrap(existing_model, accum_steps=4)
model.fit(x, y, batch_size=32, accum_steps=8)
```
"""

from keras_accum.model import AccumModel
from keras_accum.wrap import wrap

__version__ = "0.1.0"

__all__ = ["AccumModel", "__version__", "wrap"]
