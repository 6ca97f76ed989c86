"""`AccumScheduler`: change `accum_steps` at epoch boundaries (batch-size warm-up),
from a schedule or from the measured gradient noise scale."""

import inspect
import numbers
from typing import NamedTuple, Optional

from keras_accum import _internals as internals
from keras_accum.growth import rate_rules
from keras_accum import arguments
from keras_accum.arguments import NOISE_SCALE, check_accum_steps
from keras_accum.engine.fit import FitSetting
from keras_accum.growth.estimate import BatchGrowth, NoiseEstimate
from keras_accum.growth.probe import probe_argument

# The learning_rate_rule argument's default: "auto" with "noise_scale",
# None with a dict or a callable.
DEFAULT = object()


class Decision(NamedTuple):
    """One decision of an `AccumScheduler` (its `path`).

    Attributes:
        epoch: the epoch it was made in (0-based).
        updates: `optimizer.iterations` when it was made.
        samples: samples trained in this `fit` when it was made.
        accum_steps: the value set (or kept) for the next windows.
        learning_rate: the rate set by the rule, or None without one.
        estimate: the `growth.NoiseEstimate` the decision acted on
            ("noise_scale" schedule): the windows' smoothed one, or the
            probe's; None for other schedules.
        probed: whether `estimate` was measured on the `probe`.

    Example:

    ```python
    for decision in scheduler.path:
        print(decision.updates, decision.accum_steps, decision.learning_rate)
    ```
    """

    epoch: int
    updates: int
    samples: int
    accum_steps: int
    learning_rate: Optional[float]
    estimate: Optional[NoiseEstimate]
    probed: bool = False


