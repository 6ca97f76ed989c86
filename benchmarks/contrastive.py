"""A contrastive batch of B samples at micro-batch b: memory and time.

    python -m benchmarks.contrastive            # writes benchmarks/contrastive.md and .json
    python -m benchmarks.contrastive --quick --out /tmp   # smoke run, not a measurement

A two-tower model (two MLP encoders, in-batch softmax over the batch's
items) trained four ways:

- big batch: `keras.Model`, batches of B, one forward and backward pass;
- coupled_from, b: `AccumModel(micro_batch_size=b, coupled_from=[...])`,
  batches of B: the big batch's training (weights compared below), the
  encoders twice per micro-batch;
- plain at b: `keras.Model` at batches of b: the memory the issue holds the
  coupled step to ("within 1.2x of plain training at b, plus the
  representations"); a different training;
- ordinary micro-batching, b: `AccumModel(micro_batch_size=b)`, batches of
  B: each micro-batch's own negatives, a different training; for its time.

Also: the encoders' forward pass over B samples in micro-batches of b, no
tape, timed (what `coupled_from` adds to ordinary micro-batching); the
floor, timed: the two-pass method and the big batch each written bare, one
`tf.function` with Adam's update and nothing else; and the big batch, `coupled_from`
and ordinary micro-batching under XLA (`jit_compile=True`, Keras's default
on one GPU), memory and time, against the big batch under XLA.

Memory: each configuration in a fresh Python, the most tensor memory one
`fit` of two updates holds at once above what it starts with, from
TensorFlow's allocator statistics (`memory.tensor_peak`), after one update
has traced the step: a split step's graph, unrolled over its micro-batches
(twice with `coupled_from`), is many times a plain step's, and resident
memory would count it. Time: the models
in one process, each traced by one epoch; each round times one step of
every model in a rotated order; the ratio to the big batch within a round,
median (min-max) over rounds.
"""

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402

from benchmarks import memory, timing  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ("big batch", "coupled_from, b", "plain at b", "ordinary micro-batching, b")
# (features, width, depth, representation, B, b)
SIZES = {"full": (256, 1024, 3, 128, 4096, 256), "quick": (16, 32, 1, 8, 64, 16)}
TOWERS = ["query_repr", "item_repr"]


def _loss_class():
    import keras
    import tensorflow as tf

    class InBatchSoftmax(keras.losses.Loss):
        def call(self, y_true, y_pred):
            labels = tf.range(tf.shape(y_pred)[0])
            return keras.losses.sparse_categorical_crossentropy(labels, y_pred, from_logits=True)

    return InBatchSoftmax


def make_model(config, quick, jit_compile="auto"):
    import keras
    import tensorflow as tf

    import keras_accum

    features, width, depth, dim, _, micro = SIZES["quick" if quick else "full"]
    keras.utils.set_random_seed(0)
    queries, items = keras.Input((features,)), keras.Input((features,))
    towers = []
    for name, h in (("query_repr", queries), ("item_repr", items)):
        for _ in range(depth):
            h = keras.layers.Dense(width, activation="relu")(h)
        # No bias on the items: the loss is blind to a shift of every item
        # alike, a zero gradient that Adam would turn float noise into.
        towers.append(keras.layers.Dense(dim, use_bias=name == "query_repr", name=name)(h))
    scores = keras.layers.Lambda(lambda t: tf.matmul(t[0], t[1], transpose_b=True))(towers)
    if config in ("big batch", "plain at b"):
        model = keras.Model([queries, items], scores)
    elif config == "coupled_from, b":
        model = keras_accum.AccumModel(
            [queries, items], scores, micro_batch_size=micro, coupled_from=TOWERS
        )
    else:
        model = keras_accum.AccumModel([queries, items], scores, micro_batch_size=micro)
    model.compile(keras.optimizers.Adam(1e-3), _loss_class()(), jit_compile=jit_compile)
    return model


