"""Keras's `BackupAndRestore` and the epoch `fit` starts at.

`keras_accum.BackupAndRestore` reuses Keras's batch counting:
`_should_save_on_batch(batch)` counts the batches since the last backup
from `_last_batch_seen` (reset at each epoch's end) and
`_batches_seen_since_last_saving`.
"""


def set_initial_epoch(model, epoch):
    """Makes the coming `fit` start at `epoch`, as Keras's BackupAndRestore does."""
    model._initial_epoch = epoch


def backup_counts_from_zero(callback):
    """A `BackupAndRestore` counts batches anew (at `fit`'s start)."""
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
    return callback._should_save_on_batch(batch)


def backups_made_by(method_name):
    """Class decorator for a `keras.callbacks.BackupAndRestore` subclass:
    Keras's own backup method (`_save_model`, which the base class's
    `on_epoch_end` and `on_train_batch_end` call) runs the subclass's
    `method_name` instead, so no path of the base class writes a backup of
    its own.

    Example:

    ```python
    @backups_made_by("_save_epoch_end")
    class Backup(keras.callbacks.BackupAndRestore):
        def _save_epoch_end(self):
            ...
    ```
    """

    def decorate(cls):
        def _save_model(self):
            return getattr(self, method_name)()

        cls._save_model = _save_model
        return cls

    return decorate
