"""Learning-rate rules: the rate that goes with a batch that changed.

A rate tuned for one batch is wrong for a batch 16 times bigger: taken
there unchanged, the bigger batch buys few of the steps it could; and a
rate tuned for a big batch makes a small one diverge. A rule says by what
factor to multiply the rate tuned for batch `tuned_batch` (by default the
batch training starts at) when the batch is `batch`:

- `"linear"`: `batch / tuned_batch` (Goyal et al. 2017; SGD while the batch
  is well below the noise scale);
- `"sqrt"`: `sqrt(batch / tuned_batch)` (Adam-family, Malladi et al. 2022);
- `"adascale"`: AdaScale's gain (Johnson et al. 2020; SGD)
  `r = (sigma^2 + mu^2) / (sigma^2 / S + mu^2)` with `S = batch /
  tuned_batch`, `sigma^2 = tr(Sigma) / tuned_batch`, `mu^2 = |G|^2`, that
  is `(1 + B_noise / tuned_batch) / (1 + B_noise / batch)`, from the
  measured noise scale: linear while the noise dominates, flat once the
  batch is past the noise scale. The same curve as McCandlish et al.'s
  optimal rate `eps(B) = eps_max / (1 + B_noise / B)`, anchored at the
  tuned rate;
- `"adascale_sqrt"`: its square root (an Adam-family variant; took more
  updates than `"sqrt"` on the Adam benchmark);
- `"auto"`: `"adascale"` for `keras.optimizers.SGD`, `"sqrt"` for every
  other optimizer (measured best of the four on an SGD and an Adam task:
  docs/batch-growth.md).

A rule is a function `(batch, tuned_batch, estimate) -> factor`
(`estimate`: the schedule's `growth.NoiseEstimate`, or None), so a user's
own is one too. Every rule gives 1 at `tuned_batch`: a schedule that does
not change the batch does not change the rate.

Example:

```python
factor = RULES["sqrt"](batch=256, tuned_batch=16, estimate=None)  # 4.0
follower = RateFollower(RULES["sqrt"])
follower.start(optimizer, tuned_batch=16)
follower.follow(batch=64, estimate=None)  # the rate is now 2x the tuned one
follower.stop()                           # the tuned rate back
```
"""

import math
import warnings

import keras

from keras_accum import _internals as internals
from keras_accum.arguments import AUTO
from keras_accum.growth.sample_schedule import SampleSchedule


def linear(batch, tuned_batch, estimate=None):
    """`batch / tuned_batch`.

    Example:

    ```python
    linear(64, 16)  # 4.0
    ```
    """
    return batch / tuned_batch


def square_root(batch, tuned_batch, estimate=None):
    """`sqrt(batch / tuned_batch)`.

    Example:

    ```python
    square_root(64, 16)  # 2.0
    ```
    """
    return math.sqrt(batch / tuned_batch)


def adascale(batch, tuned_batch, estimate=None):
    """AdaScale's gain `(1 + B_noise / tuned_batch) / (1 + B_noise / batch)`.

    `B_noise` is the estimate while it is resolved, else its lower bound
    (unresolved, the noise dominates: the gain is then at least what that
    bound gives). Without an estimate (nothing measured yet), the noise is
    taken to dominate below the tuned batch (`batch / tuned_batch`: a
    smaller batch gets a proportionally smaller rate) and nothing is
    assumed above it (1).

    Example:

    ```python
    adascale(64, 16, NoiseEstimate(48.0, 40.0, 60.0, 10, True))  # 1.75
    ```
    """
    noise = None if estimate is None else (
        estimate.value if estimate.resolved else estimate.low)
    if noise is None or not noise > 0:
        return min(1.0, batch / tuned_batch)
    if math.isinf(noise):
        return batch / tuned_batch
    return (1.0 + noise / tuned_batch) / (1.0 + noise / batch)


