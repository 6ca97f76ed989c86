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
from keras.src.backend.tensorflow.trainer import (
    TensorFlowTrainer,
    _collective_all_reduce_multi_worker,
    reduce_per_replica,
)
from keras.src.layers.normalization.batch_normalization import BatchNormalization
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
# `make_replicated_function` its `_make_function`, and
# `keras_accum.normaliser` the divisor Keras's `Loss.__call__`,
# `reduce_values` and `apply_mask` compute, reached through
# `CompileLoss.call`'s terms; `symbolic_build` and `reduce_outputs` replace
# `_maybe_symbolic_build` and the multi-worker branch of `reduce_per_replica`
# (tensorflow/tensorflow#72388). `keras_accum.batchnorm` relies on
# `BatchNormalization.call` updating the moving statistics as
# `moving * momentum + batch * (1 - momentum)` from what `_moments` returns.
# tests/test_keras_internals.py compares these.
MIRRORED_SOURCES = {
    "TensorFlowTrainer.train_step": "debf0efab9d5794b017ade2937acbcc51886fc1dc5cf021e7d7e80f974ee707c",
    "TensorFlowTrainer._make_function": "bb33b7a0da3d27406c70fac54b8e9617156ef225f452b93f6addf8cc34aca0d0",
    "Loss.__call__": "f42c42282ee8902b2fb95310f8b9347c728040cf1fbcfdd3b94538c07d2e9fa8",
    "reduce_values": "60b0462147725ad25b69cbfa93f1662fd83a803d6b43add1804d48c7f0cdddb9",
    "apply_mask": "61d8938cd8663dee3c27b678b4af5f17408c2b03ff039b7b2e9125cd07610d00",
    "CompileLoss.call": "402aaf05f91c73c4a4bcaa65be5a447566fbbbb05f5079b29a35312bcbfd509f",
    "TensorFlowTrainer._maybe_symbolic_build": "92a504f5eba9b29f81f1bf26180bdd5bf5186b06b7bda426534b90d2d02bc1c2",
    "reduce_per_replica": "2e7d54b1e6edc29a8c6a7e6b66cd4c8be3ba7842412c93753ac3afe169fa7fb8",
    "BatchNormalization.call": "31502bd832c5eb64f0bb108a4db21f204b906fff8bebd34ffa3a4f68eab00eb5",
    "BatchNormalization._moments": "2ba739b46f4fadea719cd8e41e56d591ef86adae38d58c11930efba046093378",
}

