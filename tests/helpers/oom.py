"""Real out-of-memory errors on demand, for `micro_batch_size="auto"`.

`Limit` and `LimitedLoss` ask TensorFlow for an impossible tensor (2**40
floats per sample) whenever they see more than `k` samples at once, so the
allocator raises a genuine `ResourceExhaustedError` on any machine, without
allocating anything. Under the tests' allocator (tests/conftest.py) it is
raised at once; TensorFlow's default CPU allocator would first retry it for
10 s.
"""

import keras
import tensorflow as tf


def _impossible(n, like):
    # n x 2**40 floats. The width is made from the data so that no graph
    # optimisation can evaluate (and fail on) the allocation ahead of time.
    width = tf.constant(2**40, tf.int64) + tf.cast(
        tf.reduce_min(tf.abs(tf.sign(like))) * 0, tf.int64
    )
    huge = tf.zeros(tf.stack([n, width]), like.dtype)
    return tf.reduce_sum(huge[:1, :1]) * 0  # kept in the graph, adds 0


def _limited(x, k):
    """`x`, plus an impossible allocation if `x` holds more than `k` samples."""
    n = tf.shape(x, out_type=tf.int64)[0]
    return x + tf.cond(n > k, lambda: _impossible(n, x), lambda: tf.zeros((), x.dtype))


class Limit(keras.layers.Layer):
    """The identity, out of memory above `k` samples at once; no weights."""

    def __init__(self, k, **kwargs):
        super().__init__(**kwargs)
        self.k = k

    def call(self, x):
        return _limited(x, self.k)


class LimitedLoss(keras.losses.SparseCategoricalCrossentropy):
    """The test loss, out of memory above `k` samples at once: puts a limit on
    every way in without touching its model."""

    def __init__(self, k):
        super().__init__(from_logits=True)
        self.k = k

    def call(self, y_true, y_pred):
        return _limited(super().call(y_true, y_pred), self.k)

    def get_config(self):
        return {"k": self.k}
