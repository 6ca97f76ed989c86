"""The step plan: everything a traced train step reads as a Python constant.

A traced step bakes in the window length, whether it uses buffers, how it
splits a batch and for which batch size, and the statistic a sparse
window keeps. `StepPlan` holds these, frozen; its `cache_key` keys the
train functions (functions.py): switching back to a plan reuses its step.
"""

from typing import NamedTuple

from keras_accum.arguments import AUTO
from keras_accum.window import slices


class StepPlan(NamedTuple):
    """What a traced step reads as constants.

    Attributes:
        settings: the model's `AccumSettings` now.
        batch_size_seen: the first training batch's size (None: not seen):
            what the split is for, and a sparse window's capacity.
        auto_size: the size "auto" chose (None: the whole batch).
        statistic: what the optimizer's sparse update reads of a row's
            occurrences (`slices.statistic_of`).
        coupling: the model's `Coupling` at `coupled_from`, or None.
    """

    settings: object
    batch_size_seen: object = None
    auto_size: object = None
    statistic: object = slices.SQUARE
    coupling: object = None

    @property
    def accum_steps(self):
        return self.settings.accum_steps

    @property
    def skip_nonfinite(self):
        return self.settings.skip_nonfinite

    @property
    def micro_batch_size(self):
        return self.settings.micro_batch_size

    @property
    def uses_buffers(self):
        """Whether the step adds into the window's buffers (a skip policy
        decides before applying, so it needs them even at `accum_steps=1`)."""
        return self.accum_steps > 1 or self.skip_nonfinite

    @property
    def splits(self):
        return self.micro_batch_size is not None

    @property
    def split_size(self):
        """The micro-batch size the step splits into; None for the whole
        batch as one micro-batch ("auto" before any step ran out of memory:
        the split step's writes wait for its gradients, so it can retry)."""
        if self.micro_batch_size == AUTO:
            return self.auto_size
        return self.micro_batch_size

    @property
    def cache_key(self):
        """The train function's key: "auto" makes a step per size itself
        (split/auto.py); the batch size counts only where the step splits;
        the statistic follows the optimizer, which the cache compares."""
        return self._replace(
            batch_size_seen=self.batch_size_seen if self.splits else None,
            auto_size=None,
            statistic=None,
        )
