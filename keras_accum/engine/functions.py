"""The train functions `fit` calls: made per step plan, cached, fast-forwarded.

`TrainFunctions` is what a model's `train_function` is. Everything that
changes what `fit` calls goes through it: a new `accum_steps` (the setter,
`fit(accum_steps=)`, `AccumScheduler`), a new `micro_batch_size`,
`compile()` (Keras assigns `train_function = None`), a load that leaves a
window the traced step cannot continue, and BackupAndRestore, whose resumed
epoch takes its first batches without training. It holds the step made for
the current plan (`function`) and, apart from it, a fast-forward or a
first batch awaited; `fit` calls `current()`.

A function is made for the step plan (plan.py) and kept under its key, with
the objects its trace captured (optimizer, loss tracker, trainable
variables, window buffers): switching back to a plan reuses its function
while those are the same objects; new buffers or a new compile make it
stale. The engine is handed to every call that makes a function.
"""

import itertools
import warnings
from typing import NamedTuple

import keras
import tensorflow as tf

from keras_accum import _internals as internals
from keras_accum import window
from keras_accum.arguments import AUTO
from keras_accum.engine import step
from keras_accum.optimizer import check_not_accumulating
from keras_accum.split import across_replicas
from keras_accum.split.auto import StepState, written_before_gradients
from keras_accum.split.microbatch import static_batch_size


class TrainFunctions:
    """What a model's `train_function` is: the current step, under any
    fast-forward or first batch awaited; and the cached steps and flush
    function behind it.

    Attributes:
        function: the step for the current plan, None until made.
    """

    def __init__(self):
        self.function = None
        self._fast_forward = None
        self._first_batch = None
        self._see = None
        # (batch size, micro_batch_size) pairs warned about (see make).
        self._warned_unsplit = set()
        self._cache = {}
        self._flush = (None, None)

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
        """The step is made again when next needed (settings changed)."""
        self.function = None

    def retrace(self, engine):
        """A setting the trace reads changed: the step for the new plan now
        (its cached function, else a new trace), if one was made before.
        Now rather than later: fit reads `train_function` before every step."""
        if self.function is not None:
            self.function = None
            self.make(engine)

    def make(self, engine, force=False):
        """`model.make_train_function(force)`: the step for `engine`'s plan
        now (a trace reads the plan when it is made: "auto" traces a step
        per size it chooses)."""
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
            # The batch's pooled moments (and noise scale) are applied in
            # the step: their variables are made now, outside any replica.
            state.build_observers(model.distribute_strategy)
        compiled, buffers = _captured(model, plan, state)
        entry = None if force else self._cache.get(plan.cache_key)
        if entry is not None and entry.compiled.same(compiled) and entry.buffers.same(buffers):
            function = entry.function
        else:
            function = self._new(engine, plan)
            # Entries of an earlier compile or of replaced buffers would
            # never be used again, yet hold on to their traced graphs.
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
                # Several replicas: computed apart from every collective, so
                # that running out of memory on one blocks no other.
                after_step = _replica_step(engine)[1] if plan.uses_buffers else None
                halves = (
                    lambda data: step.compute_split(model, engine.plan(), state, data),
                    lambda data, split: step.write_split(model, engine.plan(), state, data, split),
                )
                return across_replicas.train_function(
                    engine.auto, model, halves, after_step, written
                )
            function = engine.auto.train_function(
                model, lambda: _step_on_data(engine), written
            )
            function.draws_batches = True  # takes each batch in Python (see_first)
            return function
        if plan.uses_buffers:
            if internals.replicated(strategy):
                return internals.make_replicated_function(model, *_replica_step(engine))
        elif internals.multi_worker(strategy):
            # Keras's own train function fails across workers (its log
            # reduction, tensorflow/tensorflow#72388); same step, our function.
            return internals.make_replicated_function(model, engine.train_step)
        # Keras's own, made as Keras makes it (it assigns train_function,
        # which is `assign` here).
        keras.Model.make_train_function(model, force=True)
        return self.function

    # -- fast-forward (BackupAndRestore) ---------------------------------------

    def fast_forward(self, batches, engine):
        """Makes the next `batches` batches be taken from `fit`'s iterator
        without training, whatever step is made or assigned meanwhile.

        After the last of them, the step for the settings in force then is
        the one `fit` calls (made at once if there is none, so a setting
        that cannot go on with a restored window raises its error here,
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
        """A fit ended: neither a fast-forward nor a first batch awaited
        (`see_first`) is left for the next one."""
        self._fast_forward = None
        self._first_batch = None

    # -- the first batch, when only the step can see its size --------------

    def see_first(self, engine, see):
        """Makes the next call of the train function take its first batch
        from `fit`'s iterator itself and hand its size to `see(size)`
        before a step is made for it.

        For data whose batch size no spec tells before drawing (a `tf.data`
        pipeline batched without `drop_remainder`, a generator): the model
        is built from the spec, and the size the step splits by (and a
        window's sparse capacity, and the schedule's sample count) is the
        first batch's, read from the batch the first step trains, not from
        one drawn apart (which a seeded shuffle would then reorder). That
        call's batches are trained eagerly, by the model's own step (the
        train function the plan needs is traced from the second call on,
        with the size known): no trace is spent on them alone. A train
        function that draws its batches in Python ("auto") takes them as
        they come. A fast-forward's first batch is seen as it is skipped.
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
            step_on = internals.make_step_on_data(model, engine.train_step, eager=True)
            return internals.each_batch(
                model, batches, lambda data: step_on(internals.optionals_to_none(data))
            )

        self._first_batch = seeing_first
        self._see = see

    # -- flushing ----------------------------------------------------------

    def flush_function(self, model, state):
        """The traced function that applies `model`'s open window (of `state`):
        one per optimizer and window variables, each called about once an
        epoch."""
        captured = Captured(
            (model.optimizer, *state.buffers.acc_grads, *state.moments.variables)
        )
        kept, function = self._flush
        if kept is None or not kept.same(captured):
            # TensorFlow's frequent-retracing warning counts traces of the
            # same code over every model in the process: one per compile is
            # not excessive.
            traced = internals.without_retracing_warning(
                tf.function(
                    lambda: window.close(state, model.optimizer, model.distribute_strategy)
                )
            )
            # Held in a plain closure: a tf.function attribute would be
            # tracked and exported.
            function = lambda: traced()  # noqa: E731
            self._flush = (captured, function)
        return function


