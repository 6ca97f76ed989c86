"""Run by test_fault_tolerance.py in a fresh process: BackupAndRestore and a
mid-window save under MirroredStrategy on two logical CPU devices (set up
before TensorFlow starts its runtime). Prints one JSON object."""

import json
import os
import sys
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
# tests/, for the shared helpers.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import tensorflow as tf  # noqa: E402

# `python <this file> 1`: a one-replica MirroredStrategy() (no device split).
REPLICAS = int(sys.argv[1]) if len(sys.argv) > 1 else 2
if REPLICAS > 1:
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * REPLICAS
    )

from helpers import internals  # noqa: E402
from helpers.data import make_data  # noqa: E402
from helpers.models import OPTIMIZERS, functional, loss  # noqa: E402
from helpers.training import InterruptAt  # noqa: E402

import keras_accum  # noqa: E402

strategy = tf.distribute.MirroredStrategy(
    [f"/cpu:{i}" for i in range(REPLICAS)] if REPLICAS > 1 else None
)
assert strategy.num_replicas_in_sync == REPLICAS
x, y = make_data(92)  # global micro-batch 8 (4 per replica), N=4


def interrupt():
    """Ctrl-C in the second epoch, after 6 micro-batches (a window half done)."""
    return InterruptAt(1, 5)


def compiled():
    with strategy.scope():
        model = functional(keras_accum.AccumModel, accum_steps=4)
        model.compile(OPTIMIZERS["adam"](), loss())
    return model


def fit(model, x, y, epochs, callbacks=()):
    return model.fit(x, y, batch_size=8, epochs=epochs, shuffle=False, verbose=0,
                     callbacks=list(callbacks))


def main():
    out = {}
    directory = tempfile.mkdtemp()
    backup = keras_accum.BackupAndRestore(os.path.join(directory, "backup"))
    try:
        fit(compiled(), x, y, 3, [interrupt(), backup])
    except KeyboardInterrupt:
        pass
    model = compiled()
    out["epochs_resumed"] = len(fit(model, x, y, 3, [backup]).history["loss"])
    out["interrupted"] = [w.tolist() for w in model.get_weights()]

    # A backup every 5 batches: 3 batches into the second epoch, skipped.
    backup = keras_accum.BackupAndRestore(os.path.join(directory, "batches"), save_freq=5)
    try:
        fit(compiled(), x, y, 3, [interrupt(), backup])
    except KeyboardInterrupt:
        pass
    model = compiled()
    out["epochs_resumed_batches"] = len(fit(model, x, y, 3, [backup]).history["loss"])
    out["batch_level"] = [w.tolist() for w in model.get_weights()]

    model = compiled()
    try:
        fit(model, x, y, 3, [interrupt()])
    except KeyboardInterrupt:
        pass
    path = os.path.join(directory, "mid.weights.h5")
    model.save_weights(path)
    model = compiled()
    with strategy.scope():
        model.optimizer.build(model.trainable_variables)
    model.load_weights(path)
    out["pending_loaded"] = internals.pending(model)
    fit(model, x[48:], y[48:], 1)  # the rest of the second epoch
    fit(model, x, y, 1)  # the third
    out["saved_mid_window"] = [w.tolist() for w in model.get_weights()]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
