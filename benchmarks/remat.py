"""Rematerialisation next to micro-batching: peak memory and time per step.

    python -m benchmarks.remat            # writes benchmarks/remat.md and remat.json
    python -m benchmarks.remat --quick --out /tmp/remat   # smoke run, not a measurement

Four ways to train each workload with the same updates, on batches of
B = N*b samples. The workloads: `cnn`, the architecture of
benchmarks/workloads.py's memory CNN (three 3x3 convolutions at full and
halved resolutions, pooling between, global pooling, a Dense layer), and
`ffn`, two Transformer feed-forward blocks (`x + W2 gelu(W1 x)`, each one
layer whose hidden activations are 8 times wider than its input):

- big batch: `keras.Model`, the whole batch in one forward and backward pass;
- micro_batch_size=b: `keras_accum.AccumModel(micro_batch_size=b)`, the
  batch split into N micro-batches inside the step;
- remat: the big batch with its layers made inside
  `keras.RematScope("larger_than", ...)`: every layer whose output is
  larger than the threshold (the convolutions and poolings, or the
  feed-forward blocks; not the global pooling or the Dense layer)
  recomputes its call in the backward pass instead of keeping what it
  computed in the forward pass;
- remat + micro_batch_size=b: both.

Memory (as benchmarks/memory.py measures it): each configuration in a fresh
Python with MALLOC_MMAP_THRESHOLD_ pinned; the peak resident memory that
one `fit` of two updates adds, after the model, its optimizer's slots and
the dataset are made. With `--memory-repeats` above 1, repeated that many
times, interleaved, and the median reported.

Time: the four models in one process, each traced by one epoch of `fit`;
then each round times one step (one update, B samples) of every model, in
an order rotated by one place per round. Only ratios within a round are
used: the median (min-max) over rounds of `config / big batch`, by wall
clock, and the median milliseconds per step. The four models start from the
same weights and train on the same data: their weights after the epoch must
agree (the largest difference is printed and written).
"""

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # quiet TensorFlow start-up

import numpy as np  # noqa: E402

from benchmarks import memory, timing, workloads  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ("big batch", "micro_batch_size=b", "remat", "remat + micro_batch_size=b")
NOTES = {
    "big batch": "keras.Model, batch B",
    "micro_batch_size=b": "keras_accum.AccumModel(micro_batch_size=b), batch B split into N inside the step",
    "remat": "keras.Model, batch B, layers made in keras.RematScope('larger_than')",
    "remat + micro_batch_size=b": "keras_accum.AccumModel(micro_batch_size=b), layers made in the same scope",
}
# Per workload, (size, width, micro-batch b, N): B = N*b. cnn: images of
# size x size, `width` channels; ffn: sequences of `size` tokens of `width`
# features, hidden layers 8 x wider.
SIZES = {
    "cnn": {"full": (64, 32, 16, 8), "quick": (16, 8, 4, 4)},
    "ffn": {"full": (128, 64, 16, 8), "quick": (16, 8, 4, 4)},
}
WORKLOADS = tuple(SIZES)


def sizes(workload, quick):
    size, width, micro, steps = SIZES[workload]["quick" if quick else "full"]
    return size, width, micro, steps, micro * steps


def data(workload, quick):
    size, width, _, _, big = sizes(workload, quick)
    rng = np.random.default_rng(workloads.SEED)
    samples = 2 * big  # two updates
    shape = (size, size, 3) if workload == "cnn" else (size, width)
    x = rng.random((samples, *shape), dtype=np.float32)
    return x, rng.integers(0, 10, samples)


def _feed_forward_class():
    import keras

    class FeedForward(keras.layers.Layer):
        """A Transformer's feed-forward block, `x + W2 gelu(W1 x)`, as one
        layer: its hidden activations (8 x wider than its input and output)
        are what rematerialising it does not keep."""

        def __init__(self, width, **kwargs):
            super().__init__(**kwargs)
            # The block is rematerialised as a whole; its Dense layers,
            # whose call takes `training`, cannot be on TensorFlow
            # (keras-team/keras#21207).
            with keras.RematScope(mode=None):
                self.up = keras.layers.Dense(8 * width, activation="gelu")
                self.down = keras.layers.Dense(width)

        def call(self, inputs):
            return inputs + self.down(self.up(inputs))

    return FeedForward


