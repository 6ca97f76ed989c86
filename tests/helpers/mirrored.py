"""Training under MirroredStrategy, run in the test process on the two
logical CPU devices tests/conftest.py sets up (`helpers.replicas`).

Each function trains its models under a strategy of `replicas` replicas
(1: what `MirroredStrategy()` is on a CPU-only machine) and returns plain
data (lists, numbers, strings) of what it measured; the test module that
calls it makes the assertions. Once scripts run in processes of their
own; the checks are unchanged.
"""

import json
import os
import tempfile

import keras
import numpy as np
import tensorflow as tf

import keras_accum
from helpers import internals
from helpers.data import bn_data, make_data, small_table_data, token_data
from helpers.models import (
    OPTIMIZERS,
    bn_net,
    functional,
    loss,
    mlp,
    moving,
    small_tables_net,
    text_net,
)
from helpers.noise import (
    embedding_data,
    embedding_net,
    estimate,
    per_example_gradients,
    regression_data,
    regression_net,
    windows_of,
)
from helpers.replicas import mirrored, new_mirrored
from helpers.training import InterruptAt
from keras_accum import AccumModel, AccumScheduler


def _plain(out):
    """`out` as JSON would carry it: what the tests compared before."""
    return json.loads(json.dumps(out))


# -- data parallel training against one device (test_distributed.py) -----------


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
            return super().reduce_implementation(
                reduce_op, per_replica_value, destinations, options
            )


def max_diff(a, b):
    return float(max(np.abs(u - v).max() for u, v in zip(a.get_weights(), b.get_weights())))


def history_diff(ha, hb):
    return float(
        max(np.abs(np.array(ha.history[k]) - np.array(hb.history[k])).max() for k in ha.history)
    )