class AccumScheduler(FitSetting):
    """Sets `model.accum_steps` as training goes: from a schedule of epochs,
    or grown to the measured gradient noise scale; and the learning rate
    with it.

    Like `keras.callbacks.LearningRateScheduler`, for the effective batch:
    a small batch early, a larger one later. The window open at an epoch's
    end is applied then (as always in `fit`), and a change between epochs
    waits for the open window to be applied, so training equals a plain
    model fed the same sequence of batches: `micro-batch x accum_steps`
    samples per update.

    `optimizer.iterations` counts updates, so learning-rate schedules see
    the big-batch run's steps: with a growing batch, a schedule indexed by
    steps moves more slowly per sample (`path` records the samples at each
    decision). Wrap the schedule in `keras_accum.SampleSchedule` to count
    its steps in samples instead (updates of `tuned_batch` samples); the
    scheduler keeps its count, and a rule multiplies its rate. Each distinct value is traced once for the whole `fit`,
    however often the schedule returns to it. On resume (`initial_epoch`,
    `BackupAndRestore`) the schedule is applied for the epoch training
    starts at. Like `fit(accum_steps=...)`, the change lasts for that `fit`
    only: afterwards `model.accum_steps`, and the learning rate a rule set,
    are what they were before. The value in force is logged as
    `accum_steps` in each epoch's logs (the progress bar prints it as an
    integer). With `fit(accum_steps=N)`, a schedule that sets another value
    for the epoch training starts at is refused before training (`N` would
    never be used); a schedule starting later, or "noise_scale", starts
    from `N`.

    Args:
        schedule: a dict `{epoch: accum_steps}` (0-based epochs; each value
            holds from its epoch until the next key; before the first key,
            the model's own `accum_steps`), or a callable
            `epoch -> accum_steps` (None keeps the current value). A dict is
            checked here, and so is that a callable takes one argument; its
            values are checked for every epoch of the `fit` before training
            starts.
            Or "noise_scale": a warm-up that follows the gradient noise
            scale the model measures (`noise_scale=True`; docs: noise
            scale). At each decision, the windows since the last one are
            added to a smoothed estimate (`growth.BatchGrowth`), and
            `accum_steps` grows towards `noise_scale_multiple * estimate /
            samples_per_step` (`samples_per_step`: the batch `fit` draws,
            global under a strategy), from the estimate's lower bound
            while the estimate is unresolved: at most doubling per
            decision, up to `max_accum_steps`; never shrinking, unless
            `min_accum_steps` is given.
            With a `probe`, a decision at which the noise scale has
            outgrown training's window (the smoothed estimate unresolved,
            too few windows yet included, or above `accum_steps` times the
            batch `fit` draws) acts on the noise scale measured on the
            probe instead.
        verbose: 1 prints a message when the value changes.
        max_accum_steps: with "noise_scale" (and only then, where it is
            required): the largest `accum_steps` to grow to.
        every_updates: with "noise_scale": decide after every this many
            optimizer updates, at a window's end (default
            `arguments.DEFAULT_EVERY_UPDATES`). A fit's first decisions
            come sooner: the gap is half the updates of the fit so far,
            from a third of `every_updates` up (at 50: decisions at
            updates 16, 32, 63, 113, then every 50; the batch can grow
            16-fold by update 113 instead of 200).
        every_samples: with "noise_scale", instead of `every_updates`
            (with the same ramp, in samples):
            decide once this many samples were trained since the last
            decision (at a window's end).
        noise_scale_multiple: with "noise_scale": the batch grown towards,
            in multiples of the noise scale (default
            `arguments.DEFAULT_NOISE_SCALE_MULTIPLE`, 1.5: the measured
            noise scale sits at 0.5-1x the critical batch, where a bigger
            batch stops paying; docs: growing the batch).
        min_accum_steps: with "noise_scale": let the batch shrink, at most
            halving per decision, down to this (which may be below the
            start), when even the estimate's upper end wants a smaller
            one. Default None: it never shrinks.
        learning_rate_rule: how the learning rate follows the batch
            (keras_accum/rate_rules.py): "auto" (AdaScale's gain for SGD,
            "sqrt" for Adam and other adaptive optimizers),
            "adascale", "adascale_sqrt", "sqrt", "linear", a function
            `(batch, tuned_batch, estimate) -> factor`, or None (the rate
            is left alone). The optimizer's rate is taken as the one tuned
            for `tuned_batch`, and multiplied by the factor at each change
            (and from the first step when the fit starts at another batch).
            Default: "auto" with "noise_scale", None with a dict or a
            callable.
        probe: with "noise_scale": `(x, y)` or `(x, y, sample_weight)`,
            examples held aside (not trained on here) to measure the noise
            scale on at the current weights where training's windows have
            become too small to (keras_accum/probe.py): shuffled once,
            split into `probe_windows` windows, each of two or more
            micro-batches of what one device runs at once (a replica's
            share of the batch `fit` draws, or `micro_batch_size` when the
            step splits it). Not across workers yet. Give several times the noise scale you
            expect per window (e.g. 8 x 1,024 samples for a batch grown to
            1,024). Each use costs a forward and backward pass over it; it
            changes no weight, statistic or seed. Default None: the
            windows' estimate only.
        probe_windows: the windows the probe is split into (>= 3; default
            8): the spread of their estimates is the interval.
        tuned_batch: the batch (samples per update, global) the
            optimizer's rate was tuned for, with a `learning_rate_rule` or
            a `keras_accum.SampleSchedule` (whose steps are updates of this
            many samples). Default: the batch the fit starts at. Give it when starting
            smaller than the batch the rate was tuned for: a rate tuned for
            256 samples can make 16-sample updates diverge.

    Attributes:
        path: the `Decision`s of the last `fit` (each change, and with
            "noise_scale" each decision), in order.

    Example:

    ```python
    model = keras_accum.AccumModel(inputs, outputs)
    model.compile("adam", "sparse_categorical_crossentropy")
    # batch 32 for epochs 0-1, 64 for epoch 2, 128 from epoch 3 on
    warmup = keras_accum.AccumScheduler({0: 1, 2: 2, 3: 4})
    model.fit(x, y, batch_size=32, epochs=4, callbacks=[warmup])

    # or as a function of the epoch, with the rate scaled by sqrt(batch)
    keras_accum.AccumScheduler(lambda epoch: min(2 ** epoch, 8), learning_rate_rule="sqrt")

    # or grown to the measured noise scale, up to 32 micro-batches,
    # deciding every 50 updates, the rate following by AdaScale's gain
    model = keras_accum.AccumModel(inputs, outputs, accum_steps=2, noise_scale=True)
    model.compile(keras.optimizers.SGD(0.1), "sparse_categorical_crossentropy")
    grow = keras_accum.AccumScheduler("noise_scale", max_accum_steps=32)
    model.fit(x, y, batch_size=32, epochs=3, callbacks=[grow])
    ```
    """

    def __init__(self, schedule, verbose=0, max_accum_steps=None, *,
                 every_updates=None, every_samples=None,
                 learning_rate_rule=DEFAULT, tuned_batch=None,
                 noise_scale_multiple=None, min_accum_steps=None,
                 probe=None, probe_windows=None):
        super().__init__()
        (self.max_accum_steps, self.every_updates, self.every_samples,
         self.noise_scale_multiple, self.min_accum_steps) = arguments.noise_scale_arguments(
            schedule, max_accum_steps, every_updates, every_samples, noise_scale_multiple,
            min_accum_steps)
        if learning_rate_rule is DEFAULT:
            learning_rate_rule = rate_rules.AUTO if schedule == NOISE_SCALE else None
        self._rule = rate_rules.check_rule(learning_rate_rule)
        self.learning_rate_rule = learning_rate_rule
        self.tuned_batch = arguments.check_tuned_batch(tuned_batch)
        self._probe = probe_argument(schedule, probe, probe_windows)
        self.probe_windows = None if self._probe is None else self._probe.windows
        if schedule == NOISE_SCALE:
            self._table = None
            self._schedule = self._from_noise_scale
        elif isinstance(schedule, dict):
            self._table = _checked_table(schedule)
            self._schedule = self._lookup
        elif callable(schedule):
            _check_takes_an_epoch(schedule)
            self._table = None
            self._schedule = schedule
        else:
            raise TypeError(
                "`schedule` must be a dict {epoch: accum_steps}, a callable "
                'epoch -> accum_steps, or "noise_scale". '
                + _not_noise_scale(schedule) +
                f"Received: schedule={schedule!r} (of type {type(schedule).__name__})."
            )
        self.schedule = schedule
        self.verbose = verbose
        self.path = []
        self._growth = (
            BatchGrowth(self.max_accum_steps, multiple=self.noise_scale_multiple,
                        min_accum_steps=self.min_accum_steps)
            if schedule == NOISE_SCALE else None
        )
        self._follower = None
        self._epoch = 0
        self._since = _Since()
        self._start = _Since()  # the fit's start (decisions come sooner after it)
        self._trained = 0  # samples trained in this fit
        self._begun = False  # the rate for the fit's first batch is set
        self._started = False  # on_train_begin ran in this fit
        self._restored = None  # a backup's state, until applied
        self._acted_on = None, False  # the last decision's estimate, probed
        self._probe_checked = False  # the probe's size checked in this fit

    def _lookup(self, epoch):
        value = None
        for start, steps in self._table:
            if start > epoch:
                break
            value = steps
        return value

    def _from_noise_scale(self, epoch):
        # At an epoch's start or every_updates/every_samples: the windows
        # since the last decision join the smoothed estimate; where the
        # noise scale has outgrown the window, a probe measures it instead.
        growth, current = self._growth, self.engine.settings.accum_steps
        size = self._batch_drawn()
        growth.take_windows(self.engine.state.noise)
        estimate, probed = growth.estimate, False
        if (self._probe is not None and size and growth.can_change(current)
                and _outgrown(estimate, current * size)):
            estimate, probed = self._probe.measure(self.model, self._probe_micro_batch()), True
        self._acted_on = estimate, probed
        return growth.next_accum_steps(current, size, estimate)

    def _value(self, epoch):
        value = self._schedule(epoch)
        if value is None:
            return None
        try:
            return check_accum_steps(value)
        except (TypeError, ValueError) as error:
            raise type(error)(
                f"`schedule` returned {value!r} for epoch {epoch}: {error}"
            ) from None

    def value_at_start(self, epoch):
        """The value the schedule sets for `epoch`, as far as it is known
        before training: None for "noise_scale" (it grows from the value in
        force) and for a callable returning None. Checked as in `fit`."""
        if self.schedule == NOISE_SCALE:
            return None
        return self._value(epoch)

    def bind_fit(self, engine):
        super().bind_fit(engine)
        if engine is None:
            self._started = False
            self._restored = None
            if self._follower is not None:
                # The fit ended (or failed): the tuned rate back, with the
                # model's own accum_steps.
                self._follower.stop()
                self._follower = None

    def on_train_begin(self, logs=None):
        self._check_model()
        if self.schedule == NOISE_SCALE:
            if not self.engine.settings.noise_scale:
                raise ValueError(
                    'AccumScheduler("noise_scale") follows the noise scale '
                    "the model measures, and this model does not measure "
                    "it: make it with `noise_scale=True` (AccumModel or "
                    "keras_accum.wrap)."
                )
            self._growth.begin(self.engine.state.noise)
            if self._probe is not None:
                if internals.multi_worker(self.model.distribute_strategy):
                    raise ValueError(
                        "`probe` is not supported across workers yet: each "
                        "worker would measure it apart and could decide "
                        "another `accum_steps`. Drop `probe` for a "
                        "multi-worker fit (the windows' estimate is reduced "
                        "across workers)."
                    )
                self._probe_checked = False
        elif self._table is None:
            # A callable is checked for every epoch before the first step.
            for epoch in range(self.params.get("epochs") or 0):
                self._value(epoch)
        self.path = []
        self._since = self._start = _Since(self._updates(), 0)
        self._trained = 0
        follows = rate_rules.RateFollower.needed(self._rule, self.model.optimizer)
        arguments.check_tuned_batch_used(self.tuned_batch, follows)
        if follows:
            self._follower = rate_rules.RateFollower(self._rule)
            self._follower.start(self.model.optimizer, self.tuned_batch)
        self._begun = False
        self._started = True
        if self._restored is not None:
            self._apply_state()

    # -- backups (keras_accum.BackupAndRestore) -------------------------------

    def state(self):
        """The schedule's state mid-`fit`, kept in each backup: the
        `accum_steps` in force, the decision counters, the tuned rate, the
        smoothed estimate and the windows measured since the last decision
        (the open one's too, on one replica)."""
        if self.engine is None or not self._started:
            return None
        state = {"class": type(self).__name__, "accum_steps": self.engine.settings.accum_steps,
                 "since": list(self._since), "start": list(self._start),
                 "trained": self._trained, "begun": self._begun}
        if self._follower is not None:
            state["rate"] = self._follower.state()
        if self._growth is not None:
            state["growth"] = self._growth.state(self.engine.state.noise)
        return state

    def restore_state(self, state):
        self._restored = state
        if self._started:
            self._apply_state()

    def _apply_state(self):
        state, self._restored = self._restored, None
        if state["accum_steps"] != self.engine.settings.accum_steps:
            # The backup's window was opened with this value.
            self.engine.set_accum_steps(state["accum_steps"])
        self._since = _Since(*state["since"])
        self._start = _Since(*state["start"])
        self._trained = state["trained"]
        self._begun = state["begun"]
        if self._follower is not None and "rate" in state:
            # The optimizer's rate came back with the weights (scaled); the
            # tuned one is the backup's, and so is a SampleSchedule's count.
            self._follower.restore(state["rate"])
        if self._growth is not None and "growth" in state:
            self._growth.restore(state["growth"], self.engine.state.noise)

    def _check_model(self):
        # A keras_accum model's fit hands its engine over (bind_fit).
        if self.engine is None:
            raise ValueError(
                "AccumScheduler needs a keras_accum model (AccumModel or "
                f"keras_accum.wrap(model)). Received a {type(self.model).__name__}."
            )

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch
        if self._probe is not None and not self._probe_checked:
            # The batch fit draws is known now, before the fit's first step
            # (a resumed fit's too).
            self._probe_checked = True
            micro_batch = self._probe_micro_batch()
            if micro_batch:
                self._probe.check(micro_batch)
        if not (self.schedule == NOISE_SCALE and self._decides_within_epochs()):
            self._decide(epoch)
        if not self._begun:
            # The fit's first batch is known now (Keras builds the model
            # from it before the callbacks start): the rate for it.
            self._begun = True
            if self._follower is not None:
                rate = self._follow(None)
                if self.path and self.path[-1].updates == self._since.updates:
                    self.path[-1] = self.path[-1]._replace(learning_rate=rate)

    def on_train_batch_end(self, batch, logs=None):
        size = self._batch_drawn() or 0
        # Counted by full batches: an epoch's short last batch counts whole.
        self._trained += size
        if not self._decides_within_epochs() or self.engine.window_open():
            return
        updates = self._updates()
        if self.every_updates is not None:
            due = updates - self._since.updates >= _gap(
                updates - self._start.updates, self.every_updates)
        else:
            due = self._trained - self._since.samples >= _gap(self._trained, self.every_samples)
        if due:
            self._decide(self._epoch)

    def _batch_drawn(self):
        # The batch fit draws per step, global: under a strategy the model
        # sees one replica's share. None before the first.
        size = self.engine.batch_size_seen
        return size and size * self.model.distribute_strategy.num_replicas_in_sync

    def _probe_micro_batch(self):
        # What one device runs at once in a step: the micro-batch when the
        # step splits its batch (memory), else the replica's share.
        share = self.engine.batch_size_seen
        setting = self.engine.settings.micro_batch_size
        split = self.engine.auto.size if setting == "auto" else setting
        return min(split, share) if split and share else share

    def _updates(self):
        # `.numpy()`: under a strategy the count is a MirroredVariable,
        # which `int()` refuses.
        return int(self.model.optimizer.iterations.numpy())

    def _decides_within_epochs(self):
        return self.every_updates is not None or self.every_samples is not None

    def _decide(self, epoch):
        value = self._value(epoch)
        estimate, probed = self._acted_on if self._growth is not None else (None, False)
        self._since = _Since(self._updates(), self._trained)
        changed = value is not None and value != self.engine.settings.accum_steps
        if changed:
            # A window is never open here (an epoch's start, or a window's
            # end; a resumed mid-epoch window was opened with this value).
            # For this fit only, as fit(accum_steps=...): not the setter,
            # which would make the value the model's own after fit.
            self.engine.set_accum_steps(value)
            if self.verbose > 0:
                print(f"\nEpoch {epoch + 1}: AccumScheduler setting accum_steps to {value}.")
        rate = self._follow(estimate) if changed and self._begun else None
        if changed or self._growth is not None:
            self.path.append(Decision(
                epoch, self._since.updates, self._trained, self.engine.settings.accum_steps,
                rate, estimate, probed))

    def _follow(self, estimate):
        if self._follower is None:
            return None
        size = self._batch_drawn()
        if not size:
            return self._follower.rate()  # no data seen: nothing to scale by
        return self._follower.follow(size * self.engine.settings.accum_steps, estimate)

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            # Printed as an integer by the progress bar (LoggedCount).
            logs["accum_steps"] = internals.LoggedCount(self.engine.settings.accum_steps)


