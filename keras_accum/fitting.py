"""What `AccumModel.fit` adds around Keras's `fit`: settings for one call,
and the window applied when an epoch's data ends.

Example:

```python
with one_fit(model, callbacks, accum_steps=8, micro_batch_size=None) as callbacks:
    keras.Model.fit(model, x, y, callbacks=callbacks)
```
"""

import contextlib
import inspect
import math
import warnings

import keras

from keras_accum import _internals as internals
from keras_accum.arguments import (
    FIT_ARGUMENTS,
    check_accum_steps,
    check_keywords,
    check_micro_batch_size,
)
from keras_accum.microbatch import static_batch_size
from keras_accum.scheduler import AccumScheduler


class EpochEndFlush(keras.callbacks.Callback):
    """Applies a pending window when an epoch's data ends, inside `fit` only.

    `fit` runs validation through `evaluate(callbacks=<fit's callbacks>)`, so
    `on_test_begin` is the moment after the last training batch and before
    the first validation batch; `on_epoch_end` covers epochs without
    validation. It is put first in the list, so every other callback's
    `on_epoch_end` (checkpoints included) sees the updated weights.

    Example:

    ```python
    callbacks = [EpochEndFlush(model), *user_callbacks]
    ```
    """

    def __init__(self, model):
        super().__init__()
        self._accum_model = model
        self._trained = False
        self._warned = False

    def on_epoch_begin(self, epoch, logs=None):
        noise = self._accum_model._window.noise
        if noise is not None:
            noise.start_epoch()

    def on_train_batch_end(self, batch, logs=None):
        self._trained = True

    def on_test_begin(self, logs=None):
        self._flush()

    def on_epoch_end(self, epoch, logs=None):
        self._flush()
        model = self._accum_model
        if logs is not None and model.skip_nonfinite:
            # Printed as an integer by the progress bar (LoggedCount).
            logs["skipped_windows"] = internals.LoggedCount(model.skipped_windows)
        if model._window.noise is not None:
            self._log_noise_scale(logs)

    def _log_noise_scale(self, logs):
        # After the flush: the epoch's last window is in the estimate.
        model = self._accum_model
        value = model._window.noise.end_epoch()
        model._noise_scale = value
        if logs is not None:
            logs["noise_scale"] = value
        if math.isnan(value) and not self._warned:
            self._warned = True
            warnings.warn(
                "noise_scale is NaN: no window of this epoch had two "
                "micro-batches or more, and the noise scale is measured by "
                "comparing a window's gradient with its micro-batches' "
                f"(accum_steps={model.accum_steps}, micro_batch_size="
                f"{model.micro_batch_size!r}). Train with accum_steps >= 2 or "
                "a micro_batch_size below the batch size; "
                "a loss summed rather than averaged is not measured either.",
                stacklevel=2,
            )

    def _flush(self):
        # An epoch that trained on no data (Keras warns that the input ran
        # out) leaves an open window from before the fit as it was.
        if self._trained:
            self._accum_model.flush()


class FitChanges:
    """The settings the user assigns (`model.accum_steps = n`, from a
    callback, say) while a `fit` runs.

    `fit(accum_steps=...)` and `AccumScheduler` change a setting for their
    `fit` only, and `fit` puts the model's own back when it returns. A value
    the user assigns during the fit is the model's own from then on, and
    stays, as a learning rate assigned from a callback stays.

    Example:

    ```python
    model._fit_changes.set_by_user(accum_steps=2)  # the setter, during fit
    ```
    """

    def __init__(self):
        self.settings = None  # None outside fit

    def start(self):
        self.settings = {}

    def set_by_user(self, **settings):
        if self.settings is not None:
            self.settings.update(settings)

    def stop(self):
        settings, self.settings = self.settings or {}, None
        return settings


def check_callbacks(callbacks, strategy):
    """Refuses Keras's own `BackupAndRestore` across workers, before `fit`.

    It restores each worker from its own newest backup; after a worker died
    around an epoch's end those are different epochs, and the restarted
    workers' collectives no longer line up (an error or a hang).
    """
    if not internals.multi_worker(strategy):
        return
    for callback in callbacks:
        if type(callback) is keras.callbacks.BackupAndRestore:
            raise ValueError(
                "keras.callbacks.BackupAndRestore does not coordinate "
                "workers: after a worker dies around an epoch's end, the "
                "restarted workers resume from different epochs. Received "
                f"BackupAndRestore(backup_dir={callback.backup_dir!r}) under "
                "MultiWorkerMirroredStrategy. Use "
                "keras_accum.BackupAndRestore (same arguments, with "
                "double_checkpoint=True and one directory per worker)."
            )


