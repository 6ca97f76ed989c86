"""The step plan: everything a traced train step reads as a Python constant.

A traced step bakes in the window length, whether it uses buffers, how it
splits a batch into micro-batches, the batch size that split is for and the
statistic of a sparse gradient's occurrences its window keeps. `StepPlan`
holds exactly these, frozen, each once: the model's settings and what was
learnt beside them; `make_plan(...)` makes it from values (the model
makes its own at the moment a step is traced, and hands it in). Its `cache_key` is the key
under which train functions are cached (train_functions.py): a setting that
changes the plan gets its own function, and switching back reuses it.

Example:

```python
plan = make_plan(settings, batch_size_seen=64)
plan.uses_buffers      # accum_steps > 1, or windows may be skipped
plan.split_size        # micro-batch size the step splits into, or None
```
"""

from typing import NamedTuple

from keras_accum.arguments import AUTO
from keras_accum.window import slices


class StepPlan(NamedTuple):
    """What a traced step reads as constants.

    Attributes:
        settings: the model's `AccumSettings` (`accum_steps`,
            `skip_nonfinite`, `micro_batch_size`, ... as set now).
        batch_size_seen: the first training batch's size (None: not seen):
            the batch size the split is for, and the window's most
            occurrences of a sparse gradient's rows.
        auto_size: the size "auto" has chosen (None: the whole batch).
        statistic: the statistic of a sparse gradient's occurrences the
            optimizer's update reads (`slices.statistic_of`).
        coupling: the model's `Coupling` at `coupled_from` (coupling.py),
            or None.
    """

    settings: object
    batch_size_seen: object = None
    auto_size: object = None
    statistic: object = slices.SQUARE
    coupling: object = None

    @property
    def accum_steps(self):
        """Micro-batches per optimizer update (the setting)."""
        return self.settings.accum_steps

    @property
    def skip_nonfinite(self):
        """Whether windows may be skipped (then buffers are used even for
        `accum_steps=1`, to decide before applying)."""
        return self.settings.skip_nonfinite

    @property
    def micro_batch_size(self):
        """The setting: an int, "auto" or None."""
        return self.settings.micro_batch_size

    @property
    def uses_buffers(self):
        """Whether the step adds into the window's buffers (else Keras's own
        step, or the batch's gradient straight to the optimizer)."""
        return self.accum_steps > 1 or self.skip_nonfinite

    @property
    def splits(self):
        """Whether the step splits each batch into micro-batches."""
        return self.micro_batch_size is not None

    @property
    def split_size(self):
        """The micro-batch size the step splits into; None for one
        micro-batch of the whole batch ("auto" before any out-of-memory
        step: the split step writes no state before its gradients exist,
        so a step that runs out of memory can be retried)."""
        if self.micro_batch_size == AUTO:
            return self.auto_size
        return self.micro_batch_size

    @property
    def cache_key(self):
        """The key of the train function for this plan: "auto" makes its
        own steps for each size it chooses (auto_micro_batch.py); the batch
        size is the key's only where the step splits (elsewhere a cached
        step keeps the size read when it was traced); the statistic follows
        the optimizer, which the cache compares itself."""
        return self._replace(
            batch_size_seen=self.batch_size_seen if self.splits else None,
            auto_size=None,
            statistic=None,
        )


def make_plan(settings, batch_size_seen=None, auto_size=None, statistic=slices.SQUARE,
              coupling=None):
    """The plan of a step for `settings` (`AccumSettings`), the first
    training batch's size, "auto"'s chosen size, the optimizer's
    statistic (`slices.statistic_of(optimizer)`) and the model's
    `Coupling`."""
    return StepPlan(settings, batch_size_seen, auto_size, statistic, coupling)
