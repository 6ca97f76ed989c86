"""What `noise_scale=True` costs: the same model measuring and not, in one process.

    python -m benchmarks.noise_scale_cost
    python -m benchmarks.noise_scale_cost --rounds 601 --workloads mlp cnn embedding
    python -m benchmarks.noise_scale_cost --unit epoch --rounds 41   # epochs of fit
    python -m benchmarks.noise_scale_cost --jit-compile --workloads mlp
    python -m benchmarks.noise_scale_cost --quick   # smoke run, not a measurement

For each workload (benchmarks/workloads.py: mlp, cnn, embedding), two pairs
of models are built from the same seed and trained on the same data:

- step mode: `AccumModel(accum_steps=N)`, micro-batch b, `noise_scale` on
  and off;
- split: `AccumModel(micro_batch_size=b)`, batches of N*b, on and off.

Each round times one window (N micro-batches of b) through the train
function of every model, in an order rotated by one place per round (as
benchmarks/before_after.py's `--unit window`): short rounds pair well on a
loaded machine. `--unit epoch` times one epoch of `fit` instead: the step
time a user sees (callbacks and the epoch's end included), each model
running many windows in a row. Only ratios within a round are used: the
result is the median (min-max) over rounds of `on / off`, with a 95%
confidence interval of the median, by wall clock and by process CPU time,
per workload and mode. Measuring adds, per micro-batch, one pass
over the gradients (a sum of squares) and, per window, one over the
window's gradient: the weights must stay bit-identical (checked here too).

Writes benchmarks/noise_scale_cost.json (`--out`) and prints a Markdown
table (benchmarks/noise_scale_cost.md holds the committed run's).
"""

import argparse
import datetime
import json
import math
import os
import statistics
import sys
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # quiet TensorFlow start-up

import numpy as np  # noqa: E402

from benchmarks import workloads  # noqa: E402
from benchmarks.before_after import train_one_epoch, window_timer  # noqa: E402

MODES = {
    "step": (dict(accum_steps=workloads.ACCUM_STEPS), workloads.MICRO_BATCH),
    "split": (
        dict(micro_batch_size=workloads.MICRO_BATCH),
        workloads.MICRO_BATCH * workloads.ACCUM_STEPS,
    ),
}


def _model(workload, noise_scale, jit_compile=False, **kwargs):
    import keras

    import keras_accum

    keras.utils.set_random_seed(workloads.SEED)
    inputs, outputs = workload.build()
    model = keras_accum.AccumModel(inputs, outputs, noise_scale=noise_scale, **kwargs)
    model.compile(
        optimizer=keras.optimizers.Adam(workloads.LEARNING_RATE),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=jit_compile,
    )
    return model


def _summary(values):
    return {
        "median": statistics.median(values),
        "median_ci95": median_interval(values),
        "min": min(values),
        "max": max(values),
        "rounds": len(values),
    }


def rotated_rounds(timers, rounds):
    """`{label: [what timers[label]() returned, per round]}`: each round
    calls every timer once, in an order rotated by one place per round;
    round 0 is a warm-up, dropped. Values of one round are paired."""
    measured = {label: [] for label in timers}
    order = list(timers)
    for index in range(rounds + 1):
        shift = index % len(order)
        values = {label: timers[label]() for label in order[shift:] + order[:shift]}
        if index:
            for label, value in values.items():
                measured[label].append(value)
    return measured


def median_interval(values):
    """A distribution-free 95% confidence interval for the median: the
    order statistics at n/2 -+ 1.96 sqrt(n)/2 (the binomial's normal
    approximation). Tells whether a median of paired ratios is within a
    bound or only happened to land there."""
    ordered = sorted(values)
    n = len(ordered)
    half = 1.96 * math.sqrt(n) / 2
    low = max(0, math.floor(n / 2 - half))
    high = min(n - 1, math.ceil(n / 2 + half) - 1)
    return [ordered[low], ordered[high]]