def check_schedule_agrees(callbacks, accum_steps, initial_epoch):
    """Refuses `fit(accum_steps=n)` with an `AccumScheduler` that sets
    another value for the epoch the fit starts at: the schedule would
    replace `n` before the first step, and `n` would never be used.

    A schedule that starts later (`{3: 8}`) or follows the noise scale
    starts from `n`, as from the model's own value without it.
    """
    if accum_steps is None:
        return
    for callback in callbacks:
        if not isinstance(callback, AccumScheduler):
            continue
        value = callback._value_at_start(initial_epoch)
        if value is not None and value != accum_steps:
            raise ValueError(
                f"fit(accum_steps={accum_steps}) and the AccumScheduler in "
                f"`callbacks` (schedule={callback.schedule!r}) both set "
                f"accum_steps for epoch {initial_epoch}, where training "
                f"starts: the schedule says {value}, and would silently win. "
                "Nothing was trained. Give the value once: in the schedule "
                f"(e.g. {{{initial_epoch}: {accum_steps}, ...}}), or as "
                "fit's accum_steps with a schedule that starts at a later "
                "epoch."
            )


# The keyword arguments of Keras's fit, which AccumModel.fit passes on.
_KERAS_FIT_ARGUMENTS = frozenset(inspect.signature(keras.Model.fit).parameters)


@contextlib.contextmanager
def one_fit(model, callbacks, accum_steps=None, micro_batch_size=None, fit_kwargs=None):
    """The settings and callbacks of one `fit` call; yields the callbacks.

    Every argument is checked before anything changes. `accum_steps` and
    `micro_batch_size`, if given, hold for this call only, and so do the
    values an `AccumScheduler` sets: afterwards the model's own come back
    without applying the open window (after an interrupted fit it stays
    open, to be resumed), and the next fit traces its own step. A value the
    user assigns during the fit (`model.accum_steps = n` in a callback) is
    the model's own, and stays. A resumed epoch's skipping belongs to this
    call too. `fit_kwargs` are the other arguments of this `fit`, checked
    for a misspelling of ours.
    """
    fit_kwargs = fit_kwargs or {}
    check_keywords(fit_kwargs, "fit()", FIT_ARGUMENTS, passed_on=_KERAS_FIT_ARGUMENTS)
    if isinstance(callbacks, keras.callbacks.Callback):
        callbacks = [callbacks]  # Keras accepts one callback too
    given = getattr(callbacks, "callbacks", callbacks) or []
    check_callbacks(given, model.distribute_strategy)
    if accum_steps is not None:
        accum_steps = check_accum_steps(accum_steps)
    if micro_batch_size is not None:
        micro_batch_size = check_micro_batch_size(micro_batch_size)
    check_schedule_agrees(given, accum_steps, fit_kwargs.get("initial_epoch", 0))
    previous = model._settings
    if accum_steps is not None:
        model._set_accum_steps(accum_steps)
    if micro_batch_size is not None:
        model._change(micro_batch_size=micro_batch_size)
    model._fit_changes.start()
    flush = EpochEndFlush(model)
    if isinstance(callbacks, keras.callbacks.CallbackList):
        callbacks.callbacks.insert(0, flush)
        flush.set_model(model)
    else:
        callbacks = [flush] + list(callbacks or [])
    model._training_build = True
    try:
        yield callbacks
    finally:
        model._training_build = False
        if isinstance(callbacks, keras.callbacks.CallbackList):
            callbacks.callbacks.remove(flush)
        previous = previous._replace(**model._fit_changes.stop())
        if model._settings != previous:
            # Not through the setters: the open window stays open.
            model._settings = previous
            model._train_functions.invalidate()
        model._train_functions.stop_skipping()


def see_training_batch(model, data_batch):
    """The first training batch of a `fit` or `train_on_batch`, in Python.

    The step splits a batch whose size the trace may not know (fit's batch
    dimension is None): the size is taken from here, and a new size gets
    its own train function.
    """
    size = None if data_batch is None else static_batch_size(data_batch)
    if size is None or size == model._batch_size_seen:
        return
    model._batch_size_seen = size
    if model._settings.micro_batch_size is not None:
        model._train_functions.invalidate()