def data(quick):
    features, _, _, _, big, _ = SIZES["quick" if quick else "full"]
    rng = np.random.default_rng(0)
    n = 2 * big
    x = rng.normal(size=(n, features)).astype("float32")
    items = (x @ rng.normal(size=(features, features)) / np.sqrt(features)).astype("float32")
    return [x, items], np.zeros((n,), "float32")


def batch_of(config, quick):
    _, _, _, _, big, micro = SIZES["quick" if quick else "full"]
    return micro if config == "plain at b" else big


def measure_memory(name, quick):
    import tensorflow as tf

    config = XLA.get(name, name)
    model = make_model(config, quick, jit_compile=name in XLA)
    model.optimizer.build(model.trainable_variables)
    x, y = data(quick)
    batch = batch_of(config, quick)
    if config == "plain at b":  # two updates, as the others
        x, y = [t[: 2 * batch] for t in x], y[: 2 * batch]
    dataset = tf.data.Dataset.from_tensor_slices((tuple(x), y)).batch(batch)
    # Traced first (one update): an unrolled split step's graph is many
    # times a plain step's, and what is measured is the step's tensors.
    model.fit(dataset.take(1), epochs=1, shuffle=False, verbose=0)
    return memory.tensor_peak(lambda: model.fit(dataset, epochs=1, shuffle=False, verbose=0))


def _memory_in_fresh_process(config, quick, out):
    command = [
        sys.executable,
        "-m",
        "benchmarks.contrastive",
        "--memory-worker",
        config,
        "--json",
        str(out),
    ] + (["--quick"] if quick else [])
    env = {**os.environ, "TF_CPU_ALLOCATOR_USE_BFC": "true", "PYTHONPATH": str(ROOT)}
    subprocess.run(command, cwd=ROOT, env=env, check=True, timeout=1800)
    return json.loads(Path(out).read_text())


# The second forward pass alone (timed), and the steps under XLA (Keras's
# default on one GPU), each against the big batch under XLA.
SECOND_FORWARD = "the encoders' forward pass, micro-batches of b (no tape)"
XLA = {
    "big batch, XLA": "big batch",
    "coupled_from, b, XLA": "coupled_from, b",
    "ordinary micro-batching, b, XLA": "ordinary micro-batching, b",
}


# The floor: the step written bare, one `tf.function` with Adam's update and
# nothing else (no Keras loss tracking, no metrics, no keras_accum), the
# two-pass method against the big batch written the same way.
BARE = {"two passes, bare": "gradcache", "big batch, bare": "big"}


def baseline_of(name):
    if name in BARE:
        return "big batch, bare"
    return "big batch, XLA" if name in XLA else "big batch"


class SecondForward:
    """What `coupled_from` adds to ordinary micro-batching: the encoders'
    forward pass over the batch, micro-batch by micro-batch, no tape; timed
    as a model's `train_function` is."""

    def __init__(self, model, quick):
        import keras
        import tensorflow as tf

        _, _, _, _, big, micro = SIZES["quick" if quick else "full"]
        encoders = keras.Model(model.inputs, [model.get_layer(n).output for n in TOWERS])

        @tf.function
        def forward(iterator):
            (queries, items), _ = next(iterator)
            total = tf.constant(0.0)
            for start in range(0, big, micro):
                reps = encoders(
                    [queries[start : start + micro], items[start : start + micro]], training=True
                )
                total += tf.add_n([tf.reduce_sum(r) for r in reps])
            return {"loss": total}

        self.train_function = forward


