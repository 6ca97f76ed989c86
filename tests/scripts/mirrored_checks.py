"""Run by test_distributed.py in a fresh process: two logical CPU devices
must be configured before TensorFlow initialises its runtime.

`python tests/scripts/mirrored_checks.py 1` runs the same checks under a
one-replica `MirroredStrategy()` (a CPU-only or one-GPU machine's: no
device split), the commonest way multi-GPU code is first run.

Prints one JSON object of measurements; the test makes the assertions.
"""

import json
import os
import sys
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
# tests/, for the shared helpers.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import tensorflow as tf  # noqa: E402

REPLICAS = int(sys.argv[1]) if len(sys.argv) > 1 else 2
if REPLICAS > 1:
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * REPLICAS
    )

import keras  # noqa: E402
import numpy as np  # noqa: E402
from helpers import internals  # noqa: E402
from helpers.data import bn_data, make_data  # noqa: E402
from helpers.models import OPTIMIZERS, bn_net, functional, loss, mlp, moving  # noqa: E402

from keras_accum import AccumModel, AccumScheduler  # noqa: E402


class CountingReductions(tf.distribute.ReductionToOneDevice):
    """Counts, at run time, cross-device reductions of non-scalar values
    (gradients), leaving out the scalar ones Keras makes for metrics."""

    def __init__(self):
        super().__init__()
        self.count = tf.Variable(0, dtype=tf.int64)

    def _counted(self, values):
        if max(len(v.values[0].shape) for v in values) > 0:
            return [self.count.assign_add(1)]
        return []

    def batch_reduce_implementation(self, reduce_op, value_destination_pairs, options):
        with tf.control_dependencies(self._counted([v for v, _ in value_destination_pairs])):
            return super().batch_reduce_implementation(reduce_op, value_destination_pairs, options)

    def reduce_implementation(self, reduce_op, per_replica_value, destinations, options):
        with tf.control_dependencies(self._counted([per_replica_value])):
            return super().reduce_implementation(reduce_op, per_replica_value, destinations, options)


def max_diff(a, b):
    return float(max(np.abs(u - v).max() for u, v in zip(a.get_weights(), b.get_weights())))


def history_diff(ha, hb):
    return float(max(np.abs(np.array(ha.history[k]) - np.array(hb.history[k])).max() for k in ha.history))


