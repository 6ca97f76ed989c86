"""What `AccumModel.fit` adds around Keras's `fit`: settings for one call,
and the window applied when an epoch's data ends.

Example:

```python
with one_fit(model, callbacks, accum_steps=8, micro_batch_size=None) as callbacks:
    keras.Model.fit(model, x, y, callbacks=callbacks)
```
"""

import contextlib
import math
import warnings

import keras

from keras_accum.arguments import check_accum_steps, check_micro_batch_size
from keras_accum.backup import check_callbacks
from keras_accum.microbatch import static_batch_size


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
            logs["skipped_windows"] = model.skipped_windows
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


@contextlib.contextmanager
def one_fit(model, callbacks, accum_steps=None, micro_batch_size=None):
    """The settings and callbacks of one `fit` call; yields the callbacks.

    Every argument is checked before anything changes. `accum_steps` and
    `micro_batch_size`, if given, hold for this call only: afterwards the
    model's own come back without applying the open window (after an
    interrupted fit it stays open, to be resumed), and the next fit traces
    its own step. A resumed epoch's skipping belongs to this call too.
    """
    if isinstance(callbacks, keras.callbacks.Callback):
        callbacks = [callbacks]  # Keras accepts one callback too
    check_callbacks(
        getattr(callbacks, "callbacks", callbacks) or [], model.distribute_strategy
    )
    if accum_steps is not None:
        accum_steps = check_accum_steps(accum_steps)
    if micro_batch_size is not None:
        micro_batch_size = check_micro_batch_size(micro_batch_size)
    previous = model._settings
    if accum_steps is not None:
        model.accum_steps = accum_steps
    if micro_batch_size is not None:
        model.micro_batch_size = micro_batch_size
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
