"""Learning-rate rules: the factor by which to multiply the rate tuned for
`tuned_batch` when the batch is `batch`, a function `(batch, tuned_batch,
estimate) -> factor` (`estimate`: a `NoiseEstimate` or None), 1 at
`tuned_batch`; a user's own is one too. `RateFollower` follows one for a
`fit`. Which to use: docs/batch-growth.md, "The learning rate follows the batch".
"""

import math
import warnings

import keras

from keras_accum import _internals as internals
from keras_accum.arguments import AUTO
from keras_accum.growth.sample_schedule import SampleSchedule


def linear(batch, tuned_batch, estimate=None):
    """`batch / tuned_batch` (Goyal et al. 2017; SGD well below the noise scale)."""
    return batch / tuned_batch


def square_root(batch, tuned_batch, estimate=None):
    """`sqrt(batch / tuned_batch)` (Adam-family, Malladi et al. 2022)."""
    return math.sqrt(batch / tuned_batch)


def adascale(batch, tuned_batch, estimate=None):
    """AdaScale's gain (Johnson et al. 2020; SGD) `(1 + B_noise / tuned_batch) /
    (1 + B_noise / batch)`: McCandlish et al.'s optimal rate anchored at the
    tuned one. `B_noise`: the estimate, or its lower bound while unresolved;
    without one, `batch / tuned_batch` below the tuned batch, 1 above it.
    """
    noise = None if estimate is None else (estimate.value if estimate.resolved else estimate.low)
    if noise is None or not noise > 0:
        return min(1.0, batch / tuned_batch)
    if math.isinf(noise):
        return batch / tuned_batch
    return (1.0 + noise / tuned_batch) / (1.0 + noise / batch)


def adascale_sqrt(batch, tuned_batch, estimate=None):
    """The square root of AdaScale's gain: for Adam-family optimizers, whose
    rate goes with the batch's square root while the noise dominates."""
    return math.sqrt(adascale(batch, tuned_batch, estimate))


RULES = {
    "linear": linear,
    "sqrt": square_root,
    "adascale": adascale,
    "adascale_sqrt": adascale_sqrt,
}
# "auto" (`for_optimizer`): "adascale" for SGD, "sqrt" for adaptive ones.
# Measured: benchmarks/design-notes.md, "Why auto is sqrt for Adam".


def check_rule(rule, argument="learning_rate_rule"):
    """The rule function for a name; a callable, None, or "auto" (resolved by
    `for_optimizer`) as given; refuses others."""
    if rule is None or callable(rule) or rule == AUTO:
        return rule
    if isinstance(rule, str) and rule in RULES:
        return RULES[rule]
    raise ValueError(
        f"`{argument}` must be one of {sorted(RULES) + [AUTO]}, a function "
        "(batch, tuned_batch, estimate) -> factor, or None (the rate is "
        f"left as it is). Received: {argument}={rule!r}."
    )


def for_optimizer(rule, optimizer):
    """`rule` with "auto" resolved for `optimizer`: AdaScale's gain for
    `keras.optimizers.SGD`, the square root of the batch ratio otherwise."""
    if rule != AUTO:
        return rule
    inner = internals.innermost(optimizer)
    return adascale if isinstance(inner, keras.optimizers.SGD) else square_root


