"""The accumulation window: everything a model accumulates between two
optimizer updates (`AccumState`, state.py), and the one rule by which a
window is applied, skipped or discarded (`state.close`).

The state's parts, each in a module of its own:

- the gradient buffers (buffers.py: the arithmetic; binding.py: which
  variables they belong to; file_format.py: how they are saved; slices.py:
  sparse gradients kept as slices or per-row sums; trace.py: what the
  step being traced added; replicas.py: per-replica state);
- the skip policy (nonfinite.py), asked once per window;
- the observers: the BatchNormalization moments pooled over the window
  (batchnorm.py) and the gradient noise scale measured from it
  (noise_scale.py).

Example:

```python
from keras_accum.window import AccumState, close
state = AccumState(GradientAccumulator(), BatchNormMoments(model), NonFiniteWindows())
state.when_full(4, lambda: close(state, optimizer, strategy))
```
"""

from keras_accum.window.state import AccumState, close, close_batch

__all__ = ["AccumState", "close", "close_batch"]
