"""How precise is the noise scale once it has outgrown training's window?
Training's windows (the estimate a scheduler's decision acts on) against a
fixed probe, both against the exact `B_simple`, on the batch-growth
regression.

    python -m benchmarks.noise_probe            # ~5 min on one core
    python -m benchmarks.noise_probe --quick    # a smoke run, not a measurement

The task is benchmarks/batch_growth.py's (the teacher-student regression,
SGD). A plain student is trained at batch 256 with the rate the committed
sweep found best there, and its weights are kept at CHECKPOINTS updates
(the noise scale grows as the loss falls). At each checkpoint, weights
frozen:

- **exact**: `B_simple = tr(Sigma) / |G|^2` over the 65,536 training
  examples, from per-example gradients (tr with ddof=1);
- **windows of W**: an `AccumModel(noise_scale=True)` at learning rate 0
  trains WINDOW_UPDATES updates of W samples (micro-batches of 8, a
  random order per repeat) under `AccumScheduler("noise_scale")` with
  its default decisions and a cap that keeps W; the estimate is its last
  decision's (smoothed as in training, over some 100 windows' weight);
- **probe of P**: `NoiseProbe` on P random training examples (a new
  draw per repeat), 8 windows, micro-batches of 16: what
  `AccumScheduler(probe=...)` acts on.

Each is repeated REPEATS times. Reported per checkpoint: the exact value,
and per estimator the median and 10th-90th percentiles of estimate/exact,
the share of repeats resolved (an interval bounded above) and of those
whose interval holds the exact value, and the samples' forward and backward
passes one estimate costs. The weights do not move while an estimate is
made here; in training they do, which the windows' smoothing also averages
over.

Writes benchmarks/noise_probe.json and its .md (`--out`).
"""

import argparse
import json
import math
import os
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402

from benchmarks import batch_growth as bg  # noqa: E402

CHECKPOINTS = (50, 200, 700)  # updates at batch 256; 706 reach the target
WINDOWS = (16, 128)  # training's window sizes W, in samples
WINDOW_MICRO = 8
WINDOW_UPDATES = 200  # decisions at 16, 32, 63, 113, 163 (every 50): the last's
PROBES = (2048, 8192)  # probe sizes P
PROBE_WINDOWS, PROBE_MICRO = 8, 16
REPEATS = 10
STUDENT_SEED = 0


def exact_noise_scale(model, x, y, chunk=512):
    """`(B_simple, tr(Sigma), |G|^2)` from per-example gradients of the MSE.

    In chunks: the Jacobian's vectorised backward pass holds chunk x chunk
    x width tensors (mostly zeros), which at 4,096 ran out of memory."""
    import tensorflow as tf

    variables = model.trainable_variables
    total, squares, n = None, 0.0, len(x)
    for start in range(0, n, chunk):
        xb, yb = x[start : start + chunk], y[start : start + chunk]
        with tf.GradientTape() as tape:
            losses = tf.reduce_mean(tf.square(model(xb, training=True) - yb), -1)
        jacobians = tape.jacobian(losses, variables)
        rows = np.concatenate(
            [np.asarray(j, np.float64).reshape(len(xb), -1) for j in jacobians], axis=1
        )
        total = rows.sum(0) if total is None else total + rows.sum(0)
        squares += float(np.sum(rows * rows))
    mean = total / n
    trace = (squares - n * float(mean @ mean)) / (n - 1)
    signal = float(mean @ mean)
    return trace / signal, trace, signal


def checkpoints(task, rate, updates=CHECKPOINTS, batch=256, seed=STUDENT_SEED):
    """The plain student's weights at each count of `updates` at `batch`."""
    model = task.student(seed, rate)
    rng = np.random.default_rng(seed)
    kept, done = {}, 0
    while done < max(updates):
        order = rng.permutation(len(task.x_train))
        for start in range(0, len(order) - batch + 1, batch):
            rows = order[start : start + batch]
            model.train_on_batch(task.x_train[rows], task.y_train[rows])
            done += 1
            if done in updates:
                kept[done] = [w.copy() for w in model.get_weights()]
            if done == max(updates):
                break
    return kept


def frozen_student(task, weights, **model_kwargs):
    """A measuring `AccumModel` of the student at `weights`, learning rate 0."""
    import keras

    import keras_accum

    model = task.build_student(
        STUDENT_SEED, keras_accum.AccumModel, noise_scale=True, **model_kwargs
    )
    model.compile(keras.optimizers.SGD(0.0), "mse")
    model.build((None, task.input_dim))
    model.set_weights(weights)
    return model


def windows_estimates(task, weights, window, repeats, updates=WINDOW_UPDATES):
    """The last decision's estimate of the default scheduler, frozen weights."""
    import keras_accum

    steps = window // WINDOW_MICRO
    model = frozen_student(task, weights, accum_steps=steps)
    out = []
    for repeat in range(repeats):
        rows = np.random.default_rng(1000 + repeat).choice(
            len(task.x_train), updates * window, replace=False
        )
        scheduler = keras_accum.AccumScheduler(
            "noise_scale", max_accum_steps=steps, learning_rate_rule=None
        )
        model.fit(
            task.x_train[rows],
            task.y_train[rows],
            batch_size=WINDOW_MICRO,
            shuffle=False,
            verbose=0,
            callbacks=[scheduler],
        )
        out.append(scheduler.path[-1].estimate)
    return out


