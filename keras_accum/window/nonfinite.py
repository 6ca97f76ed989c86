"""Skipping windows whose gradient is not finite (`skip_nonfinite=True`):
the skip policy of `state.close`, as optax's `should_skip_update_fn`.

`state.close` asks the policy once per window; the policy decides for all
of the window's state at once (the gradient, the BatchNormalization
moments, the noise scale), so a skipped window moves nothing.
"""

import keras
import numpy as np
import tensorflow as tf

from keras_accum import _internals as internals
from keras_accum.window import slices


def all_finite(tensors):
    """A boolean scalar: every element of every tensor (None skipped) is finite.

    For a `tf.IndexedSlices`, its values: a window kept as slices (slices.py)
    holds nothing else.
    """
    checks = [
        tf.reduce_all(tf.math.is_finite(slices.values_of(t)))
        for t in tensors
        if t is not None
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

    A skipped window makes no update: weights, optimizer state and
    `optimizer.iterations` are untouched; its micro-batches are discarded
    and the next window starts afresh. Under mixed_float16 the
    `LossScaleOptimizer` keeps doing what it does (skip and lower its
    scale); the window is counted all the same.

    The count is a `tf.Variable`, saved by `tf.train.Checkpoint` and by
    Keras's `save`/`save_weights` with the rest of the training state.

    Attributes:
        skipped: int64 scalar; windows skipped so far.

    Example:

    ```python
    guard = NonFiniteWindows()
    guard(lambda: all_finite(grads), optimizer, apply, discard)  # apply() unless not finite
    ```
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
        """The skip policy (state.py): `apply()` if `finite()` (the window's
        gradient has no NaN or Inf, agreed across replicas), else
        `discard()`; counted either way.

        All the window state that `apply` and `discard` touch (gradients,
        BatchNormalization moments, the noise scale) follows the one
        decision.
        """
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

    # -- Keras saving -------------------------------------------------------------

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

