"""Growing the batch to the gradient noise scale: an estimate to act on.

The window measures the noise scale (window/noise_scale.py); an estimate
over a few dozen windows is still noisy, and at a batch far below the
noise scale its denominator (`|G|^2`) is not resolved from zero: the
ratio is then heavy-tailed, or infinite. So the schedule acts on a
**smoothed** estimate with a **confidence interval**:

- the sums of the windows' `tr(Sigma)` and `|G|^2` estimates (numerator
  and denominator apart, as the paper advises) are averaged across
  decisions with exponentially decaying weights;
- Fieller's interval for a ratio of means gives `low` and `high`; the
  estimate is *resolved* when the signal's mean is positive beyond the
  interval's reach (`high` finite). Unresolved, only `low` is known.

`BatchGrowth` turns an estimate into `accum_steps`: resolved, to the
estimate; unresolved, to its lower bound (the noise scale is at least
that); at most doubling per decision, never below the value in force, up to
the cap.

Example:

```python
growth = BatchGrowth(max_accum_steps=128)
growth.begin(noise)                # the window's NoiseScale, as a fit starts
growth.take_windows(noise)         # at each decision: the windows since
growth.next_accum_steps(current=4, samples_per_step=16)
```
"""

import math
from typing import NamedTuple

import numpy as np

from keras_accum.window.noise_scale import (
    PRODUCTS,
    SIGNAL,
    SIGNAL_SQUARES,
    TRACE,
    TRACE_SQUARES,
    WINDOWS,
)

# Two standard errors: a 95% interval.
Z = 2.0
# Fewer windows than this give no spread to trust.
MIN_WINDOWS = 3
# A decision keeps this share of the estimate before it (the windows since
# then count in full): the last interval and half the one before weigh
# about as much as all older ones.
KEEP = 0.5


class NoiseEstimate(NamedTuple):
    """The noise scale `B_simple` estimated over some windows, with its interval.

    Attributes:
        value: the ratio of the windows' summed `tr(Sigma)` and `|G|^2`
            estimates, in samples; `inf` if the signal's sum is not
            positive, NaN without windows.
        low: lower end of the 95% (Fieller) interval; 0 when not even the
            noise is resolved.
        high: upper end; `inf` when unresolved.
        windows: the windows behind it (weighted, when smoothed).
        resolved: whether `|G|^2` is resolved from zero, so that `value`
            can be acted on; otherwise only `low` is.

    Example:

    ```python
    estimate = NoiseEstimate.of(noise.read())
    if estimate.resolved:
        print(estimate.value, (estimate.low, estimate.high))
    ```
    """

    value: float
    low: float
    high: float
    windows: float
    resolved: bool

    @classmethod
    def of(cls, sums, z=Z):
        """The estimate from `NoiseScale` sums (or a difference of two reads)."""
        sums = np.asarray(sums, dtype=np.float64)
        n = float(sums[WINDOWS])
        if not n > 0:
            return cls(math.nan, math.nan, math.nan, 0.0, False)
        trace, signal = sums[TRACE] / n, sums[SIGNAL] / n
        value = _ratio(trace, signal)
        if n < MIN_WINDOWS:
            return cls(value, 0.0, math.inf, n, False)
        # Variances of the means (sample variances over n).
        scale = 1.0 / (n * (n - 1.0))
        s_tt = max(sums[TRACE_SQUARES] - n * trace * trace, 0.0) * scale
        s_gg = max(sums[SIGNAL_SQUARES] - n * signal * signal, 0.0) * scale
        s_tg = (sums[PRODUCTS] - n * trace * signal) * scale
        low, high = _fieller(trace, signal, s_tt, s_gg, s_tg, z)
        return cls(value, low, high, n, math.isfinite(high))


def _ratio(trace, signal):
    if signal > 0:
        return float(trace / signal)
    return math.inf if trace > 0 else math.nan


def _fieller(trace, signal, s_tt, s_gg, s_tg, z):
    # R is in the interval where (T - R G)^2 <= z^2 var(T - R G):
    # a R^2 - 2 b R + c <= 0.
    z2 = z * z
    a = signal * signal - z2 * s_gg
    b = trace * signal - z2 * s_tg
    c = trace * trace - z2 * s_tt
    disc = b * b - a * c
    if a > 0 and signal > 0:
        # Bounded: the signal is resolved from zero.
        root = math.sqrt(max(disc, 0.0))
        return max((b - root) / a, 0.0), (b + root) / a
    # Unbounded above. Where the quadratic opens downwards, the ray towards
    # +inf starts at its larger root; if the noise itself is not resolved
    # (c <= 0), nothing bounds it from below.
    if c <= 0 or disc <= 0 or a == 0:
        return 0.0, math.inf
    root = math.sqrt(disc)
    return max((b - root) / a, (b + root) / a, 0.0), math.inf