class Bare:
    """The big batch's step (`kind="big"`) or the two-pass method's
    (`kind="gradcache"`: representations per micro-batch without a tape,
    the similarity and loss on the whole batch, each micro-batch again
    backpropagating its rows), in one `tf.function` with the optimizer's
    update; timed as a model's `train_function` is."""

    def __init__(self, model, kind, quick):
        import keras
        import tensorflow as tf

        _, _, _, _, big, micro = SIZES["quick" if quick else "full"]
        encoders = keras.Model(model.inputs, [model.get_layer(n).output for n in TOWERS])
        variables = encoders.trainable_variables
        loss_fn = _loss_class()()
        optimizer = model.optimizer

        def loss_of(reps, y):
            logits = tf.matmul(reps[0], reps[1], transpose_b=True)
            return tf.reduce_mean(loss_fn.call(y, logits))

        @tf.function
        def big_batch(iterator):
            x, y = next(iterator)
            with tf.GradientTape() as tape:
                loss = loss_of(encoders(list(x), training=True), y)
            optimizer.apply(tape.gradient(loss, variables), variables)
            return {"loss": loss}

        @tf.function
        def two_passes(iterator):
            (queries, items), y = next(iterator)
            parts = [[queries[s : s + micro], items[s : s + micro]] for s in range(0, big, micro)]
            reps = [[tf.stop_gradient(r) for r in encoders(p, training=True)] for p in parts]
            whole = [tf.concat(r, 0) for r in zip(*reps)]
            with tf.GradientTape() as tape:
                tape.watch(whole)
                loss = loss_of(whole, y)
            upstream = tape.gradient(loss, whole)
            grads = None
            for k, part in enumerate(parts):
                with tf.GradientTape() as tape:
                    surrogate = tf.add_n(
                        [
                            tf.reduce_sum(r * u[k * micro : (k + 1) * micro])
                            for r, u in zip(encoders(part, training=True), upstream)
                        ]
                    )
                g = tape.gradient(surrogate, variables)
                grads = g if grads is None else [a + b for a, b in zip(grads, g)]
            optimizer.apply(grads, variables)
            return {"loss": loss}

        self.train_function = big_batch if kind == "big" else two_passes


def measure_time(rounds, quick):
    x, y = data(quick)
    models = {config: make_model(config, quick) for config in CONFIGS if config != "plain at b"}
    models.update(
        {name: make_model(config, quick, jit_compile=True) for name, config in XLA.items()}
    )
    for name, model in models.items():
        model.fit(
            x,
            y,
            batch_size=batch_of(XLA.get(name, name), quick),
            epochs=1,
            shuffle=False,
            verbose=0,
        )
    reference = models["big batch"].get_weights()
    difference = max(
        float(np.max(np.abs(a - b)))
        for a, b in zip(reference, models["coupled_from, b"].get_weights())
    )
    models[SECOND_FORWARD] = SecondForward(models["big batch"], quick)
    for name, kind in BARE.items():
        # A model of its own each: they update its weights and optimizer.
        bare = make_model("big batch", quick)
        bare.fit(x, y, batch_size=batch_of("big batch", quick), epochs=1, shuffle=False, verbose=0)
        models[name] = Bare(bare, kind, quick)
    seconds = timing.paired_train_steps(models, x, y, batch_of("big batch", quick), rounds)
    return seconds, difference


def _summary(values):
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def run(rounds, quick, out):
    import keras
    import tensorflow as tf

    features, width, depth, dim, big, micro = SIZES["quick" if quick else "full"]
    result = {
        "date": datetime.date.today().isoformat(),
        "keras": keras.__version__,
        "tensorflow": tf.__version__,
        "cpus": os.cpu_count(),
        "rounds": rounds,
        "sizes": {
            "features": features,
            "width": width,
            "depth": depth,
            "representation": dim,
            "B": big,
            "b": micro,
        },
        # Both towers' representations of a batch, float32.
        "representations_mib": 2 * big * dim * 4 / memory.MIB,
        "similarity_mib": big * big * 4 / memory.MIB,
        "memory": {},
    }
    for index, config in enumerate((*CONFIGS, *XLA)):
        path = out.with_suffix(f".{index}.json")
        result["memory"][config] = _memory_in_fresh_process(config, quick, path)
        path.unlink()
    seconds, difference = measure_time(rounds, quick)
    result["max_weight_difference"] = difference
    result["time_ms"] = {c: _summary([1000 * s for s in v]) for c, v in seconds.items()}
    result["time_ratio"] = {
        c: _summary([a / b for a, b in zip(v, seconds[baseline_of(c)])]) for c, v in seconds.items()
    }
    return result