def _cnn(keras, size, width):
    layers = keras.layers
    inputs = keras.Input((size, size, 3))
    x = layers.Conv2D(width, 3, padding="same", activation="relu")(inputs)
    x = layers.MaxPooling2D()(x)
    x = layers.Conv2D(width, 3, padding="same", activation="relu")(x)
    x = layers.MaxPooling2D()(x)
    x = layers.Conv2D(2 * width, 3, padding="same", activation="relu")(x)
    x = layers.GlobalAveragePooling2D()(x)
    return inputs, layers.Dense(10)(x)


def _ffn(keras, size, width):
    feed_forward = _feed_forward_class()
    inputs = keras.Input((size, width))
    x = feed_forward(width)(inputs)
    x = feed_forward(width)(x)
    x = keras.layers.GlobalAveragePooling1D()(x)
    return inputs, keras.layers.Dense(10)(x)


def make_model(config, workload, quick):
    """The compiled model of `config`, from the benchmark's seed."""
    import keras

    import keras_accum

    size, width, micro, _, big = sizes(workload, quick)
    # Counts the batch, as Keras does: above the global pooling's and the
    # Dense layer's outputs at the big batch (a Dense call, which takes
    # `training`, cannot be rematerialised on TensorFlow:
    # keras-team/keras#21207), below every other layer's at the micro-batch.
    threshold = big * max(10, 2 * width)
    keras.utils.set_random_seed(workloads.SEED)
    remat = config.startswith("remat")
    scope = keras.RematScope("larger_than", output_size_threshold=threshold) if remat else None
    if scope is not None:
        scope.__enter__()
    try:
        inputs, outputs = (_cnn if workload == "cnn" else _ffn)(keras, size, width)
    finally:
        if scope is not None:
            scope.__exit__(None, None, None)
    if config.endswith("micro_batch_size=b"):
        model = keras_accum.AccumModel(inputs, outputs, micro_batch_size=micro)
    else:
        model = keras.Model(inputs, outputs)
    model.compile(
        optimizer=keras.optimizers.Adam(workloads.LEARNING_RATE),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def measure_memory(config, workload, quick):
    """The peak RSS growth of one `fit` of `config` (benchmarks/memory.py's
    method); run in a fresh process."""
    import tensorflow as tf

    _, _, _, _, big = sizes(workload, quick)
    model = make_model(config, workload, quick)
    model.optimizer.build(model.trainable_variables)
    x, y = data(workload, quick)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(big)
    result = memory.fit_peak_growth(lambda: model.fit(dataset, epochs=1, shuffle=False, verbose=0))
    return {**result, "updates": int(model.optimizer.iterations.numpy())}


def _memory_in_fresh_process(config, workload, quick, out):
    command = [
        sys.executable,
        "-m",
        "benchmarks.remat",
        "--memory-worker",
        config,
        "--workloads",
        workload,
        "--json",
        str(out),
    ] + (["--quick"] if quick else [])
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "PYTHONPATH": str(ROOT)}
    subprocess.run(command, cwd=ROOT, env=env, check=True, timeout=900)
    return json.loads(Path(out).read_text())


def measure_time(workload, rounds, quick):
    """Paired step times of the four models in this process."""
    _, _, _, _, big = sizes(workload, quick)
    x, y = data(workload, quick)
    models = {config: make_model(config, workload, quick) for config in CONFIGS}
    for model in models.values():  # traced; the same updates for all
        model.fit(x, y, batch_size=big, epochs=1, shuffle=False, verbose=0)
    reference = models["big batch"].get_weights()
    difference = max(
        float(np.max(np.abs(a - b)))
        for model in models.values()
        for a, b in zip(reference, model.get_weights())
    )
    seconds = timing.paired_train_steps(models, x, y, big, rounds)
    return seconds, difference


def _summary(values):
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "rounds": len(values),
    }


DESCRIPTIONS = {
    "cnn": "CNN on {size}x{size}x3 images, 3 conv layers ({width}/{width}/{width2} channels, "
    "max pooling between) + global pooling + Dense 10",
    "ffn": "two feed-forward blocks (x + W2 gelu(W1 x), hidden {width8} wide, each one layer) "
    "on {size} tokens of {width} features + global pooling + Dense 10",
}


