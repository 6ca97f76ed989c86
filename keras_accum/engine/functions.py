"""The train functions `fit` calls: made per step plan, cached, fast-forwarded.

`TrainFunctions` is what a model's `train_function` is, and everything that
changes what `fit` calls goes through it: settings (`accum_steps`,
`micro_batch_size`, `AccumScheduler`), `compile()` (Keras assigns None), a
load the traced step cannot continue, a resumed epoch's fast-forward. A
function is cached under its plan's key with the objects its trace
captured (optimizer, loss tracker, variables, buffers): switching back
reuses it while those are the same objects.
"""

import itertools
import warnings
from typing import NamedTuple

import keras
import tensorflow as tf
from keras import tree

from keras_accum import _internals as internals
from keras_accum import window
from keras_accum.arguments import AUTO
from keras_accum.engine import step
from keras_accum.optimizer import check_not_accumulating
from keras_accum.split import across_replicas
from keras_accum.split.auto import StepState, written_before_gradients
from keras_accum.split.microbatch import static_batch_size

# A flush traced costs a trace and an instantiation: the CPU time of 16 to
# 25 flushes run op by op where flushes cost most (dense models of 122
# variables: 11 s against 0.48 s on one device, 14 s against 0.9 s under one
# replica, 24 s against 1.5 s under two; 10 variables under two replicas:
# 3.7 s against 0.15 s), of about 70 on a small model on one device (3.2 s
# against 0.045 s). So the first 16 flushes of a compile run op by op and
# the 17th is traced: a run of many flushes (epochs, validations) pays the
# trace once, a run of a few (most) never does.
EAGER_FLUSHES = 16


