"""Every place keras_accum reaches into Keras internals, and nowhere else.

Written against Keras 3.15.1 on the TensorFlow backend. Keras 3.x releases
move these names; `tests/test_keras_internals.py` fails loudly, naming this
module, when one of them moves or when the TF trainer's `train_step` (which
`AccumModel.train_step` mirrors) changes.
"""

import contextlib

import tensorflow as tf
from keras import tree
from keras.src.backend.common.masking import get_keras_mask
from keras.src.backend.tensorflow.trainer import TensorFlowTrainer, reduce_per_replica
from keras.src.losses.loss import (
    apply_mask,
    squeeze_or_expand_to_same_rank,
    unscale_loss_for_distribution,
)
from keras.src.models.functional import Functional
from keras.src.models.model import functional_init_arguments
from keras.src.saving.keras_saveable import KerasSaveable
from keras.src.utils.tracking import no_automatic_dependency_tracking

WRITTEN_AGAINST = "3.15.1"

# A `KerasSaveable` attribute of a model is visited by Keras's saving
# (`save`, `save_weights`, `load_weights`) under its own path, which is how
# the pending window travels in `.keras` and `.weights.h5` files without a
# plain model that loads the same file ever seeing it.

# Keras code that keras_accum mirrors rather than calls, by the SHA-256 of
# its source: `AccumModel._accumulate` mirrors the TF trainer's train_step,
# `make_replicated_train_function` its `_make_function`, and
# `keras_accum.normaliser` the divisor Keras's `Loss.__call__`,
# `reduce_values` and `apply_mask` compute, reached through
# `CompileLoss.call`'s terms. tests/test_keras_internals.py compares these.
MIRRORED_SOURCES = {
    "TensorFlowTrainer.train_step": "debf0efab9d5794b017ade2937acbcc51886fc1dc5cf021e7d7e80f974ee707c",
    "TensorFlowTrainer._make_function": "bb33b7a0da3d27406c70fac54b8e9617156ef225f452b93f6addf8cc34aca0d0",
    "Loss.__call__": "f42c42282ee8902b2fb95310f8b9347c728040cf1fbcfdd3b94538c07d2e9fa8",
    "reduce_values": "60b0462147725ad25b69cbfa93f1662fd83a803d6b43add1804d48c7f0cdddb9",
    "apply_mask": "61d8938cd8663dee3c27b678b4af5f17408c2b03ff039b7b2e9125cd07610d00",
    "CompileLoss.call": "402aaf05f91c73c4a4bcaa65be5a447566fbbbb05f5079b29a35312bcbfd509f",
}

__all__ = [
    "Functional",
    "KerasSaveable",
    "TensorFlowTrainer",
    "MIRRORED_SOURCES",
    "WRITTEN_AGAINST",
    "batch_size",
    "build_compiled_loss",
    "call_for_training",
    "compute_loss",
    "apply_mask",
    "functional_init_arguments",
    "make_replicated_train_function",
    "get_keras_mask",
    "recording_loss_calls",
    "squeeze_or_expand_to_same_rank",
    "no_automatic_dependency_tracking",
    "track_loss",
]


def call_for_training(model, x):
    """The forward pass exactly as Keras's train_step makes it."""
    if model._call_has_training_arg:
        return model(x, training=True)
    return model(x)


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


def make_replicated_train_function(model, replica_step, after_step):
    """A train function whose update runs in cross-replica context.

    Keras's TF trainer (`TensorFlowTrainer._make_function`) runs the whole
    step inside `strategy.run`, so a conditional update is a `cond` around
    the optimizer's cross-replica `merge_call` inside a replica, which
    `tf.distribute` refuses (why Keras's own `gradient_accumulation_steps`
    fails under MirroredStrategy, keras-team/keras#20582). Here each step is
    `strategy.run(replica_step)` followed by `after_step()` in cross-replica
    context, where the conditional update lives. Outputs are reduced as
    Keras's `one_step_on_data` reduces them.
    """
    strategy = model.distribute_strategy

    @tf.autograph.experimental.do_not_convert
    def one_step_on_data(data):
        outputs = strategy.run(replica_step, args=(data,))
        after_step()
        return reduce_per_replica(outputs, strategy, reduction="auto")

    if not model.run_eagerly:
        one_step_on_data = tf.function(
            one_step_on_data, reduce_retracing=True, jit_compile=model.jit_compile
        )

    def function(iterator):
        outputs = None
        for _, data in zip(range(model.steps_per_execution), iterator):
            outputs = one_step_on_data(data)
        if outputs is None:
            raise StopIteration
        return outputs

    return function
