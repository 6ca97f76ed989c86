"""`SampleSchedule`: a Keras learning-rate schedule whose steps count samples.
The scheduler drives it at each change of the batch (`follow`): between
changes every update holds the same samples, so nothing runs in the step.
"""

from __future__ import annotations

from collections.abc import Sequence

import keras
import numpy as np
import tensorflow as tf

# The fields of the count (`state()`), in its variable.
BASE_UPDATES = 0  # optimizer.iterations at the last change
BASE_STEP = 1  # the schedule's step then (samples / tuned_batch)
SCALE = 2  # samples per update / tuned_batch, since the last change
FACTOR = 3  # the rule's factor for the batch in force
TUNED_BATCH = 4  # the tuned batch the steps count, once known (0: not yet)
_AT_START = (0.0, 0.0, 1.0, 1.0, 0.0)


@keras.saving.register_keras_serializable(package="keras_accum")
class SampleSchedule(keras.optimizers.schedules.LearningRateSchedule):
    """A learning-rate schedule evaluated at the samples trained rather than the
    updates made, times the learning-rate rule's factor for the batch in force.

    Its step is `samples / tuned_batch`, the update a run at the tuned batch
    would be at: counted in updates, a schedule slows per sample as an
    `AccumScheduler` grows the batch. Until the batch changes it is
    `schedule` at `optimizer.iterations` (the step a float32). The manual:
    docs/batch-growth.md, "The learning rate follows the batch".

    Args:
        schedule: a `keras.optimizers.schedules.LearningRateSchedule` whose
            steps are updates of `tuned_batch` samples (the scheduler's
            `tuned_batch`: by default the batch the first `fit` starts at).
        state: the 5 numbers a saved schedule restores (its config's);
            None for a new one.

    Example:

    ```python
    warmup = keras.optimizers.schedules.PolynomialDecay(
        1e-4, decay_steps=500, end_learning_rate=1e-3)  # 500 updates of 32
    optimizer = keras.optimizers.Adam(keras_accum.SampleSchedule(warmup))
    ```
    """

    def __init__(
        self,
        schedule: keras.optimizers.schedules.LearningRateSchedule | dict,
        state: Sequence[float] | None = None,
    ) -> None:
        if isinstance(schedule, dict):
            schedule = keras.optimizers.schedules.deserialize(schedule)
        if not isinstance(schedule, keras.optimizers.schedules.LearningRateSchedule):
            raise TypeError(
                "`schedule` must be a keras.optimizers.schedules."
                "LearningRateSchedule (e.g. CosineDecay(0.1, decay_steps="
                "1000)), whose steps SampleSchedule counts in samples. "
                f"Received: schedule={schedule!r} (of type "
                f"{type(schedule).__name__}). For a fixed rate give the "
                "optimizer the number itself."
            )
        state = _AT_START if state is None else _checked_state(state)
        self.schedule = schedule
        # float64: exact integers far past float32's 2**24.
        self._state = tf.Variable(
            state, dtype=tf.float64, trainable=False, name="sample_schedule_state"
        )

    def __call__(self, step: int | tf.Tensor) -> tf.Tensor:
        state = tf.convert_to_tensor(self._state)
        step = tf.cast(step, tf.float64)
        progress = state[BASE_STEP] + (step - state[BASE_UPDATES]) * state[SCALE]
        # An optimizer behind the count (a new one, or older weights): its own.
        progress = tf.where(step < state[BASE_UPDATES], step, progress)
        rate = self.schedule(tf.cast(progress, tf.float32))
        return rate * tf.cast(state[FACTOR], rate.dtype)

    def step_at(self, updates: int) -> float:
        """The schedule's step (samples / tuned batch) at `updates` updates.

        Args:
            updates: a count of optimizer updates (`optimizer.iterations`).

        Example:

        ```python
        counted = keras_accum.SampleSchedule(
            keras.optimizers.schedules.CosineDecay(0.1, decay_steps=1000))
        counted.step_at(100)  # 100.0: nothing has changed the batch yet
        ```
        """
        base_updates, base_step, scale, _, _ = self.state()
        if updates < base_updates:
            return float(updates)  # an optimizer behind the count
        return base_step + (updates - base_updates) * scale

    @property
    def tuned_batch(self) -> float | None:
        """The batch the steps count (samples per step), once a fit set it; None
        before. A later fit counts in the same unit.

        Example:

        ```python
        counted = keras_accum.SampleSchedule(
            keras.optimizers.schedules.CosineDecay(0.1, decay_steps=1000))
        counted.follow(0, scale=1.0, factor=1.0, tuned_batch=256)
        counted.tuned_batch  # 256.0
        ```
        """
        return self.state()[TUNED_BATCH] or None

    def behind(self, updates: int) -> bool:
        """Whether an optimizer at `updates` is behind the count (a new one, or
        one whose weights were loaded from earlier).

        Example:

        ```python
        counted = keras_accum.SampleSchedule(
            keras.optimizers.schedules.CosineDecay(0.1, decay_steps=1000))
        counted.follow(100, scale=4.0, factor=1.0)
        counted.behind(20)  # True: the count is at update 100
        ```
        """
        return updates < self.state()[BASE_UPDATES]

    def follow(
        self, updates: int, scale: float, factor: float, tuned_batch: int | None = None
    ) -> None:
        """From update `updates` on, each update holds `scale` tuned batches of
        samples and the rate is the schedule's times `factor` (between steps,
        at a change of the batch); records `tuned_batch` if given.

        Example:

        ```python
        counted = keras_accum.SampleSchedule(
            keras.optimizers.schedules.CosineDecay(0.1, decay_steps=1000))
        counted.follow(100, scale=4.0, factor=2.0)  # from update 100, 4x the samples
        counted.step_at(110)  # 140.0
        ```
        """
        tuned = tuned_batch or self.state()[TUNED_BATCH]
        self._state.assign([updates, self.step_at(updates), scale, factor, tuned])

    def state(self) -> tuple[float, ...]:
        """The 5 numbers (updates and step at the last change, samples per update
        in tuned batches, factor, tuned batch or 0), as floats.

        Example:

        ```python
        counted = keras_accum.SampleSchedule(
            keras.optimizers.schedules.CosineDecay(0.1, decay_steps=1000))
        copy = keras_accum.SampleSchedule(counted.schedule, state=counted.state())
        ```
        """
        return tuple(float(v) for v in np.asarray(self._state.numpy()))

    def restore(self, state: Sequence[float]) -> None:
        """Takes back a `state()`, between steps (a backup's restore).

        Example:

        ```python
        counted = keras_accum.SampleSchedule(
            keras.optimizers.schedules.CosineDecay(0.1, decay_steps=1000))
        saved = counted.state()
        counted.follow(100, scale=4.0, factor=1.0)
        counted.restore(saved)  # the count as it was
        ```
        """
        self._state.assign(_checked_state(state))

    def get_config(self):
        return {
            "schedule": keras.optimizers.schedules.serialize(self.schedule),
            "state": list(self.state()),
        }


def _checked_state(state):
    """`state` as 5 floats, or a ValueError naming it."""
    try:
        values = tuple(float(v) for v in state)
    except (TypeError, ValueError):
        values = None
    if isinstance(state, (str, bytes)) or values is None or len(values) != len(_AT_START):
        raise ValueError(
            f"`state` must be the {len(_AT_START)} numbers of a saved "
            "SampleSchedule's config (`state()`), or None for a new one. "
            f"Received: state={state!r}."
        )
    return values
