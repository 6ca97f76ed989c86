"""What `AccumModel.fit` adds around Keras's `fit`: settings for one call,
the settings callbacks' states, and the window applied when an epoch's data
ends. Everything here is handed the model's `Engine`.
"""

import contextlib
import inspect
import json
import math
import os
import warnings

import keras

from keras_accum import _internals as internals
from keras_accum.arguments import (
    FIT_ARGUMENTS,
    check_accum_steps,
    check_keywords,
    check_micro_batch_size,
)


class FitSetting(keras.callbacks.Callback):
    """A callback that sets the model's settings for one `fit` only
    (`AccumScheduler`): `one_fit` hands it the model's `Engine`, and asks it
    before training what it sets for the epoch training starts at.
    """

    # The running fit's model's `Engine`, given by `one_fit`; None outside a fit.
    engine = None

    def bind_fit(self, engine):
        """The model's `Engine` as a fit starts; None when it ends."""
        self.engine = engine

    def value_at_start(self, epoch):
        """The `accum_steps` set for `epoch` as far as known before training, or None."""
        return None

    def state(self):
        """What a backup keeps of this callback mid-`fit` (JSON-able), or None."""
        return None

    def restore_state(self, state):
        """Takes back a `state()` when a backup or a file is restored."""


class FitScope:
    """What a model keeps of the running `fit`.

    Its settings callbacks; the settings the user assigns during it (the
    model's setters: they stay after the fit, as a learning rate set from a
    callback stays, while `fit(accum_steps=...)` and `AccumScheduler` change
    them for the fit only); and the callbacks' states a `.keras` file written
    mid-fit brought (an asset: `AccumModel.save_assets`), handed once to the
    next fit's callback of each class.
    """

    FILE = "fit_setting_states.json"

    def __init__(self):
        self.settings_callbacks = []
        self._by_user = None  # None outside fit
        self._loaded = {}  # {class name: state} from a file, for the next fit

    def set_by_user(self, **settings):
        """Settings the user assigned: kept after the fit."""
        if self._by_user is not None:
            self._by_user.update(settings)

    def start(self, callbacks):
        """A fit starts: each settings callback gets the loaded state of its class, once."""
        self._by_user = {}
        self.settings_callbacks = list(callbacks)
        loaded, self._loaded = self._loaded, {}
        for callback in self.settings_callbacks:
            state = loaded.pop(type(callback).__name__, None)
            if state is not None:
                callback.restore_state(state)
        if loaded:
            warnings.warn(
                f"The model was loaded from a file written mid-fit with the "
                f"state of {', '.join(sorted(loaded))}, and this fit has no "
                "such callback: that state is dropped (the schedule starts "
                "afresh if one is given later). To continue it, pass the "
                "same callback to this fit.",
                stacklevel=5,
            )

    def stop(self):
        """The fit ended: the settings the user assigned during it."""
        settings, self._by_user = self._by_user or {}, None
        self.settings_callbacks = []
        return settings

    def states(self):
        """`{class name: state}` of the running fit's stateful settings callbacks."""
        states = {}
        for callback in self.settings_callbacks:
            state = callback.state()
            if state is not None:
                states[type(callback).__name__] = state
        return states

    def save(self, dir_path):
        """Writes `states()` into `dir_path` (nothing if empty)."""
        states = self.states()
        if states:
            with open(os.path.join(dir_path, self.FILE), "w") as f:
                json.dump(states, f)

    def read(self, dir_path):
        """Keeps what `save` wrote into `dir_path` for the next fit."""
        path = os.path.join(dir_path, self.FILE)
        self._loaded = {}
        if os.path.exists(path):
            with open(path) as f:
                self._loaded = json.load(f)


class EpochEndFlush(keras.callbacks.Callback):
    """Applies a pending window when an epoch's data ends, inside `fit` only.

    `fit` validates through `evaluate(callbacks=...)`, so `on_test_begin` comes
    after the last training batch and before the first validation batch;
    `on_epoch_end` covers epochs without validation. First in the list, so
    every other callback's `on_epoch_end` sees the updated weights.
    """

    def __init__(self, engine):
        super().__init__()
        self._engine = engine
        self._trained = False
        self._warned = False

    def on_epoch_begin(self, epoch, logs=None):
        noise = self._engine.state.noise
        if noise is not None:
            noise.start_epoch()

    def on_train_batch_end(self, batch, logs=None):
        self._trained = True

    def on_test_begin(self, logs=None):
        self._flush()

    def on_epoch_end(self, epoch, logs=None):
        self._flush()
        engine = self._engine
        if logs is not None and engine.settings.skip_nonfinite:
            # Printed as an integer by the progress bar (LoggedCount).
            logs["skipped_windows"] = internals.LoggedCount(engine.state.skipped_windows)
        if engine.state.noise is not None:
            self._log_noise_scale(logs)

    def _log_noise_scale(self, logs):
        # After the flush: the epoch's last window is in the estimate.
        engine = self._engine
        value = engine.state.noise.end_epoch()
        engine.noise_scale = value
        if logs is not None:
            logs["noise_scale"] = value
        if math.isnan(value) and not self._warned:
            self._warned = True
            warnings.warn(
                "noise_scale is NaN: no window of this epoch had two "
                "micro-batches or more, and the noise scale is measured by "
                "comparing a window's gradient with its micro-batches' "
                f"(accum_steps={engine.settings.accum_steps}, micro_batch_size="
                f"{engine.settings.micro_batch_size!r}). Train with accum_steps >= 2 or "
                "a micro_batch_size below the batch size; "
                "a loss summed rather than averaged is not measured either.",
                stacklevel=2,
            )

    def _flush(self):
        # An epoch that trained on no data (Keras warns that the input ran
        # out) leaves an open window from before the fit as it was.
        if self._trained:
            self._engine.flush()