# The first decisions of a fit come sooner: the gap is half the fit so far,
# from every / RAMP up to every. The batch at most doubles per decision, so
# growing 16-fold at a fixed gap took 4 gaps (200 updates at 50, spent at
# the small batch). Measured on benchmarks/batch_growth.py (medians of 3
# seeds, S_min / E_min): without the ramp 2.29 / 2.21 from the rate tuned
# for 16 and 2.38 / 2.17 from 256's; RAMP 3: 1.96 / 2.20 and 2.16 / 2.21;
# RAMP 5: 2.20 / 2.42 and 2.12 / 2.21.
RAMP = 3


def _outgrown(estimate, window):
    """Whether the noise scale has outgrown a `window` of samples: the
    estimate unresolved, or above it."""
    return not estimate.resolved or estimate.value > window


def _gap(elapsed, every):
    """Updates (or samples) from the last decision to the next, `elapsed`
    into the fit: `elapsed / 2`, at least `every / RAMP`, at most `every`."""
    return min(every, max(every // RAMP, elapsed // 2, 1))


class _Since(NamedTuple):
    """`optimizer.iterations` and the samples trained at the last decision."""

    updates: int = 0
    samples: int = 0




def _not_noise_scale(schedule):
    if isinstance(schedule, str):
        return 'A string must be "noise_scale". '
    return ""


def _check_takes_an_epoch(schedule):
    """Refuses a callable that cannot be called with one argument (the epoch)."""
    try:
        signature = inspect.signature(schedule)
    except (TypeError, ValueError):
        return  # no signature to read (some builtins): checked when called
    try:
        signature.bind(0)
    except TypeError as error:
        raise TypeError(
            "`schedule` must be a callable taking the epoch (0-based) and "
            "returning accum_steps, e.g. `lambda epoch: min(2 ** epoch, 8)`, "
            f"but it cannot be called with one argument ({error}). "
            f"Received: schedule={schedule!r} with signature {signature}."
        ) from None


def _checked_table(schedule):
    if not schedule:
        raise ValueError(
            "`schedule` must map at least one epoch to accum_steps, e.g. "
            "{0: 1, 5: 4}. Received: schedule={}."
        )
    table = []
    for epoch, steps in schedule.items():
        if (
            isinstance(epoch, bool)
            or not isinstance(epoch, numbers.Integral)
            or epoch < 0
        ):
            raise ValueError(
                "`schedule` keys must be epochs, integers >= 0 (0 is the "
                f"first epoch). Received: schedule={schedule!r} with key {epoch!r}."
            )
        try:
            steps = check_accum_steps(steps)
        except (TypeError, ValueError) as error:
            raise type(error)(
                f"`schedule` value for epoch {epoch} is not a valid accum_steps: "
                f"{error} Received: schedule={schedule!r}."
            ) from None
        table.append((int(epoch), steps))
    return sorted(table)