class TrainFunctions:
    """What a model's `train_function` is: the step for the current plan
    (`function`, None until made), under any fast-forward or first batch
    awaited; and the cached steps and flush function behind it.
    """

    def __init__(self):
        self.function = None
        self._fast_forward = None
        self._first_batch = None
        self._see = None
        # (batch size, micro_batch_size) pairs warned about (see make).
        self._warned_unsplit = set()
        self._cache = {}
        self._flush = None  # _Flushes: the flush function's state

    # -- what fit calls ----------------------------------------------------

    def current(self):
        """The function `fit` calls next (None: none made yet)."""
        if self._fast_forward is not None:
            return self._fast_forward
        if self._first_batch is not None:
            return self._first_batch
        return self.function

    def assign(self, value):
        """`model.train_function = value`: the step, not the fast-forward."""
        if self._fast_forward is not None and value is self._fast_forward:
            return  # put back by whoever read it (Keras's export does)
        self.function = value

    def invalidate(self):
        """The step is made again when next needed."""
        self.function = None

    def retrace(self, engine):
        """A setting the trace reads changed: the step for the new plan now, if
        one was made before (fit reads `train_function` before every step).
        """
        if self.function is not None:
            self.function = None
            self.make(engine)

    def make(self, engine, force=False):
        """`model.make_train_function(force)`: the step for `engine`'s plan now
        (a trace reads the plan: "auto" traces a step per size it chooses).
        """
        if self.function is not None and not force:
            return self.function
        model, state = engine.model, engine.state
        plan = engine.plan()
        internals.check_fit(model)
        self._warn_if_nothing_is_split(plan)
        if model.optimizer is not None:
            check_not_accumulating(model.optimizer, plan.accum_steps)
        if plan.uses_buffers and model.built:
            state.bind(
                model.trainable_variables,
                plan.accum_steps,
                model.distribute_strategy,
                model.optimizer,
            )
        elif plan.splits and model.built:
            # The step closes the batch's observers: their variables now,
            # outside any replica.
            state.build_observers(model.distribute_strategy)
        compiled, buffers = _captured(model, plan, state)
        entry = None if force else self._cache.get(plan.cache_key)
        if entry is not None and entry.compiled.same(compiled) and entry.buffers.same(buffers):
            function = entry.function
        else:
            function = self._new(engine, plan)
            # Entries of an earlier compile or buffers hold dead graphs.
            current = Captured(tuple(state.buffers.acc_grads))
            self._cache = {
                key: kept
                for key, kept in self._cache.items()
                if kept.compiled.same(compiled)
                and (not kept.buffers.objects or kept.buffers.same(current))
            }
            self._cache[plan.cache_key] = _Entry(compiled, buffers, function)
        self.function = function
        return function

    def _warn_if_nothing_is_split(self, plan):
        # A micro-batch bigger than the batch: one micro-batch of the whole
        # batch, no memory saved. Once per batch size and setting.
        micro, batch = plan.micro_batch_size, plan.batch_size_seen
        if not isinstance(micro, int) or batch is None or micro <= batch:
            return
        if (batch, micro) in self._warned_unsplit:
            return
        self._warned_unsplit.add((batch, micro))
        warnings.warn(
            f"micro_batch_size={micro} is larger than the batch fit draws "
            f"({batch} samples per replica): each batch is trained whole, and "
            "splitting saves no memory. micro_batch_size splits the batch you "
            f"give fit: for batches of {micro * 4} in micro-batches of {micro}, "
            f"pass batch_size={micro * 4} (the batch your recipe calls for).",
            stacklevel=4,
        )

    def _new(self, engine, plan):
        model, state = engine.model, engine.state
        strategy = model.distribute_strategy
        if plan.micro_batch_size == AUTO:
            written = StepState(lambda: written_before_gradients(model, state), strategy)
            if strategy.num_replicas_in_sync > 1 or internals.multi_worker(strategy):
                # Computed apart from every collective: one replica out of
                # memory blocks no other.
                after_step = _replica_step(engine)[1] if plan.uses_buffers else None
                halves = (
                    lambda data: step.compute_split(model, engine.plan(), state, data),
                    lambda data, split: step.write_split(model, engine.plan(), state, data, split),
                )
                return across_replicas.train_function(
                    engine.auto, model, halves, after_step, written
                )
            function = engine.auto.train_function(model, lambda: _step_on_data(engine), written)
            function.draws_batches = True  # takes each batch in Python (see_first)
            return function
        if plan.uses_buffers:
            if internals.replicated(strategy):
                return internals.make_replicated_function(model, *_replica_step(engine))
        elif internals.multi_worker(strategy):
            # Keras's own fails across workers (tensorflow/tensorflow#72388).
            return internals.make_replicated_function(model, model.train_step)
        # Keras's own (it assigns train_function: `assign` here).
        keras.Model.make_train_function(model, force=True)
        return self.function

    # -- fast-forward (BackupAndRestore) ---------------------------------------

    def fast_forward(self, batches, engine):
        """The next `batches` batches are taken from `fit`'s iterator without
        training, whatever step is made meanwhile; then the step in force (made
        at once, so a setting that cannot continue a restored window raises
        before any batch trains).
        """

        def done():
            self._fast_forward = None
            if self.function is None:
                self.make(engine)

        def seen(batch):
            # The first batch awaited (see_first) is this one.
            if self._first_batch is not None:
                self._first_batch = None
                self._see(static_batch_size(internals.optionals_to_none(batch)))

        forward = _fast_forwarding(engine.model, batches, done, seen)
        self._fast_forward = forward if batches else None

    def stop_fast_forward(self):
        self._fast_forward = None

    def end_fit(self):
        """A fit ended: no fast-forward or first batch awaited is left."""
        self._fast_forward = None
        self._first_batch = None

    # -- the first batch, when only the step can see its size --------------

    def see_first(self, engine, see):
        """The next call takes its first batch from `fit`'s iterator and hands
        its size to `see(size)` before a step is made for it.

        For data whose batch size no spec tells (`tf.data` batched without
        `drop_remainder`, a generator): the size comes from the batch the first
        step trains, never from one drawn apart (a seeded shuffle would reorder).
        That call's batches go through the traced train function itself, each
        as a data set of one batch with the iterator's element spec (no trace
        of its own; run eagerly, a step holds all of its tensors at once:
        twice a traced step's memory). "auto", which draws in Python, takes
        them as they come; a fast-forward's first batch is seen as it is skipped.
        """
        model = engine.model

        def seeing_first(iterator):
            self._first_batch = None
            try:
                first = next(iterator)
            except (StopIteration, tf.errors.OutOfRangeError):
                raise StopIteration from None  # no data: how fit learns it
            see(static_batch_size(internals.optionals_to_none(first)))
            function = self.make(engine)
            batches = itertools.chain([first], iterator)
            if getattr(function, "draws_batches", False):
                return function(batches)
            logs = None
            for batch in itertools.islice(batches, model.steps_per_execution):
                logs = function(iter(_one_batch(batch, iterator.element_spec)))
            return logs

        self._first_batch = seeing_first
        self._see = see

    # -- flushing ----------------------------------------------------------

    def flush_function(self, model, state):
        """What applies the open window outside a step (`flush`, an epoch's
        end, before a validation): op by op for the first `EAGER_FLUSHES`
        flushes of one optimizer and window, then a function traced for them.
        """
        close = lambda: window.close(state, model.optimizer, model.distribute_strategy)  # noqa: E731
        if model.run_eagerly:
            return close
        captured = Captured((model.optimizer, *state.buffers.acc_grads, *state.moments.variables))
        flushes = self._flush
        if flushes is None or not flushes.captured.same(captured):
            flushes = _Flushes(captured, 0, None)
        if flushes.traced is None and flushes.eager < EAGER_FLUSHES:
            self._flush = flushes._replace(eager=flushes.eager + 1)
            return close
        if flushes.traced is None:
            # One trace per compile is not the retracing TF warns about.
            traced = internals.without_retracing_warning(tf.function(close))
            # A plain closure: a tf.function attribute would be exported.
            flushes = flushes._replace(traced=lambda: traced())
            self._flush = flushes
        return flushes.traced


