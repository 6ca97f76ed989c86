"""`BackupAndRestore`: Keras's fault-tolerance callback, safe across workers.

Keras 3's `keras.callbacks.BackupAndRestore` saves and loads each worker's
files on their own. Across workers (`MultiWorkerMirroredStrategy`) a worker
that dies around an epoch-end backup leaves the others' backups one epoch
ahead of its own; on restart each resumes from a different epoch and the
collectives no longer line up. A save that is cut short also overwrites
the only backup in place. This callback keeps the same arguments and fixes
both: backups are written to a temporary name and committed by a rename,
and on restart the workers agree on the newest backup every one of them
has, before any of them loads. Batch-level backups (`save_freq=N`) resume
exactly: the batches already seen are skipped, not trained again.
"""

import json
import os
import re
import shutil

import h5py
import keras
import numpy as np
import tensorflow as tf

from keras_accum import _internals as internals
from keras_accum.engine import engine_of
from keras_accum.engine.functions import fast_forward, stop_fast_forward

_COMMITTED = re.compile(r"^epoch-(\d+)(?:-batch-(\d+))?\.json$")
# A restore point (epoch, batch) travels in the all-gather as one integer.
_BATCHES = 2**32
# Fixed-size rows, so that one all-gather carries every worker's answer.
_PATH_BYTES = 1024
_KEPT = 2


