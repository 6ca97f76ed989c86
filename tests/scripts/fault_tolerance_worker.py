"""One worker of the fault-tolerance tests (tests/test_fault_tolerance.py).

Started by the test through tests/helpers/processes.py (TF_CONFIG,
SIGNAL_DIR, ...). `MODE=train` fits a small AccumModel for EPOCHS epochs
with `keras_accum.BackupAndRestore` in `BACKUP_ROOT/worker-<task>`, stopping
at the named point the test asked for (see `processes.pause_at`), and on success
writes its final weights to `OUT`; with `AUTO=1` the model trains with
`micro_batch_size="auto"`, and worker 1 runs out of memory (genuinely:
tests/helpers/oom.py) from the second epoch on, so every worker retries
that epoch's first step on smaller micro-batches. `MODE=misuse` records what each misuse
raises; `MODE=save_alone` saves after its peer has exited.
"""

import json
import logging
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
# tests/, for the shared helpers.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import tensorflow as tf  # noqa: E402

strategy = tf.distribute.MultiWorkerMirroredStrategy()

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_accum  # noqa: E402
from helpers import internals  # noqa: E402
from helpers.data import make_data  # noqa: E402
from helpers.models import OPTIMIZERS, functional, loss  # noqa: E402
from helpers.oom import LimitedLoss  # noqa: E402
from helpers.processes import WAIT, pause_at, task_index, wait_for_file  # noqa: E402
from helpers.training import InterruptAt  # noqa: E402

MICRO_BATCH, ACCUM_STEPS, EPOCHS = 8, 4, 4  # global micro-batch: 4 per worker
# 100 samples: 13 micro-batches an epoch, windows of 4, 4, 4 and 1.


def dataset():
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    x, y = make_data(100)
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(MICRO_BATCH).with_options(options)


AUTO = os.environ.get("AUTO") == "1"
# The most samples worker 1 holds at once in auto mode, read when a step
# runs: no limit in the first epoch, 2 (of its 4 per micro-batch) after.
LIMIT = tf.Variable(10_000, dtype=tf.int64, trainable=False)


def compiled():
    with strategy.scope():
        if AUTO:
            model = functional(
                keras_accum.AccumModel, accum_steps=ACCUM_STEPS, micro_batch_size="auto"
            )
            model.compile(OPTIMIZERS["adam"](), LimitedLoss(LIMIT))
        else:
            model = functional(keras_accum.AccumModel, accum_steps=ACCUM_STEPS)
            model.compile(OPTIMIZERS["adam"](), loss())
    return model


class RetryPoint(logging.Handler):
    """Stops at "auto_retry" when every worker has agreed on a smaller size
    and is about to train the batch again (keras_accum's warning)."""

    def emit(self, record):
        if "ran out of memory" in record.getMessage():
            pause_at("auto_retry")


class Points(keras.callbacks.Callback):
    """The named points of a training run, in the second epoch (index 1)."""

    def on_train_batch_end(self, batch, logs=None):
        if self._epoch == 1 and batch == 5:
            pause_at("mid_window")  # 6 micro-batches: a window half done
        if self._epoch == 1 and batch == 7:
            pause_at("window_boundary")  # 8: a window just applied

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch
        if AUTO and epoch >= 1 and task_index() == 1:
            LIMIT.assign(2)

    def on_epoch_end(self, epoch, logs=None):
        if epoch == 1:
            pause_at("before_backup")


def pausing_saves(model):
    """Makes the second epoch's backup stop at the points named for it."""
    save_weights = model.save_weights
    saves = []

    def save(filepath, *args, **kwargs):
        saves.append(filepath)
        if len(saves) == 2:
            pause_at("peer_backup")  # before writing: the peer dies meanwhile
        save_weights(filepath, *args, **kwargs)
        if len(saves) == 2 and os.environ.get("PAUSE_AT") == "own_backup_write":
            # Killed half way through writing: what is on disk is cut short.
            size = os.path.getsize(filepath)
            with open(filepath, "r+b") as f:
                f.truncate(size // 2)
            pause_at("own_backup_write")

    model.save_weights = save


def train(out):
    logging.getLogger("keras_accum").addHandler(RetryPoint())
    model = compiled()
    pausing_saves(model)
    backup = keras_accum.BackupAndRestore(
        os.path.join(os.environ["BACKUP_ROOT"], f"worker-{task_index()}"),
        save_freq=int(os.environ["SAVE_FREQ"]) if "SAVE_FREQ" in os.environ else "epoch",
        double_checkpoint=True,
    )
    # The committed backups this worker starts with.
    out["held"] = [list(p) for p in internals.restore_points_on_disk(backup)]
    history = model.fit(dataset(), epochs=EPOCHS, verbose=0, callbacks=[Points(), backup])
    out["epochs_run"] = len(history.history["loss"])
    out["chosen"] = model.chosen_micro_batch_size if AUTO else None
    out["weights"] = [w.tolist() for w in model.get_weights()]


def misuse(out):
    root = os.environ["BACKUP_ROOT"]
    cases = {
        "shared": dict(backup_dir=os.path.join(root, "shared"), double_checkpoint=True),
        "single_checkpoint": dict(
            backup_dir=os.path.join(root, f"worker-{task_index()}"),
            double_checkpoint=False,
        ),
    }
    cases["keras_callback"] = dict(
        backup_dir=os.path.join(root, f"keras-{task_index()}"), keras=True
    )
    for name, kwargs in cases.items():
        model = compiled()
        callback = (
            keras.callbacks.BackupAndRestore
            if kwargs.pop("keras", False)
            else keras_accum.BackupAndRestore
        )
        try:
            model.fit(dataset(), epochs=1, verbose=0, callbacks=[callback(**kwargs)])
            out[name] = "trained"
        except ValueError as error:
            out[name] = str(error)
        out[f"{name}_iterations"] = int(model.optimizer.iterations.numpy())
        out[f"{name}_written"] = os.path.exists(kwargs["backup_dir"])


def save_alone(out):
    """Saves and reloads a half-done window after the peer has gone."""
    model = compiled()
    try:
        # After 6 micro-batches: a window half done.
        model.fit(dataset(), epochs=1, verbose=0, callbacks=[InterruptAt(0, 5)])
    except KeyboardInterrupt:
        pass
    # The test kills worker 1 here, then lets worker 0 go on alone.
    pause_at("save_alone")
    if task_index() == 1:
        return
    wait_for_file(os.path.join(os.environ["SIGNAL_DIR"], "go"), WAIT)
    before = internals.local_window(model)
    directory = os.environ["BACKUP_ROOT"]
    started = time.monotonic()
    model.save_weights(os.path.join(directory, "alone.weights.h5"))
    model.save(os.path.join(directory, "alone.keras"))
    out["save_seconds"] = time.monotonic() - started
    internals.zero_local_window(model)
    model.load_weights(os.path.join(directory, "alone.weights.h5"))
    after = internals.local_window(model)
    out["pending"] = internals.pending(model)
    out["same_window"] = all(
        np.array_equal(a, b) for va, vb in zip(before, after) for a, b in zip(va, vb)
    )
    try:
        model.load_weights(os.path.join(directory, "missing.weights.h5"))
    except Exception as error:  # noqa: BLE001 - recorded, asserted by the test
        out["failed_load"] = type(error).__name__
    out["pending_after_failed_load"] = internals.pending(model)


def main():
    out = {"task": task_index()}
    {"train": train, "misuse": misuse, "save_alone": save_alone}[os.environ["MODE"]](out)
    with open(os.environ["OUT"] + f".{task_index()}", "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
