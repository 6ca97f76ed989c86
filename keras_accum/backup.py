"""`BackupAndRestore`: Keras's fault-tolerance callback, safe across workers.

Keras's saves and loads each worker's files on their own: a worker dying
around a backup resumes from another epoch than its peers, and a save cut
short overwrites the only backup. Here backups are committed by a rename,
and the workers agree on the newest backup every one has before any loads.
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
    also works across workers: each worker passes its OWN directory and
    `double_checkpoint=True`, and at `fit`'s start all restore the newest
    backup every worker holds. A backup (`save_weights`: weights, optimizer
    variables, window) is committed by a rename, then a small point file, so one
    cut short never replaces a good one. Resuming is exact when each epoch's
    data order is reproducible. The manual: docs/fault-tolerance.md.

    Args:
        backup_dir: this worker's directory for the backups, shared with no
            other worker or callback.
        save_freq: `"epoch"` (at each epoch's end) or an integer N: a backup
            every N batches, wherever the window stands. A resume skips the
            batches the backup had seen (Keras trains them again): exactly
            the updates of an uninterrupted run, whatever else changes the
            train function meanwhile (`AccumScheduler`, `micro_batch_size`);
            a resumed window the step in force cannot continue (another
            `accum_steps`) raises, naming both, before any batch trains.
        double_checkpoint: keep the previous backup too (required across
            workers); also used when the newest cannot be read.
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
        backup_dir: str,
        save_freq: str | int = "epoch",
        double_checkpoint: bool = False,
        delete_checkpoint: bool = True,
    ) -> None:
        if save_freq != "epoch" and (
            isinstance(save_freq, bool) or not isinstance(save_freq, int) or save_freq < 1
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
        # The running fit's FitSetting callbacks (AccumScheduler): each
        # backup keeps their `state()`.
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
        self._restore_written_otherwise(point)
        self._restore_settings(point)
        epoch, batches = point
        internals.set_initial_epoch(self.model, epoch)
        if batches:
            self._restored = point
            fast_forward(self.model, batches, engine_of(self.model))

    def _restore_written_otherwise(self, point):
        # What Keras's weights file leaves out or merges (LoRA adapters,
        # seed generators' states: internals.written_otherwise), kept
        # beside it, put back as saved.
        path = self._extra_file(point)
        if os.path.exists(path):
            with np.load(path) as kept:
                values = [kept[f"arr_{i}"] for i in range(len(kept.files))]
            for variable, value in zip(internals.written_otherwise(self.model), values):
                variable.assign(value)

    def _restore_settings(self, point):
        # By position and class: a backup of a fit with other settings
        # callbacks restores none of theirs.
        with open(self._point_file(point)) as f:
            states = json.load(f).get("settings", [])
        for callback, state in zip(self._settings_callbacks(), states):
            if state is not None and state.get("class") == type(callback).__name__:
                callback.restore_state(state)

    def _restore_points(self):
        """(epoch, batch) of each committed backup here that opens, oldest first."""
        points = [p for p in self._restore_points_on_disk() if _readable(self._weights_file(p))]
        return points if self.double_checkpoint else points[-1:]

    def _agree(self, strategy, own):
        """The newest point every worker holds: one all-gather of (directory,
        points) rows, from which every worker takes the same decision, or
        raises the same error."""
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
        # Newer backups belong to the run being replayed: kept, they would
        # mix two runs at the next agreement.
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
            # A skipped batch: the model holds what was restored.
            internals.backup_batch_seen(self, batch)
            return
        if internals.backup_due_after_batch(self, batch):
            self._save(point)

    def _save_epoch_end(self):
        # Also what Keras's own backup method runs (`backups_made_by`).
        self._save((self._completed_epochs, 0))

    def _save(self, point):
        os.makedirs(self.backup_dir, exist_ok=True)
        partial = os.path.join(self.backup_dir, f"partial-{_name(point)}.weights.h5")
        self.model.save_weights(partial, overwrite=True)
        os.replace(partial, self._weights_file(point))
        extra = internals.written_otherwise(self.model)
        if extra:
            partial = os.path.join(self.backup_dir, f"partial-{_name(point)}.extra.npz")
            np.savez(partial, *[np.asarray(v.numpy()) for v in extra])
            os.replace(partial, self._extra_file(point))
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

    def _extra_file(self, point):
        return os.path.join(self.backup_dir, f"{_name(point)}.extra.npz")

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
        for path in (self._point_file(point), self._weights_file(point), self._extra_file(point)):
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
    """The point all workers restore, from every worker's (directory, points):
    the newest every worker holds, or None when none holds any. Points are
    epochs or (epoch, batch) pairs. Raises, naming every directory, for a
    shared directory, `double_checkpoint` off, or no point in common.
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
