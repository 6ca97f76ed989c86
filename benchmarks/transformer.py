"""The transformer against Keras's built-in accumulation, eagerly and under XLA, in one run.

    python -m benchmarks.transformer                    # 61 rounds, writes transformer.md/.json
    python -m benchmarks.transformer --rounds 101
    python -m benchmarks.transformer --quick --rounds 1 --out /tmp/t   # smoke run

The workload is benchmarks/workloads.py's `transformer`: a plain-Keras
GPT-style decoder (token and position embeddings, 8 causal self-attention
blocks, a next-token loss over every position), 134 trainable variables.
Every mode below is built from the same seed and trained on the same data,
twice: compiled as Keras compiles on a CPU by default (`eager` here: `fit`'s
traced `tf.function`, no XLA) and with `jit_compile=True` (`XLA`, Keras's
default on one GPU). Adam, micro-batch b = 32, N = 4 (the XLA benchmark's):

- `built-in`: `keras.Model`, `Adam(gradient_accumulation_steps=N)`, batches of b;
- `step mode`: `AccumModel(accum_steps=N)`, batches of b;
- `micro_batch_size`: `AccumModel(micro_batch_size=b)`, batches of N*b;
- `gradient-accumulator`: PyPI gradient-accumulator's
  `GradientAccumulateModel(accum_steps=N)`, batches of b (where it is
  installed and runs: `pip install --no-deps gradient-accumulator`);
- `plain at b`: `keras.Model`, batches of b (an update per micro-batch);
- `big batch`: `keras.Model`, batches of N*b: the training the others
  stand in for.

Each round times one window (N*b sequences: N calls of the train function
at b, or one at N*b, called as `fit` calls it) of every mode, eager and XLA
alike, in an order rotated by one place per round; round 0 is a warm-up,
dropped. Only ratios within a round are used (paired): the median over
rounds with a 95% confidence interval of the median and the min-max, by
wall clock and by this process's CPU time (`time.process_time()`: another
process's load delays the wall clock, not our CPU time). Exactness: after
one epoch of `fit` from the same weights (before the rounds), each
accumulating mode's weights against the big batch's.

Writes transformer.json and transformer.md into `--out` (default: this
directory). `python -m benchmarks.xla --workloads transformer` adds the
XLA floors; `python -m benchmarks.run --timing-only --workloads transformer`
the epochs of `fit` beside the other workloads' (N = 8);
`python -m benchmarks.memory_curve` the memory against the batch.
"""

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # quiet TensorFlow start-up

import numpy as np  # noqa: E402

from benchmarks import workloads, xla  # noqa: E402
from benchmarks.run import cpu_model, keras_accum_revision, load_average  # noqa: E402

HERE = Path(__file__).resolve().parent
N, B = xla.N, xla.B
COMPILES = {"eager": False, "XLA": True}
# mode: (how it is made, batch size, train-function calls per window)
MODES = {
    "built-in": ("builtin", B, N),
    "step mode": (dict(accum_steps=N), B, N),
    "micro_batch_size": (dict(micro_batch_size=B), N * B, 1),
    "gradient-accumulator": ("gradient-accumulator", B, N),
    "plain at b": ("plain", B, N),
    "big batch": ("plain", N * B, 1),
}
OPTIONAL = ("gradient-accumulator",)
NOTES = {
    "built-in": "keras.Model, Adam(gradient_accumulation_steps=N), batches of b",
    "step mode": "keras_accum.AccumModel(accum_steps=N), batches of b",
    "micro_batch_size": "keras_accum.AccumModel(micro_batch_size=b), batches of N*b split inside the step",
    "gradient-accumulator": "gradient_accumulator.GradientAccumulateModel(accum_steps=N), batches of b",
    "plain at b": "keras.Model, batches of b (an update per micro-batch)",
    "big batch": "keras.Model, batches of N*b",
}
RATIOS = [
    ("step mode", "built-in"),
    ("micro_batch_size", "built-in"),
    ("step mode", "gradient-accumulator"),
    ("micro_batch_size", "gradient-accumulator"),
    ("built-in", "plain at b"),
    ("step mode", "plain at b"),
    ("micro_batch_size", "big batch"),
    ("micro_batch_size", "step mode"),
]
# What must hold (issue 59): step mode and micro_batch_size at most this
# times the built-in's time, eagerly and under XLA (the paired median).
TARGET = 1.00
ACCUMULATING = ("built-in", "step mode", "micro_batch_size", "gradient-accumulator")


