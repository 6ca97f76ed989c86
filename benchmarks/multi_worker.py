"""Two-worker timing: AccumModel at accum_steps=1 and at N, epoch by epoch.

Started by `benchmarks.run` as each of two worker processes on localhost,
with TF_CONFIG set (see `run.run_workers`):

    python -m benchmarks.multi_worker --rounds 8 --json out.json

Under MultiWorkerMirroredStrategy every optimizer update all-reduces the
gradients across workers. With a model whose parameters are large next to
its compute (wide dense layers, a small micro-batch), that all-reduce
dominates an epoch at accum_steps=1; at accum_steps=N it happens N times
less often. Both settings are trained in this process, one epoch each per
round in rotated order, on the same data. Writes per-epoch times as JSON.

With `--auto`, the settings are instead `micro_batch_size="auto"` (never
running out of memory here, so training whole per-replica batches) and the
integer `micro_batch_size` of that same size, each at accum_steps=1 and at
N: what auto mode's per-step agreement across workers costs, paired epoch
by epoch (benchmarks/auto_multi_worker.py reports it).
"""

import argparse
import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # quiet TensorFlow start-up

import numpy as np  # noqa: E402

from benchmarks import workloads  # noqa: E402
from benchmarks.timing import _epoch_timer  # noqa: E402

GLOBAL_MICRO_BATCH = 16  # over both workers: 8 per replica


def sizes(quick):
    """(input features, hidden width, micro-batches per epoch)."""
    return (32, 64, 16) if quick else (512, 1536, 48)


def settings_of(auto):
    """{name: AccumModel arguments} of the settings compared."""
    n = workloads.ACCUM_STEPS
    if not auto:
        return {"1": dict(accum_steps=1), str(n): dict(accum_steps=n)}
    per_replica = GLOBAL_MICRO_BATCH // 2
    return {
        f"{per_replica}_accum_1": dict(accum_steps=1, micro_batch_size=per_replica),
        "auto_accum_1": dict(accum_steps=1, micro_batch_size="auto"),
        f"{per_replica}_accum_{n}": dict(accum_steps=n, micro_batch_size=per_replica),
        f"auto_accum_{n}": dict(accum_steps=n, micro_batch_size="auto"),
    }


def run(rounds, quick, auto=False):
    import keras
    import tensorflow as tf

    import keras_accum

    # Two workers share this machine's cores: one thread each for ops, as
    # one worker per core would run, instead of both oversubscribing them.
    tf.config.threading.set_intra_op_parallelism_threads(1)
    strategy = tf.distribute.MultiWorkerMirroredStrategy()  # reads TF_CONFIG
    features, width, steps = sizes(quick)
    rng = np.random.default_rng(workloads.SEED)
    x = rng.normal(size=(steps * GLOBAL_MICRO_BATCH, features)).astype("float32")
    y = workloads._labels(rng, len(x))
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    data = (
        tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_MICRO_BATCH).with_options(options)
    )

    arguments = settings_of(auto)
    settings = tuple(arguments)
    models = {}
    for setting in settings:
        keras.utils.set_random_seed(workloads.SEED)
        with strategy.scope():
            inputs = keras.Input((features,))
            hidden = keras.layers.Dense(width, activation="relu")(inputs)
            hidden = keras.layers.Dense(width, activation="relu")(hidden)
            outputs = keras.layers.Dense(10)(hidden)
            model = keras_accum.AccumModel(inputs, outputs, **arguments[setting])
            model.compile(
                keras.optimizers.Adam(workloads.LEARNING_RATE),
                keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            )
        models[setting] = model

    seconds = {n: [] for n in settings}
    updates = {}
    for round_index in range(rounds):
        order = settings if round_index % 2 == 0 else settings[::-1]
        for setting in order:
            model = models[setting]
            timer = _epoch_timer()
            before = int(model.optimizer.iterations.numpy())
            model.fit(data, epochs=1, verbose=0, shuffle=False, callbacks=[timer])
            updates[setting] = int(model.optimizer.iterations.numpy()) - before
            seconds[setting].append(timer.seconds[0])
        label = "micro_batch_size / accum_steps " if auto else "accum_steps="
        print(
            f"  two workers round {round_index + 1}/{rounds}: "
            + ", ".join(f"{label}{n} {seconds[n][-1]:.3f}s" for n in settings),
            flush=True,
        )
    return {
        "workers": strategy.num_replicas_in_sync,
        "global_micro_batch": GLOBAL_MICRO_BATCH,
        "micro_batches_per_epoch": steps,
        "parameters": int(models[settings[0]].count_params()),
        "description": f"MLP {features}-{width}-{width}-10, global micro-batch "
        f"{GLOBAL_MICRO_BATCH} ({GLOBAL_MICRO_BATCH // strategy.num_replicas_in_sync} per worker)",
        "updates_per_epoch": updates,
        "rounds": rounds,
        "seconds": seconds,
        "chosen": {n: m.chosen_micro_batch_size for n, m in models.items() if "auto" in n},
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, required=True)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--auto", action="store_true", help="auto against integer micro-batches")
    parser.add_argument("--json", required=True, help="where to write the result")
    args = parser.parse_args(argv)
    result = run(args.rounds, args.quick, args.auto)
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
