"""Keras's TensorFlow trainer: the forward pass, the symbolic build, and the
train and test functions made in its place (what they mirror or replace:
fingerprints.py).
"""

import itertools

import tensorflow as tf
from keras import tree

from keras_accum._internals.distribute import multi_worker
from keras_accum._internals.versions import is_missing, moved, reach, required

_TRAINER = "keras.src.backend.tensorflow.trainer"
_ArrayDataAdapter = reach("keras.src.trainers.data_adapters.array_data_adapter", "ArrayDataAdapter")
# Keras 3.16 renamed the TF trainer `TensorFlowTrainer` -> `Trainer`.
TensorFlowTrainer = reach(_TRAINER, "Trainer", "TensorFlowTrainer")
reduce_per_replica = reach(_TRAINER, "reduce_per_replica")
# TensorFlow has no public switch that keeps a function's calls calls (see
# `not_inlined`): the attribute's name, as `tf.function` allows it.
_NO_INLINE = reach("tensorflow.python.eager.polymorphic_function.attributes", "NO_INLINE")


def call_for_training(model, x):
    """The forward pass exactly as Keras's train_step makes it."""
    if required(model, "_call_has_training_arg"):
        return model(x, training=True)
    return model(x)


def called_like(wrapper, model):
    """Keras's steps call `wrapper` (forwarding to `model`) as they would call
    `model`: with `training=` only if `model.call` takes it. Else Keras runs
    its layers with `training=None` (as in inference), and the wrapper's
    `training=True` would reach them through Keras's call context."""
    required(wrapper, "_call_has_training_arg")
    wrapper._call_has_training_arg = required(model, "_call_has_training_arg")


def symbolic_build(model, iterator=None, data_batch=None, without_strategy=False):
    """`TensorFlowTrainer._maybe_symbolic_build` without its cross-replica reduce.

    Keras reduces the `PerReplica` batch it builds from eagerly, which fails
    across workers (tensorflow/tensorflow#72388); one local replica's batch
    has the same shapes. Without a strategy Keras waits for the first traced
    step; `without_strategy=True` builds here from the element spec
    (`batch_spec`), drawing nothing, so the first epoch reads the data as a
    plain model's does. Returns the batch built from, or None.
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
        # (step, it) before Keras 3.13, then (begin_step, end_step, it).
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
    """The spec of the batches an epoch iterator yields, from its
    `_distributed_dataset`, never by drawing one: `tf.TensorSpec` leaves,
    None for a `tf.experimental.Optional` (Keras >= 3.13's absent entry)."""
    dataset = required(iterator, "_distributed_dataset")
    return tree.map_structure(
        lambda spec: None if isinstance(spec, tf.OptionalSpec) else spec,
        dataset.element_spec,
    )


def array_batch_size(iterator):
    """The size of the first batch an epoch iterator over arrays yields (Keras's
    array adapter), known before drawing it; None for other data, whose spec
    alone may tell it."""
    adapter = required(iterator, "data_adapter")
    if not isinstance(adapter, _ArrayDataAdapter):
        return None
    if adapter.num_batches == 1 and adapter.has_partial_batch:
        return adapter.partial_batch_size
    return adapter.batch_size


def compile_arguments(model):
    """What `keras.Model.compile` last received for `model`, as given (Keras's
    `_compile_config`, without `auto_scale_loss`): a KerasHub task's own
    `compile` fills in its defaults first."""
    config = getattr(required(model, "_compile_config"), "config", None)
    if not isinstance(config, dict):
        raise moved(
            "`Trainer._compile_config`",
            f"a compiled {type(model).__name__}'s holds no `config` dict",
        )
    return dict(config)


def reduce_outputs(outputs, strategy):
    """A step's logs, reduced over replicas as Keras's `fit` reduces them.

    Keras's `reduce_per_replica(..., "auto")` takes the mean, but across
    workers along axis 0, which fails for scalar logs
    (tensorflow/tensorflow#72388); there this takes it with `axis=None`.
    """
    if multi_worker(strategy):
        return tree.map_structure(lambda v: strategy.reduce("MEAN", v, axis=None), outputs)
    return reduce_per_replica(outputs, strategy, reduction="auto")


def make_step_on_data(model, replica_step, after_step=None, reduce_retracing=True, eager=False):
    """One training step on a batch in hand, as Keras's `one_step_on_data`:
    `strategy.run(replica_step)`, then `after_step()` in cross-replica
    context, outputs reduced by `reduce_outputs`. Traced with the model's
    `jit_compile` unless eager; `reduce_retracing=False`: once per batch shape.
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
    """A batch with `tf.experimental.Optional` leaves made None, as Keras >= 3.13
    does before its step (`_autoconvert_optionals`), for a batch taken from
    the iterator outside Keras's train function."""
    return tree.map_structure(
        lambda t: None if isinstance(t, tf.experimental.Optional) else t, data
    )


def make_replicated_function(model, replica_step, after_step=None):
    """A train or test function for a model under a multi-replica strategy.

    Keras's `_make_function` runs the whole step in `strategy.run`, where
    `tf.distribute` refuses a conditional update around a `merge_call` (why
    Keras's `gradient_accumulation_steps` fails under MirroredStrategy,
    keras-team/keras#20582); here `after_step()` runs after it, in
    cross-replica context.
    """
    one_step_on_data = make_step_on_data(model, replica_step, after_step)

    def one_step_on_iterator(iterator):
        # Inside the traced step, as Keras: an eager `next()` costs a launch
        # of its own (across workers, also a collective).
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
    """Keras's train function's loop: `run` on each of the next
    `model.steps_per_execution` batches of `iterator` (`fit`'s, or a list);
    the last outputs, or StopIteration for none (an epoch's end). With
    `in_step`, `run(iterator)` draws in its traced step, and the data ends
    with `tf.errors.OutOfRangeError`."""
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
    """`function` (a `tf.function`), exempt from TensorFlow's retracing warning,
    counted per code object across the process, which a function made per
    optimizer and window and called once an epoch (the flush) trips. The
    flag is private (tests/test_keras_internals.py checks it is read)."""
    function._omit_frequent_tracing_warning = True
    return function


def not_inlined(python_function):
    """`tf.function(python_function)` whose calls TensorFlow's runtime keeps
    as calls of one function, not inlined into the caller's graph: its
    kernels, and the constants they hold, exist once however often it is
    called (inlined, each call site gets its own). `experimental_attributes`
    is public; the attribute's name is not."""
    if is_missing(_NO_INLINE):
        _NO_INLINE()  # the stand-in raises KerasInternalsChanged, naming it
    return tf.function(python_function, experimental_attributes={_NO_INLINE: True})