__all__ = [
    "BatchNormalization",
    "Functional",
    "KerasSaveable",
    "TensorFlowTrainer",
    "MIRRORED_SOURCES",
    "WRITTEN_AGAINST",
    "batch_size",
    "build_compiled_loss",
    "call_for_training",
    "compute_loss",
    "copy_build_shapes",
    "apply_mask",
    "batch_normalization_layers",
    "recording_moments",
    "functional_init_arguments",
    "make_replicated_function",
    "multi_worker",
    "set_initial_epoch",
    "reduce_outputs",
    "symbolic_build",
    "get_keras_mask",
    "recording_loss_calls",
    "squeeze_or_expand_to_same_rank",
    "no_automatic_dependency_tracking",
    "track_loss",
    "unknown_variables",
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


def copy_build_shapes(source, target):
    """Records `source`'s build input shapes as `target`'s.

    `Layer.build` records them when it runs; Keras's `export()` reads them
    to serve a subclassed model. A wrapper made around a built model is
    built without running `build`.
    """
    target._build_shapes_dict = getattr(source, "_build_shapes_dict", None)


def unknown_variables(optimizer, variables):
    """Those of `variables` a built `optimizer` was not built for."""
    known = optimizer._trainable_variables_indices
    return [v for v in variables if optimizer._var_key(v) not in known]


def multi_worker(strategy):
    """Whether `strategy` runs across several worker processes."""
    return _collective_all_reduce_multi_worker(strategy)


def set_initial_epoch(model, epoch):
    """Makes the coming `fit` start at `epoch`, as Keras's BackupAndRestore does."""
    model._initial_epoch = epoch


def symbolic_build(model, iterator=None, data_batch=None, without_strategy=False):
    """`TensorFlowTrainer._maybe_symbolic_build`, without a cross-replica reduce.

    Keras builds the model, compiled loss, metrics and optimizer from a
    batch's shapes before the first step; to get one batch out of a
    distributed iterator it reduces the `PerReplica` batch across replicas,
    eagerly, which fails under `MultiWorkerMirroredStrategy`
    (tensorflow/tensorflow#72388). Only shapes and dtypes are read, so one
    local replica's batch does as well, and no collective runs.

    Without a strategy Keras waits for the first traced step instead; with
    `without_strategy=True` the build happens here all the same.
    """
    if model._distribute_strategy is None and not without_strategy:
        # As Keras: without a strategy, building waits for the first trace.
        return
    strategy = model.distribute_strategy

    def local(value):
        if isinstance(value, tf.distribute.DistributedValues):
            return strategy.experimental_local_results(value)[0]
        return value

    if iterator is not None:
        for _, _, it in iterator:
            try:
                data_batch = tree.map_structure(local, next(it))
            except StopIteration:
                return  # no data: nothing will train
            break
    with strategy.scope():
        model._symbolic_build(data_batch=data_batch)


def reduce_outputs(outputs, strategy):
    """A step's logs, reduced over replicas as Keras's `fit` reduces them.

    Keras's `reduce_per_replica(..., "auto")` takes the mean over replicas,
    but across workers asks for it along axis 0, which fails for the scalar
    logs every step returns (tensorflow/tensorflow#72388). Across workers
    this takes the same mean with `axis=None`: over replicas, any shape.
    """
    if multi_worker(strategy):
        return tree.map_structure(
            lambda v: strategy.reduce("MEAN", v, axis=None), outputs
        )
    return reduce_per_replica(outputs, strategy, reduction="auto")


def make_replicated_function(model, replica_step, after_step=None):
    """A train or test function for a model under a multi-replica strategy.

    Keras's TF trainer (`TensorFlowTrainer._make_function`) runs the whole
    step inside `strategy.run`, so a conditional update is a `cond` around
    the optimizer's cross-replica `merge_call` inside a replica, which
    `tf.distribute` refuses (why Keras's own `gradient_accumulation_steps`
    fails under MirroredStrategy, keras-team/keras#20582). Here each step is
    `strategy.run(replica_step)` followed by `after_step()` (if given) in
    cross-replica context, where the conditional update lives. Outputs are
    reduced by `reduce_outputs`, which also works across workers.
    """
    strategy = model.distribute_strategy

    @tf.autograph.experimental.do_not_convert
    def one_step_on_data(data):
        outputs = strategy.run(replica_step, args=(data,))
        if after_step is not None:
            after_step()
        return reduce_outputs(outputs, strategy)

    def one_step_on_iterator(iterator):
        # The next batch is taken inside the traced step, as Keras does: an
        # eager `next()` on a distributed iterator costs a launch of its own
        # (across workers, also a collective to agree on whether data is
        # left).
        return one_step_on_data(iterator.get_next())

    if not model.run_eagerly:
        one_step_on_data = tf.function(
            one_step_on_data, reduce_retracing=True, jit_compile=model.jit_compile
        )
        one_step_on_iterator = tf.function(one_step_on_iterator, reduce_retracing=True)

    def steps(iterator):
        if isinstance(iterator, tf.distribute.DistributedIterator):
            # fit and evaluate; the end of the data is an OutOfRangeError.
            for _ in range(model.steps_per_execution):
                try:
                    yield one_step_on_iterator(iterator)
                except tf.errors.OutOfRangeError:
                    return
        else:
            # train_on_batch and test_on_batch pass a list of batches.
            for _, data in zip(range(model.steps_per_execution), iterator):
                yield one_step_on_data(data)

    def function(iterator):
        outputs = None
        for outputs in steps(iterator):
            pass
        if outputs is None:
            raise StopIteration
        return outputs

    return function


def batch_normalization_layers(model):
    """Every Keras `BatchNormalization` in `model` (nested ones included), in
    a fixed order, and whether keras_accum may pool its statistics: a layer
    whose class overrides `call` or `_moments`, or that uses batch
    renormalisation, updates its statistics in ways we do not mirror."""
    for layer in model._flatten_layers(include_self=False, recursive=True):
        if isinstance(layer, BatchNormalization):
            cls = type(layer)
            plain = (
                cls.call is BatchNormalization.call
                and cls._moments is BatchNormalization._moments
                and not layer.renorm
            )
            yield layer, plain


@contextlib.contextmanager
def recording_moments(layer, record):
    """Inside the block, `record(inputs, mask, mean, variance)` is called with
    every batch's moments that `layer` computes in training mode.

    `BatchNormalization.call` gets its batch mean and variance from
    `self._moments(inputs, mask)`; an instance attribute shadows the method
    for the block (a trace, or one eager step).
    """
    original = layer._moments

    def moments(inputs, mask):
        mean, variance = original(inputs, mask)
        record(inputs, mask, mean, variance)
        return mean, variance

    layer._moments = moments
    try:
        yield
    finally:
        del layer._moments
