"""What a micro-batch's loss is divided by, so that a window divides by the window's.

Keras divides a batch's summed loss by a normaliser: the number of loss
elements (`sum_over_batch_size`), the number of unmasked ones when the
predictions carry a mask, the sum of sample weights
(`mean_with_sample_weight`), or nothing (`sum`). The big batch's gradient is
`grad(sum of all terms) / (sum of all normalisers)`; weighting each
micro-batch's gradient by its own normaliser and dividing the window by their
total gives exactly that. Averaging per-micro-batch losses instead is the
"gradient accumulation loss bug": a micro-batch of short sequences would
count as much as one of long ones.
"""

import tensorflow as tf
from keras import losses, ops, tree

from keras_accum import _internals as internals

SUM = "sum"  # the loss is not normalised: the window's gradient is a sum


def loss_normaliser(loss_fn, y_true, y_pred, sample_weight):
    """The divisor Keras's reduction applies to this loss term.

    Returns a float32 scalar tensor, `SUM` for `reduction="sum"`, or None when
    it cannot be known (not a Keras `Loss`, a `Loss` with its own `__call__`,
    or an unsupported reduction).
    """
    if not isinstance(loss_fn, losses.Loss) or type(loss_fn).__call__ is not losses.Loss.__call__:
        return None
    reduction = loss_fn.reduction
    if reduction == "sum":
        return SUM
    if reduction not in ("sum_over_batch_size", "mean", "mean_with_sample_weight"):
        return None
    # As Keras's Loss.__call__: the mask of the predictions, then of the
    # element-wise losses. The losses are computed again, outside the
    # gradient, only for their shape and mask.
    in_mask = internals.get_keras_mask(y_pred)
    convert = lambda t: ops.convert_to_tensor(t, dtype=loss_fn.dtype)  # noqa: E731
    values = loss_fn.call(
        tree.map_structure(convert, y_true), tree.map_structure(convert, y_pred)
    )
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
    """One weight for a micro-batch from its loss terms' normalisers.

    Args:
        normalisers: `loss_normaliser` results, one per compiled loss term.
        num_samples: the micro-batch's number of samples.

    Returns:
        `(weight, normalise)`: the micro-batch's weight, and whether the
        window's gradient is divided by the window's total weight (False for
        `sum` losses, whose window gradient is a sum).

    One term: its normaliser, exactly Keras's big-batch division. Several
    terms: the first term's normaliser, exact when the terms' normalisers are
    proportional across micro-batches (e.g. all per-sample losses, or all
    masked alike); a window cannot divide each term by its own total without
    one buffer per term. Unknown normalisers, or `sum` mixed with means, fall
    back to the number of samples.
    """
    samples = tf.cast(num_samples, tf.float32)
    if not normalisers or any(n is None for n in normalisers):
        return samples, True
    if all(n is SUM for n in normalisers):
        return tf.constant(1.0), False
    if any(n is SUM for n in normalisers):
        return samples, True
    return normalisers[0], True