def adascale_sqrt(batch, tuned_batch, estimate=None):
    """The square root of AdaScale's gain: for Adam-family optimizers,
    whose rate goes with the square root of the batch while the noise
    dominates (Malladi et al. 2022), and stays once the batch is past the
    noise scale.

    Example:

    ```python
    adascale_sqrt(64, 16, NoiseEstimate(48.0, 40.0, 60.0, 10, True))  # 1.32
    ```
    """
    return math.sqrt(adascale(batch, tuned_batch, estimate))


RULES = {
    "linear": linear,
    "sqrt": square_root,
    "adascale": adascale,
    "adascale_sqrt": adascale_sqrt,
}
# "auto": AdaScale's gain for plain SGD (with or without momentum), the
# square root of the batch ratio for every other (adaptive) optimizer. On
# the Adam benchmark "sqrt" and "adascale" tied and "adascale_sqrt" (the
# earlier default, never above "sqrt") took 15% more updates; "sqrt" is
# the one the literature gives for Adam and holds the rate further below
# where it diverges (x8 at 64x the batch, where x64 diverged).


def check_rule(rule, argument="learning_rate_rule"):
    """The rule function for a name, a callable, None, or "auto" (kept
    as the name: `for_optimizer` resolves it); refuses others."""
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
    """Makes the optimizer's rate follow the batch for one `fit`: the tuned
    rate times a rule's factor, and the tuned rate back at its end.

    The tuned rate is the optimizer's at the fit's start: a number (a Keras
    variable the traced step reads, set through the public
    `optimizer.learning_rate`), or a `SampleSchedule`, which is told the
    factor and the samples each update holds (its steps count samples; it
    is followed without a rule too, with the factor 1). Another
    `LearningRateSchedule` with a rule is refused before training.

    Example:

    ```python
    follower = RateFollower(square_root)
    follower.start(model.optimizer, tuned_batch=16)
    follower.follow(64, None)
    follower.stop()
    ```
    """

    def __init__(self, rule):
        self.rule = rule
        self.optimizer = None
        self.schedule = None  # the optimizer's SampleSchedule, if it has one
        self.tuned = None
        self.tuned_batch = None

    @staticmethod
    def needed(rule, optimizer):
        """Whether a fit with `rule` (None: none) and `optimizer` has a rate
        to follow: a rule, or a `SampleSchedule` to count samples for."""
        return rule is not None or isinstance(
            internals.learning_rate_schedule(optimizer), SampleSchedule)

    def start(self, optimizer, tuned_batch=None):
        """Remembers the tuned rate, and the batch it was tuned for (None:
        the first batch `follow` is given)."""
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
            self.schedule.follow(self._updates(), batch / self.tuned_batch, factor,
                                 self.tuned_batch)
            return self.rate()
        rate = self.tuned * factor
        self.optimizer.learning_rate = rate
        return rate

    def rate(self):
        """The rate the next update uses."""
        return float(keras.ops.convert_to_numpy(self.optimizer.learning_rate))

    def stop(self):
        """The tuned rate back (a fit's end); a `SampleSchedule` keeps its
        count and counts updates of the tuned batch from here."""
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
        # `.numpy()`: under a strategy the count is a MirroredVariable.
        return int(self.optimizer.iterations.numpy())


def check_rate_is_a_number(optimizer):
    """Refuses a `LearningRateSchedule` (or callable) rate other than a
    `SampleSchedule` with a rule, before training.

    Read from the optimizer's config (public): a number there is a rate
    the traced step reads from a variable; a schedule is a dict.
    """
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
    """Refuses a `tuned_batch` that nothing in the fit uses (`used`: a rule
    or a `SampleSchedule` follows the batch), before training."""
    if tuned_batch is not None and not used:
        raise ValueError(
            "`tuned_batch` is the batch the learning rate was tuned for, "
            "which a learning_rate_rule or a keras_accum.SampleSchedule "
            "uses, and this fit has neither (learning_rate_rule=None, and "
            "the optimizer's rate is not a SampleSchedule). Nothing was "
            f"trained. Received: tuned_batch={tuned_batch!r}."
        )
