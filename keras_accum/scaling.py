"""The arithmetic that makes a window's sum exact: a micro-batch's gradient (of
a loss normalised by `w_i`, times the loss scale `s`) enters the window times
`into_window(w_i, s) = w_i / s` and the sum leaves it times `out_of_window(...)
= s / sum_i w_i`, the loss scale kept for the `LossScaleOptimizer`'s own
unscaling and overflow check, once per window as for the big batch."""

import tensorflow as tf


def loss_scale_of(optimizer):
    """The factor `optimizer.scale_loss` multiplies losses by (a
    `LossScaleOptimizer`'s dynamic scale, or `loss_scale_factor`); None for 1."""
    scale = optimizer.scale_loss(1.0)
    if isinstance(scale, (int, float)) and scale == 1:
        return None
    return scale


def into_window(weight, loss_scale):
    """What a micro-batch's (loss-scaled) gradient is multiplied by as it is
    added: `weight / loss_scale`; None when both are None."""
    if loss_scale is None:
        return weight
    return (1.0 if weight is None else weight) / loss_scale


def out_of_window(normalise, total_weight, loss_scale):
    """What the window's sum is multiplied by to give the update's gradient:
    `1 / total_weight` for a mean, 1 for a sum, times `loss_scale` if given;
    None for 1. A window of weight 0 (all masked) gives a zero gradient, as
    Keras's big batch does."""
    if isinstance(normalise, bool):
        inv = tf.math.divide_no_nan(1.0, total_weight) if normalise else None
    else:
        inv = tf.where(normalise, tf.math.divide_no_nan(1.0, total_weight), 1.0)
    if loss_scale is not None:
        scale = tf.cast(loss_scale, tf.float32)
        inv = scale if inv is None else inv * scale
    return inv


def buffer_dtype(variable_dtype, requested=None):
    """A variable's buffer dtype: `requested`, else float32 for half and single
    precision (summing many low-precision gradients in low precision loses
    accuracy), float64 for float64 variables."""
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
