"""Keras's TensorFlow trainer: the forward pass, the symbolic build, and the
train and test functions keras_accum makes in its place.

`make_replicated_function` and `make_step_on_data` mirror
`TensorFlowTrainer._make_function`, `symbolic_build` and `reduce_outputs`
replace `_maybe_symbolic_build` and the multi-worker branch of
`reduce_per_replica` (tensorflow/tensorflow#72388); see fingerprints.py.
"""

import itertools

import tensorflow as tf
from keras import tree

from keras_accum._internals.distribute import multi_worker
from keras_accum._internals.versions import moved, reach, required

_TRAINER = "keras.src.backend.tensorflow.trainer"
_ArrayDataAdapter = reach(
    "keras.src.trainers.data_adapters.array_data_adapter", "ArrayDataAdapter"
)
# Keras 3.16 renamed the TF trainer `TensorFlowTrainer` -> `Trainer`.
TensorFlowTrainer = reach(_TRAINER, "Trainer", "TensorFlowTrainer")
reduce_per_replica = reach(_TRAINER, "reduce_per_replica")


def call_for_training(model, x):
    """The forward pass exactly as Keras's train_step makes it."""
    if required(model, "_call_has_training_arg"):
        return model(x, training=True)
    return model(x)


def called_like(wrapper, model):
    """Keras's train, test and predict steps call `wrapper`, whose `call`
    forwards to `model`, as they would call `model`: with `training=` only
    if `model.call` takes it.

    Why: Keras's steps call a model whose `call` takes no `training`
    without one, so its layers run with `training=None`
    (BatchNormalization and Dropout as in inference, moving statistics
    kept). The wrapper's own `call` takes `training`; called with
    `training=True`, it would hand that to every layer of `model` through
    Keras's call context.
    """
    required(wrapper, "_call_has_training_arg")
    wrapper._call_has_training_arg = required(model, "_call_has_training_arg")


def symbolic_build(model, iterator=None, data_batch=None, without_strategy=False):
    """`TensorFlowTrainer._maybe_symbolic_build`, without a cross-replica reduce.

    Keras builds the model, compiled loss, metrics and optimizer from a
    batch's shapes before the first step; to get one batch out of a
    distributed iterator it reduces the `PerReplica` batch across replicas,
    eagerly, which fails under `MultiWorkerMirroredStrategy`
    (tensorflow/tensorflow#72388). Only shapes and dtypes are read, so one
    local replica's batch does as well, and no collective runs. Under a
    strategy the batch is drawn as Keras draws it (one batch, from a pass
    over the data of its own).

    Without a strategy Keras waits for the first traced step instead, and
    draws nothing before it; with `without_strategy=True` the build
    happens here all the same, from the data's element spec (`batch_spec`):
    nothing is drawn, so the first epoch reads the data in the order, and
    as many times, as a plain model's (a seeded `shuffle` reshuffles at
    every pass).

    Returns:
        The batch built from (one replica's share of it, or the element
        spec), or None.
    """
    if required(model, "_distribute_strategy") is None:
        if not without_strategy:
            # As Keras: without a strategy, building waits for the first trace.
            return None
        if data_batch is None and iterator is not None:
            data_batch = batch_spec(iterator)
        required(model, "_symbolic_build")(data_batch=data_batch)
        return data_batch
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
        required(model, "_symbolic_build")(data_batch=data_batch)
    return data_batch


def batch_spec(iterator):
    """The spec of the batches `fit`'s (or `evaluate`'s) epoch iterator
    yields, as a batch structure Keras's `_symbolic_build` reads shapes and
    dtypes from (`tf.TensorSpec` leaves; a `tf.experimental.Optional`'s,
    Keras >= 3.13's stand-in for an absent entry, made None).

    Read from the data set the iterator draws from (`_distributed_dataset`,
    the same attribute in every supported Keras), never by drawing a batch.

    Raises:
        KerasInternalsChanged: the epoch iterator no longer has its data set
            where every reviewed Keras kept it.
    """
    dataset = required(iterator, "_distributed_dataset")
    return tree.map_structure(
        lambda spec: None if isinstance(spec, tf.OptionalSpec) else spec,
        dataset.element_spec,
    )


