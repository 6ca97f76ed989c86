"""`AccumScheduler`: change `accum_steps` as training goes, from a schedule
of epochs (epochs.py) or grown to the measured gradient noise scale
(noise_growth.py); the learning rate follows (rate_rules.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

from keras_accum import _internals as internals
from keras_accum.arguments import check_positive
from keras_accum.engine.fit import FitSetting
from keras_accum.growth import rate_rules
from keras_accum.growth.epochs import EpochSchedule
from keras_accum.growth.estimate import NoiseEstimate
from keras_accum.growth.noise_growth import NoiseScaleGrowth
from keras_accum.growth.probe import probe_argument

if TYPE_CHECKING:
    from keras_accum.engine import Engine

NOISE_SCALE = "noise_scale"
# learning_rate_rule's default: "auto" with "noise_scale", else None.
DEFAULT = object()


class Decision(NamedTuple):
    """One decision of an `AccumScheduler` (its `path`).

    Attributes:
        epoch: the epoch it was made in (0-based).
        updates: `optimizer.iterations` then.
        samples: samples trained in this `fit` then.
        accum_steps: the value set (or kept) for the next windows.
        learning_rate: the rate set by the rule, or None without one.
        estimate: the `NoiseEstimate` acted on ("noise_scale"; the windows'
            smoothed one, or the probe's), else None.
        probed: whether `estimate` was measured on the probe.
    """

    epoch: int
    updates: int
    samples: int
    accum_steps: int
    learning_rate: float | None
    estimate: NoiseEstimate | None
    probed: bool = False


def _argument(name, attribute, read=lambda value: value):
    """A property reading the noise-scale strategy's `attribute`: AccumScheduler's `name`."""

    def get(self) -> int | float | None:
        value = getattr(self._strategy, attribute, None)
        return None if value is None else read(value)

    get.__doc__ = f"""The `{name}` argument, normalised; None for a dict or callable schedule.

        Example:

        ```python
        grow = keras_accum.AccumScheduler("noise_scale", max_accum_steps=32)
        grow.{name}
        ```
        """
    return property(get)


class AccumScheduler(FitSetting):
    """Sets `model.accum_steps` as training goes, from a schedule of epochs or
    grown to the measured gradient noise scale; and the learning rate with it.

    Like `keras.callbacks.LearningRateScheduler`, for the effective batch. A
    change waits for the open window to be applied, so training equals a
    plain model fed the same batches, and lasts for that `fit` only (as
    `fit(accum_steps=...)`); epoch logs hold the value as `accum_steps`. The
    manual: docs/schedules-and-skipping.md and docs/batch-growth.md.

    Args:
        schedule: a dict `{epoch: accum_steps}` (0-based epochs; each value
            holds until the next key, the model's own before the first), a
            callable `epoch -> accum_steps` (None keeps the value in force),
            both checked for every epoch before training; or "noise_scale":
            grown towards `noise_scale_multiple` times the noise scale the
            model measures (`noise_scale=True`), at most doubling per
            decision, up to `max_accum_steps`.
        verbose: 1 prints a message when the value changes.
        max_accum_steps: with "noise_scale", where it is required: the
            largest `accum_steps` to grow to.
        every_updates: with "noise_scale": decide every this many updates, at
            a window's end (default 50; a fit's first decisions come sooner).
        every_samples: with "noise_scale", instead of `every_updates`: decide
            once this many samples were trained since the last decision.
        noise_scale_multiple: with "noise_scale": the batch grown towards, in
            noise scales (default 1.5).
        min_accum_steps: with "noise_scale": let the batch shrink, at most
            halving per decision, down to this. Default None: never shrinks.
        learning_rate_rule: the factor the rate (tuned for `tuned_batch`)
            is multiplied by at each change: "auto" (AdaScale's gain for SGD,
            "sqrt" for others), "adascale", "adascale_sqrt", "sqrt",
            "linear", a function `(batch, tuned_batch, estimate) -> factor`,
            or None (left alone). Default: "auto" with "noise_scale", else
            None.
        probe: with "noise_scale": `(x, y)` or `(x, y, sample_weight)`,
            examples held aside to measure the noise scale on where it has
            outgrown training's windows (several times the noise scale you
            expect per window); not across workers yet. Default None.
        probe_windows: the windows the probe is split into (>= 3; default 8).
        tuned_batch: the batch (samples per update, global) the optimizer's
            rate was tuned for, for a `learning_rate_rule` or a
            `SampleSchedule`. Default: the batch the fit starts at.

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

    def __init__(
        self,
        schedule: dict[int, int] | Callable[[int], int | None] | str,
        verbose: int = 0,
        max_accum_steps: int | None = None,
        *,
        every_updates: int | None = None,
        every_samples: int | None = None,
        learning_rate_rule: str
        | Callable[[int, int, NoiseEstimate | None], float]
        | None = DEFAULT,
        tuned_batch: int | None = None,
        noise_scale_multiple: float | None = None,
        min_accum_steps: int | None = None,
        probe: tuple | None = None,
        probe_windows: int | None = None,
    ) -> None:
        super().__init__()
        growth = {
            "max_accum_steps": max_accum_steps,
            "every_updates": every_updates,
            "every_samples": every_samples,
            "noise_scale_multiple": noise_scale_multiple,
            "min_accum_steps": min_accum_steps,
        }
        noise_scale = isinstance(schedule, str) and schedule == NOISE_SCALE
        if noise_scale:
            self._strategy = NoiseScaleGrowth(
                max_accum_steps,
                every_updates,
                every_samples,
                noise_scale_multiple,
                min_accum_steps,
                probe_argument(True, probe, probe_windows),
            )
        elif isinstance(schedule, dict) or callable(schedule):
            for name, value in growth.items():
                if value is not None:
                    raise ValueError(
                        f'`{name}` is for AccumScheduler("noise_scale"); a dict or '
                        "callable schedule sets accum_steps per epoch itself. "
                        f"Received: {name}={value!r} with schedule={schedule!r}."
                    )
            probe_argument(False, probe, probe_windows, schedule)
            self._strategy = EpochSchedule(schedule)
        else:
            hint = 'A string must be "noise_scale". ' if isinstance(schedule, str) else ""
            raise TypeError(
                "`schedule` must be a dict {epoch: accum_steps}, a callable "
                f'epoch -> accum_steps, or "noise_scale". {hint}'
                f"Received: schedule={schedule!r} (of type {type(schedule).__name__})."
            )
        if learning_rate_rule is DEFAULT:
            learning_rate_rule = rate_rules.AUTO if noise_scale else None
        self._rule = rate_rules.check_rule(learning_rate_rule)
        self.learning_rate_rule = learning_rate_rule
        self.tuned_batch = check_positive(
            "tuned_batch", tuned_batch, None, "samples per update the rate was tuned for"
        )
        self.schedule = schedule
        self.verbose = verbose
        self.path = []
        self._follower = None
        self._epoch = 0
        self._since = _Since()
        self._start = _Since()  # the fit's start (decisions come sooner after it)
        self._trained = 0  # samples trained in this fit
        self._begun = False  # the rate for the fit's first batch is set
        self._started = False  # on_train_begin ran in this fit
        self._restored = None  # a backup's, until `_apply_state`

    # The noise-scale strategy's arguments, as given (normalised); None
    # for a dict or callable schedule.
    max_accum_steps = _argument("max_accum_steps", "max_accum_steps")
    every_updates = _argument("every_updates", "every_updates")
    every_samples = _argument("every_samples", "every_samples")
    noise_scale_multiple = _argument("noise_scale_multiple", "multiple")
    min_accum_steps = _argument("min_accum_steps", "min_accum_steps")
    probe_windows = _argument("probe_windows", "probe", lambda probe: probe.windows)

    def value_at_start(self, epoch: int) -> int | None:
        """The value the schedule sets for `epoch` as known before training,
        checked as in `fit`: None for "noise_scale" (it grows from the value
        in force) and for a callable returning None.

        Example:

        ```python
        keras_accum.AccumScheduler({0: 1, 3: 4}).value_at_start(5)  # 4
        ```
        """
        return self._strategy.value_at_start(epoch)

    def bind_fit(self, engine: Engine | None) -> None:
        """Called by the model's `fit` with its `Engine` as it starts, and with
        None as it ends (a followed learning rate goes back to the tuned one).

        Example:

        ```python
        inputs = keras.Input((4,))
        model = keras_accum.AccumModel(inputs, keras.layers.Dense(2)(inputs))
        grow = keras_accum.AccumScheduler({0: 1, 3: 4})
        grow.bind_fit(model.accumulation)  # what fit does as it starts
        grow.bind_fit(None)  # and as it ends
        ```
        """
        super().bind_fit(engine)
        if engine is None:
            self._started = False
            self._restored = None
            if self._follower is not None:
                # The fit ended (or failed): the tuned rate back.
                self._follower.stop()
                self._follower = None

    def on_train_begin(self, logs=None):
        self._check_model()
        self._strategy.begin(self.engine, self.params.get("epochs") or 0)
        self.path = []
        self._since = self._start = _Since(self._updates(), 0)
        self._trained = 0
        follows = rate_rules.RateFollower.needed(self._rule, self.model.optimizer)
        rate_rules.check_tuned_batch_used(self.tuned_batch, follows)
        if follows:
            self._follower = rate_rules.RateFollower(self._rule)
            self._follower.start(self.model.optimizer, self.tuned_batch)
        self._begun = False
        self._started = True
        if self._restored is not None:
            self._apply_state()

    # -- backups (keras_accum.BackupAndRestore) -------------------------------

    def state(self) -> dict | None:
        """What each backup keeps of the scheduler mid-`fit`: the `accum_steps`
        in force, the decision counters, the tuned rate, the smoothed estimate
        and the windows measured since the last decision (the open one's too,
        on one replica). `keras_accum.BackupAndRestore` keeps it.

        Example:

        ```python
        grow = keras_accum.AccumScheduler({0: 1, 3: 4})
        grow.state()  # None: nothing to keep outside a fit
        ```
        """
        if self.engine is None or not self._started:
            return None
        state = {
            "class": type(self).__name__,
            "accum_steps": self.engine.settings.accum_steps,
            "since": list(self._since),
            "start": list(self._start),
            "trained": self._trained,
            "begun": self._begun,
        }
        if self._follower is not None:
            state["rate"] = self._follower.state()
        if isinstance(self._strategy, NoiseScaleGrowth):
            state["growth"] = self._strategy.state(self.engine)
        return state

    def restore_state(self, state: dict) -> None:
        """Takes back a `state()` (a backup's restore), applied as soon as the
        fit has started.

        Example:

        ```python
        grow = keras_accum.AccumScheduler({0: 1, 3: 4})
        grow.restore_state({"class": "AccumScheduler", "accum_steps": 4, "since": [0, 0],
                            "start": [0, 0], "trained": 0, "begun": False})
        ```
        """
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
            # The weights brought the scaled rate back; the tuned one and a
            # SampleSchedule's count are the backup's.
            self._follower.restore(state["rate"])
        if "growth" in state and isinstance(self._strategy, NoiseScaleGrowth):
            self._strategy.restore(state["growth"], self.engine)

    def _check_model(self):
        # A keras_accum model's fit hands its engine over (bind_fit).
        if self.engine is None:
            raise ValueError(
                "AccumScheduler needs a keras_accum model (AccumModel or "
                f"keras_accum.wrap(model)). Received a {type(self.model).__name__}."
            )

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch
        strategy = self._strategy
        if not strategy.decides_within_epochs:
            self._decide(epoch)
        else:
            strategy.epoch_begins(self.engine)
        if not self._begun:
            # The first batch is known now (Keras builds the model from it
            # before the callbacks start): the rate for it.
            self._begun = True
            if self._follower is not None:
                rate = self._follow(None)
                if self.path and self.path[-1].updates == self._since.updates:
                    self.path[-1] = self.path[-1]._replace(learning_rate=rate)

    def on_train_batch_end(self, batch, logs=None):
        # Counted by full batches: an epoch's short last batch counts whole.
        self._trained += self.engine.batch_drawn() or 0
        if not self._strategy.decides_within_epochs or self.engine.window_open():
            return
        updates = self._updates()
        due = self._strategy.due(
            (updates - self._since.updates, updates - self._start.updates),
            (self._trained - self._since.samples, self._trained),
        )
        if due:
            self._decide(self._epoch)

    def _updates(self):
        # `.numpy()`: `int()` refuses a MirroredVariable.
        return int(self.model.optimizer.iterations.numpy())

    def _decide(self, epoch):
        value, estimate, probed = self._strategy.decide(epoch, self.engine)
        self._since = _Since(self._updates(), self._trained)
        changed = value is not None and value != self.engine.settings.accum_steps
        if changed:
            # No window is open here (an epoch's start or a window's end; a
            # resumed one was opened with this value). For this fit only:
            # the setter would make the value the model's own after fit.
            self.engine.set_accum_steps(value)
            if self.verbose > 0:
                print(f"\nEpoch {epoch + 1}: AccumScheduler setting accum_steps to {value}.")
        rate = self._follow(estimate) if changed and self._begun else None
        if changed or self._strategy.decides_within_epochs:
            self.path.append(
                Decision(
                    epoch,
                    self._since.updates,
                    self._trained,
                    self.engine.settings.accum_steps,
                    rate,
                    estimate,
                    probed,
                )
            )

    def _follow(self, estimate):
        if self._follower is None:
            return None
        size = self.engine.batch_drawn()
        if not size:
            return self._follower.rate()  # no data seen: nothing to scale by
        return self._follower.follow(size * self.engine.settings.accum_steps, estimate)

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            # Printed as an integer by the progress bar (LoggedCount).
            logs["accum_steps"] = internals.LoggedCount(self.engine.settings.accum_steps)


class _Since(NamedTuple):
    """`optimizer.iterations` and the samples trained at the last decision."""

    updates: int = 0
    samples: int = 0
