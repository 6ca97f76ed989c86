"""Every place keras_accum reaches into Keras internals, and nowhere else.

Supports Keras 3.8 to 3.x on the TensorFlow backend (TensorFlow >= 2.18);
read against the Keras sources listed in `REVIEWED_KERAS`. Keras releases
move these names; where a supported version differs, the code here detects
the feature, not the version. `tests/test_keras_internals.py` fails loudly,
naming the function, when a Keras release changes a function that
keras_accum mirrors (`MIRRORED_SOURCES`).
"""

import contextlib
import inspect

import keras
import tensorflow as tf

from keras_accum._keras_versions import (
    MIN_KERAS,
    MIN_TENSORFLOW,
    REVIEWED_KERAS,
    SUPPORTED,
    KerasInternalsChanged,
    check_versions,
    is_missing,
    reach,
    warn_if_unreviewed,
)

# The supported range, checked before anything below reaches into Keras:
# older releases lack names used here (and fail with confusing errors).
check_versions(keras.__version__, tf.__version__)


def legacy_keras_hint(obj):
    """A sentence for errors about `obj` if it is a tf_keras (Keras 2) object.

    With TF_USE_LEGACY_KERAS=1 `tf.keras` is tf_keras while `import keras`
    is still Keras 3: keras_accum works with the latter only.
    """
    if type(obj).__module__.split(".")[0] != "tf_keras":
        return ""
    return (
        " This is a tf_keras (Keras 2) object, from `tf.keras` under "
        "TF_USE_LEGACY_KERAS=1; keras_accum works with Keras 3 only: build "
        "it with `import keras`, not `tf.keras`."
    )


from keras import tree  # noqa: E402

# Every name from `keras.src`, through `reach` (see _keras_versions.py): a
# name this Keras lacks becomes a stand-in that raises, naming the change,
# when used, so `import keras_accum` does not fail on it. Newest name first.
_TRAINER = "keras.src.backend.tensorflow.trainer"
# Keras 3.16 renamed the TF trainer `TensorFlowTrainer` -> `Trainer`.
TensorFlowTrainer = reach(_TRAINER, "Trainer", "TensorFlowTrainer")
_collective_all_reduce_multi_worker = reach(_TRAINER, "_collective_all_reduce_multi_worker")
reduce_per_replica = reach(_TRAINER, "reduce_per_replica")
get_keras_mask = reach("keras.src.backend.common.masking", "get_keras_mask")
set_keras_mask = reach("keras.src.backend.common.masking", "set_keras_mask")
BatchNormalization = reach(
    "keras.src.layers.normalization.batch_normalization", "BatchNormalization"
)
_LOSS = "keras.src.losses.loss"
apply_mask = reach(_LOSS, "apply_mask")
squeeze_or_expand_to_same_rank = reach(_LOSS, "squeeze_or_expand_to_same_rank")
unscale_loss_for_distribution = reach(_LOSS, "unscale_loss_for_distribution")
Functional = reach("keras.src.models.functional", "Functional")
functional_init_arguments = reach("keras.src.models.model", "functional_init_arguments")
KerasSaveable = reach("keras.src.saving.keras_saveable", "KerasSaveable")
_no_tracking = reach("keras.src.utils.tracking", "no_automatic_dependency_tracking")
# TensorFlow has no public test for "no strategy.scope()" (see `replicated`).
_default_strategy = reach(
    "tensorflow.python.distribute.distribute_lib", "_get_default_strategy"
)


def no_automatic_dependency_tracking(method):
    """Keras's decorator; used at import, so a missing one fails on call."""
    if not is_missing(_no_tracking):
        return _no_tracking(method)

    def moved(*_args, **_kwargs):
        _no_tracking()  # raises KerasInternalsChanged, naming the change

    return moved

