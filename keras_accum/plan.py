"""The step plan: everything a traced train step reads as a Python constant.

A traced step bakes in the window length, whether it uses buffers, how it
splits a batch into micro-batches and the batch size that split is for.
`StepPlan` holds exactly these, frozen; `plan_of(model)` makes it from the
model's settings at the moment a step is traced. It is also the one key
under which train functions are cached (train_functions.py): a setting that
changes the plan gets its own function, and switching back reuses it.

Example:

```python
plan = plan_of(model)
plan.uses_buffers      # accum_steps > 1, or windows may be skipped
plan.split_size        # micro-batch size the step splits into, or None
```
"""

from typing import NamedTuple

from keras_accum.arguments import AUTO


class StepPlan(NamedTuple):
    """What a traced step reads as constants.

    Attributes:
        accum_steps: micro-batches per optimizer update.
        skip_nonfinite: whether windows may be skipped (then buffers are
            used even for `accum_steps=1`, to decide before applying).
        micro_batch_size: the setting: an int, "auto" or None.
        batch_size_seen: the first training batch's size (None: not seen):
            the batch size the split is for, and the window's most
            occurrences of a sparse gradient's rows.
        auto_size: the size "auto" has chosen (None: the whole batch).
    """

    accum_steps: int
    skip_nonfinite: bool
    micro_batch_size: object
    batch_size_seen: object
    auto_size: object = None

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
        step keeps the size read when it was traced)."""
        return self._replace(
            batch_size_seen=self.batch_size_seen if self.splits else None,
            auto_size=None,
        )


def plan_of(model):
    """The plan of `model`'s next traced step, from its current settings."""
    settings = model._settings
    return StepPlan(
        accum_steps=settings.accum_steps,
        skip_nonfinite=settings.skip_nonfinite,
        micro_batch_size=settings.micro_batch_size,
        batch_size_seen=model._batch_size_seen,
        auto_size=model._auto_micro_batch.size,
    )
