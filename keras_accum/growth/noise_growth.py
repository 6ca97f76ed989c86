"""An `AccumScheduler` strategy: `accum_steps` grown to the measured gradient
noise scale (estimate.py's `BatchGrowth`), decided every K updates (or N
samples) at a window's end; where the noise scale has outgrown training's
window, a probe (probe.py) measures it on held examples instead.
"""

from keras_accum import _internals as internals
from keras_accum.arguments import AUTO, check_accum_steps, check_positive
from keras_accum.growth.estimate import BatchGrowth

DEFAULT_EVERY_UPDATES = 50
DEFAULT_NOISE_SCALE_MULTIPLE = 1.5
# A fit's first decisions come sooner (`_gap`).
# Measured: benchmarks/design-notes.md, "The decision ramp".
RAMP = 3


class NoiseScaleGrowth:
    """`accum_steps` grown to the gradient noise scale the model measures.
    The arguments are `AccumScheduler`'s (`multiple`: `noise_scale_multiple`),
    normalised; `probe` is a `NoiseProbe` or None."""

    decides_within_epochs = True

    def __init__(
        self,
        max_accum_steps,
        every_updates=None,
        every_samples=None,
        multiple=None,
        min_accum_steps=None,
        probe=None,
    ):
        (
            self.max_accum_steps,
            self.every_updates,
            self.every_samples,
            self.multiple,
            self.min_accum_steps,
        ) = _checked(max_accum_steps, every_updates, every_samples, multiple, min_accum_steps)
        self.growth = BatchGrowth(
            self.max_accum_steps, multiple=self.multiple, min_accum_steps=self.min_accum_steps
        )
        self.probe = probe
        self._probe_checked = False

    def value_at_start(self, epoch):
        return None  # grows from the value in force

    def begin(self, engine, epochs):
        """A fit starts: the model must measure; the estimate starts afresh."""
        if not engine.settings.noise_scale:
            raise ValueError(
                'AccumScheduler("noise_scale") follows the noise scale '
                "the model measures, and this model does not measure "
                "it: make it with `noise_scale=True` (AccumModel or "
                "keras_accum.wrap)."
            )
        self.growth.begin(engine.state.noise)
        if self.probe is not None:
            if internals.multi_worker(engine.model.distribute_strategy):
                raise ValueError(
                    "`probe` is not supported across workers yet: each "
                    "worker would measure it apart and could decide "
                    "another `accum_steps`. Drop `probe` for a "
                    "multi-worker fit (the windows' estimate is reduced "
                    "across workers)."
                )
            self._probe_checked = False

    def epoch_begins(self, engine):
        """A probe too small for the batch `fit` draws (known from the first
        epoch's start) is refused before the first step."""
        if self.probe is not None and not self._probe_checked:
            self._probe_checked = True
            micro_batch = _probe_micro_batch(engine)
            if micro_batch:
                self.probe.check(micro_batch)

    def due(self, updates, samples):
        """Whether a decision is due, from `(since the last decision, since the
        fit's start)` pairs of `updates` and of `samples`."""
        if self.every_updates is not None:
            since, elapsed = updates
            return since >= _gap(elapsed, self.every_updates)
        since, elapsed = samples
        return since >= _gap(elapsed, self.every_samples)

    def decide(self, epoch, engine):
        """`(accum_steps, estimate, probed)`: the windows since the last decision
        join the smoothed estimate; where the noise scale has outgrown the
        window, the probe measures it instead."""
        growth, current = self.growth, engine.settings.accum_steps
        size = engine.batch_drawn()
        growth.take_windows(engine.state.noise)
        estimate, probed = growth.estimate, False
        if (
            self.probe is not None
            and size
            and growth.can_change(current)
            and _outgrown(estimate, current * size)
        ):
            estimate = self.probe.measure(engine.model, _probe_micro_batch(engine))
            probed = True
        return growth.next_accum_steps(current, size, estimate), estimate, probed

    def state(self, engine):
        return self.growth.state(engine.state.noise)

    def restore(self, state, engine):
        self.growth.restore(state, engine.state.noise)


def _probe_micro_batch(engine):
    # What one device runs at once: the micro-batch when the step splits its
    # batch, else the replica's share.
    share = engine.batch_size_seen
    setting = engine.settings.micro_batch_size
    split = engine.auto.size if setting == AUTO else setting
    return min(split, share) if split and share else share


def _outgrown(estimate, window):
    """Whether the noise scale has outgrown a `window` of samples: unresolved,
    or above it."""
    return not estimate.resolved or estimate.value > window


def _gap(elapsed, every):
    """Updates (or samples) from the last decision to the next, `elapsed` into
    the fit: `elapsed / 2`, at least `every / RAMP`, at most `every`."""
    return min(every, max(every // RAMP, elapsed // 2, 1))


def _checked(max_accum_steps, every_updates, every_samples, multiple, min_accum_steps):
    """The arguments, checked and normalised, in order."""
    if max_accum_steps is None:
        raise ValueError(
            'AccumScheduler("noise_scale") needs `max_accum_steps`, the '
            "largest accum_steps to grow to, e.g. "
            'AccumScheduler("noise_scale", max_accum_steps=32). '
            "Received: max_accum_steps=None."
        )
    max_accum_steps = _named_accum_steps("max_accum_steps", max_accum_steps)
    if every_updates is not None and every_samples is not None:
        raise ValueError(
            "Give `every_updates` or `every_samples`, not both. Received: "
            f"every_updates={every_updates!r}, every_samples={every_samples!r}."
        )
    if every_samples is None:
        every_updates = check_positive(
            "every_updates", every_updates, DEFAULT_EVERY_UPDATES, "how often the schedule decides"
        )
    else:
        every_samples = check_positive(
            "every_samples", every_samples, None, "how often the schedule decides"
        )
    multiple = check_positive(
        "noise_scale_multiple",
        multiple,
        DEFAULT_NOISE_SCALE_MULTIPLE,
        "the batch to grow towards, in noise scales; e.g. 1.5",
        float,
    )
    if min_accum_steps is not None:
        min_accum_steps = _named_accum_steps("min_accum_steps", min_accum_steps)
        if min_accum_steps > max_accum_steps:
            raise ValueError(
                "`min_accum_steps` (the smallest accum_steps the schedule may "
                "shrink to) must be at most `max_accum_steps`. Received: "
                f"min_accum_steps={min_accum_steps}, max_accum_steps={max_accum_steps}."
            )
    return max_accum_steps, every_updates, every_samples, multiple, min_accum_steps


def _named_accum_steps(name, value):
    try:
        return check_accum_steps(value)
    except (TypeError, ValueError) as error:
        raise type(error)(str(error).replace("accum_steps", name)) from None
