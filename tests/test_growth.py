"""The noise-scale schedule's parts, against their formulas: the estimate
and its interval (keras_accum/growth.py), the decision, and the
learning-rate rules (keras_accum/rate_rules.py)."""

import math

import numpy as np
import pytest

from keras_accum.growth.estimate import BatchGrowth, NoiseEstimate
from keras_accum.growth.rate_rules import RULES, adascale, check_rule, linear, square_root

pytestmark = pytest.mark.unit


def _sums(trace, signal):
    """NoiseScale's sums of windows with these estimates."""
    trace, signal = np.asarray(trace, float), np.asarray(signal, float)
    return np.array(
        [
            trace.sum(),
            signal.sum(),
            len(trace),
            (trace**2).sum(),
            (signal**2).sum(),
            (trace * signal).sum(),
        ]
    )


def _windows(rng, n, trace=400.0, signal=2.0, spread=(100.0, 1.0)):
    # Per-window estimates scatter about the truth, the signal's the most.
    return (trace + spread[0] * rng.standard_normal(n), signal + spread[1] * rng.standard_normal(n))


def test_the_value_is_the_ratio_of_the_sums():
    trace, signal = [300.0, 500.0, 460.0, 340.0], [1.0, 3.0, 2.5, 1.5]
    estimate = NoiseEstimate.of(_sums(trace, signal))
    assert estimate.value == pytest.approx(sum(trace) / sum(signal), rel=1e-12)
    assert estimate.windows == 4
    assert estimate.low < estimate.value < estimate.high


def test_the_interval_is_fiellers():
    rng = np.random.default_rng(0)
    trace, signal = _windows(rng, 20)
    estimate = NoiseEstimate.of(_sums(trace, signal))
    # Fieller: R with (mean(T) - R mean(G))^2 = 4 var(mean(T - R G)).
    for bound in (estimate.low, estimate.high):
        d = trace - bound * signal
        assert d.mean() ** 2 == pytest.approx(4 * d.var(ddof=1) / len(d), rel=1e-9)
    assert estimate.resolved


def test_the_interval_covers_the_truth_about_95_percent_of_the_time():
    rng = np.random.default_rng(1)
    covered = 0
    for _ in range(400):
        estimate = NoiseEstimate.of(_sums(*_windows(rng, 30)))
        covered += estimate.low <= 200.0 <= estimate.high
    assert 0.90 <= covered / 400 <= 0.99, covered


def test_a_signal_not_resolved_from_zero_is_unresolved_with_a_lower_bound():
    rng = np.random.default_rng(2)
    # The signal's mean is within its own spread of zero: the noise scale
    # may be anything above a bound the trace alone sets.
    trace, signal = _windows(rng, 12, signal=0.2, spread=(50.0, 1.0))
    estimate = NoiseEstimate.of(_sums(trace, signal))
    assert not estimate.resolved and estimate.high == math.inf
    assert 0 < estimate.low < 400.0 / 0.2
    d = trace - estimate.low * signal
    assert d.mean() ** 2 == pytest.approx(4 * d.var(ddof=1) / len(d), rel=1e-9)


def test_nothing_known_without_windows_and_no_interval_from_two():
    empty = NoiseEstimate.of(np.zeros(6))
    assert math.isnan(empty.value) and not empty.resolved and empty.windows == 0
    two = NoiseEstimate.of(_sums([300.0, 500.0], [1.0, 3.0]))
    assert two.value == 200.0 and not two.resolved and (two.low, two.high) == (0.0, math.inf)


class _Noise:
    """A NoiseScale's cumulative sums, as `read()` gives them."""

    def __init__(self):
        self.sums = np.zeros(6)

    def read(self):
        return self.sums.copy()


def test_each_decision_adds_the_windows_since_the_last_and_halves_the_older():
    noise, growth = _Noise(), BatchGrowth(max_accum_steps=64, keep=0.5)
    noise.sums += _sums([999.0] * 3, [1.0] * 3)  # before the fit: not counted
    growth.begin(noise)
    first, second = _sums([300.0] * 4, [1.0] * 4), _sums([100.0] * 4, [2.0] * 4)
    noise.sums += first
    growth.take_windows(noise)
    noise.sums += second
    growth.take_windows(noise)
    np.testing.assert_allclose(growth.smoothed, 0.5 * first + second)
    assert growth.estimate == NoiseEstimate.of(0.5 * first + second)
    growth.begin(noise)
    assert growth.smoothed is None and growth.estimate.windows == 0


@pytest.mark.parametrize(
    "trace, signal, current, expected",
    [
        ([640.0] * 3 + [660.0] * 3, [10.0] * 6, 2, 4),  # 65 / 16 = 4.06: 4
        ([6400.0] * 6, [10.0] * 6, 2, 4),  # wants 40: at most doubling
        ([64000.0] * 6, [10.0] * 6, 48, 64),  # and the cap
        ([160.0] * 6, [10.0] * 6, 8, 8),  # wants 1: never shrinks
        ([640.0, 660.0], [10.0, 10.0], 2, 2),  # two windows: keeps
    ],
)
def test_the_next_accum_steps(trace, signal, current, expected):
    growth = BatchGrowth(max_accum_steps=64)
    growth.observe(_sums(trace, signal))
    assert growth.next_accum_steps(current, samples_per_step=16) == expected