def report(results):
    first = next(iter(results.values()))
    lines = [
        "# Rematerialisation next to micro-batching",
        "",
        f"Written by `python -m benchmarks.remat` on {first['date']} (Keras "
        f"{first['keras']}, TensorFlow {first['tensorflow']}, {first['cpus']} CPU cores).",
        "",
    ]
    for workload, result in results.items():
        lines += _workload_report(workload, result)
    return "\n".join(lines)


def _workload_report(workload, result):
    size, width, micro, steps, big = result["sizes"]
    description = DESCRIPTIONS[workload].format(
        size=size, width=width, width2=2 * width, width8=8 * width
    )
    lines = [
        f"## {workload}",
        "",
        f"{description}, Adam; batches of B = {big} = N*b ({steps} x {micro}), one update per batch.",
        "",
        "| configuration | what | peak memory of fit (MiB) | vs big batch | time per step (ms) "
        "| vs big batch, paired (min-max) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    base_memory = result["memory"]["big batch"]["median"]
    for config in CONFIGS:
        mem = result["memory"][config]
        ratio = result["time_ratio"][config]
        lines.append(
            f"| {config} | {NOTES[config]} | {mem['median']:.0f} ({mem['min']:.0f}-{mem['max']:.0f}) "
            f"| {mem['median'] / base_memory:.2f} | {result['time_ms'][config]['median']:.0f} "
            f"| {ratio['median']:.2f} ({ratio['min']:.2f}-{ratio['max']:.2f}) |"
        )
    lines += [
        "",
        "Memory: the peak resident memory one `fit` of two updates adds, "
        + (
            f"median of {result['memory_repeats']} fresh processes each (min-max)"
            if result["memory_repeats"] > 1
            else "in a fresh process of its own"
        )
        + f". Time: "
        f"{result['rounds']} rounds, one step of every model per round in a rotated order; "
        "the ratio is each round's time over the big batch's in the same round.",
        f"The four models' weights after one epoch differ by at most "
        f"{result['max_weight_difference']:.1e}: the same training.",
        "",
    ]
    return lines


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--memory-repeats", type=int, default=1)
    parser.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    parser.add_argument(
        "--out", default=str(ROOT / "benchmarks"), help="folder for remat.md and remat.json"
    )
    parser.add_argument("--memory-worker", choices=CONFIGS, help=argparse.SUPPRESS)
    parser.add_argument("--json", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    import keras

    if not hasattr(keras, "RematScope"):
        sys.exit(
            f"benchmarks.remat needs keras.RematScope (Keras >= 3.9); this is Keras {keras.__version__}"
        )
    if args.memory_worker:
        (workload,) = args.workloads
        Path(args.json).write_text(
            json.dumps(measure_memory(args.memory_worker, workload, args.quick))
        )
        return

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    readings = {w: {config: [] for config in CONFIGS} for w in args.workloads}
    for repeat in range(args.memory_repeats):
        for workload in args.workloads:
            for config in CONFIGS:
                print(
                    f"memory {workload} {config} ({repeat + 1}/{args.memory_repeats}, "
                    "fresh process)",
                    flush=True,
                )
                reading = _memory_in_fresh_process(
                    config, workload, args.quick, out / "remat_memory.json"
                )
                readings[workload][config].append(reading["growth_mib"])
    (out / "remat_memory.json").unlink()

    import tensorflow as tf

    results = {}
    for workload in args.workloads:
        print(f"time {workload}: {args.rounds} rounds", flush=True)
        seconds, difference = measure_time(workload, args.rounds, args.quick)
        results[workload] = {
            "date": datetime.date.today().isoformat(),
            "keras": keras.__version__,
            "tensorflow": tf.__version__,
            "cpus": os.cpu_count(),
            "sizes": sizes(workload, args.quick),
            "quick": args.quick,
            "rounds": args.rounds,
            "memory_repeats": args.memory_repeats,
            "memory": {c: {**_summary(v), "readings": v} for c, v in readings[workload].items()},
            "time_ms": {c: _summary([s * 1000 for s in v]) for c, v in seconds.items()},
            "time_ratio": {
                c: _summary([a / b for a, b in zip(v, seconds["big batch"])])
                for c, v in seconds.items()
            },
            "max_weight_difference": difference,
        }
    (out / "remat.json").write_text(json.dumps(results, indent=1))
    text = report(results)
    (out / "remat.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
