"""The arithmetic that makes a window's sum exact: how a micro-batch's
gradient goes into the window, and how the window's sum comes out as the
update's gradient.

A micro-batch's loss is normalised by its weight `w_i` (what Keras divides
it by: samples, unmasked tokens, sample weights; normaliser.py), and under
loss scaling multiplied by the optimizer's scale `s`. So its gradient
`g_i` is turned into `w_i * gradient_i` by `into_window(w_i, s)` =
`w_i / s`, and the window's sum `sum_i w_i * gradient_i` into the big
batch's gradient by `out_of_window(normalise, sum_i w_i, s)` =
`s / sum_i w_i` (the loss scale again, for the `LossScaleOptimizer`'s own
unscaling and overflow check, once per window, as for the big batch).
Everything else in keras_accum multiplies by these two factors.
The sum itself is kept in `buffer_dtype`: float32 for low-precision
variables, unless `accum_dtype` asks otherwise.

Example:

```python
buffer += gradient * into_window(weight, loss_scale_of(optimizer))
update = buffer * out_of_window(True, window_weight, loss_scale_of(optimizer))
```
"""

import tensorflow as tf


def loss_scale_of(optimizer):
    """The factor `optimizer.scale_loss` multiplies losses by, or None for 1.

    A `LossScaleOptimizer` (mixed_float16) gives its dynamic scale, a tensor;
    an optimizer with `loss_scale_factor` gives that; any other gives None, so
    nothing is multiplied on the unscaled path.

    Example:

    ```python
    loss_scale_of(keras.optimizers.SGD())  # None
    ```
    """
    scale = optimizer.scale_loss(1.0)
    if isinstance(scale, (int, float)) and scale == 1:
        return None
    return scale


def into_window(weight, loss_scale):
    """What a micro-batch's (loss-scaled) gradient is multiplied by as it is
    added: `weight / loss_scale`; None when both are None (nothing to do).

    Example:

    ```python
    into_window(32.0, None)  # 32.0
    ```
    """
    if loss_scale is None:
        return weight
    return (1.0 if weight is None else weight) / loss_scale


def out_of_window(normalise, total_weight, loss_scale):
    """What the window's sum is multiplied by to give the update's gradient:
    `1 / total_weight` for a mean (`normalise`; a Python bool or a boolean
    tensor), 1 for a sum, times `loss_scale` if given; None for 1.

    `divide_no_nan`: a window whose loss terms were all masked has weight 0
    and, as Keras's big batch, a zero gradient.

    Example:

    ```python
    out_of_window(True, tf.constant(92.0), None)  # 1 / 92
    ```
    """
    if isinstance(normalise, bool):
        inv = tf.math.divide_no_nan(1.0, total_weight) if normalise else None
    else:
        inv = tf.where(normalise, tf.math.divide_no_nan(1.0, total_weight), 1.0)
    if loss_scale is not None:
        scale = tf.cast(loss_scale, tf.float32)
        inv = scale if inv is None else inv * scale
    return inv


def buffer_dtype(variable_dtype, requested=None):
    """The dtype of a variable's buffer: `requested`, else float32 for
    float16/bfloat16/float32 variables (summing many low-precision gradients
    in low precision is where accumulation loses accuracy), float64 for
    float64 variables (never less precise than the weight)."""
    if requested is not None:
        return tf.as_dtype(requested)
    return tf.float64 if tf.as_dtype(variable_dtype) == tf.float64 else tf.float32


def scaled(g, scale):
    """`g * scale` in its sum dtype (float32 for half precision, as the
    buffers); sparse gradients stay sparse; `scale` None: only the cast."""
    if g is None:
        return None
    if isinstance(g, tf.IndexedSlices):
        values = scaled(g.values, scale)
        return tf.IndexedSlices(values, g.indices, g.dense_shape)
    g = tf.cast(g, buffer_dtype(g.dtype))
    return g if scale is None else g * tf.cast(scale, g.dtype)
