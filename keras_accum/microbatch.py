"""Micro-batches inside the step: each batch `fit` draws is split, its
gradients summed exactly, and one update made.

The step runs the forward and backward pass of every micro-batch of the batch
in turn (unrolled in the traced graph: no `tf.while_loop`, so XLA fuses it
like any other step) and sums their gradients, each micro-batch weighted by
what Keras normalises its loss by (normaliser.py), exactly as a window of
`accum_steps` micro-batches is summed across steps. Only one micro-batch's
activations are alive at a time, so memory is the micro-batch's; the update,
the logged loss and the metrics are the whole batch's.
"""

import math
import numbers
from typing import NamedTuple

import tensorflow as tf
from keras import tree

from keras_accum import _keras_internals as internals

AUTO = "auto"


def check_micro_batch_size(micro_batch_size):
    """Returns `micro_batch_size` (a Python int, None or "auto"), or raises
    naming what was received.

    Rejects bools, floats and other strings, even integral floats, as
    `check_accum_steps` does.
    """
    if micro_batch_size is None or micro_batch_size == AUTO:
        return micro_batch_size
    if isinstance(micro_batch_size, bool) or not isinstance(
        micro_batch_size, numbers.Integral
    ):
        raise TypeError(
            "`micro_batch_size` must be an integer >= 1, 'auto' or None. "
            f"Received: micro_batch_size={micro_batch_size!r} "
            f"(of type {type(micro_batch_size).__name__}). "
            "Pass a whole number such as micro_batch_size=32, or None to "
            "train on whole batches."
        )
    if micro_batch_size < 1:
        raise ValueError(
            "`micro_batch_size` must be an integer >= 1, 'auto' or None. "
            f"Received: micro_batch_size={micro_batch_size!r}. "
            "Use None to train on whole batches."
        )
    return int(micro_batch_size)


def static_batch_size(data):
    """The batch dimension of `data` as a Python int, or None if unknown."""
    x = data[0] if isinstance(data, tuple) else data
    for leaf in tree.flatten(x):
        if leaf is not None and getattr(leaf, "shape", None) is not None:
            if len(leaf.shape) == 0:
                return None
            dim = leaf.shape[0]
            return None if dim is None else int(dim)
    return None


def num_micro_batches(batch_size, micro_batch_size):
    """How many micro-batches a batch of `batch_size` samples is split into."""
    return max(1, math.ceil(batch_size / micro_batch_size))
