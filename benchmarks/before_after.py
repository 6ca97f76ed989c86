"""Before/after: this checkout's keras_accum against an earlier revision's, in one process.

    python -m benchmarks.before_after --before REV
    python -m benchmarks.before_after --before REV --workloads mlp cnn embedding --rounds 21
    python -m benchmarks.before_after --before REV --windows 2 --rounds 101  # short rounds
    python -m benchmarks.before_after --before REV --unit window --rounds 150  # one window a round
    python -m benchmarks.before_after --before REV --quick      # smoke run, not a measurement

Run from the repository root. `REV` is any git revision (a commit, a branch,
`HEAD` to measure uncommitted changes to keras_accum/). Its keras_accum/ is
extracted with `git archive REV keras_accum` into a temporary directory and
renamed `keras_accum_before` (every `keras_accum` name in its files
rewritten), so both versions import side by side in this one process.

For each workload (benchmarks/workloads.py), every model is built from the
same seed (same initial weights) and trained on the same data:

- `builtin`: a plain keras.Model with Adam(gradient_accumulation_steps=N),
  micro-batch b: Keras's own accumulation, the reference;
- `step after` / `step before`: AccumModel(accum_steps=N), micro-batch b
  (step mode, the default path);
- `micro after` / `micro before`: AccumModel(micro_batch_size=b), batches
  of N*b split inside the step (unavailable for a revision without it).

All make the same updates of N*b samples. After one warm-up round (tracing,
dropped), each round trains every model for one epoch, in an order rotated
by one place per round, so that every model meets the same background load;
only ratios within a round are used (the machine may be shared and noisy).
The JSON result (default benchmarks/results_before_after.json) holds per
workload and mode the median (min-max) over rounds of `after / builtin`,
`before / builtin` and `after / before`, by wall clock (`ratios`) and by
this process's CPU time (`cpu_ratios`, less sensitive to other processes'
load), the raw epoch times, and the largest weight difference between the
two versions at the end (0 when a change leaves training bit for bit as it
was). `--unit window` times one window (N micro-batches) per round through
the train function instead of an epoch of `fit`: rounds of a fraction of a
second pair far better on a loaded machine (the step-level figures in
benchmarks/step_mode_ops.md). `--before HEAD` with a clean tree is an A/A run: how far from 1.00
`after / before` strays is the noise of the machine at the time.
"""

import argparse
import datetime
import importlib
import io
import json
import os
import re
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # quiet TensorFlow start-up

import numpy as np  # noqa: E402

from benchmarks import workloads  # noqa: E402
from benchmarks.run import cpu_model, keras_accum_revision, load_average  # noqa: E402

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
BEFORE = "keras_accum_before"
MODES = ("step", "micro")


def _git(*arguments):
    return subprocess.run(["git", *arguments], cwd=REPO, capture_output=True, check=True).stdout


def extract(revision, directory):
    """Writes `revision`'s keras_accum/ as `directory/keras_accum_before`.

    Returns:
        The revision's full commit hash.
    """
    commit = _git("rev-parse", "--verify", f"{revision}^{{commit}}").decode().strip()
    archive = _git("archive", "--format=tar", commit, "keras_accum")
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(directory, filter="data")
    source = Path(directory) / "keras_accum"
    target = Path(directory) / BEFORE
    source.rename(target)
    # Word-bounded: `keras_accum_before` itself is not rewritten again, and
    # the serialisation package becomes its own (no registration clash).
    pattern = re.compile(r"\bkeras_accum\b")
    for path in target.rglob("*.py"):
        path.write_text(pattern.sub(BEFORE, path.read_text()))
    return commit


def make(name, workload, versions):
    """`(compiled model, batch_size)` for `name`, or raises if the version
    cannot build it (e.g. a revision without `micro_batch_size`)."""
    import keras

    n, b = workloads.ACCUM_STEPS, workloads.MICRO_BATCH
    keras.utils.set_random_seed(workloads.SEED)
    inputs, outputs = workload.build()
    optimizer = keras.optimizers.Adam(workloads.LEARNING_RATE)
    if name == "builtin":
        model, batch_size = keras.Model(inputs, outputs), b
        optimizer = keras.optimizers.Adam(workloads.LEARNING_RATE, gradient_accumulation_steps=n)
    else:
        mode, version = name.split()
        accum = versions[version]
        if mode == "step":
            model, batch_size = accum.AccumModel(inputs, outputs, accum_steps=n), b
        else:
            model = accum.AccumModel(inputs, outputs, micro_batch_size=b)
            batch_size = n * b
            if getattr(model, "micro_batch_size", None) != b:
                # A revision before micro_batch_size passed it on to Keras,
                # which ignored it: that model trains whole batches of N*b.
                raise TypeError("this version of AccumModel has no micro_batch_size")
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model, batch_size


