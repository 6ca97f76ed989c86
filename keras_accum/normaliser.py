"""What a micro-batch's loss is divided by, so that a window divides by the window's.

The big batch's gradient is `grad(sum of all terms) / (sum of all normalisers)`:
each micro-batch weighted by its own normaliser, the window divided by their
total. Averaging micro-batch losses instead is the "gradient accumulation loss
bug": a micro-batch of short sequences would weigh as much as one of long ones.
"""

import tensorflow as tf
from keras import losses, ops, tree

from keras_accum import _internals as internals

SUM = "sum"  # the loss is not normalised: the window's gradient is a sum


def loss_normaliser(loss_fn, y_true, y_pred, sample_weight):
    """The divisor Keras's reduction applies to this loss term, a float32 scalar
    (loss elements, unmasked ones, or the sum of sample weights); `SUM` for
    `reduction="sum"`; None when it cannot be known (not a Keras `Loss`, a
    `Loss` with its own `__call__`, or another reduction)."""
    if not isinstance(loss_fn, losses.Loss) or type(loss_fn).__call__ is not losses.Loss.__call__:
        return None
    reduction = loss_fn.reduction
    if reduction == "sum":
        return SUM
    if reduction not in ("sum_over_batch_size", "mean", "mean_with_sample_weight"):
        return None
    # As Keras's Loss.__call__: the predictions' mask, then the losses'. The
    # losses are computed again, outside the gradient, for shape and mask only.
    in_mask = internals.get_keras_mask(y_pred)
    convert = lambda t: ops.convert_to_tensor(t, dtype=loss_fn.dtype)  # noqa: E731
    values = loss_fn.call(tree.map_structure(convert, y_true), tree.map_structure(convert, y_pred))
    out_mask = internals.get_keras_mask(values)
    masks = [m for m in (in_mask, out_mask) if m is not None]
    mask = None if not masks else masks[0] if len(masks) == 1 else masks[0] & masks[1]
    count = tf.cast(tf.size(values), tf.float32)
    if reduction == "mean_with_sample_weight":
        weights = internals.apply_mask(sample_weight, mask, loss_fn.dtype, reduction)
        if weights is None:
            return count
        _, weights = internals.squeeze_or_expand_to_same_rank(values, weights)
        return tf.reduce_sum(tf.cast(weights, tf.float32))
    if mask is None:
        return count
    # Keras weights valid entries by total/valid and divides by the number
    # of losses: the divisor is valid * count / total.
    total = tf.cast(tf.size(mask), tf.float32)
    valid = tf.reduce_sum(tf.cast(mask, tf.float32))
    return tf.math.divide_no_nan(valid * count, total)


def micro_batch_weight(normalisers, num_samples):
    """One weight for a micro-batch from its loss terms' normalisers, and
    whether the window is a mean (`(weight, normalise)`, False for `sum`).

    Several terms: the first's, exact when the terms' normalisers are
    proportional across micro-batches (else one buffer per term would be
    needed). Unknown ones, or `sum` mixed with means: the number of samples.
    """
    samples = tf.cast(num_samples, tf.float32)
    if not normalisers or any(n is None for n in normalisers):
        return samples, True
    if all(n is SUM for n in normalisers):
        return tf.constant(1.0), False
    if any(n is SUM for n in normalisers):
        return samples, True
    return normalisers[0], True