class RateFollower:
    """Makes the optimizer's rate follow the batch for one `fit`: the tuned rate
    (the optimizer's at the fit's start) times a rule's factor, and the tuned
    rate back at its end. A `SampleSchedule` rate is told the factor and the
    samples per update instead (also without a rule, at factor 1)."""

    def __init__(self, rule):
        self.rule = rule
        self.optimizer = None
        self.schedule = None  # the optimizer's SampleSchedule, if it has one
        self.tuned = None
        self.tuned_batch = None

    @staticmethod
    def needed(rule, optimizer):
        """Whether a fit with `rule` (or None) and `optimizer` has a rate to
        follow: a rule, or a `SampleSchedule` to count samples for."""
        return rule is not None or isinstance(
            internals.learning_rate_schedule(optimizer), SampleSchedule
        )

    def start(self, optimizer, tuned_batch=None):
        """Remembers the tuned rate and the batch it was tuned for (None: the
        first batch `follow` is given)."""
        schedule = internals.learning_rate_schedule(optimizer)
        if isinstance(schedule, SampleSchedule):
            self.schedule = schedule
            updates = int(optimizer.iterations.numpy())
            if schedule.behind(updates):
                warnings.warn(
                    f"The optimizer's iterations ({updates}) are behind its "
                    "SampleSchedule's count (a new optimizer given the "
                    "schedule of an earlier one, or weights loaded from "
                    "earlier): the count restarts from the optimizer's "
                    f"iterations, step {updates}.",
                    stacklevel=2,
                )
            # A later fit counts in the first one's unit.
            tuned_batch = tuned_batch or schedule.tuned_batch
        elif self.rule is not None:
            check_rate_is_a_number(optimizer)
            self.tuned = float(keras.ops.convert_to_numpy(optimizer.learning_rate))
        self.rule = for_optimizer(self.rule, optimizer)
        self.optimizer = optimizer
        self.tuned_batch = tuned_batch

    def follow(self, batch, estimate):
        """The rate for `batch` (samples per update) now; returns it."""
        if self.optimizer is None:
            return None
        if self.tuned_batch is None:
            self.tuned_batch = batch
        factor = 1.0 if self.rule is None else float(self.rule(batch, self.tuned_batch, estimate))
        if self.schedule is not None:
            self.schedule.follow(
                self._updates(), batch / self.tuned_batch, factor, self.tuned_batch
            )
            return self.rate()
        rate = self.tuned * factor
        self.optimizer.learning_rate = rate
        return rate

    def rate(self):
        """The rate the next update uses."""
        return float(keras.ops.convert_to_numpy(self.optimizer.learning_rate))

    def stop(self):
        """The tuned rate back (a fit's end); a `SampleSchedule` keeps its count
        and counts updates of the tuned batch from here."""
        if self.schedule is not None:
            self.schedule.follow(self._updates(), 1.0, 1.0)
        elif self.optimizer is not None and self.tuned is not None:
            self.optimizer.learning_rate = self.tuned
        self.optimizer = None
        self.schedule = None

    def state(self):
        """What a backup keeps (JSON-able)."""
        state = {"tuned": self.tuned, "tuned_batch": self.tuned_batch}
        if self.schedule is not None:
            state["schedule"] = list(self.schedule.state())
        return state

    def restore(self, state):
        """Takes back a `state()` after the weights were restored."""
        self.tuned, self.tuned_batch = state["tuned"], state["tuned_batch"]
        if self.schedule is not None and "schedule" in state:
            self.schedule.restore(state["schedule"])

    def _updates(self):
        # `.numpy()`: `int()` refuses a MirroredVariable.
        return int(self.optimizer.iterations.numpy())


def check_rate_is_a_number(optimizer):
    """Refuses a `LearningRateSchedule` (or callable) rate with a rule, other
    than a `SampleSchedule`, before training. Read from the public config,
    where a rate the traced step reads from a variable is a number."""
    config = optimizer.get_config()
    if "inner_optimizer" in config:  # LossScaleOptimizer forwards the rate
        config = config["inner_optimizer"]["config"]
    rate = config.get("learning_rate")
    if not isinstance(rate, (int, float)):
        kind = rate.get("class_name", "schedule") if isinstance(rate, dict) else type(rate).__name__
        raise ValueError(
            "A learning_rate_rule sets the optimizer's rate as the batch "
            f"changes, and this optimizer's rate is a {kind}, not a "
            "number. Give the optimizer a number (the rate tuned for the "
            "starting batch), wrap the schedule in "
            "keras_accum.SampleSchedule (its steps then count samples, and "
            "the rule multiplies its rate), or pass learning_rate_rule=None "
            "to AccumScheduler. Nothing was trained."
        )


def check_tuned_batch_used(tuned_batch, used):
    """Refuses, before training, a `tuned_batch` that nothing in the fit uses
    (`used`: a rule or a `SampleSchedule` follows the batch)."""
    if tuned_batch is not None and not used:
        raise ValueError(
            "`tuned_batch` is the batch the learning rate was tuned for, "
            "which a learning_rate_rule or a keras_accum.SampleSchedule "
            "uses, and this fit has neither (learning_rate_rule=None, and "
            "the optimizer's rate is not a SampleSchedule). Nothing was "
            f"trained. Received: tuned_batch={tuned_batch!r}."
        )