def _describe(error):
    return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"[:300]


def run(rounds, quick):
    """Builds, traces and times every mode, eager and XLA; returns the
    JSON-able result."""
    workload = workloads.transformer(quick)
    x, y = workload.data(np.random.default_rng(workloads.SEED))
    timers, unavailable, weights, parameters = {}, {}, {}, {}
    for compile_name, jit_compile in COMPILES.items():
        for mode, spec in MODES.items():
            label = f"{mode}, {compile_name}"
            print(f"  tracing {label}", flush=True)
            made = []
            try:
                timers[label], _ = xla._timer(
                    spec, workload, x, y, hlo=False, jit_compile=jit_compile, model_out=made
                )
            except Exception as error:  # an optional implementation may not run
                if mode not in OPTIONAL:
                    raise
                unavailable[label] = _describe(error)
                continue
            (model,) = made
            weights[label] = model.get_weights()  # after one epoch of fit
            parameters = {
                "variables": len(model.trainable_variables),
                "parameters": int(model.count_params()),
            }
    difference = {}
    for compile_name in COMPILES:
        reference = weights[f"big batch, {compile_name}"]
        for mode in ACCUMULATING:
            label = f"{mode}, {compile_name}"
            if label in weights:
                difference[label] = max(
                    float(np.max(np.abs(a - b))) for a, b in zip(weights[label], reference)
                )
    print(f"  {rounds} rounds of {len(timers)} windows, load {load_average()}", flush=True)
    measured = xla.rotated_rounds(timers, rounds)
    wall = {label: [w for w, _ in values] for label, values in measured.items()}
    cpu = {label: [c for _, c in values] for label, values in measured.items()}
    results = {}
    for compile_name in COMPILES:

        def of(seconds, compile_name=compile_name):
            suffix = f", {compile_name}"
            return {k[: -len(suffix)]: v for k, v in seconds.items() if k.endswith(suffix)}

        results[compile_name] = {
            "median_window_ms": {m: 1000 * statistics.median(s) for m, s in of(wall).items()},
            "median_window_cpu_ms": {m: 1000 * statistics.median(s) for m, s in of(cpu).items()},
            "ratios": xla.paired_ratios(of(wall), RATIOS),
            "cpu_ratios": xla.paired_ratios(of(cpu), RATIOS),
            "max_weight_difference_vs_big_batch": {m: d for m, d in of(difference).items()},
        }
    # XLA against eager, mode by mode (paired too: the same rounds).
    xla_over_eager = xla.paired_ratios(wall, [(f"{m}, XLA", f"{m}, eager") for m in MODES])
    return {
        "description": workload.description,
        **parameters,
        "samples_per_epoch": workload.samples,
        "unavailable": unavailable,
        "compiles": results,
        "xla_over_eager": {k.split(", XLA")[0]: v for k, v in xla_over_eager.items()},
        "seconds": wall,
        "cpu_seconds": cpu,
    }


def _cell(r):
    low, high = r["median_ci95"]
    return f"{r['median']:.3f} ({low:.3f}-{high:.3f})"


def targets(result):
    """`[(met, sentence)]`: step mode and micro_batch_size at most TARGET
    times the built-in, eagerly and under XLA, by wall clock (CPU time
    beside it)."""
    lines = []
    for compile_name, measured in result["compiles"].items():
        for mode in ("step mode", "micro_batch_size"):
            key = f"{mode} / built-in"
            wall, cpu = measured["ratios"].get(key), measured["cpu_ratios"].get(key)
            if wall is None:
                lines.append((None, f"{compile_name}: {key}: not measured"))
                continue
            lines.append(
                (
                    round(wall["median"], 2) <= TARGET,
                    f"{compile_name}: {key} = {wall['median']:.3f} (95% CI "
                    f"{wall['median_ci95'][0]:.3f}-{wall['median_ci95'][1]:.3f}; CPU time "
                    f"{cpu['median']:.3f}) (target <= {TARGET:.2f})",
                )
            )
    return lines


