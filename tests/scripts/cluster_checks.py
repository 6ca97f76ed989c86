"""The program of each worker of the test run's one two-worker cluster on
localhost (`cluster` in tests/conftest.py; TF_CONFIG set by it):
MultiWorkerMirroredStrategy needs one process per worker, and each must
start its collectives with the other. One cluster serves every test file
that needs one: test_distributed.py reads `out["distributed"]`,
test_auto_replicas.py `out["auto"]` (`micro_batch_size="auto"` where only
worker `SMALL_TASK` is short of memory: tests/helpers/auto_replicas.py).

Run without TF_CONFIG, it is the one worker of
`MultiWorkerMirroredStrategy()` on its own (one replica), and runs the
distributed checks only.

Prints one JSON object of results (weights as nested lists, histories); the
tests compare them with single-process references and between the workers.
"""

import json
import os
import sys
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
# tests/, for the shared helpers.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import tensorflow as tf  # noqa: E402

strategy = tf.distribute.MultiWorkerMirroredStrategy()

import keras  # noqa: E402
import numpy as np  # noqa: E402

from helpers import coupled, internals  # noqa: E402
from helpers.auto_replicas import AutoRuns  # noqa: E402
from helpers.data import make_data, small_table_data  # noqa: E402
from helpers.models import OPTIMIZERS, functional, loss, small_tables_net  # noqa: E402
from helpers.noise import regression_data, regression_net  # noqa: E402
from keras_accum import AccumModel  # noqa: E402

MICRO_BATCH = 8  # global: 4 per worker


def dataset(x, y, batch=MICRO_BATCH):
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(batch).with_options(options)


def weights(model):
    return [w.tolist() for w in model.get_weights()]


def compiled(accum_steps, optimizer="adam", cls=AccumModel):
    with strategy.scope():
        model = functional(cls, accum_steps=accum_steps) if cls is AccumModel else functional(cls)
        model.compile(OPTIMIZERS[optimizer](), loss(), metrics=["accuracy"])
        # Built now so that `load_weights` restores optimizer state (as in
        # Keras, an unbuilt optimizer skips it).
        model.optimizer.build(model.trainable_variables)
    return model