def checks(n_replicas):
    """Training under a MirroredStrategy of `n_replicas` replicas against one
    device (test_distributed.py asserts)."""
    reductions = CountingReductions()
    # A strategy of its own: its cross-device ops count the reductions.
    strategy = new_mirrored(n_replicas, cross_device_ops=reductions)
    # Global micro-batch 8 (4 per replica), N=4: windows of 4, 4 and 2
    # micro-batches, the last of 8 and 4 samples (2 per replica).
    x, y = make_data(76)
    val = make_data(20, seed=3)
    fit = dict(epochs=2, shuffle=False, verbose=0, validation_data=val)
    out = {"replicas": n_replicas, "weights": {}, "history": {}}

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
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "m.weights.h5")
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
        plain.fit(
            x, y, batch_size=batch, epochs=epoch + 1, initial_epoch=epoch, shuffle=False, verbose=0
        )
    with strategy.scope():
        acc = functional(AccumModel)
        acc.compile(OPTIMIZERS["adam"](), loss())
    acc.fit(
        x,
        y,
        batch_size=8,
        epochs=3,
        shuffle=False,
        verbose=0,
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
    for replica in range(n_replicas):
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
            "replicas_differ": float(
                max(np.abs(c.numpy() - r[0].numpy()).max() for r in replicas for c in r)
            ),
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
    return _plain(out)


# -- the noise scale (test_noise_scale.py) ---------------------------------------

# Global batch 16 (8 per replica) on 92 samples: the last batch is 12 (6
# per replica); uneven windows.
NOISE_N, NOISE_BATCH = 92, 16
NOISE_CONFIGS = {
    "step mode": dict(accum_steps=4),
    "micro_batch_size": dict(micro_batch_size=4),
    "both": dict(accum_steps=2, micro_batch_size=4),
    # No step runs out of memory: each replica's share is one micro-batch.
    "auto": dict(accum_steps=2, micro_batch_size="auto"),
}


def noise_checks(replicas):
    """The noise scale under a MirroredStrategy of `replicas` replicas, and
    the estimator on per-example gradients (test_noise_scale.py asserts)."""
    strategy = mirrored(replicas)
    out = {"replicas": replicas, "estimates": {}, "identical": {}}
    regression = regression_data(NOISE_N, noise=1.0)
    # "sparse": an Embedding's gradient (IndexedSlices) of a 500-row table,
    # whose rows are summed before its norm (most seen once per window).
    sparse = embedding_data(NOISE_N, vocab=500)
    for name, kwargs in {**NOISE_CONFIGS, "sparse": dict(accum_steps=4)}.items():
        x, y = sparse if name == "sparse" else regression
        with strategy.scope():
            if name == "sparse":
                model = embedding_net(AccumModel, 500, noise_scale=True, **kwargs)
            else:
                model = regression_net(AccumModel, noise_scale=True, **kwargs)
        history = model.fit(x, y, batch_size=NOISE_BATCH, epochs=2, shuffle=False, verbose=0)
        grads = per_example_gradients(model, x, y)
        windows = windows_of(
            NOISE_N,
            NOISE_BATCH,
            kwargs.get("accum_steps", 1),
            None if kwargs.get("micro_batch_size") == "auto" else kwargs.get("micro_batch_size"),
            replicas=replicas,
        )
        out["estimates"][name] = {
            "logged": history.history["noise_scale"],
            "expected": estimate(grads, windows) if max(map(len, windows)) > 1 else None,
            "last": model.noise_scale,
        }

    # Measuring changes nothing: Adam, metrics, uneven windows.
    xc, yc = make_data(NOISE_N)
    for name, kwargs in NOISE_CONFIGS.items():
        runs = []
        for noise_scale in (True, False):
            with strategy.scope():
                model = functional(AccumModel, noise_scale=noise_scale, **kwargs)
                model.compile(
                    keras.optimizers.Adam(0.01),
                    "sparse_categorical_crossentropy",
                    metrics=["accuracy"],
                )
            history = model.fit(xc, yc, batch_size=NOISE_BATCH, epochs=2, shuffle=False, verbose=0)
            runs.append((model, history.history))
        (on, h_on), (off, h_off) = runs
        out["identical"][name] = {
            "weights": all(
                np.array_equal(a, b) for a, b in zip(on.get_weights(), off.get_weights())
            ),
            "history": all(h_on[k] == h_off[k] for k in h_off),
            "iterations": [int(m.optimizer.iterations.numpy()) for m in (on, off)],
            "noise_scale": h_on["noise_scale"],
        }
    out["schedule"] = schedule_run(strategy)
    out["schedule_probe"] = schedule_run(strategy, probe=True)
    return _plain(out)


# The noise-scale schedule's run (test_noise_scale.py replays it on a plain
# model): every 3 updates, the rate by sqrt(batch).
SCHEDULE_N, SCHEDULE_MICRO, SCHEDULE_TUNED = 344, 8, 0.05


def schedule_run(strategy, probe=False):
    """`AccumScheduler("noise_scale")` under `strategy`: its decisions and
    the trained weights. With `probe`, deciding on a probe where the window
    is outgrown, and the probe's estimate at the trained weights under the
    strategy and on one device."""
    x, y = regression_data(SCHEDULE_N, noise=4.0)
    with strategy.scope():
        model = regression_net(AccumModel, accum_steps=2, noise_scale=True)
        model.compile(keras.optimizers.Adam(SCHEDULE_TUNED), "mse")
    held = regression_data(512, noise=4.0, seed=5) if probe else None
    scheduler = AccumScheduler(
        "noise_scale",
        max_accum_steps=12,
        every_updates=3,
        learning_rate_rule="sqrt",
        probe=held,
        probe_windows=4 if probe else None,
    )
    model.fit(
        x, y, batch_size=SCHEDULE_MICRO, epochs=3, shuffle=False, verbose=0, callbacks=[scheduler]
    )
    out = {
        "path": [(d.updates, d.accum_steps, d.learning_rate) for d in scheduler.path],
        "probed": [d.probed for d in scheduler.path],
        "samples": [d.samples for d in scheduler.path],
        "weights": [w.tolist() for w in model.get_weights()],
        "iterations": int(model.optimizer.iterations.numpy()),
    }
    if probe:
        from keras_accum.growth.probe import NoiseProbe

        one_device = regression_net(AccumModel, accum_steps=2, noise_scale=True)
        one_device.set_weights(model.get_weights())
        measure = NoiseProbe(held, windows=4).measure
        out["probe_values"] = [measure(m, SCHEDULE_MICRO).value for m in (model, one_device)]
    return out


# -- embeddings (test_sparse.py, test_small_tables.py) ---------------------------


def sparse_checks(replicas, small=False, optimizers=("adam", "rmsprop")):
    """Embeddings under a MirroredStrategy of `replicas` replicas, trained
    with each of `optimizers`; with `small`, the small-tables model (windows
    kept as per-row moments), also split by `micro_batch_size` (a replica's
    per-row sums over its share). Largest weight differences (test_sparse.py
    and test_small_tables.py assert)."""
    micro, n = 8, 4
    net = small_tables_net if small else text_net
    strategy = mirrored(replicas)
    # Global micro-batch 8 (4 per replica), N=4: windows of 4, 4 and 2
    # micro-batches, the last of 8 and 4 samples.
    x, y = small_table_data(92) if small else token_data(76)
    fit = dict(epochs=2, shuffle=False, verbose=0)
    out = {}
    for name in optimizers:
        one_device = net()
        one_device.compile(OPTIMIZERS[name](), loss())
        one_device.fit(x, y, batch_size=micro * n, **fit)
        with strategy.scope():
            plain = net()
            plain.compile(OPTIMIZERS[name](), loss())
            accum = net(AccumModel, accum_steps=n)
            accum.compile(OPTIMIZERS[name](), loss())
        try:
            plain.fit(x, y, batch_size=micro * n, **fit)
            accum.fit(x, y, batch_size=micro, **fit)
        except ValueError as error:
            # Keras 3.8's own sparse update of a gradient reduced across
            # replicas fails (`values_for_union` on a partly unknown shape),
            # the plain model's as ours: reported, and the test allows it on
            # that Keras only.
            out[f"{name}_error"] = str(error)
            try:
                accum.fit(x, y, batch_size=micro, **fit)
            except ValueError as accum_error:
                out[f"{name}_accum_error"] = str(accum_error)
            continue
        out[f"{name}_vs_one_device_big_batch"] = max_diff(one_device, accum)
        out[f"{name}_vs_mirrored_big_batch"] = max_diff(plain, accum)
        if small:
            # Each replica splits its share of a batch of 32 (the last of 28:
            # 14 a replica, 4 + 4 + 4 + 2) into micro-batches of 4, more
            # tokens than the 2- and 7-row tables have rows: row sums.
            with strategy.scope():
                split = net(AccumModel, micro_batch_size=4)
                split.compile(OPTIMIZERS[name](), loss())
            split.fit(x, y, batch_size=micro * n, **fit)
            out[f"{name}_micro_batch_size_vs_one_device_big_batch"] = max_diff(one_device, split)
    return _plain(out)


# -- BackupAndRestore and mid-window saves (test_fault_tolerance.py) -------------


def interrupt():
    """Ctrl-C in the second epoch, after 6 micro-batches (a window half done)."""
    return InterruptAt(1, 5)


def _fit(model, x, y, epochs, callbacks=()):
    return model.fit(
        x, y, batch_size=8, epochs=epochs, shuffle=False, verbose=0, callbacks=list(callbacks)
    )


def backup_checks(replicas, directory):
    """BackupAndRestore and a mid-window save under a MirroredStrategy of
    `replicas` replicas, files in `directory` (test_fault_tolerance.py
    asserts)."""
    strategy = mirrored(replicas)
    x, y = make_data(92)  # global micro-batch 8 (4 per replica), N=4

    def compiled():
        with strategy.scope():
            model = functional(keras_accum.AccumModel, accum_steps=4)
            model.compile(OPTIMIZERS["adam"](), loss())
        return model

    out = {}
    backup = keras_accum.BackupAndRestore(os.path.join(directory, "backup"))
    try:
        _fit(compiled(), x, y, 3, [interrupt(), backup])
    except KeyboardInterrupt:
        pass
    model = compiled()
    out["epochs_resumed"] = len(_fit(model, x, y, 3, [backup]).history["loss"])
    out["interrupted"] = [w.tolist() for w in model.get_weights()]

    # A backup every 5 batches: 3 batches into the second epoch, skipped.
    backup = keras_accum.BackupAndRestore(os.path.join(directory, "batches"), save_freq=5)
    try:
        _fit(compiled(), x, y, 3, [interrupt(), backup])
    except KeyboardInterrupt:
        pass
    model = compiled()
    out["epochs_resumed_batches"] = len(_fit(model, x, y, 3, [backup]).history["loss"])
    out["batch_level"] = [w.tolist() for w in model.get_weights()]

    model = compiled()
    try:
        _fit(model, x, y, 3, [interrupt()])
    except KeyboardInterrupt:
        pass
    path = os.path.join(directory, "mid.weights.h5")
    model.save_weights(path)
    model = compiled()
    with strategy.scope():
        model.optimizer.build(model.trainable_variables)
    model.load_weights(path)
    out["pending_loaded"] = internals.pending(model)
    _fit(model, x[48:], y[48:], 1)  # the rest of the second epoch
    _fit(model, x, y, 1)  # the third
    out["saved_mid_window"] = [w.tolist() for w in model.get_weights()]
    return _plain(out)