def test_the_batch_grows_towards_a_multiple_of_the_estimate():
    growth = BatchGrowth(max_accum_steps=64, multiple=2.0)
    growth.observe(_sums([640.0] * 3 + [660.0] * 3, [10.0] * 6))
    assert growth.next_accum_steps(6, samples_per_step=16) == 8  # 2 x 65 / 16


def test_unresolved_it_grows_to_the_lower_bound():
    rng = np.random.default_rng(2)
    trace, signal = _windows(rng, 12, signal=0.2, spread=(50.0, 1.0))
    growth = BatchGrowth(max_accum_steps=1000)
    growth.observe(_sums(trace, signal))
    low = growth.estimate.low
    assert growth.next_accum_steps(8, samples_per_step=1) == min(16, max(8, round(low)))
    assert growth.next_accum_steps(400, samples_per_step=1) == max(400, round(low))


def test_asked_to_it_shrinks_by_the_upper_end_at_most_halving_down_to_the_minimum():
    rng = np.random.default_rng(3)
    trace, signal = _windows(rng, 40, trace=160.0, signal=4.0, spread=(20.0, 0.5))
    never, asked = (
        BatchGrowth(max_accum_steps=64),
        BatchGrowth(max_accum_steps=64, min_accum_steps=3),
    )
    for growth in (never, asked):
        growth.observe(_sums(trace, signal))
    estimate = asked.estimate
    assert estimate.resolved and estimate.high < 2 * estimate.value  # about 40, tight
    upper = round(estimate.high)  # samples_per_step=1, multiple 1
    assert never.next_accum_steps(64, samples_per_step=1) == 64  # never shrinks
    assert asked.next_accum_steps(64, samples_per_step=1) == max(32, upper)  # halving at most
    assert asked.next_accum_steps(upper + 2, samples_per_step=1) == upper  # to the upper end
    assert asked.next_accum_steps(2 * upper, samples_per_step=1) == upper
    assert asked.next_accum_steps(upper, samples_per_step=1) == upper  # within: kept
    assert asked.next_accum_steps(upper, samples_per_step=16) == max(3, -(-upper // 2))
    assert asked.next_accum_steps(4, samples_per_step=16) == 3  # the minimum
    assert asked.next_accum_steps(2, samples_per_step=32) == 2  # below it: not raised


def test_asked_to_it_does_not_shrink_on_an_unresolved_estimate():
    rng = np.random.default_rng(2)
    trace, signal = _windows(rng, 12, signal=0.2, spread=(50.0, 1.0))
    growth = BatchGrowth(max_accum_steps=1000, min_accum_steps=1)
    growth.observe(_sums(trace, signal))
    assert not growth.estimate.resolved
    assert growth.next_accum_steps(1000, samples_per_step=1) == 1000


# -- the learning-rate rules ---------------------------------------------------


def test_each_rule_is_its_formula_and_one_at_the_tuned_batch():
    resolved = NoiseEstimate(48.0, 40.0, 60.0, 10, True)
    assert linear(64, 16) == 4.0 and square_root(64, 16) == 2.0
    assert adascale(64, 16, resolved) == pytest.approx((1 + 48 / 16) / (1 + 48 / 64))
    for rule in RULES.values():
        assert rule(16, 16, resolved) == pytest.approx(1.0)


def test_adascale_reads_the_lower_bound_unresolved_and_is_linear_at_infinity():
    unresolved = NoiseEstimate(math.inf, 30.0, math.inf, 10, False)
    assert adascale(64, 16, unresolved) == pytest.approx((1 + 30 / 16) / (1 + 30 / 64))
    infinite_bound = NoiseEstimate(math.inf, math.inf, math.inf, 10, False)
    assert adascale(64, 16, infinite_bound) == 4.0
    assert adascale(64, 16, None) == 1.0  # nothing measured: not scaled up
    assert adascale(16, 256, None) == 1 / 16  # but down, as if noise dominated
    assert adascale(64, 16, NoiseEstimate(math.nan, 0.0, math.inf, 1, False)) == 1.0


def test_a_rule_is_a_name_a_function_or_none():
    assert check_rule("sqrt") is square_root and check_rule(None) is None
    mine = lambda batch, tuned_batch, estimate: 1.0  # noqa: E731
    assert check_rule(mine) is mine
    with pytest.raises(ValueError, match=r"learning_rate_rule='cubic'"):
        check_rule("cubic")


def test_auto_is_adascale_for_sgd_and_sqrt_for_adaptive_optimizers():
    import keras

    from keras_accum.growth.rate_rules import adascale_sqrt, for_optimizer

    resolved = NoiseEstimate(48.0, 40.0, 60.0, 10, True)
    assert adascale_sqrt(64, 16, resolved) == pytest.approx(math.sqrt(adascale(64, 16, resolved)))
    assert for_optimizer("auto", keras.optimizers.SGD(0.1, momentum=0.9)) is adascale
    assert for_optimizer("auto", keras.optimizers.Adam()) is square_root
    assert (
        for_optimizer("auto", keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD()))
        is adascale
    )
    assert for_optimizer(linear, keras.optimizers.Adam()) is linear
