"""Keras's losses and masks: the compiled loss, its terms and what each one
divides by, the logged loss, and the masks Keras carries on tensors.

`keras_accum.normaliser` computes the divisor of Keras's `Loss.__call__`,
`reduce_values` and `apply_mask`, reached through `CompileLoss.call`'s
terms (`recording_loss_calls`); see fingerprints.py.
"""

import contextlib

import tensorflow as tf
from keras import tree

from keras_accum._internals.versions import reach

_LOSS = "keras.src.losses.loss"
apply_mask = reach(_LOSS, "apply_mask")
squeeze_or_expand_to_same_rank = reach(_LOSS, "squeeze_or_expand_to_same_rank")
unscale_loss_for_distribution = reach(_LOSS, "unscale_loss_for_distribution")
get_keras_mask = reach("keras.src.backend.common.masking", "get_keras_mask")
set_keras_mask = reach("keras.src.backend.common.masking", "set_keras_mask")


def compute_loss(model, x, y, y_pred, sample_weight):
    """`model.compute_loss`, also for overrides without a `training` arg."""
    return model._compute_loss(
        x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True
    )


def batch_size(x):
    """Number of samples in a batch, counted as Keras's loss tracker does."""
    return tf.shape(next(i for i in tree.flatten(x) if i is not None))[0]


def track_loss(model, loss, n):
    """Updates the model's logged `loss` exactly as Keras's train_step does."""
    model._loss_tracker.update_state(
        unscale_loss_for_distribution(loss), sample_weight=n
    )


def loss_tracker(model):
    """The metric holding `model`'s logged loss (None before `compile`).

    `compile()` makes a new one; a step traced before it updates the old one.
    """
    return getattr(model, "_loss_tracker", None)


@contextlib.contextmanager
def recording_loss_calls(model, record):
    """Calls `record(loss_fn, y_true, y_pred, sample_weight)` for every
    compiled loss term that `model.compute_loss` evaluates inside the block.

    Keras's `CompileLoss` keeps its terms in `_flat_losses` as
    `(path, loss_fn, loss_weight, name)`; each term is swapped for a wrapper
    for the duration of the block (a trace), then put back. Models without a
    compiled loss record nothing.
    """
    compile_loss = getattr(model, "_compile_loss", None)
    terms = getattr(compile_loss, "_flat_losses", None)
    if not terms:
        # Unbuilt: without a distribution strategy Keras builds the compiled
        # loss lazily, in the first traced step, after the point where we
        # must wrap its terms; see build_compiled_loss.
        yield
        return

    def recording(loss_fn):
        def call(y_true, y_pred, sample_weight=None):
            record(loss_fn, y_true, y_pred, sample_weight)
            return loss_fn(y_true, y_pred, sample_weight)

        return call

    compile_loss._flat_losses = [
        (path, recording(fn), weight, name) for path, fn, weight, name in terms
    ]
    try:
        yield
    finally:
        compile_loss._flat_losses = terms


def build_compiled_loss(model, data):
    """Builds the compiled loss (and metrics) from a batch's shapes, if needed.

    Keras's TF trainer defers this to the first traced step when there is no
    distribution strategy; `_symbolic_build` is what it runs otherwise, and
    works on symbolic copies of the batch, adding nothing to the trace.
    """
    compile_loss = getattr(model, "_compile_loss", None)
    if compile_loss is not None and not compile_loss.built:
        model._symbolic_build(data_batch=data)
