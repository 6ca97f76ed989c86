"""The window: what a model accumulates between two optimizer updates
(`AccumState`, state.py) and the one rule that applies, skips or discards it
(`state.close`); the gradient buffers (buffers.py and the modules it uses), the
skip policy (nonfinite.py), and the observers: BatchNormalization moments
(batchnorm.py) and the gradient noise scale (noise_scale.py).
"""

from keras_accum.window.buffers import MicroBatch
from keras_accum.window.state import AccumState, close, close_batch

__all__ = ["AccumState", "MicroBatch", "close", "close_batch"]