# Keras code that keras_accum mirrors rather than calls, by the SHA-256 of
# its source, with the Keras versions that have that source: every one
# listed was read and is handled here. `AccumModel._accumulate` mirrors the
# TF trainer's train_step, `make_replicated_function` and `make_step_on_data`
# its `_make_function` (`micro_batch_size="auto"` also relies on the contract
# of the `function(iterator)` it returns: `fit` passes an iterator that
# yields batches, and StopIteration or OutOfRangeError ends the epoch),
# and `keras_accum.normaliser` the divisor Keras's `Loss.__call__`,
# `reduce_values` and `apply_mask` compute, reached through
# `CompileLoss.call`'s terms; `symbolic_build` and `reduce_outputs` replace
# `_maybe_symbolic_build` and the multi-worker branch of `reduce_per_replica`
# (tensorflow/tensorflow#72388). `keras_accum.batchnorm` relies on
# `BatchNormalization.call` updating the moving statistics as
# `moving * momentum + batch * (1 - momentum)` from what `_moments` returns.
# tests/test_keras_internals.py compares these.
#
# What differs between the supported versions, and how it is handled:
# - train_step: Keras < 3.13 counts the logged loss's batch size from the
#   first input, later ones from the first input that is not None;
#   `batch_size` does the latter, the same wherever the former works.
# - _make_function: Keras >= 3.13 turns `tf.experimental.Optional` inputs
#   into None and loops over `steps_per_execution` in a while loop;
#   `make_replicated_function` keeps its own loop (see there).
# - apply_mask: how the mask's weights are computed (epsilon, divide_no_nan,
#   where); `keras_accum.normaliser` calls Keras's own, so it always agrees.
# - CompileLoss.call: the single-loss path reads `_flat_losses` by position
#   (< 3.13) or resolves paths; both call each term's loss function, which
#   is what `recording_loss_calls` wraps.
# - _maybe_symbolic_build: epoch iterators yield `(step, iterator)` before
#   3.13 and `(begin, end, iterator)` since; `symbolic_build` takes the last.
# - BatchNormalization.call: renormalisation (`renorm`) is new after 3.13,
#   and the statistics update moved after normalising; the update formula
#   is the same. _moments: masking arithmetic only.
# - Keras 3.16 renamed the TF trainer class `TensorFlowTrainer` -> `Trainer`
#   (found by either name). Its `_make_function` now takes the batch of a
#   `steps_per_execution=1` step with `get_next_as_optional()` outside the
#   traced step; the contract `auto` relies on is unchanged. `Loss.__call__`
#   reads the mask and name scope from `backend.common`/`backend` (the same
#   functions); `CompileLoss.call` calls each term through `_call_loss` (a
#   clearer shape error), still as `loss_fn(y_true, y_pred, sample_weight)`,
#   which is what `recording_loss_calls` wraps.
MIRRORED_SOURCES = {
    "TensorFlowTrainer.train_step": {
        "38eff65a3e8e64475bc46a4e655af968166c2909f8127cbf5d9466bdca1a0950": "3.8.0 3.10.0",
        "debf0efab9d5794b017ade2937acbcc51886fc1dc5cf021e7d7e80f974ee707c": "3.13.2 3.15.1 3.16.0.dev2026102704",
    },
    "TensorFlowTrainer._make_function": {
        "55eb952812cac1fbb9934e24de911532f45314c57ed6e6a53c9ebe88f392d2ff": "3.8.0 3.10.0",
        "bb33b7a0da3d27406c70fac54b8e9617156ef225f452b93f6addf8cc34aca0d0": "3.13.2 3.15.1",
        "b96ff481cdc14b4cad4a0fe00d41b6c6c908f4e173bfcca153815fd06533d298": "3.16.0.dev2026102704",
    },
    "Loss.__call__": {
        "f42c42282ee8902b2fb95310f8b9347c728040cf1fbcfdd3b94538c07d2e9fa8": "3.8.0 3.10.0 3.13.2 3.15.1",
        "6d0748313371823bff754a32d265639f628871eea08774c032820bb95e76ad9c": "3.16.0.dev2026102704",
    },
    "reduce_values": {
        "60b0462147725ad25b69cbfa93f1662fd83a803d6b43add1804d48c7f0cdddb9": "3.8.0 3.10.0 3.13.2 3.15.1 3.16.0.dev2026102704",
    },
    "apply_mask": {
        "c08def1fbac14b549d9b8faea29bb814bb2281d7a91bb3bf3ca2db082a71a3c8": "3.8.0 3.10.0",
        "13f8242de3cd4a06973e4cb15e4252ddbbb20c30d19480825673a3a6a1ffbffb": "3.13.2",
        "61d8938cd8663dee3c27b678b4af5f17408c2b03ff039b7b2e9125cd07610d00": "3.15.1 3.16.0.dev2026102704",
    },
    "CompileLoss.call": {
        "def46c01e48ca7207205b4fa60dcdcbef39815790dab91591d7b1d0b91e8f1f2": "3.8.0 3.10.0",
        "41012fc179db545db2f77a0ace0af06c00cebbbe67c0a3f34a53b3d20e639745": "3.13.2",
        "402aaf05f91c73c4a4bcaa65be5a447566fbbbb05f5079b29a35312bcbfd509f": "3.15.1",
        "e69a6e8919f8be2d5f7bd7c59f5d217c151934a68c31cc4e8af85cb2b226f641": "3.16.0.dev2026102704",
    },
    "TensorFlowTrainer._maybe_symbolic_build": {
        "181752273e37d689f7dd4915f31a454130a3761290dc4b6d351465b85d4c6b81": "3.8.0 3.10.0",
        "92a504f5eba9b29f81f1bf26180bdd5bf5186b06b7bda426534b90d2d02bc1c2": "3.13.2 3.15.1 3.16.0.dev2026102704",
    },
    "reduce_per_replica": {
        "2e7d54b1e6edc29a8c6a7e6b66cd4c8be3ba7842412c93753ac3afe169fa7fb8": "3.8.0 3.10.0 3.13.2 3.15.1 3.16.0.dev2026102704",
    },
    "BatchNormalization.call": {
        "9b6a3cfad619b3f6730adc4e1c8241fed02133c60d203305d668f902185c55bb": "3.8.0 3.10.0 3.13.2",
        "31502bd832c5eb64f0bb108a4db21f204b906fff8bebd34ffa3a4f68eab00eb5": "3.15.1 3.16.0.dev2026102704",
    },
    "BatchNormalization._moments": {
        "08ec7edbbc47aaea1afdd90c12915925c685e4466fc22ab369a6ffcf79496e83": "3.8.0",
        "e168ab1449ab50aef696bf76ef7d0474b104f6e7eea3fdc4a3e3b5b6b98a416d": "3.10.0 3.13.2",
        "2ba739b46f4fadea719cd8e41e56d591ef86adae38d58c11930efba046093378": "3.15.1 3.16.0.dev2026102704",
    },
}