def train_one_epoch(model, x, y, batch_size):
    """One epoch of `fit`; returns `(wall seconds, process CPU seconds)`.

    Timed from `on_epoch_begin` to `on_epoch_end` by a callback after the
    model's own (AccumModel's end-of-epoch flush included), as
    benchmarks/timing.py times. CPU time (all of this process's threads) is
    the less load-sensitive of the two on a shared machine: another
    process's work delays our wall clock, not our CPU time, but it still
    costs us cache and, through TensorFlow's spinning thread pools, some CPU.
    """
    import keras

    class EpochTimer(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.start = time.perf_counter(), time.process_time()

        def on_epoch_end(self, epoch, logs=None):
            wall, cpu = self.start
            self.seconds = time.perf_counter() - wall, time.process_time() - cpu

    timer = EpochTimer()
    model.fit(
        x,
        y,
        batch_size=batch_size,
        epochs=1,
        shuffle=False,
        verbose=0,
        callbacks=[timer],
    )
    return timer.seconds


def window_timer(model, x, y, batch_size):
    """A function timing one window of `model`'s train function on `x, y`.

    One window is N micro-batches of b (step mode and the built-in) or one
    batch of N*b (micro_batch_size), taken from a repeating dataset of the
    same data and called as `fit` calls the train function, without `fit`'s
    per-epoch set-up and callbacks. Call after one epoch of `fit` (traced,
    windows closed). Returns `(wall seconds, process CPU seconds)`.
    """
    import tensorflow as tf

    steps = workloads.ACCUM_STEPS if batch_size == workloads.MICRO_BATCH else 1
    dataset = tf.data.Dataset.from_tensor_slices((x, y))
    iterator = iter(dataset.batch(batch_size, drop_remainder=True).repeat())

    def time_one_window():
        function = model.train_function
        wall, cpu = time.perf_counter(), time.process_time()
        for _ in range(steps):
            logs = function(iterator)
        float(logs["loss"])  # as fit reads its logs
        return time.perf_counter() - wall, time.process_time() - cpu

    return time_one_window


def _summary(values):
    values = [v for v in values if v is not None]
    if not values:
        return None
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "rounds": len(values),
    }


def run_workload(workload_name, rounds, quick, modes, versions, windows=None, unit="epoch"):
    """Times every model of one workload; returns its JSON-able result."""
    workload = workloads.timing_workload(workload_name, quick)
    x, y = workload.data(np.random.default_rng(workloads.SEED))
    if windows:
        # Shorter epochs, more rounds: pairs closer in time on a machine
        # whose load changes from second to second.
        samples = windows * workloads.ACCUM_STEPS * workloads.MICRO_BATCH
        x, y = x[:samples], y[:samples]
    names = ["builtin"] + [f"{m} {v}" for m in modes for v in ("after", "before")]
    models, unavailable = {}, {}
    for name in names:
        try:
            models[name] = make(name, workload, versions)
        except Exception as error:  # an older revision may lack a mode
            unavailable[name] = f"{type(error).__name__}: {error}"[:300]
    wall = {name: [] for name in models}
    cpu = {name: [] for name in models}
    timers = {}
    for round_index in range(rounds + 1):  # round 0: warm-up, dropped
        order = list(models)
        shift = round_index % len(order)
        times = {}
        for name in order[shift:] + order[:shift]:
            model, batch_size = models[name]
            if unit == "epoch" or not round_index:
                times[name] = train_one_epoch(model, x, y, batch_size)
                if unit == "window":
                    timers[name] = window_timer(model, x, y, batch_size)
            else:
                times[name] = timers[name]()
        label = "warm-up" if round_index == 0 else f"round {round_index}/{rounds}"
        print(
            f"  {workload_name} {label}: " + ", ".join(f"{n} {times[n][0]:.3f}s" for n in models),
            flush=True,
        )
        if round_index:
            for name, (w, c) in times.items():
                wall[name].append(w)
                cpu[name].append(c)

    def paired(seconds, a, b):
        if a not in seconds or b not in seconds:
            return None
        return _summary([p / q for p, q in zip(seconds[a], seconds[b])])

    result = {
        "description": workload.description,
        "samples": len(x),
        "unit": unit,
        "steps_per_epoch": len(x) // workloads.MICRO_BATCH,
        "wall_seconds": wall,
        "cpu_seconds": cpu,
        "median_wall_seconds": {n: statistics.median(s) for n, s in wall.items()},
        "unavailable": unavailable,
        "ratios": {},
        "cpu_ratios": {},
        "max_weight_difference_after_vs_before": {},
    }
    for mode in modes:
        for key, seconds in (("ratios", wall), ("cpu_ratios", cpu)):
            result[key][mode] = {
                "after / builtin": paired(seconds, f"{mode} after", "builtin"),
                "before / builtin": paired(seconds, f"{mode} before", "builtin"),
                "after / before": paired(seconds, f"{mode} after", f"{mode} before"),
            }
        if f"{mode} after" in models and f"{mode} before" in models:
            after = models[f"{mode} after"][0].get_weights()
            before = models[f"{mode} before"][0].get_weights()
            result["max_weight_difference_after_vs_before"][mode] = max(
                float(np.max(np.abs(a - b))) for a, b in zip(after, before)
            )
    return result