def _one_batch(batch, spec):
    """A data set of `batch` alone whose element spec is `spec` (the static
    shapes relaxed to it), so that the train function traced for `spec`'s
    iterator takes it without tracing again."""

    def relaxed(*parts):
        parts = parts[0] if len(parts) == 1 else parts
        return tree.map_structure(
            lambda t, s: (
                tf.compat.v1.placeholder_with_default(t, s.shape)
                if isinstance(s, tf.TensorSpec)
                else t
            ),
            parts,
            spec,
        )

    return tf.data.Dataset.from_tensors(batch).map(relaxed)


def _step_on_data(engine):
    # "auto": one step on a batch in hand, traced per batch shape.
    model = engine.model
    if engine.plan().uses_buffers and internals.replicated(model.distribute_strategy):
        # One replica: the window closes in cross-replica context.
        return internals.make_step_on_data(model, *_replica_step(engine), reduce_retracing=False)
    return internals.make_step_on_data(model, model.train_step, reduce_retracing=False)


def _replica_step(engine):
    # The replica's part, and the cross-replica part that closes the window
    # once full (replica 0's micro-step decides for all).
    model, state = engine.model, engine.state

    def replica_step(data):
        return step.accumulate(model, engine.plan(), state, data)

    def after_step():
        state.when_full(
            engine.plan().accum_steps,
            lambda: window.close(state, model.optimizer, model.distribute_strategy),
        )

    return replica_step, after_step


class Captured(NamedTuple):
    """Objects a trace captured, compared by identity (and kept alive), and plain settings."""

    objects: tuple
    settings: tuple = ()

    def same(self, other):
        return (
            self.settings == other.settings
            and len(self.objects) == len(other.objects)
            and all(x is y for x, y in zip(self.objects, other.objects))
        )


class _Flushes(NamedTuple):
    """The flushes of one optimizer and window (`captured`): how many ran op
    by op, and the traced function once made."""

    captured: Captured
    eager: int
    traced: object


class _Entry(NamedTuple):
    """A cached train function and what its trace captured."""

    compiled: Captured
    buffers: Captured
    function: object


def compiled(model):
    """What any trace over `model`'s compile captures: optimizer, loss tracker
    (new at each compile), trainable variables, plain settings. The probe's
    traced function keys on it too.
    """
    return Captured(
        (model.optimizer, internals.loss_tracker(model), *model.trainable_variables),
        (model.jit_compile, model.run_eagerly, model.steps_per_execution),
    )


def _captured(model, plan, state):
    """`(compiled, buffers)`: the buffers count only where the step adds into them."""
    buffers = Captured(tuple(state.buffers.acc_grads) if plan.uses_buffers else ())
    return compiled(model), buffers


def fast_forward(model, batches, engine=None):
    """`model`'s coming `batches` train steps take their data only: held by a
    keras_accum model's (`engine`'s) train functions through any retrace, or
    wrapped around a plain model's function.
    """
    if engine is not None:
        engine.functions.fast_forward(batches, engine)
        return
    train_function = model.train_function

    def done():
        model.train_function = train_function

    forward = _fast_forwarding(model, batches, done)
    forward.train_function = train_function
    model.train_function = forward


def _fast_forwarding(model, batches, done, seen=None):
    """A train function taking `fit`'s next `batches` batches without training
    (`steps_per_execution` a call), `seen(batch)` with the first, `done()`
    after the last.
    """
    remaining = batches

    def fast_forwarding(iterator):
        nonlocal remaining
        for _ in range(min(model.steps_per_execution, remaining)):
            batch = next(iterator)
            if seen is not None and remaining == batches:
                seen(batch)
            remaining -= 1
        if not remaining:
            done()
        return {}

    return fast_forwarding


def stop_fast_forward(model, engine=None):
    """Ends a fast-forward left by a `fit` interrupted during it."""
    if engine is not None:
        engine.functions.stop_fast_forward()
        return
    original = getattr(model.train_function, "train_function", None)
    if original is not None:
        model.train_function = original
