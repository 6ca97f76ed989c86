"""Keras's losses and masks: the compiled loss and its terms, the logged loss,
and masks on tensors. `keras_accum.normaliser` computes the divisor of
`Loss.__call__`, `reduce_values` and `apply_mask`, reached through
`CompileLoss.call`'s terms (`recording_loss_calls`; fingerprints.py).
"""

import contextlib

import tensorflow as tf
from keras import tree

from keras_accum._internals.versions import moved, reach, required

_LOSS = "keras.src.losses.loss"
apply_mask = reach(_LOSS, "apply_mask")
squeeze_or_expand_to_same_rank = reach(_LOSS, "squeeze_or_expand_to_same_rank")
unscale_loss_for_distribution = reach(_LOSS, "unscale_loss_for_distribution")
get_keras_mask = reach("keras.src.backend.common.masking", "get_keras_mask")
set_keras_mask = reach("keras.src.backend.common.masking", "set_keras_mask")


def compute_loss(model, x, y, y_pred, sample_weight):
    """`model.compute_loss`, also for overrides without a `training` arg."""
    return required(model, "_compute_loss")(
        x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True
    )


def batch_size(x):
    """Number of samples in a batch, counted as Keras's loss tracker does."""
    return tf.shape(next(i for i in tree.flatten(x) if i is not None))[0]


def track_loss(model, loss, n):
    """Updates the model's logged `loss` exactly as Keras's train_step does."""
    loss_tracker(model).update_state(unscale_loss_for_distribution(loss), sample_weight=n)


def loss_tracker(model):
    """The metric holding `model`'s logged loss (None before `compile`; each
    `compile()` makes a new one, and a step traced before updates the old).
    """
    return required(model, "_loss_tracker")


@contextlib.contextmanager
def recording_loss_calls(model, record):
    """Calls `record(loss_fn, y_true, y_pred, sample_weight)` for every compiled
    loss term `model.compute_loss` evaluates inside the block, by swapping
    each `(path, loss_fn, loss_weight, name)` of `CompileLoss._flat_losses`
    for a wrapper. `loss=None` records nothing (then weighed by samples).

    Raises `KerasInternalsChanged` if the terms are not where every reviewed
    Keras keeps them, not built, or not called: the micro-batches would be
    weighted by samples, not by what Keras divides the loss by.
    """
    compile_loss = required(model, "_compile_loss")
    if compile_loss is None:
        yield
        return
    terms = required(compile_loss, "_flat_losses")
    if not compile_loss.built or terms is None:
        # `build_compiled_loss` ran before: the build moved elsewhere.
        raise moved(
            "`CompileLoss.build`",
            "the compiled loss was not built by `Trainer._symbolic_build`",
        )
    calls = []

    def recording(loss_fn):
        def call(y_true, y_pred, sample_weight=None):
            calls.append(loss_fn)
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
    if terms and not calls and _computes_compiled_loss(model):
        raise moved(
            "`CompileLoss.call`",
            "the compiled loss was computed without calling its terms from `_flat_losses`",
        )


def _computes_compiled_loss(model):
    # Keras's own `compute_loss` adds the compiled loss; an override may not.
    import keras

    return type(model).compute_loss is keras.Model.compute_loss


def build_compiled_loss(model, data):
    """Builds the compiled loss (and metrics) from a batch's shapes, if needed,
    with `_symbolic_build` (symbolic copies: nothing added to the trace);
    Keras's TF trainer waits for the first traced step without a strategy."""
    compile_loss = required(model, "_compile_loss")
    if compile_loss is not None and not compile_loss.built:
        required(model, "_symbolic_build")(data_batch=data)