def probe_estimates(task, weights, samples, repeats):
    """`NoiseProbe.measure` on `samples` random training examples per repeat."""
    from keras_accum.growth.probe import NoiseProbe

    model = frozen_student(task, weights)
    out = []
    for repeat in range(repeats):
        rows = np.random.default_rng(2000 + repeat).choice(
            len(task.x_train), samples, replace=False
        )
        probe = NoiseProbe((task.x_train[rows], task.y_train[rows]), windows=PROBE_WINDOWS)
        out.append(probe.measure(model, PROBE_MICRO))
    return out


def summary(estimates, exact, cost):
    ratios = np.array([e.value / exact if e.resolved else math.inf for e in estimates])
    finite = [e for e in estimates if e.resolved]
    return {
        "cost_samples": cost,
        "median_ratio": float(np.percentile(ratios, 50, method="nearest")),
        "p10_ratio": float(np.percentile(ratios, 10, method="nearest")),
        "p90_ratio": float(np.percentile(ratios, 90, method="nearest")),
        "resolved": len(finite) / len(estimates),
        "covers": (sum(e.low <= exact <= e.high for e in finite) / len(finite)) if finite else None,
        "estimates": [
            [float(e.value), float(e.low), float(e.high), bool(e.resolved)] for e in estimates
        ],
    }


def report(results):
    lines = [
        "| updates (batch 256) | exact `B_simple` | estimator | samples per estimate "
        "| estimate / exact: median (10th-90th percentile) | resolved | interval holds exact |",
        "|---|---|---|---|---|---|---|",
    ]
    for point in results["checkpoints"]:
        for name, s in point["estimators"].items():
            covers = "-" if s["covers"] is None else f"{s['covers']:.0%}"
            spread = f"{s['median_ratio']:.2f} ({s['p10_ratio']:.2f}-{s['p90_ratio']:.2f})".replace(
                "inf", "unresolved"
            )
            lines.append(
                f"| {point['updates']} | {point['exact']:,.0f} | {name} | "
                f"{s['cost_samples']:,} | {spread} | {s['resolved']:.0%} | {covers} |"
            )
    lines += [
        "",
        f"{results['repeats']} repeats per estimator (a new order of the training windows, "
        "or a new draw of the probe), weights frozen. Windows of W: the last decision of "
        f'the default `AccumScheduler("noise_scale")` after {results["window_updates"]} '
        "updates of W samples (micro-batches of 8); samples per estimate: the windows' "
        "weight in the smoothed estimate (about 100 windows). Probe of P: `NoiseProbe` of P "
        f"training examples, {results['probe_windows']} windows, micro-batches of "
        f"{results['probe_micro']}: P forward and backward passes. 'unresolved': the "
        "estimate's interval is unbounded above (a ratio counted as infinite).",
        "",
        f"Run {results['date']}, TensorFlow {results['versions']['tensorflow']}, Keras "
        f"{results['versions']['keras']}, {results['threads']} thread(s), "
        f"{results['wall_seconds']:.0f} s.",
    ]
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=REPEATS)
    parser.add_argument("--quick", action="store_true", help="a smoke run, not a measurement")
    parser.add_argument(
        "--out",
        default=None,
        help="JSON path (default: benchmarks/noise_probe.json; none when --quick)",
    )
    args = parser.parse_args(argv)
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    tf.config.threading.set_inter_op_parallelism_threads(args.threads)

    out = args.out or (None if args.quick else str(Path(__file__).parent / "noise_probe.json"))
    began = time.perf_counter()
    task = bg.make_task()
    swept = json.loads((Path(__file__).parent / "batch_growth.json").read_text())
    rate = swept["best"]["256"]["learning_rate"]
    updates, windows, probes, repeats = CHECKPOINTS, WINDOWS, PROBES, args.repeats
    window_updates = WINDOW_UPDATES
    if args.quick:
        updates, windows, probes, repeats, window_updates = (50,), (16,), (2048,), 2, 40
        task.x_train, task.y_train = task.x_train[:8192], task.y_train[:8192]
    kept = checkpoints(task, rate, updates)
    points = []
    for count in updates:
        weights = kept[count]
        model = task.build_student(STUDENT_SEED)
        model.set_weights(weights)
        exact = exact_noise_scale(model, task.x_train, task.y_train)[0]
        estimators = {}
        for window in windows:
            estimates = windows_estimates(task, weights, window, repeats, window_updates)
            weight = estimates[-1].windows
            estimators[f"windows of {window}"] = summary(estimates, exact, int(weight * window))
        for samples in probes:
            estimators[f"probe of {samples}"] = summary(
                probe_estimates(task, weights, samples, repeats), exact, samples
            )
        points.append({"updates": count, "exact": exact, "estimators": estimators})
        print(
            f"{count} updates: exact {exact:,.0f}; "
            + "; ".join(
                f"{name} {s['median_ratio']:.2f} ({s['p10_ratio']:.2f}-{s['p90_ratio']:.2f}), "
                f"resolved {s['resolved']:.0%}"
                for name, s in estimators.items()
            ),
            flush=True,
        )
    results = {
        **bg.run_record(args.threads, time.perf_counter() - began, args.quick),
        "learning_rate": rate,
        "repeats": repeats,
        "window_updates": window_updates,
        "probe_windows": PROBE_WINDOWS,
        "probe_micro": PROBE_MICRO,
        "checkpoints": points,
    }
    if out:
        Path(out).write_text(json.dumps(results, indent=1) + "\n")
        Path(out).with_suffix(".md").write_text(report(results))
        print(f"wrote {out} and its .md")
    return results


if __name__ == "__main__":
    main()
