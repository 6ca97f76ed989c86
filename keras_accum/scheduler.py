"""`AccumScheduler`: change `accum_steps` at epoch boundaries (batch-size warm-up),
from a schedule or from the measured gradient noise scale."""

import inspect
import math
import numbers

from keras_accum import _internals as internals
from keras_accum.arguments import check_accum_steps
from keras_accum.fitting import FitSetting


class AccumScheduler(FitSetting):
    """Sets `model.accum_steps` at the start of each epoch, from a schedule.

    Like `keras.callbacks.LearningRateScheduler`, for the effective batch:
    a small batch early, a larger one later. The window open at an epoch's
    end is applied then (as always in `fit`), so every window lies inside
    one epoch and the training equals a plain model whose batch size
    follows the same schedule: `micro-batch x accum_steps` in each epoch.

    `optimizer.iterations` counts updates, so learning-rate schedules see
    the big-batch run's steps. Each distinct value is traced once for the
    whole `fit`, however often the schedule returns to it. On resume
    (`initial_epoch`, `BackupAndRestore`) the schedule is applied for the
    epoch training starts at. Like `fit(accum_steps=...)`, the change lasts
    for that `fit` only: afterwards `model.accum_steps` is what it was
    before. The value in force is logged as `accum_steps` in each epoch's
    logs (the progress bar prints it as an integer). With
    `fit(accum_steps=N)`, a schedule that sets another value for the epoch
    training starts at is refused before training (`N` would never be
    used); a schedule starting later, or "noise_scale", starts from `N`.

    Args:
        schedule: a dict `{epoch: accum_steps}` (0-based epochs; each value
            holds from its epoch until the next key; before the first key,
            the model's own `accum_steps`), or a callable
            `epoch -> accum_steps` (None keeps the current value). A dict is
            checked here, and so is that a callable takes one argument; its
            values are checked for every epoch of the `fit` before training
            starts.
            Or "noise_scale": a warm-up that follows the gradient noise
            scale the model measures (`noise_scale=True`): at the start of
            each epoch for which an estimate exists (the previous epoch's,
            `model.noise_scale`),
            `accum_steps = min(max_accum_steps, max(current,
            round(noise_scale / samples_per_step)))`, `samples_per_step`
            being the batch `fit` draws (global under a strategy): it only
            grows. A NaN estimate keeps the current value.
        verbose: 1 prints a message when the value changes.
        max_accum_steps: with "noise_scale" (and only then, where it is
            required): the largest `accum_steps` to grow to.

    Example:

    ```python
    model = keras_accum.AccumModel(inputs, outputs)
    model.compile("adam", "sparse_categorical_crossentropy")
    # batch 32 for epochs 0-1, 64 for epoch 2, 128 from epoch 3 on
    warmup = keras_accum.AccumScheduler({0: 1, 2: 2, 3: 4})
    model.fit(x, y, batch_size=32, epochs=4, callbacks=[warmup])

    # or as a function of the epoch
    keras_accum.AccumScheduler(lambda epoch: min(2 ** epoch, 8))

    # or grown to the measured noise scale, up to 32 micro-batches
    model = keras_accum.AccumModel(inputs, outputs, accum_steps=2, noise_scale=True)
    model.compile("adam", "sparse_categorical_crossentropy")
    grow = keras_accum.AccumScheduler("noise_scale", max_accum_steps=32)
    model.fit(x, y, batch_size=32, epochs=3, callbacks=[grow])
    ```
    """

    def __init__(self, schedule, verbose=0, max_accum_steps=None):
        super().__init__()
        self.max_accum_steps = _check_max_accum_steps(schedule, max_accum_steps)
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

    def _lookup(self, epoch):
        value = None
        for start, steps in self._table:
            if start > epoch:
                break
            value = steps
        return value

    def _from_noise_scale(self, epoch):
        measured = self.model.noise_scale
        size = self.fit_control.batch_size_seen()
        if measured is None or math.isnan(measured) or not size:
            return None
        current = self.model.accum_steps
        wanted = self.max_accum_steps if math.isinf(measured) else round(measured / size)
        return min(self.max_accum_steps, max(current, wanted))

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

    def on_train_begin(self, logs=None):
        self._check_model()
        if self.schedule == NOISE_SCALE:
            if not self.fit_control.settings().noise_scale:
                raise ValueError(
                    'AccumScheduler("noise_scale") follows the noise scale '
                    "the model measures, and this model does not measure "
                    "it: make it with `noise_scale=True` (AccumModel or "
                    "keras_accum.wrap)."
                )
        elif self._table is None:
            # A callable is checked for every epoch before the first step.
            for epoch in range(self.params.get("epochs") or 0):
                self._value(epoch)

    def _check_model(self):
        if not hasattr(type(self.model), "accum_steps"):
            raise ValueError(
                "AccumScheduler needs a keras_accum model (AccumModel or "
                f"keras_accum.wrap(model)). Received a {type(self.model).__name__}."
            )

    def on_epoch_begin(self, epoch, logs=None):
        value = self._value(epoch)
        if value is None or value == self.model.accum_steps:
            return
        # The previous epoch's window was applied at its end, so nothing is
        # pending here (a resumed mid-epoch window was opened with this value).
        # For this fit only, as fit(accum_steps=...): not the setter, which
        # would make the value the model's own after fit.
        self.fit_control.set_accum_steps(value)
        if self.verbose > 0:
            print(f"\nEpoch {epoch + 1}: AccumScheduler setting accum_steps to {value}.")

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            # Printed as an integer by the progress bar (LoggedCount).
            logs["accum_steps"] = internals.LoggedCount(self.model.accum_steps)


NOISE_SCALE = "noise_scale"


def _not_noise_scale(schedule):
    if isinstance(schedule, str):
        return 'A string must be "noise_scale". '
    return ""


def _check_max_accum_steps(schedule, max_accum_steps):
    if schedule == NOISE_SCALE:
        if max_accum_steps is None:
            raise ValueError(
                'AccumScheduler("noise_scale") needs `max_accum_steps`, the '
                "largest accum_steps to grow to, e.g. "
                'AccumScheduler("noise_scale", max_accum_steps=32). '
                "Received: max_accum_steps=None."
            )
        try:
            return check_accum_steps(max_accum_steps)
        except (TypeError, ValueError) as error:
            raise type(error)(
                str(error).replace("accum_steps", "max_accum_steps")
            ) from None
    if max_accum_steps is not None:
        raise ValueError(
            '`max_accum_steps` is for AccumScheduler("noise_scale"); a '
            "dict or callable schedule sets accum_steps itself. "
            f"Received: max_accum_steps={max_accum_steps!r} with "
            f"schedule={schedule!r}."
        )
    return None


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