def distributed(task):
    """Training across workers against one process (test_distributed.py)."""
    out = {"task": task, "replicas": strategy.num_replicas_in_sync}
    train, val = dataset(*make_data(76)), dataset(*make_data(20, seed=3))

    # Plain Keras fit, for the README's claim that it fails here.
    try:
        compiled(1, cls=keras.Model).fit(train, epochs=1, verbose=0)
        out["plain_keras"] = "trained"
    except Exception as error:  # noqa: BLE001 - recorded, asserted by the test
        out["plain_keras"] = f"{type(error).__name__}: {str(error)[:200]}"

    # 76 samples, global micro-batch 8, N=4: windows of 4, 4 and 2 (8 and 4
    # samples) micro-batches per epoch.
    out["fit"] = {}
    for name in ("adam", "sgd_momentum", "adamw"):
        model = compiled(4, name)
        history = model.fit(train, epochs=2, verbose=0, validation_data=val)
        out["fit"][name] = {"weights": weights(model), "history": history.history}
    # evaluate and predict on the last one: every sample, in order.
    out["evaluate"] = model.evaluate(val, verbose=0, return_dict=True)
    out["predict"] = model.predict(train, verbose=0).tolist()
    # numpy input: Keras makes the dataset and shards it the same way.
    model = compiled(4)
    history = model.fit(
        *make_data(76),
        batch_size=MICRO_BATCH,
        epochs=2,
        shuffle=False,
        verbose=0,
        validation_data=make_data(20, seed=3),
    )
    out["numpy"] = {"weights": weights(model), "history": history.history}
    model = compiled(1)
    history = model.fit(train, epochs=2, verbose=0, validation_data=val)
    out["accum_1"] = {"weights": weights(model), "history": history.history}

    # Tables smaller than a window (2, 7, 60 rows): kept as moments, whose
    # statistic buffers every worker makes inside the traced replica step.
    with strategy.scope():
        model = small_tables_net(AccumModel, accum_steps=4)
        model.compile(OPTIMIZERS["adam"](), loss())
    model.fit(dataset(*small_table_data(92)), epochs=2, verbose=0)
    out["small_tables"] = weights(model)

    # The noise scale: measured on every worker alike, training unchanged.
    regression = dataset(*regression_data(92, noise=1.0))
    out["noise_scale"] = {}
    for name, noise_scale, rate in (("on", True, 0.05), ("off", False, 0.05), ("still", True, 0.0)):
        with strategy.scope():
            model = regression_net(AccumModel, accum_steps=4, noise_scale=noise_scale)
            model.compile(keras.optimizers.SGD(rate), "mse")
        history = model.fit(regression, epochs=2, verbose=0)
        out["noise_scale"][name] = {"weights": weights(model), "history": history.history}

    # coupled_from: the representations gathered across workers, the loss
    # on the global batch (test_coupled.py's model: batches of 32, 16 per
    # worker, the last 28; micro-batches of 8).
    with strategy.scope():
        model = coupled.two_tower(
            AccumModel, micro_batch_size=coupled.MICRO, coupled_from=coupled.TOWERS
        )
        model.compile(keras.optimizers.Adam(0.01), coupled.InBatchSoftmax())
    (queries, items), y = coupled.data()
    history = model.fit(
        dataset({"queries": queries, "items": items}, y, batch=coupled.BATCH),
        epochs=coupled.FIT["epochs"],
        verbose=0,
    )
    out["coupled"] = {"weights": weights(model), "history": history.history}

    # skip_nonfinite: a NaN in one worker's share of a micro-batch of the
    # second window (samples 40-43 go to worker 0, 44-47 to worker 1), each
    # worker's in turn: every worker skips the window.
    out["skip"] = {}
    x, y = make_data(76)
    for k in range(strategy.num_replicas_in_sync):
        x_nan = x.copy()
        x_nan[41 + 4 * k, 0] = np.nan
        with strategy.scope():
            model = functional(AccumModel, accum_steps=4, skip_nonfinite=True)
            model.compile(OPTIMIZERS["adam"](), loss())
        history = model.fit(dataset(x_nan, y), epochs=2, verbose=0)
        out["skip"][f"nan_on_worker_{k}"] = {
            "weights": weights(model),
            "skipped": model.skipped_windows,
            "logged": history.history["skipped_windows"],
            "iterations": int(model.optimizer.iterations.numpy()),
        }

    # A checkpoint written after 6 micro-batches (a window half done) on every
    # worker; resumed by a fresh model, and flushed by another.
    # Each worker writes its own file, holding its own share of the window.
    # Saved after micro-batches 6 and 12; 6 is used.
    directory = tempfile.mkdtemp()
    pattern = os.path.join(directory, f"worker{out['task']}-{{batch}}.weights.h5")
    path = pattern.format(batch=6)
    uninterrupted = compiled(4)
    uninterrupted.fit(
        train,
        epochs=1,
        verbose=0,
        callbacks=[keras.callbacks.ModelCheckpoint(pattern, save_weights_only=True, save_freq=6)],
    )
    resumed = compiled(4)
    resumed.load_weights(path)
    out["resumed_pending"] = internals.pending(resumed)
    resumed.fit(train.skip(6), epochs=1, verbose=0)
    out["uninterrupted"], out["resumed"] = weights(uninterrupted), weights(resumed)
    flushed = compiled(4)
    flushed.load_weights(path)
    flushed.flush()
    out["flushed"] = weights(flushed)
    return out


def main():
    config = os.environ.get("TF_CONFIG")
    task = int(json.loads(config)["task"]["index"]) if config else 0
    out = {"distributed": distributed(task)}
    if config:
        # Last: its checks end with one worker's step failing on purpose,
        # which aborts the cluster's collectives.
        small = task == int(os.environ.get("SMALL_TASK", "1"))
        out["auto"] = AutoRuns(strategy, task, small, multi_worker=True).run()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