def run_workload(name, rounds, quick, unit="window", jit_compile=False):
    """Times the on/off pairs of one workload; returns its JSON-able result."""
    workload = workloads.timing_workload(name, quick)
    x, y = workload.data(np.random.default_rng(workloads.SEED))
    models = {}
    for mode, (kwargs, batch_size) in MODES.items():
        for noise_scale in (True, False):
            label = f"{mode} {'on' if noise_scale else 'off'}"
            model = _model(workload, noise_scale, jit_compile, **kwargs)
            models[label] = (model, batch_size)
    # One epoch of fit each (traced), then the same weights on and off?
    for _label, (model, batch_size) in models.items():
        train_one_epoch(model, x, y, batch_size)
    identical = {
        mode: all(
            np.array_equal(a, b)
            for a, b in zip(
                models[f"{mode} on"][0].get_weights(), models[f"{mode} off"][0].get_weights()
            )
        )
        for mode in MODES
    }
    if unit == "window":
        timers = {label: window_timer(m, x, y, b) for label, (m, b) in models.items()}
    else:  # an epoch of fit, as a user's fit runs it
        timers = {
            label: (lambda m=m, b=b: train_one_epoch(m, x, y, b))
            for label, (m, b) in models.items()
        }
    measured = rotated_rounds(timers, rounds)
    wall = {label: [w for w, _ in values] for label, values in measured.items()}
    cpu = {label: [c for _, c in values] for label, values in measured.items()}
    result = {
        "description": workload.description,
        "bit_identical_after_one_epoch": identical,
        "median_wall_seconds": {k: statistics.median(v) for k, v in wall.items()},
        "ratios": {},
        "cpu_ratios": {},
    }
    for mode in MODES:
        for key, seconds in (("ratios", wall), ("cpu_ratios", cpu)):
            result[key][mode] = _summary(
                [a / b for a, b in zip(seconds[f"{mode} on"], seconds[f"{mode} off"])]
            )
    return result


def markdown(results):
    lines = [
        "| workload | mode | on / off, wall | 95% CI of the median | on / off, CPU | bit-identical |",
        "|---|---|---|---|---|---|",
    ]
    for name, result in results["workloads"].items():
        for mode in MODES:
            cells = []
            for key in ("ratios", "cpu_ratios"):
                r = result[key][mode]
                cells.append(f"{r['median']:.3f} ({r['min']:.2f}-{r['max']:.2f})")
            low, high = result["ratios"][mode]["median_ci95"]
            same = "yes" if result["bit_identical_after_one_epoch"][mode] else "NO"
            lines.append(
                f"| {name} | {mode} | {cells[0]} | {low:.3f}-{high:.3f} | {cells[1]} | {same} |"
            )
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--workloads",
        nargs="+",
        default=list(workloads.TIMING_WORKLOADS),
        choices=workloads.TIMING_WORKLOADS,
    )
    parser.add_argument(
        "--rounds", type=int, default=301, help="timed rounds (default: %(default)s)"
    )
    parser.add_argument("--quick", action="store_true", help="tiny models: a smoke run")
    parser.add_argument(
        "--unit",
        choices=("window", "epoch"),
        default="window",
        help="what a round times: one window through the train function, or "
        "one epoch of fit (callbacks, epoch end and all) (default: %(default)s)",
    )
    parser.add_argument(
        "--jit-compile", action="store_true", help="compile with jit_compile=True (XLA)"
    )
    parser.add_argument("--out", default=str(Path(__file__).parent / "noise_scale_cost.json"))
    args = parser.parse_args(argv)
    import keras
    import tensorflow as tf

    results = {
        "date": datetime.date.today().isoformat(),
        "versions": {
            "tensorflow": tf.__version__,
            "keras": keras.__version__,
            "python": sys.version.split()[0],
        },
        "rounds": args.rounds,
        "quick": args.quick,
        "unit": args.unit,
        "jit_compile": args.jit_compile,
        "workloads": {},
    }
    for name in args.workloads:
        print(f"{name}...", flush=True)
        results["workloads"][name] = run_workload(
            name, args.rounds, args.quick, args.unit, args.jit_compile
        )
    Path(args.out).write_text(json.dumps(results, indent=1))
    print(markdown(results))


if __name__ == "__main__":
    main()
