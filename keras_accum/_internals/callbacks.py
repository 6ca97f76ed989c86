"""Keras's `BackupAndRestore` bookkeeping, the epoch `fit` starts at, and
counts in `fit`'s progress bar.

`keras_accum.BackupAndRestore` reuses Keras's batch counting:
`_should_save_on_batch` reads `_last_batch_seen` (reset at each epoch's end)
and `_batches_seen_since_last_saving`.
"""

import keras
import numpy as np

from keras_accum._internals.versions import require, required


def set_initial_epoch(model, epoch):
    """Makes the coming `fit` start at `epoch`, as Keras's BackupAndRestore does."""
    required(model, "_initial_epoch")  # set anywhere else, fit would not read it
    model._initial_epoch = epoch


def backup_counts_from_zero(callback):
    """A `BackupAndRestore` counts batches anew (at `fit`'s start), after
    checking that the bookkeeping is where every reviewed Keras keeps it
    (else backups would come at other batches or be Keras's own, or a
    resume would train its epochs again)."""
    require(
        callback, "_batches_seen_since_last_saving", "_last_batch_seen", "_should_save_on_batch"
    )
    required(keras.callbacks.BackupAndRestore, "_save_model")
    if callback.model is not None:
        required(callback.model, "_initial_epoch")  # where a resume starts
    callback._batches_seen_since_last_saving = 0
    callback._last_batch_seen = 0


def backup_epoch_ended(callback):
    """The next batch a `BackupAndRestore` sees starts an epoch."""
    callback._last_batch_seen = 0


def backup_batch_seen(callback, batch):
    """`batch` passed without counting towards the next backup (skipped)."""
    callback._last_batch_seen = batch


def backup_due_after_batch(callback, batch):
    """Counts `batch`; whether a batch-level backup is due after it."""
    return required(callback, "_should_save_on_batch")(batch)


def backups_made_by(method_name):
    """Class decorator for a `keras.callbacks.BackupAndRestore` subclass: Keras's
    `_save_model` (called by the base class's `on_epoch_end` and
    `on_train_batch_end`) runs `method_name` instead, so no path of the base
    class writes a backup of its own."""

    def decorate(cls):
        def _save_model(self):
            return getattr(self, method_name)()

        cls._save_model = _save_model
        return cls

    return decorate


class LoggedCount(int):
    """A count in `fit`'s epoch logs (`accum_steps`, `skipped_windows`) that the
    progress bar prints as an integer, not `4.0000`: it stays itself through
    Keras `Progbar`'s `np.mean`, division by its steps (1 at an epoch's end)
    and `.4f`/`.4e` formatting. Elsewhere, a plain int."""

    def __array_function__(self, func, types, args, kwargs):
        # `np.mean` of the value alone is the value; anything else, the int.
        if func is np.mean and args == (self,) and not kwargs:
            return self
        args = tuple(int(a) if a is self else a for a in args)
        return func(*args, **kwargs)

    def __truediv__(self, other):
        # The progress bar's mean over the one value it was given.
        return self if other == 1 else int(self) / other

    def __format__(self, spec):
        if spec[-1:] in _FLOAT_PRESENTATIONS:
            return str(int(self))
        return format(int(self), spec)


_FLOAT_PRESENTATIONS = frozenset("eEfFgG%")