def report(result):
    s = result["sizes"]
    mem = {c: result["memory"][c]["growth_mib"] for c in CONFIGS}
    lines = [
        "# A contrastive batch at micro-batch b: memory and time",
        "",
        f"Written by `python -m benchmarks.contrastive` on {result['date']} (Keras "
        f"{result['keras']}, TensorFlow {result['tensorflow']}, {result['cpus']} CPU cores).",
        "",
        f"Two towers, each {s['depth']} Dense layers of {s['width']} (ReLU) on {s['features']} "
        f"features and a {s['representation']}-wide representation; in-batch softmax over "
        f"the batch's items; Adam. B = {s['B']}, b = {s['b']}.",
        "",
        "| configuration | peak tensor memory of fit (MiB) | vs plain at b | time per step (ms) "
        "| vs big batch, paired (min-max) |",
        "| --- | --- | --- | --- | --- |",
    ]
    for config in CONFIGS:
        timing = result["time_ms"].get(config)
        ratio = result["time_ratio"].get(config)
        lines.append(
            f"| {config} | {mem[config]:.0f} | {mem[config] / mem['plain at b']:.2f} | "
            + (
                f"{timing['median']:.0f} | {ratio['median']:.2f} ({ratio['min']:.2f}-{ratio['max']:.2f}) |"
                if timing
                else "- | - (batches of b: not the same step) |"
            )
        )
    lines += [
        "",
        "| timed (and XLA) | peak tensor memory of fit (MiB) | time per step (ms) "
        "| vs its big batch, paired (min-max) |",
        "| --- | --- | --- | --- |",
    ]
    for name in (SECOND_FORWARD, *BARE, *XLA):
        timing, ratio = result["time_ms"][name], result["time_ratio"][name]
        peak = result["memory"].get(name)
        lines.append(f"| {name} | {peak['growth_mib']:.0f} | " if peak else f"| {name} | - | ")
        lines[-1] += (
            f"{timing['median']:.0f} | {ratio['median']:.2f} "
            f"({ratio['min']:.2f}-{ratio['max']:.2f}) |"
        )
    floor = (
        result["time_ratio"]["ordinary micro-batching, b"]["median"]
        + result["time_ratio"][SECOND_FORWARD]["median"]
    )
    lines += [
        "",
        f"Ordinary micro-batching plus the second forward pass: {floor:.2f}x the big batch "
        f"(`coupled_from`: {result['time_ratio']['coupled_from, b']['median']:.2f}x). "
        "The bare rows are each step written as one `tf.function` with Adam's update and "
        "nothing else, the two passes against the big batch written so: the floor of the "
        "method on this machine. "
        "The XLA rows are `jit_compile=True`, each against the big batch under XLA.",
        "",
        f"The whole batch's representations take {result['representations_mib']:.1f} MiB and "
        f"its similarity matrix {result['similarity_mib']:.0f} MiB (the coupled part holds it, "
        "its softmax and their gradients on the whole batch, as the big batch does).",
        f"Weights of `coupled_from` after one epoch against the big batch's: largest "
        f"difference {result['max_weight_difference']:.1e}.",
        f"Memory: the most tensor memory one `fit` of two updates holds at once, from "
        "TensorFlow's allocator statistics, in a fresh process per configuration, after a "
        f"first update traced the step. Time: {result['rounds']} rounds, one step of every model per round "
        "in a rotated order.",
        "",
    ]
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--memory-worker", choices=(*CONFIGS, *XLA), help=argparse.SUPPRESS)
    parser.add_argument("--json", help=argparse.SUPPRESS)
    parser.add_argument(
        "--out",
        default=str(ROOT / "benchmarks"),
        help="directory for contrastive.json and contrastive.md",
    )
    args = parser.parse_args(argv)
    if args.memory_worker:
        Path(args.json).write_text(json.dumps(measure_memory(args.memory_worker, args.quick)))
        return
    out = Path(args.out) / "contrastive"
    out.parent.mkdir(parents=True, exist_ok=True)
    result = run(args.rounds, args.quick, out)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    out.with_suffix(".md").write_text(report(result))
    print(report(result))


if __name__ == "__main__":
    main()