def array_batch_size(iterator):
    """The size of the first batch an epoch iterator over arrays yields
    (Keras's array adapter: `batch_size` samples, or all of them when
    fewer), known before drawing it; None for any other data (a `tf.data`
    pipeline, a generator, a `PyDataset`), whose spec alone may tell it."""
    adapter = required(iterator, "data_adapter")
    if not isinstance(adapter, _ArrayDataAdapter):
        return None
    if adapter.num_batches == 1 and adapter.has_partial_batch:
        return adapter.partial_batch_size
    return adapter.batch_size


def compile_arguments(model):
    """What `keras.Model.compile` last received for `model` (a dict: the
    optimizer, loss, metrics, ... objects themselves, as given).

    A model whose class has its own `compile` (a KerasHub task) fills in its
    defaults and hands them to Keras's; Keras keeps them as given in
    `_compile_config` (every reviewed Keras). `auto_scale_loss` is not kept.

    Raises:
        KerasInternalsChanged: this Keras keeps them elsewhere.
    """
    config = getattr(required(model, "_compile_config"), "config", None)
    if not isinstance(config, dict):
        raise moved(
            "`Trainer._compile_config`",
            f"a compiled {type(model).__name__}'s holds no `config` dict",
        )
    return dict(config)


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


def make_step_on_data(model, replica_step, after_step=None, reduce_retracing=True,
                      eager=False):
    """One training step on a batch in hand, as Keras's `one_step_on_data`.

    `strategy.run(replica_step)` on the batch, then `after_step()` (if given)
    in cross-replica context, outputs reduced by `reduce_outputs`; traced
    (with the model's `jit_compile`) unless the model runs eagerly or
    `eager` is given; with `reduce_retracing=False`, once per batch shape.
    """
    strategy = model.distribute_strategy

    @tf.autograph.experimental.do_not_convert
    def one_step_on_data(data):
        outputs = strategy.run(replica_step, args=(data,))
        if after_step is not None:
            after_step()
        return reduce_outputs(outputs, strategy)

    if model.run_eagerly or eager:
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
    one_step_on_data = make_step_on_data(model, replica_step, after_step)

    def one_step_on_iterator(iterator):
        # The next batch is taken inside the traced step, as Keras does: an
        # eager `next()` on a distributed iterator costs a launch of its own
        # (across workers, also a collective to agree on whether data is
        # left).
        return one_step_on_data(iterator.get_next())

    if not model.run_eagerly:
        one_step_on_iterator = tf.function(one_step_on_iterator, reduce_retracing=True)

    def function(iterator):
        if isinstance(iterator, tf.distribute.DistributedIterator):
            # fit and evaluate; the end of the data is an OutOfRangeError.
            return each_batch(model, iterator, one_step_on_iterator, in_step=True)
        # train_on_batch and test_on_batch pass a list of batches.
        return each_batch(model, iterator, one_step_on_data)

    return function


def each_batch(model, iterator, run, in_step=False):
    """Keras's train function's loop: `run` on each of the next batches of
    `iterator`, `model.steps_per_execution` of them at most (fewer where the
    data ends); the last one's outputs.

    Args:
        model: the model trained (its `steps_per_execution`).
        iterator: `fit`'s iterator, or a list of batches (`train_on_batch`).
        run: `run(batch) -> outputs`; with `in_step`, `run(iterator)`.
        in_step: whether `run` takes each batch from `iterator` itself,
            inside its traced step; the end of the data is then its
            `tf.errors.OutOfRangeError`.

    Raises:
        StopIteration: `iterator` held no batch (how Keras's train function
            says that an epoch's data has ended).
    """
    batches = itertools.repeat(iterator) if in_step else iterator
    outputs = None
    for _, batch in zip(range(model.steps_per_execution), batches):
        try:
            outputs = run(batch)
        except tf.errors.OutOfRangeError:
            if not in_step:
                raise
            break
    if outputs is None:
        raise StopIteration
    return outputs


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