@internals.backups_made_by("_save_epoch_end")
class BackupAndRestore(keras.callbacks.BackupAndRestore):
    """Backs up training as it goes; restores it exactly when `fit` restarts.

    A drop-in for `keras.callbacks.BackupAndRestore` (same arguments) that
    also works across workers. Each backup is the model's weights, optimizer
    state and accumulation window (`save_weights`), written under a
    temporary name and committed by renaming it and then writing a small
    point file, so a worker killed while saving leaves its previous backup
    intact. Saving reads only this worker's own values: it never waits for
    a peer.

    Under `MultiWorkerMirroredStrategy` every worker passes its OWN
    directory (all may be on one filesystem), and `double_checkpoint=True`
    is required: a worker that dies around a backup is then one backup
    behind the others, and with two kept each, all of them still share a
    point. When `fit` starts, the workers exchange which points they hold
    and all restore the newest one every worker has; a shared directory,
    or backups with nothing in common, are refused before anything is
    trained or written, with an error naming the directories.

    Resuming is exact when the order of each epoch's data is reproducible
    (`shuffle=False`, or a dataset whose order does not depend on earlier
    epochs), as it must be for any replay.

    Args:
        backup_dir: this worker's directory for the backups. Not shared with
            another worker or another callback.
        save_freq: `"epoch"` (at each epoch's end, where no window is open)
            or an integer N: a backup every N batches, wherever the window
            stands. Keras resumes a batch-level backup by replaying its
            epoch from the first batch (training those batches twice); this
            callback skips the batches the backup had already seen, so the
            resumed run makes exactly the updates of an uninterrupted one.
            The logged loss and metrics of the resumed epoch then cover the
            batches after the backup only. The fast-forward holds whatever else
            changes the train function meanwhile (`AccumScheduler`,
            `fit(accum_steps=...)`, `micro_batch_size`, in any callback
            order); a resumed window that the step in force cannot continue
            (another `accum_steps`) raises the error naming both values
            when the fast-forward ends, before any batch is trained. An
            `AccumScheduler`'s state (the `accum_steps` and rate in force,
            its smoothed noise scale) is kept in each backup too, so a
            schedule deciding every K updates resumes where it was.
        double_checkpoint: keep the previous backup too (required across
            workers). Also used when the newest backup cannot be read.
        delete_checkpoint: delete `backup_dir` when training ends.

    Example:

    ```python
    model = keras_accum.AccumModel(inputs, outputs, accum_steps=4)
    model.compile("adam", "sparse_categorical_crossentropy")
    backup = keras_accum.BackupAndRestore("backups", double_checkpoint=True)
    model.fit(dataset, epochs=2, callbacks=[backup], verbose=0)  # the same call on a restart

    # Across workers, under MultiWorkerMirroredStrategy: one directory each,
    # f"/shared/backups/worker-{strategy.cluster_resolver.task_id}".
    ```
    """

    def __init__(
        self,
        backup_dir,
        save_freq="epoch",
        double_checkpoint=False,
        delete_checkpoint=True,
    ):
        if save_freq != "epoch" and (
            isinstance(save_freq, bool)
            or not isinstance(save_freq, int)
            or save_freq < 1
        ):
            raise ValueError(
                "`save_freq` must be 'epoch' or an integer >= 1 (a backup "
                f"every that many batches). Received: save_freq={save_freq!r}."
            )
        super().__init__(
            backup_dir,
            save_freq=save_freq,
            double_checkpoint=double_checkpoint,
            delete_checkpoint=delete_checkpoint,
        )
        self._epoch = 0
        self._completed_epochs = 0
        self._restored = None

    def _settings_callbacks(self):
        # The running fit's FitSetting callbacks (AccumScheduler), whose
        # state each backup keeps and a restore hands back.
        engine = engine_of(self.model)
        return [] if engine is None else engine.fits.settings_callbacks

    # -- restoring ---------------------------------------------------------

    def on_train_begin(self, logs=None):
        internals.backup_counts_from_zero(self)
        self._restored = None
        # left by a `fit` interrupted in a fast-forward
        stop_fast_forward(self.model, engine_of(self.model))
        strategy = self.model.distribute_strategy
        own = self._restore_points()
        if internals.multi_worker(strategy):
            point = self._agree(strategy, own)
        else:
            point = max(own, default=None)
        if point is None:
            return
        if not self.model.built:
            raise ValueError(
                f"{self.backup_dir} holds a backup ({_describe(point)}), but "
                "the model is not built, so its weights cannot be restored "
                "into it. Build it before `fit`: call it on a batch, or "
                "`model.build(input_shape)`."
            )
        self._discard_newer_than(point)
        optimizer = self.model.optimizer
        if optimizer is not None and not optimizer.built:
            # As Keras: optimizer variables must exist before loading.
            with strategy.scope():
                optimizer.build(self.model.trainable_variables)
        self.model.load_weights(self._weights_file(point))
        self._restore_settings(point)
        epoch, batches = point
        internals.set_initial_epoch(self.model, epoch)
        if batches:
            self._restored = point
            fast_forward(self.model, batches, engine_of(self.model))

    def _restore_settings(self, point):
        # A schedule's state, by position and class: a backup written by a
        # fit with other settings callbacks restores none of theirs.
        with open(self._point_file(point)) as f:
            states = json.load(f).get("settings", [])
        for callback, state in zip(self._settings_callbacks(), states):
            if state is not None and state.get("class") == type(callback).__name__:
                callback.restore_state(state)

    def _restore_points(self):
        """(epoch, batch) of each committed backup here that opens, oldest first."""
        points = [
            p for p in self._restore_points_on_disk() if _readable(self._weights_file(p))
        ]
        return points if self.double_checkpoint else points[-1:]

    def _agree(self, strategy, own):
        """The newest point every worker holds, the same on every worker.

        One all-gather of (directory, points) rows: every worker then takes
        the same decision from the same table, or raises the same error.
        """
        path = os.path.realpath(self.backup_dir).encode()[:_PATH_BYTES]
        row = np.full(_PATH_BYTES + _KEPT, -1, np.int64)
        row[: len(path)] = np.frombuffer(path, np.uint8)
        for i, (epoch, batch) in enumerate(own[-_KEPT:]):
            row[_PATH_BYTES + i] = epoch * _BATCHES + batch
        table = _all_gather(strategy, row)
        workers = []
        for r in table:
            path = bytes(int(b) for b in r[:_PATH_BYTES] if b >= 0).decode()
            points = [divmod(int(p), _BATCHES) for p in r[_PATH_BYTES:] if p >= 0]
            workers.append((path, sorted(points)))
        return restore_point(workers, self.double_checkpoint)

    def _discard_newer_than(self, point):
        # Newer backups than the agreed one belong to a run that is being
        # replayed; keeping them would mix two runs at the next agreement.
        for other in self._restore_points_on_disk():
            if other > point:
                self._remove(other)

    # -- saving --------------------------------------------------------------

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_epoch_end(self, epoch, logs=None):
        self._completed_epochs = epoch + 1
        internals.backup_epoch_ended(self)
        if self.save_freq == "epoch":
            self._save_epoch_end()

    def on_train_batch_end(self, batch, logs=None):
        point = (self._epoch, batch + 1)
        if self._restored is not None and point <= self._restored:
            # A skipped batch: the model holds the restored state.
            internals.backup_batch_seen(self, batch)
            return
        if internals.backup_due_after_batch(self, batch):
            self._save(point)

    def _save_epoch_end(self):
        # Also what Keras's own backup method runs (`backups_made_by`), so
        # that no path of the base class writes a backup of its own.
        self._save((self._completed_epochs, 0))

    def _save(self, point):
        os.makedirs(self.backup_dir, exist_ok=True)
        partial = os.path.join(self.backup_dir, f"partial-{_name(point)}.weights.h5")
        self.model.save_weights(partial, overwrite=True)
        os.replace(partial, self._weights_file(point))
        # The point file commits the backup: written last, also atomically.
        epoch, batch = point
        settings = [callback.state() for callback in self._settings_callbacks()]
        _write_atomically(
            self._point_file(point),
            json.dumps({"epoch": epoch, "batch": batch, "settings": settings}),
        )
        kept = _KEPT if self.double_checkpoint else 1
        for other in self._restore_points_on_disk()[:-kept]:
            self._remove(other)

    def on_train_end(self, logs=None):
        if self.delete_checkpoint and os.path.isdir(self.backup_dir):
            shutil.rmtree(self.backup_dir)

    # -- files -------------------------------------------------------------

    def _weights_file(self, point):
        return os.path.join(self.backup_dir, f"{_name(point)}.weights.h5")

    def _point_file(self, point):
        return os.path.join(self.backup_dir, f"{_name(point)}.json")

    def _restore_points_on_disk(self):
        if not os.path.isdir(self.backup_dir):
            return []
        return sorted(
            (int(m.group(1)), int(m.group(2) or 0))
            for m in map(_COMMITTED.match, os.listdir(self.backup_dir))
            if m
        )

    def _remove(self, point):
        # The point file first: a backup is never committed without weights.
        for path in (self._point_file(point), self._weights_file(point)):
            if os.path.exists(path):
                os.remove(path)