def mirrored():
    """`{name: function}` of the Keras code named in MIRRORED_SOURCES."""
    compile_loss = reach("keras.src.trainers.compile_utils", "CompileLoss")
    loss = reach(_LOSS, "Loss")
    reduce_values = reach(_LOSS, "reduce_values")

    def method(owner, name):
        return getattr(owner, name) if not is_missing(owner) else owner

    return {
        "TensorFlowTrainer.train_step": method(TensorFlowTrainer, "train_step"),
        "TensorFlowTrainer._make_function": method(TensorFlowTrainer, "_make_function"),
        "Loss.__call__": method(loss, "__call__"),
        "reduce_values": reduce_values,
        "apply_mask": apply_mask,
        "CompileLoss.call": method(compile_loss, "call"),
        "TensorFlowTrainer._maybe_symbolic_build": method(
            TensorFlowTrainer, "_maybe_symbolic_build"
        ),
        "reduce_per_replica": reduce_per_replica,
        "BatchNormalization.call": method(BatchNormalization, "call"),
        "BatchNormalization._moments": method(BatchNormalization, "_moments"),
    }


# On a Keras not in REVIEWED_KERAS, one warning if anything above changed.
warn_if_unreviewed(mirrored(), MIRRORED_SOURCES)


class SavedState(KerasSaveable):
    """Base of keras_accum's training state held by a model (the pending
    window, BatchNorm windows, the count of skipped windows).

    Keras's saving (`save`, `save_weights`, `load_weights`) visits every
    `KerasSaveable` attribute of a model under its own path and calls its
    `save_own_variables` / `load_own_variables`; a plain model loading the
    same file never looks there. Subclasses define those two methods.
    """

    def _obj_type(self):
        # Saving walks an object's attributes except those a fresh object of
        # the kind named here has (`get_attr_skipset`), and refuses kinds it
        # does not know. Every supported Keras knows "Loss" (3.8 and 3.10 do
        # not know "Operation"), and a Loss has none of the attribute names
        # of our state objects, so all of them are visited; the same kind on
        # every version keeps files loadable across versions.
        return "Loss"


