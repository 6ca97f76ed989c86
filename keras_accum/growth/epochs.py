"""An `AccumScheduler` strategy: `accum_steps` set per epoch, from a dict
`{epoch: accum_steps}` or a callable `epoch -> accum_steps`."""

import inspect
import numbers

from keras_accum.arguments import check_accum_steps


class EpochSchedule:
    """`accum_steps` for each epoch, decided at the epoch's start from
    `schedule` (`AccumScheduler`'s dict, checked here, or callable)."""

    decides_within_epochs = False

    def __init__(self, schedule):
        if isinstance(schedule, dict):
            self._table = _checked_table(schedule)
            self._call = self._lookup
        else:
            _check_takes_an_epoch(schedule)
            self._table = None
            self._call = schedule

    def _lookup(self, epoch):
        value = None
        for start, steps in self._table:
            if start > epoch:
                break
            value = steps
        return value

    def value(self, epoch):
        """The `accum_steps` for `epoch`, checked; None: the value in force."""
        value = self._call(epoch)
        if value is None:
            return None
        try:
            return check_accum_steps(value)
        except (TypeError, ValueError) as error:
            raise type(error)(f"`schedule` returned {value!r} for epoch {epoch}: {error}") from None

    def value_at_start(self, epoch):
        return self.value(epoch)

    def begin(self, engine, epochs):
        """A fit starts: a callable is checked for every epoch before the first
        step."""
        if self._table is None:
            for epoch in range(epochs):
                self.value(epoch)

    def decide(self, epoch, scheduler):
        """`(accum_steps or None, estimate, probed)` at `epoch`'s start."""
        return self.value(epoch), None, False


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
        if isinstance(epoch, bool) or not isinstance(epoch, numbers.Integral) or epoch < 0:
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