def markdown(results):
    result = results["transformer"]
    machine = results["machine"]
    versions = results["versions"]
    out = [
        "# The transformer against Keras's built-in accumulation",
        "",
    ]
    if results["quick"]:
        out += ["**Quick mode**: a tiny decoder, a smoke run; the numbers mean nothing.", ""]
    out += [
        f"Written by `python -m benchmarks.transformer --rounds {results['rounds']}` on "
        f"{results['date']}: {machine['cpu']}, {machine['cores']} cores, load average "
        f"{machine['load_start']} at the start and {machine['load_end']} at the end; "
        f"Python {versions['python']}, TensorFlow {versions['tensorflow']}, Keras "
        f"{versions['keras']}, gradient-accumulator {versions['gradient-accumulator'] or 'not installed'}; "
        f"keras_accum at {machine['keras_accum']}.",
        "",
        f"Workload: {result['description']}; {result['variables']} trainable variables, "
        f"{result['parameters']:,} parameters. Adam, micro-batch b = {B}, N = {N} "
        f"(updates of {N * B} sequences). `eager`: compiled as Keras compiles on a CPU "
        "by default (`fit`'s traced `tf.function`, no XLA); `XLA`: `jit_compile=True`.",
        "",
    ]
    out += [f"- `{mode}`: {NOTES[mode]}" for mode in MODES]
    out += [
        "",
        f"Each of {results['rounds']} rounds times one window ({N * B} sequences) of every "
        "mode, eager and XLA, in an order rotated by one place per round (a warm-up round "
        "dropped); a ratio is taken within a round (paired): median over rounds, its 95% "
        "confidence interval, min-max, by wall clock and by the process's CPU time.",
        "",
        "| compile | ratio | wall: median (95% CI) | min-max | CPU time: median (95% CI) |",
        "|---|---|---|---|---|",
    ]
    for compile_name, measured in result["compiles"].items():
        for label, r in measured["ratios"].items():
            out.append(
                f"| {compile_name} | {label} | {_cell(r)} | {r['min']:.2f}-{r['max']:.2f} "
                f"| {_cell(measured['cpu_ratios'][label])} |"
            )
    out += [
        "",
        "| compile | mode | median window, ms (wall) | median window, ms (CPU) "
        "| weights after one epoch: max difference from the big batch |",
        "|---|---|---|---|---|",
    ]
    for compile_name, measured in result["compiles"].items():
        for mode in MODES:
            if mode not in measured["median_window_ms"]:
                why = result["unavailable"].get(f"{mode}, {compile_name}", "did not run")
                out.append(f"| {compile_name} | {mode} | unavailable: {why} | | |")
                continue
            diff = measured["max_weight_difference_vs_big_batch"].get(mode)
            out.append(
                f"| {compile_name} | {mode} | {measured['median_window_ms'][mode]:.1f} "
                f"| {measured['median_window_cpu_ms'][mode]:.1f} "
                f"| {'-' if diff is None else f'{diff:.1e}'} |"
            )
    out += [
        "",
        "XLA / eager, mode by mode (wall, paired): "
        + ", ".join(f"{mode} {_cell(r)}" for mode, r in result["xla_over_eager"].items())
        + ".",
        "",
        "## What must hold",
        "",
    ]
    marks = {True: "met", False: "**missed**", None: "not measured"}
    out += [f"- {marks[met]}: {sentence}" for met, sentence in targets(result)]
    out.append("")
    return "\n".join(out)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--rounds",
        type=int,
        default=61,
        help="timed rounds after a warm-up round (default: %(default)s)",
    )
    parser.add_argument("--quick", action="store_true", help="a tiny decoder: a smoke run")
    parser.add_argument(
        "--out",
        default=str(HERE),
        help="folder for transformer.json and transformer.md (default: %(default)s)",
    )
    args = parser.parse_args(argv)
    import keras
    import tensorflow as tf

    from benchmarks.timing import _versions

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    machine = {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "load_start": load_average(),
        "keras_accum": keras_accum_revision(),
    }
    print(
        f"transformer, eager and XLA: {args.rounds} rounds; load {machine['load_start']}",
        flush=True,
    )
    result = run(args.rounds, args.quick)
    machine["load_end"] = load_average()
    results = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine,
        "versions": {**_versions(tf, keras), "python": platform.python_version()},
        "quick": args.quick,
        "accum_steps": N,
        "micro_batch": B,
        "rounds": args.rounds,
        "transformer": result,
    }
    (out / "transformer.json").write_text(json.dumps(results, indent=1) + "\n")
    text = markdown(results)
    (out / "transformer.md").write_text(text)
    print(text)
    print(f"wrote {out / 'transformer.md'}, {out / 'transformer.json'}")


if __name__ == "__main__":
    sys.exit(main())
