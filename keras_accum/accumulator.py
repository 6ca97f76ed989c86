"""The accumulation window: gradient buffers and the counters that go with them.

Everything that accumulates in keras_accum goes through `GradientAccumulator`,
so the arithmetic that makes uneven windows exact lives in one place.
"""

import numbers

import tensorflow as tf


def check_accum_steps(accum_steps):
    """Returns `accum_steps` as a Python int, or raises naming what was received.

    Accepts Python and numpy integers >= 1. Rejects bools (a `True` is almost
    always a mistake, not "1"), floats and strings, even integral ones, so that
    `accum_steps=2.0` coming from a config file is caught rather than guessed.
    """
    if isinstance(accum_steps, bool) or not isinstance(
        accum_steps, numbers.Integral
    ):
        raise TypeError(
            "`accum_steps` must be an integer >= 1. "
            f"Received: accum_steps={accum_steps!r} "
            f"(of type {type(accum_steps).__name__}). "
            "Pass a whole number such as accum_steps=4."
        )
    if accum_steps < 1:
        raise ValueError(
            "`accum_steps` must be an integer >= 1. "
            f"Received: accum_steps={accum_steps!r}. "
            "Use accum_steps=1 for no accumulation."
        )
    return int(accum_steps)


def _buffer_dtype(variable):
    # float32 for float16/bfloat16/float32 variables: summing many low-precision
    # gradients in low precision is where accumulation loses accuracy. float64
    # variables keep float64 so the buffer is never less precise than the weight.
    if tf.as_dtype(variable.dtype) == tf.float64:
        return tf.float64
    return tf.float32


class GradientAccumulator(tf.Module):
    """Sums weighted micro-batch gradients until a window is applied.

    A window is the run of micro-batches that together make one optimizer
    update. Each micro-batch adds `weight * gradient`, where `weight` is what
    the micro-batch's loss was normalised by (its number of samples, for
    Keras's default `sum_over_batch_size` reduction). The window's gradient is
    `acc_grads / window_weight`: the gradient of the loss over every sample in
    the window, exactly what one big batch of those samples gives, however
    unevenly the samples were split.

    The state is held in `tf.Variable`s so it lives inside `tf.function`s and
    is saved by `tf.train.Checkpoint`:

    Attributes:
        micro_step: int64 scalar; micro-batches added since the last update.
        window_weight: scalar; the sum of the weights added in this window.
        acc_grads: one buffer per trainable variable (float32, or float64 for
            float64 variables) holding the sum of weighted gradients.

    Example:

    ```python
    acc = GradientAccumulator()
    acc.build(model.trainable_variables)
    acc.add(grads, weight=batch_size)          # every micro-batch
    optimizer.apply(acc.window_gradients(), model.trainable_variables)
    acc.reset()                                # after the update
    ```
    """

    def __init__(self, name="gradient_accumulator"):
        super().__init__(name=name)
        self.micro_step = None
        self.window_weight = None
        self.acc_grads = []
        # Indices of variables whose gradient was None when the step was
        # traced: the optimizer must see None for them, as it does for a big
        # batch, not a zero gradient (which would still move Adam or decay).
        self._absent = frozenset()
        self._built = False

    @property
    def built(self):
        return self._built

    def build(self, variables):
        """Creates a zeroed buffer for each of `variables` and the counters.

        Variables are created outside any surrounding `tf.function`, so a
        lazy first build from inside a traced step is safe.
        """
        with tf.init_scope():
            self.micro_step = tf.Variable(
                0, dtype=tf.int64, trainable=False, name="micro_step"
            )
            self.window_weight = tf.Variable(
                0.0, dtype=tf.float32, trainable=False, name="window_weight"
            )
            self.acc_grads = [
                tf.Variable(
                    tf.zeros(v.shape, dtype=_buffer_dtype(v)),
                    trainable=False,
                    name=f"acc_grad_{i}",
                )
                for i, v in enumerate(variables)
            ]
        self._built = True

    def add(self, grads, weight):
        """Adds one micro-batch: `acc_grads += grads` and the window's weight.

        Args:
            grads: gradients of `weight * loss` (the weighting is folded into
                the backward pass by the caller, where it costs one scalar
                multiply instead of one per element). `tf.IndexedSlices` are
                scatter-added, never densified.
            weight: scalar; what this micro-batch's loss was normalised by.
        """
        self._absent = frozenset(i for i, g in enumerate(grads) if g is None)
        for buf, g in zip(self.acc_grads, grads):
            if g is None:
                continue
            if isinstance(g, tf.IndexedSlices):
                buf.scatter_add(
                    tf.IndexedSlices(
                        tf.cast(g.values, buf.dtype), g.indices, g.dense_shape
                    )
                )
            else:
                buf.assign_add(tf.cast(g, buf.dtype))
        self.window_weight.assign_add(tf.cast(weight, tf.float32))
        self.micro_step.assign_add(1)

    def window_gradients(self, variables):
        """The window's gradient per variable, in each variable's dtype.

        Variables that had no gradient give None, as they would for the big
        batch.
        """
        inv = 1.0 / self.window_weight
        return [
            None
            if i in self._absent
            else tf.cast(buf * tf.cast(inv, buf.dtype), v.dtype)
            for i, (buf, v) in enumerate(zip(self.acc_grads, variables))
        ]

    def reset(self):
        """Zeroes the buffers and counters: a new window starts."""
        for buf in self.acc_grads:
            buf.assign(tf.zeros_like(buf))
        self.window_weight.assign(0.0)
        self.micro_step.assign(0)
