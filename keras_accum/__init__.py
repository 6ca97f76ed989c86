"""keras_accum: exact gradient accumulation for Keras 3 on TensorFlow.

Train with the batch you can afford and get the updates of the batch you
want: micro-batch `b` with `accum_steps=N` is the same training as batch `N*b`.

```python
import keras_accum
model = keras_accum.AccumModel(inputs, outputs, accum_steps=4)
model = keras_accum.wrap(existing_model, accum_steps=4)
model.fit(x, y, batch_size=32, accum_steps=8)
optimizer = keras_accum.AccumOptimizer(keras.optimizers.Adam(), accum_steps=4)
model.fit(x, y, batch_size=32, callbacks=[keras_accum.AccumScheduler({0: 1, 3: 4})])
```
"""

try:
    import tensorflow  # noqa: F401
except ImportError as error:
    raise ImportError(
        "keras_accum needs TensorFlow >= 2.18, which is not installed. "
        "Install it with `pip install 'tensorflow>=2.18'` (or your "
        "platform's TensorFlow build, e.g. tensorflow-cpu), or from a clone "
        "of keras_accum with `python -m pip install '.[tensorflow]'`."
    ) from error

import keras  # noqa: E402

if keras.backend.backend() != "tensorflow":
    raise ImportError(
        "keras_accum trains through TensorFlow, but Keras is set to the "
        f"'{keras.backend.backend()}' backend. Set KERAS_BACKEND=tensorflow "
        "before importing keras (or in ~/.keras/keras.json)."
    )

from keras_accum.backup import BackupAndRestore  # noqa: E402
from keras_accum.growth.sample_schedule import SampleSchedule  # noqa: E402
from keras_accum.growth.scheduler import AccumScheduler  # noqa: E402
from keras_accum.model import AccumModel  # noqa: E402
from keras_accum.optimizer import AccumOptimizer  # noqa: E402
from keras_accum.wrap import wrap  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "AccumModel",
    "AccumOptimizer",
    "AccumScheduler",
    "BackupAndRestore",
    "SampleSchedule",
    "__version__",
    "wrap",
]
