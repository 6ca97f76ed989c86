"""The noise-scale estimate the growth schedule acts on: smoothed, with a
confidence interval, since at a batch far below the noise scale `|G|^2` is
not resolved from zero and the windows' ratio is heavy-tailed or infinite.
`BatchGrowth` turns it into `accum_steps`.
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
# Fewer windows give no spread to trust.
MIN_WINDOWS = 3
# The share of the smoothed sums a decision keeps (new windows count in
# full): the last interval and half the one before weigh as much as all older.
KEEP = 0.5


class NoiseEstimate(NamedTuple):
    """The noise scale `B_simple` over some windows: their `tr(Sigma)` and
    `|G|^2` estimates summed apart (as the paper advises), with Fieller's
    95% interval for a ratio of means.

    Attributes:
        value: the ratio of the sums, in samples; `inf` if the `|G|^2` sum
            is not positive, NaN without windows.
        low: the interval's lower end; 0 when not even the noise is resolved.
        high: its upper end; `inf` when `|G|^2` is not resolved.
        windows: the windows behind it (weighted, when smoothed).
        resolved: whether `|G|^2` is resolved from zero, so that `value` can
            be acted on; otherwise only `low` is.
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
    # Unbounded above: the ray towards +inf starts at the larger root; with
    # the noise itself unresolved (c <= 0), nothing bounds it from below.
    if c <= 0 or disc <= 0 or a == 0:
        return 0.0, math.inf
    root = math.sqrt(disc)
    return max((b - root) / a, (b + root) / a, 0.0), math.inf


class BatchGrowth:
    """The growth schedule over one `fit`, with its rule: `smoothed`,
    the decayed sums of the windows' estimates (NoiseScale's layout; None
    before the first decision), and what the window's `NoiseScale` held at
    the last decision. `min_accum_steps` None: never shrinks."""

    def __init__(self, max_accum_steps, keep=KEEP, multiple=1.0, min_accum_steps=None):
        self.max_accum_steps = max_accum_steps
        self.keep = keep
        self.multiple = multiple
        self.min_accum_steps = min_accum_steps
        self.smoothed = None
        # `NoiseScale.read()` at the last decision.
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
        """Whether a decision at `current` may change it: below the cap, or
        allowed to shrink."""
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
        """`accum_steps` for the next windows (on `estimate`, a probe's, or the
        smoothed one): towards `multiple` times the estimate (its lower bound
        while unresolved), at most doubling, up to the cap. Only with
        `min_accum_steps` does it shrink, at most halving, down to it: when
        even the interval's upper end (resolved only) wants a smaller batch.
        """
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
        """For a backup mid-`fit` (JSON-able): the smoothed sums, the windows
        since the last decision, and the open window's sums (one replica)."""
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
