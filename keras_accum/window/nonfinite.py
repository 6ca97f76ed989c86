"""The skip policy of `state.close` for `skip_nonfinite=True`, as optax's
`should_skip_update_fn`: asked once per window, it decides for the gradient,
the BatchNormalization moments and the noise scale, so a skipped window moves
nothing."""

import keras
import numpy as np
import tensorflow as tf

from keras_accum import _internals as internals
from keras_accum.window import slices


def all_finite(tensors):
    """Whether every element of every tensor (None skipped; slices' values) is finite."""
    checks = [
        tf.reduce_all(tf.math.is_finite(slices.values_of(t))) for t in tensors if t is not None
    ]
    if not checks:
        return tf.constant(True)
    return tf.reduce_all(tf.stack(checks))


def _loss_scaled(optimizer):
    # A LossScaleOptimizer already skips a non-finite window, and must see it
    # to lower its scale: it is left to do so, the window is only counted.
    return isinstance(optimizer, keras.optimizers.LossScaleOptimizer)


class NonFiniteWindows(tf.Module, internals.SavedState):
    """Skips a window whose gradient holds a NaN or an Inf, and counts it.

    Under mixed_float16 the `LossScaleOptimizer` skips and lowers its scale
    itself; the window is counted all the same. The count is saved.
    """

    def __init__(self, name="nonfinite_windows"):
        super().__init__(name=name)
        with tf.init_scope():
            self.skipped = tf.Variable(
                0,
                dtype=tf.int64,
                trainable=False,
                name="skipped_windows",
                aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
            )

    def __call__(self, finite, optimizer, apply, discard):
        """`apply()` if `finite()` (agreed across replicas), else `discard()`;
        counted either way."""
        finite = finite()
        if _loss_scaled(optimizer):
            apply()
        else:
            tf.cond(finite, apply, discard)
        self._count(finite)

    def _count(self, finite):
        self.skipped.assign_add(tf.cast(tf.logical_not(finite), tf.int64))

    def snapshot(self):
        """The count as an int, for `restore` (after a failed load)."""
        return int(self.skipped.numpy())

    def restore(self, snapshot):
        self.skipped.assign(snapshot)

    def save_own_variables(self, store):
        store["skipped_windows"] = self.skipped.numpy()

    def load_own_variables(self, store):
        keys = set(store.keys())
        if not keys:
            # Saved without skip_nonfinite: nothing skipped then.
            self.skipped.assign(0)
            return
        if keys != {"skipped_windows"}:
            raise ValueError(
                "The checkpoint's count of skipped windows is not keras_accum's: "
                f"expected the entry ['skipped_windows'], found {sorted(keys)}."
            )
        self.skipped.assign(int(np.asarray(store["skipped_windows"])))