def _name(point):
    epoch, batch = point
    return f"epoch-{epoch}" + (f"-batch-{batch}" if batch else "")


def _describe(point):
    """A restore point for people: epochs completed, batches into the next."""
    if isinstance(point, int):
        return f"epoch {point}"
    epoch, batch = point
    if not batch:
        return f"end of epoch {epoch}"
    return f"epoch {epoch + 1}, batch {batch}"


def restore_point(workers, double_checkpoint=True):
    """The point all workers restore, from every worker's (directory, points).

    Points are epochs, or (epoch, batch) pairs, as the workers' backups are
    named. The newest point every worker holds; None when no worker holds any
    (a fresh start). Raises, naming every directory, when workers share a
    directory, when `double_checkpoint` is off, or when the workers'
    backups have no epoch in common.
    """
    _check_directories(workers)
    if not double_checkpoint:
        raise ValueError(
            "Across workers, keras_accum.BackupAndRestore needs "
            "double_checkpoint=True: a worker that dies around a backup "
            "is one backup behind the others, and only with the previous "
            "backup kept do all workers still share a point to resume "
            "from. Received: double_checkpoint=False."
        )
    held = [set(epochs) for _, epochs in workers]
    common = set.intersection(*held)
    if common:
        return max(common)
    if not any(held):
        return None
    listing = "; ".join(
        f"worker {i}: {path} has "
        + (", ".join(_describe(p) for p in sorted(points)) or "no backup")
        for i, (path, points) in enumerate(workers)
    )
    raise ValueError(
        "The workers' backups have no point in common, so training "
        f"cannot resume consistently ({listing}). Restore the missing "
        "backups, or delete every worker's backup directory to start "
        "over."
    )


def _check_directories(workers):
    paths = [path for path, _ in workers]
    for i, a in enumerate(paths):
        for j, b in enumerate(paths):
            if i < j and (a == b or _inside(a, b) or _inside(b, a)):
                raise ValueError(
                    "Workers must not share a backup directory: worker "
                    f"{i} uses {a} and worker {j} uses {b}. Give each worker "
                    "its own, e.g. f'{backup_dir}/worker-{task_id}' with "
                    "task_id = strategy.cluster_resolver.task_id."
                )


def _inside(path, directory):
    return path.startswith(directory.rstrip(os.sep) + os.sep)


def _readable(path):
    try:
        with h5py.File(path, "r") as f:
            f.visit(lambda name: None)
        return True
    except (OSError, ValueError):
        return False


def _write_atomically(path, text):
    partial = path + ".partial"
    with open(partial, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(partial, path)


def _all_gather(strategy, row):
    """Every worker's `row`, stacked in worker order (a collective)."""
    local = len(strategy.extended.worker_devices)
    rows = strategy.experimental_distribute_values_from_function(
        lambda context: tf.constant(row[None], tf.int64)
    )
    table = strategy.gather(rows, axis=0).numpy()
    # Each worker contributed one identical row per local replica.
    return table[::local]