class BatchGrowth:
    """The noise-scale schedule's state over one `fit`: the smoothed sums,
    what the window's `NoiseScale` held at the last decision, and the rule.

    Args:
        max_accum_steps: the cap.
        keep: the share of the smoothed sums kept at each decision.
        multiple: the batch grown towards, in noise scales.
        min_accum_steps: None: never shrinks; else the batch may shrink,
            at most halving per decision, down to this.

    Attributes:
        smoothed: the decayed sums of the windows' estimates (NoiseScale's
            layout), None before the first decision.

    Example:

    ```python
    growth = BatchGrowth(max_accum_steps=64)
    growth.begin(noise)                    # a fit starts
    growth.take_windows(noise)             # at each decision
    growth.next_accum_steps(current=2, samples_per_step=32)  # e.g. 4
    ```
    """

    def __init__(self, max_accum_steps, keep=KEEP, multiple=1.0, min_accum_steps=None):
        self.max_accum_steps = max_accum_steps
        self.keep = keep
        self.multiple = multiple
        self.min_accum_steps = min_accum_steps
        self.smoothed = None
        # `NoiseScale.read()` at the last decision: the windows since are
        # the difference.
        self._read = None

    def begin(self, noise):
        """A fit starts: nothing smoothed yet, windows counted from now."""
        self.smoothed = None
        self._read = noise.read()

    def take_windows(self, noise):
        """Adds the windows `noise` measured since the last call."""
        now = noise.read()
        self.observe(now - self._read)
        self._read = now

    def can_change(self, current):
        """Whether a decision at `current` may change it: below the cap,
        or allowed to shrink."""
        return current < self.max_accum_steps or self.min_accum_steps is not None

    def observe(self, sums):
        """Adds the windows since the last observation (a sums difference)."""
        sums = np.asarray(sums, dtype=np.float64)
        if self.smoothed is None:
            self.smoothed = sums.copy()
        else:
            self.smoothed = self.keep * self.smoothed + sums

    @property
    def estimate(self):
        """The smoothed `NoiseEstimate` (NaN before any window)."""
        if self.smoothed is None:
            return NoiseEstimate.of(np.zeros(6))
        return NoiseEstimate.of(self.smoothed)

    def next_accum_steps(self, current, samples_per_step, estimate=None):
        """`accum_steps` for the next windows: towards `multiple` times the
        estimate (its lower bound while unresolved), at most doubling, up
        to the cap; never shrinking, unless `min_accum_steps` is set: then
        towards `multiple` times the interval's upper end (only a resolved
        estimate has one: a smaller batch must be wanted whatever the
        noise scale is within it), at most halving, down to it.
        `estimate`: another to act on (a probe's), by default the smoothed
        one."""
        estimate = self.estimate if estimate is None else estimate
        if not samples_per_step or estimate.windows < MIN_WINDOWS:
            return current
        target = estimate.value if estimate.resolved else estimate.low
        if not target > 0:
            return current
        wanted = self.multiple * target / samples_per_step
        wanted = math.inf if math.isinf(wanted) else round(wanted)
        if wanted >= current or self.min_accum_steps is None:
            return int(min(self.max_accum_steps, 2 * current, max(current, wanted)))
        # Unresolved, the upper end is inf: kept.
        upper = self.multiple * estimate.high / samples_per_step
        if upper >= current or current <= self.min_accum_steps:
            return current
        return int(max(self.min_accum_steps, -(-current // 2), round(upper)))

    def state(self, noise):
        """For a backup mid-`fit` (JSON-able): the smoothed sums, the
        windows measured since the last decision, and the open window's
        sums (on one replica)."""
        return {
            "smoothed": None if self.smoothed is None else self.smoothed.tolist(),
            "since_decision": (noise.read() - self._read).tolist(),
            "open_window": noise.open_window(),
        }

    def restore(self, state, noise):
        """A backup's `state` back, into this fit's `noise`."""
        smoothed = state["smoothed"]
        self.smoothed = None if smoothed is None else np.array(smoothed)
        self._read = noise.read() - np.array(state["since_decision"])
        noise.resume_window(state["open_window"])