def main():
    reductions = CountingReductions()
    devices = [f"/cpu:{i}" for i in range(REPLICAS)] if REPLICAS > 1 else None
    strategy = tf.distribute.MirroredStrategy(devices, cross_device_ops=reductions)
    assert strategy.num_replicas_in_sync == REPLICAS
    # Global micro-batch 8 (4 per replica), N=4: windows of 4, 4 and 2
    # micro-batches, the last of 8 and 4 samples (2 per replica).
    x, y = make_data(76)
    val = make_data(20, seed=3)
    fit = dict(epochs=2, shuffle=False, verbose=0, validation_data=val)
    out = {"replicas": REPLICAS, "weights": {}, "history": {}}

    # Keras's own accumulation, for the README's claim that it fails here.
    with strategy.scope():
        builtin = functional()
        builtin.compile(keras.optimizers.Adam(0.01, gradient_accumulation_steps=4), loss())
    try:
        builtin.fit(x, y, batch_size=8, epochs=1, verbose=0)
        out["builtin"] = "trained"
    except Exception as error:  # noqa: BLE001 - recorded, asserted by the test
        out["builtin"] = f"{type(error).__name__}: {str(error)[:300]}"

    for name in ("adam", "sgd_momentum", "adamw"):
        make = OPTIMIZERS[name]
        plain = functional()
        plain.compile(make(), loss(), metrics=["accuracy"])
        h_plain = plain.fit(x, y, batch_size=32, **fit)
        with strategy.scope():
            acc = functional(AccumModel, accum_steps=4)
            acc.compile(make(), loss(), metrics=["accuracy"])
        h_acc = acc.fit(x, y, batch_size=8, **fit)
        out["weights"][name] = max_diff(plain, acc)
        out["history"][name] = history_diff(h_plain, h_acc)
        out.setdefault("moved", max_diff(plain, functional()))
        if name == "adam":
            # Several steps per train-function call (3 does not divide 10).
            with strategy.scope():
                acc = functional(AccumModel, accum_steps=4)
                acc.compile(make(), loss(), metrics=["accuracy"], steps_per_execution=3)
            h_acc = acc.fit(x, y, batch_size=8, **fit)
            out["weights"]["adam_steps_per_execution_3"] = max_diff(plain, acc)
            out["history"]["adam_steps_per_execution_3"] = history_diff(h_plain, h_acc)

    # micro_batch_size: each replica splits its share of the batch (16 of
    # 32) into micro-batches of 4 (uneven: the last batch of 12 is 6 per
    # replica, 4 + 2 and two stand-ins); alone and with accum_steps=2.
    plain = functional()
    plain.compile(OPTIMIZERS["adam"](), loss(), metrics=["accuracy"])
    h_plain = plain.fit(x, y, batch_size=32, **fit)
    for accum_steps, batch in ((1, 32), (2, 16)):
        with strategy.scope():
            acc = functional(AccumModel, micro_batch_size=4, accum_steps=accum_steps)
            acc.compile(OPTIMIZERS["adam"](), loss(), metrics=["accuracy"])
        h_acc = acc.fit(x, y, batch_size=batch, **fit)
        out["micro_batch"] = out.get("micro_batch", {})
        out["micro_batch"][f"accum_steps_{accum_steps}"] = {
            "weights": max_diff(plain, acc),
            "history": history_diff(h_plain, h_acc),
            "iterations": [int(m.optimizer.iterations.numpy()) for m in (plain, acc)],
        }

    # mixed_float16: the loss scale is checked and updated once per window,
    # on the window's gradient summed across replicas.
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        plain = mlp()
        plain.compile(OPTIMIZERS["adam"](), loss())
        plain.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
        with strategy.scope():
            acc = mlp(AccumModel, accum_steps=4)
            acc.compile(OPTIMIZERS["adam"](), loss())
        acc.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    out["mixed_float16"] = {
        "plain": [w.tolist() for w in plain.get_weights()],
        "accum": [w.tolist() for w in acc.get_weights()],
        "scales": [float(m.optimizer.dynamic_scale.numpy()) for m in (plain, acc)],
    }

    # Gradient reductions per update, with and without accumulation.
    for steps in (4, 1):
        reductions.count.assign(0)
        with strategy.scope():
            model = functional(AccumModel, accum_steps=steps)
            model.compile(OPTIMIZERS["adam"](), loss(), metrics=["accuracy"])
        model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
        out[f"reductions_{steps}"] = int(reductions.count.numpy())
        out[f"updates_{steps}"] = int(model.optimizer.iterations.numpy())

    # flush() and resuming a pending window from a weights file.
    def compiled():
        with strategy.scope():
            model = functional(AccumModel, accum_steps=4)
            model.compile(OPTIMIZERS["adam"](), loss())
            model.optimizer.build(model.trainable_variables)
        return model

    def train(model, steps):
        for i in steps:
            model.train_on_batch(x[8 * i : 8 * i + 8], y[8 * i : 8 * i + 8])
        return model

    reference = functional()
    reference.compile(OPTIMIZERS["adam"](), loss())
    for batch in (slice(0, 32), slice(32, 48)):
        reference.train_on_batch(x[batch], y[batch])
    flushed = train(compiled(), range(6))
    flushed.flush()
    out["flush"] = max_diff(reference, flushed)

    uninterrupted = train(compiled(), range(8))
    interrupted = train(compiled(), range(6))
    path = os.path.join(tempfile.mkdtemp(), "m.weights.h5")
    interrupted.save_weights(path)
    resumed = compiled()
    resumed.load_weights(path)
    out["resumed_pending"] = internals.pending(resumed)
    train(resumed, range(6, 8))
    out["resume"] = max_diff(uninterrupted, resumed)

    # AccumScheduler: batch 8, then 16, then 32 (global), as a plain model
    # on one device whose batch size follows the schedule.
    plain = functional()
    plain.compile(OPTIMIZERS["adam"](), loss())
    for epoch, batch in enumerate((8, 16, 32)):
        plain.fit(x, y, batch_size=batch, epochs=epoch + 1, initial_epoch=epoch, shuffle=False, verbose=0)
    with strategy.scope():
        acc = functional(AccumModel)
        acc.compile(OPTIMIZERS["adam"](), loss())
    acc.fit(
        x, y, batch_size=8, epochs=3, shuffle=False, verbose=0,
        callbacks=[AccumScheduler({0: 1, 1: 2, 2: 4})],
    )
    out["schedule"] = max_diff(plain, acc)
    out["schedule_iterations"] = [int(m.optimizer.iterations.numpy()) for m in (plain, acc)]

    # skip_nonfinite: one NaN sample in the second window of each epoch, in
    # one replica's share of its micro-batch only (samples 40-43 go to
    # replica 0, 44-47 to replica 1): every replica must skip, whichever
    # holds the NaN.
    plain = functional()
    plain.compile(OPTIMIZERS["adam"](), loss())
    for _ in range(2):
        for batch in (slice(0, 32), slice(64, 76)):
            plain.train_on_batch(x[batch], y[batch])
    out["skip"] = {}
    for replica in range(REPLICAS):
        x_nan = x.copy()
        x_nan[41 + 4 * replica, 0] = np.nan
        with strategy.scope():
            acc = functional(AccumModel, accum_steps=4, skip_nonfinite=True)
            acc.compile(OPTIMIZERS["adam"](), loss())
        history = acc.fit(x_nan, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
        # Each replica's own copy of every weight, read on that replica.
        local = strategy.run(lambda: [tf.identity(w) for w in acc.weights])
        replicas = [strategy.experimental_local_results(w) for w in local]
        out["skip"][f"nan_on_replica_{replica}"] = {
            "diff": max_diff(plain, acc),
            "finite": bool(all(np.isfinite(w).all() for w in acc.get_weights())),
            "replicas_differ": float(max(
                np.abs(c.numpy() - r[0].numpy()).max() for r in replicas for c in r
            )),
            "replicas": len(replicas[0]),
            "skipped": acc.skipped_windows,
            "logged": history.history["skipped_windows"],
            "iterations": int(acc.optimizer.iterations.numpy()),
        }

    # BatchNormalization(synchronized=True) on the raw input: moving
    # statistics of the whole window over both replicas, once per update.
    # 91 samples: the last micro-batch of each epoch (3) splits 2+1 across
    # two replicas, so replicas must count the moments they pool globally.
    bx, by = bn_data(91)
    plain = bn_net(bn_kwargs={"synchronized": True})
    plain.compile(keras.optimizers.SGD(0.1), loss())
    plain.fit(bx, by, batch_size=32, epochs=2, shuffle=False, verbose=0)
    with strategy.scope():
        acc = bn_net(AccumModel, accum_steps=4, bn_kwargs={"synchronized": True})
        acc.compile(keras.optimizers.SGD(0.1), loss())
    acc.fit(bx, by, batch_size=8, epochs=2, shuffle=False, verbose=0)
    out["batchnorm"] = {
        "plain": [v.tolist() for v in moving(plain)],
        "accum": [v.tolist() for v in moving(acc)],
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
