"""`SampleSchedule`: a Keras learning-rate schedule whose steps count
samples, for a batch that changes during training.

A Keras optimizer calls its schedule with `optimizer.iterations`, the
updates made. While the batch is fixed, updates and samples are the same
clock. When an `AccumScheduler` grows the batch, they part: 1,000 updates
of 512 samples are 32x the data of 1,000 updates of 16, and a schedule of
updates decays (or warms up) per sample ever more slowly as the batch
grows. `SampleSchedule(schedule)` gives `schedule` the samples trained
instead, counted in batches of `tuned_batch` (the batch its rate was tuned
for): its step is `samples / tuned_batch`, the update a run at `tuned_batch`
would be at. Its rate is the schedule's times the `learning_rate_rule`'s
factor for the batch in force, so a rule works with a schedule too.

The scheduler drives it at each change of the batch (`follow`): between
two changes every update holds the same number of samples, so the samples
are computed from `optimizer.iterations` (the last change's count, plus
updates since times samples per update), no counter runs in the step.
Each update counts as `accum_steps` full micro-batches: an epoch's short
last window counts whole.

Its state (5 numbers) is saved in the optimizer's config, so a `.keras`
file resumes it; `keras_accum.BackupAndRestore` keeps it through the
scheduler's state. The tuned batch, once a fit has set it, stays with it:
a later fit counts in the same unit. Until something drives it (no
`AccumScheduler`, or one at the tuned batch that never changes it) it is
`schedule` at `optimizer.iterations`, bit for bit, except that the step
it hands `schedule` is a float32 (Keras's own schedules cast it so; one
that indexes a table by the step must cast it back). An optimizer whose
`iterations` are behind the count (a new one after `compile`, or weights
loaded from earlier) restarts it from its own `iterations`.

Example:

```python
schedule = keras_accum.SampleSchedule(
    keras.optimizers.schedules.CosineDecay(0.1, decay_steps=2000)
)  # 2000 updates of the starting batch (or of tuned_batch)
model.compile(keras.optimizers.SGD(schedule), "mse")
model.fit(x, y, batch_size=16, epochs=5, callbacks=[
    keras_accum.AccumScheduler("noise_scale", max_accum_steps=64)])
```
"""

import keras
import numpy as np
import tensorflow as tf

# The state's fields, in its variable.
BASE_UPDATES = 0  # optimizer.iterations at the last change
BASE_STEP = 1  # the schedule's step then (samples / tuned_batch)
SCALE = 2  # samples per update / tuned_batch, since the last change
FACTOR = 3  # the rule's factor for the batch in force
TUNED_BATCH = 4  # the tuned batch the steps count, once known (0: not yet)
_AT_START = (0.0, 0.0, 1.0, 1.0, 0.0)


@keras.saving.register_keras_serializable(package="keras_accum")
class SampleSchedule(keras.optimizers.schedules.LearningRateSchedule):
    """A learning-rate schedule evaluated at the samples trained (in
    batches of the tuned batch) rather than at the updates made, times the
    learning-rate rule's factor for the batch in force.

    Give it to the optimizer in place of `schedule`; an `AccumScheduler` in
    the same `fit` keeps its count (with or without a `learning_rate_rule`).

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

    def __init__(self, schedule, state=None):
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
        # float64: updates and steps stay exact integers far past float32's 2**24.
        self._state = tf.Variable(state, dtype=tf.float64, trainable=False,
                                  name="sample_schedule_state")

    def __call__(self, step):
        state = tf.convert_to_tensor(self._state)
        step = tf.cast(step, tf.float64)
        progress = state[BASE_STEP] + (step - state[BASE_UPDATES]) * state[SCALE]
        # An optimizer behind the count: its own iterations (module doc).
        progress = tf.where(step < state[BASE_UPDATES], step, progress)
        rate = self.schedule(tf.cast(progress, tf.float32))
        return rate * tf.cast(state[FACTOR], rate.dtype)

    def step_at(self, updates):
        """The schedule's step (samples / tuned batch) at `updates`
        optimizer updates, by the count so far.

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
    def tuned_batch(self):
        """The batch the steps count (samples per step), once a fit set it;
        None before."""
        return self.state()[TUNED_BATCH] or None

    def behind(self, updates):
        """Whether an optimizer at `updates` is behind the count (a new
        one, or one whose weights were loaded from earlier)."""
        return updates < self.state()[BASE_UPDATES]

    def follow(self, updates, scale, factor, tuned_batch=None):
        """From update `updates` on, each update holds `scale` tuned
        batches of samples and the rate is the schedule's times `factor`
        (called between steps, at a change of the batch); `tuned_batch`,
        if given, is recorded.

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

    def state(self):
        """The 5 numbers (updates and step at the last change, samples per
        update in tuned batches, factor, tuned batch or 0) as floats.

        Example:

        ```python
        counted = keras_accum.SampleSchedule(
            keras.optimizers.schedules.CosineDecay(0.1, decay_steps=1000))
        copy = keras_accum.SampleSchedule(counted.schedule, state=counted.state())
        ```
        """
        return tuple(float(v) for v in np.asarray(self._state.numpy()))

    def restore(self, state):
        """Takes back a `state()`, between steps (a backup's restore)."""
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