def _step_on_data(engine):
    # One step on a batch in hand ("auto"), traced per batch shape: the
    # split is static and exact for every batch, the short last one too.
    model = engine.model
    if engine.plan().uses_buffers and internals.replicated(model.distribute_strategy):
        # Under a one-replica strategy (several: across_replicas.py), the
        # window is applied in cross-replica context, as by the replicated
        # train function.
        return internals.make_step_on_data(model, *_replica_step(engine), reduce_retracing=False)
    return internals.make_step_on_data(model, engine.train_step, reduce_retracing=False)


def _replica_step(engine):
    # The replica's part (accumulate) and the cross-replica part (apply the
    # window once full: replica 0's micro-step decides for all).
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
    """Objects a trace captured, compared by identity (and kept alive
    here, so ids are not reused), and plain settings, compared by value."""

    objects: tuple
    settings: tuple = ()

    def same(self, other):
        return (
            self.settings == other.settings
            and len(self.objects) == len(other.objects)
            and all(x is y for x, y in zip(self.objects, other.objects))
        )


class _Entry(NamedTuple):
    """A cached train function and what its trace captured (`_captured`)."""

    compiled: Captured
    buffers: Captured
    function: object


def compiled(model):
    """What any trace over `model`'s compile captures, as a `Captured`: the
    optimizer, the loss tracker (new at each compile: a recompile may change
    the loss) and the trainable variables, with the plain settings. A new
    compile makes it stale; the probe's traced function keys on it too."""
    return Captured(
        (model.optimizer, internals.loss_tracker(model), *model.trainable_variables),
        (model.jit_compile, model.run_eagerly, model.steps_per_execution),
    )


def _captured(model, plan, state):
    """What a traced step captured: `(compiled, buffers)`, two `Captured`.

    `compiled`: `compiled(model)`: a new compile makes every entry stale.
    `buffers`: the window's buffers, only where the step adds into them
    (the first window's buffers leave Keras's own step as it was).
    """
    buffers = Captured(tuple(state.buffers.acc_grads) if plan.uses_buffers else ())
    return compiled(model), buffers


def fast_forward(model, batches, engine=None):
    """Makes `model`'s coming `batches` train steps take their data only.

    A keras_accum model's (`engine` given) train functions keep the
    fast-forward through any retrace; a plain Keras model (whose function
    nothing retraces during `fit`) gets its current function wrapped.
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
    """A train function that takes `fit`'s next `batches` batches without
    training (up to `steps_per_execution` a call, logging nothing), and
    calls `done()` once the last is taken; `seen(batch)`, if given, with
    the first."""
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