def _format(summary):
    if summary is None:
        return "n/a"
    return f"{summary['median']:.3f} ({summary['min']:.2f}-{summary['max']:.2f})"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="git revision to compare with")
    parser.add_argument(
        "--workloads",
        nargs="+",
        default=["mlp", "cnn"],
        choices=workloads.TIMING_WORKLOADS,
        help="default: %(default)s",
    )
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="measured rounds, after one warm-up round (default 21, 2 with --quick)",
    )
    parser.add_argument(
        "--windows",
        type=int,
        default=None,
        help="train each epoch on the first WINDOWS windows (N*b samples "
        "each) only: shorter, better-paired rounds (default: the whole workload)",
    )
    parser.add_argument(
        "--unit",
        choices=("epoch", "window"),
        default="epoch",
        help="what one round times: an epoch of fit (default), or one window "
        "(N micro-batches) through the train function: shorter and far less "
        "noisy on a loaded machine; use 100+ rounds",
    )
    parser.add_argument("--quick", action="store_true", help="tiny workloads: a smoke test")
    parser.add_argument(
        "--out",
        default=str(HERE / "results_before_after.json"),
        help="the JSON result (default: %(default)s)",
    )
    args = parser.parse_args(argv)
    rounds = args.rounds or (2 if args.quick else 21)

    with tempfile.TemporaryDirectory() as tmp:
        before_commit = extract(args.before, tmp)
        sys.path.insert(0, tmp)
        import keras
        import tensorflow as tf

        import keras_accum

        if Path(keras_accum.__file__).resolve().parent != REPO / "keras_accum":
            sys.exit(
                f"keras_accum imports from {keras_accum.__file__}, not this "
                "checkout: run from the repository root."
            )
        versions = {"after": keras_accum, "before": importlib.import_module(BEFORE)}
        print(
            f"before: {args.before} ({before_commit[:10]}); after: this checkout "
            f"({keras_accum_revision()}); N={workloads.ACCUM_STEPS}, "
            f"b={workloads.MICRO_BATCH}, {rounds} rounds; load {load_average()}",
            flush=True,
        )
        results = {
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "before": {"revision": args.before, "commit": before_commit},
            "after": keras_accum_revision(),
            "machine": {
                "cpu": cpu_model(),
                "cores": os.cpu_count(),
                "load_start": load_average(),
            },
            "versions": {"tensorflow": tf.__version__, "keras": keras.__version__},
            "quick": args.quick,
            "accum_steps": workloads.ACCUM_STEPS,
            "micro_batch": workloads.MICRO_BATCH,
            "rounds": rounds,
            "windows": args.windows,
            "unit": args.unit,
            "workloads": {},
        }
        for name in args.workloads:
            results["workloads"][name] = run_workload(
                name,
                rounds,
                args.quick,
                args.modes,
                versions,
                args.windows,
                args.unit,
            )
            # Written after each workload: a long run interrupted keeps
            # what it measured.
            results["machine"]["load_end"] = load_average()
            Path(args.out).write_text(json.dumps(results, indent=1) + "\n")

    print()
    print("paired median (min-max) over rounds; < 1 means the first is faster")
    for name, result in results["workloads"].items():
        for key in ("ratios", "cpu_ratios"):
            clock = "wall" if key == "ratios" else "cpu "
            for mode, ratios in result[key].items():
                print(
                    f"{name:10} {mode:5} {clock} "
                    + "  ".join(f"{k}: {_format(v)}" for k, v in ratios.items())
                )
        for mode, difference in result["max_weight_difference_after_vs_before"].items():
            print(f"{name:10} {mode:5} max |after - before| weight: {difference}")
        for skipped, why in result["unavailable"].items():
            print(f"{name:10} {skipped} unavailable: {why}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