def check_callbacks(callbacks, strategy):
    """Refuses Keras's own `BackupAndRestore` across workers, before `fit`:
    each worker restores its own newest backup, and after a death around an
    epoch's end those differ (the collectives then no longer line up).
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
    another value for the epoch the fit starts at (`n` would never be used).
    """
    if accum_steps is None:
        return
    for callback in callbacks:
        if not isinstance(callback, FitSetting):
            continue
        value = callback.value_at_start(initial_epoch)
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


def _first_accum_steps(callbacks, accum_steps, settings, initial_epoch):
    # The accum_steps this fit starts with: a schedule's for its first
    # epoch, else fit's own, else the model's.
    for callback in callbacks:
        if isinstance(callback, FitSetting):
            value = callback.value_at_start(initial_epoch)
            if value is not None:
                return value
    return accum_steps or settings.accum_steps


def warn_if_epochs_end_mid_window(steps_per_epoch, accum_steps):
    """Warns when `steps_per_epoch` (micro-batches) is not a multiple of
    `accum_steps`: every epoch would end with a short window.
    """
    if not isinstance(steps_per_epoch, int) or steps_per_epoch % accum_steps == 0:
        return
    left = steps_per_epoch % accum_steps
    warnings.warn(
        f"steps_per_epoch={steps_per_epoch} counts micro-batches (the batches "
        f"fit draws) and is not a multiple of accum_steps={accum_steps}: "
        f"each epoch ends with a window of {left} micro-batch"
        f"{'es' if left > 1 else ''}, applied at the epoch's end as a smaller "
        "update than the others. For U updates an epoch, pass "
        f"steps_per_epoch=U*{accum_steps} (a plain recipe's steps_per_epoch "
        f"times accum_steps).",
        stacklevel=4,
    )


# The keyword arguments of Keras's fit, which AccumModel.fit passes on.
_KERAS_FIT_ARGUMENTS = frozenset(inspect.signature(keras.Model.fit).parameters)


@contextlib.contextmanager
def one_fit(engine, callbacks, accum_steps=None, micro_batch_size=None, fit_kwargs=None):
    """The settings and callbacks of one `fit`; yields the callbacks.

    Every argument is checked before anything changes. `accum_steps`,
    `micro_batch_size` and a scheduler's values hold for this call only: at
    its end the model's own come back without applying the open window (after
    an interrupt it stays open, to resume). A value the user assigns during
    the fit is the model's own, and stays.
    """
    model = engine.model
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
    initial_epoch = fit_kwargs.get("initial_epoch", 0)
    check_schedule_agrees(given, accum_steps, initial_epoch)
    warn_if_epochs_end_mid_window(
        fit_kwargs.get("steps_per_epoch"),
        _first_accum_steps(given, accum_steps, engine.settings, initial_epoch),
    )
    previous = engine.settings
    if accum_steps is not None:
        engine.set_accum_steps(accum_steps)
    if micro_batch_size is not None:
        engine.set_micro_batch_size(micro_batch_size)
    settings_callbacks = [c for c in given if isinstance(c, FitSetting)]
    for callback in settings_callbacks:
        callback.bind_fit(engine)
    engine.fits.start(settings_callbacks)  # a .keras file's states, once
    flush = EpochEndFlush(engine)
    if isinstance(callbacks, keras.callbacks.CallbackList):
        callbacks.callbacks.insert(0, flush)
        flush.set_model(model)
    else:
        callbacks = [flush] + list(callbacks or [])
    try:
        with internals.training_build(model):
            yield callbacks
    finally:
        if isinstance(callbacks, keras.callbacks.CallbackList):
            callbacks.callbacks.remove(flush)
        # Not through the setters: the open window stays open.
        engine.restore_settings(previous._replace(**engine.fits.stop()))
        engine.functions.end_fit()
        for callback in settings_callbacks:
            callback.bind_fit(None)