__all__ = [
    "BatchNormalization",
    "Functional",
    "KerasSaveable",
    "TensorFlowTrainer",
    "MIRRORED_SOURCES",
    "REVIEWED_KERAS",
    "SUPPORTED",
    "KerasInternalsChanged",
    "SavedState",
    "mirrored",
    "check_versions",
    "legacy_keras_hint",
    "layers_shared_across_nesting",
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
    "make_step_on_data",
    "optionals_to_none",
    "metrics_summed_over_replicas",
    "multi_worker",
    "replicated",
    "set_initial_epoch",
    "reduce_outputs",
    "symbolic_build",
    "get_keras_mask",
    "set_keras_mask",
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
    # A wrapper (LossScaleOptimizer) builds its inner optimizer for the same
    # variables; before Keras 3.13 it records none of them itself.
    while hasattr(optimizer, "inner_optimizer"):
        optimizer = optimizer.inner_optimizer
    known = optimizer._trainable_variables_indices
    return [v for v in variables if optimizer._var_key(v) not in known]


def metrics_summed_over_replicas():
    """Whether Keras's metric variables are read as their sum over replicas.

    Keras 3.8 makes them without `synchronization="on_read"`, so under a
    multi-replica strategy the loss and metrics Keras logs (plain models
    too) are not the one-device values; later releases sum them on read.
    """
    return "synchronization" in inspect.signature(keras.Variable).parameters


def replicated(strategy):
    """Whether steps under `strategy` run as replicas of a `tf.distribute`
    strategy, one replica included (a one-GPU or CPU-only MirroredStrategy,
    a MultiWorkerMirroredStrategy without TF_CONFIG).

    Such a step runs in a replica context whose optimizer update is a
    `merge_call`, which cannot sit inside a conditional traced in the
    replica, whatever the number of replicas: the window is then applied in
    cross-replica context, as for several replicas. False for None and the
    default strategy (no `strategy.scope()`).
    """
    if strategy is None:
        return False
    return strategy is not _default_strategy()


def multi_worker(strategy):
    """Whether `strategy` runs across several worker processes."""
    return _collective_all_reduce_multi_worker(strategy)


def set_initial_epoch(model, epoch):
    """Makes the coming `fit` start at `epoch`, as Keras's BackupAndRestore does."""
    model._initial_epoch = epoch


# keras.callbacks.BackupAndRestore's batch counting, which
# keras_accum.BackupAndRestore reuses: `_should_save_on_batch(batch)` counts
# the batches since the last backup from `_last_batch_seen` (reset at each
# epoch's end) and `_batches_seen_since_last_saving`.


def backup_counts_from_zero(callback):
    """A `BackupAndRestore` counts batches anew (at `fit`'s start)."""
    callback._batches_seen_since_last_saving = 0
    callback._last_batch_seen = 0


def backup_epoch_ended(callback):
    """The next batch a `BackupAndRestore` sees starts an epoch."""
    callback._last_batch_seen = 0


def backup_batch_seen(callback, batch):
    """`batch` passed without counting towards the next backup (skipped)."""
    callback._last_batch_seen = batch


def backup_due_after_batch(callback, batch):
    """Counts `batch`; whether a batch-level backup is due after it."""
    return callback._should_save_on_batch(batch)


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

    Returns:
        The batch built from (one replica's share of it), or None.
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
        # Epoch iterators yield (step, it) before Keras 3.13, then
        # (begin_step, end_step, it).
        for *_, it in iterator:
            try:
                data_batch = tree.map_structure(local, next(it))
            except StopIteration:
                return None  # no data: nothing will train
            break
    with strategy.scope():
        model._symbolic_build(data_batch=data_batch)
    return data_batch


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


def make_step_on_data(model, replica_step, after_step=None, reduce_retracing=True):
    """One training step on a batch in hand, as Keras's `one_step_on_data`.

    `strategy.run(replica_step)` on the batch, then `after_step()` (if given)
    in cross-replica context, outputs reduced by `reduce_outputs`; traced
    (with the model's `jit_compile`) unless the model runs eagerly; with
    `reduce_retracing=False`, once per batch shape.
    """
    strategy = model.distribute_strategy

    @tf.autograph.experimental.do_not_convert
    def one_step_on_data(data):
        outputs = strategy.run(replica_step, args=(data,))
        if after_step is not None:
            after_step()
        return reduce_outputs(outputs, strategy)

    if model.run_eagerly:
        return one_step_on_data
    return tf.function(
        one_step_on_data,
        reduce_retracing=reduce_retracing,
        jit_compile=model.jit_compile,
    )


def optionals_to_none(data):
    """A batch with `tf.experimental.Optional` leaves made None.

    Keras >= 3.13 delivers a dataset's None entries (e.g. no sample weights)
    as empty Optionals and turns them back into None before its step
    (`_autoconvert_optionals`); a batch taken from the iterator outside
    Keras's train function needs the same.
    """
    return tree.map_structure(
        lambda t: None if isinstance(t, tf.experimental.Optional) else t, data
    )


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
    one_step_on_data = make_step_on_data(model, replica_step, after_step)

    def one_step_on_iterator(iterator):
        # The next batch is taken inside the traced step, as Keras does: an
        # eager `next()` on a distributed iterator costs a launch of its own
        # (across workers, also a collective to agree on whether data is
        # left).
        return one_step_on_data(iterator.get_next())

    if not model.run_eagerly:
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
                and not getattr(layer, "renorm", False)  # not in Keras <= 3.13
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


def without_retracing_warning(function):
    """`function` (a `tf.function`), exempt from TensorFlow's warning that
    "N out of the last M calls to ... triggered tf.function retracing".

    TensorFlow counts traces per Python code object, over every
    `tf.function` made from it in the process, and warns when 5 of the last
    10 calls traced. A function made anew per optimizer and window, and
    called about once an epoch (the flush at an epoch's end), trips it after
    a few models or compiles, though each of its traces is needed once.
    TensorFlow's own flag for this is private (`Function.__call__` reads
    it; tests/test_keras_internals.py checks that it still does).
    """
    function._omit_frequent_tracing_warning = True
    return function


def in_xla_context():
    """Whether the code being traced is compiled by XLA (`jit_compile=True`).

    XLA needs static shapes: a window of sparse slices is then handed to the
    optimizer padded to its buffer (sparse.py). TensorFlow exposes no public
    test for this.
    """
    from tensorflow.python.ops import control_flow_util

    if tf.executing_eagerly():
        return False
    return control_flow_util.GraphOrParentsInXlaContext(
        tf.compat.v1.get_default_graph()
    )


def replica_component(variable):
    """The current replica's own component of a per-replica variable.

    Sync-on-read variables refuse scatter updates (TensorFlow leaves them
    unimplemented, even in a replica context); a window kept as slices
    appends with scatter updates, on the replica's own component.
    """
    component = getattr(variable, "_get_on_device_or_primary", None)
    return variable if component is None else component()


def layers_shared_across_nesting(model):
    """`(layer, first, second)` for each layer with variables of functional
    `model` that two of its top-level layers reach (one may be the layer
    itself).

    Keras's functional config records each top-level layer by its own config,
    so such a layer is re-created once per place: a `.keras` file of the
    model loads with the tie broken, or not at all (KerasHub's tied
    `ReversibleEmbedding`, called by the backbone and by the LM head).
    """
    owners = {}
    shared = []
    for top in model.layers:
        for layer in top._flatten_layers(include_self=True, recursive=True):
            if not layer.variables:
                # Inputs a nested model shares with the outer graph, and any
                # stateless layer: made twice, they still compute the same.
                continue
            first = owners.setdefault(id(layer), top)
            if first is not top:
                shared.append((layer, first, top))
    return shared
