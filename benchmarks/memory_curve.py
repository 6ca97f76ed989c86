"""Memory and time per sample against the effective batch, on the transformer.

    python -m benchmarks.memory_curve          # B = 8..256, m = 8: memory_curve.{md,json,png}
    python -m benchmarks.memory_curve --jit-compile --out /tmp/xla   # the same under XLA
    python -m benchmarks.memory_curve --quick --batches 4 8 --micro-batch 4 --out /tmp/mc  # smoke run
    python -m benchmarks.memory_curve --pipelines known --memory-from OLD.json --timing-from OLD.json

The workload is benchmarks/workloads.py's `transformer` (a 134-variable
decoder, sequences of 32 tokens). For each effective batch B (sequences per
update) and the micro-batch m, three ways to make updates of B sequences:

- `plain`: `keras.Model`, batches of B;
- `accum_steps`: `AccumModel(accum_steps=B/m)`, batches of m (step mode);
- `micro_batch_size`: `AccumModel(micro_batch_size=m)`, batches of B split
  into B/m micro-batches inside the step.

Memory: each (way, B, pipeline) in `--repeats` fresh Pythons (3) started
with TF_CPU_ALLOCATOR_USE_BFC=true, so TensorFlow's CPU allocator keeps
statistics (`benchmarks.memory.tensor_peak`); the median is read, every
process's peak kept (`peak_bytes_each`): the allocator's peak moves by a few
tenths of a MB from one process to the next, as much as the criterion's
margin. The model is built and
compiled, the optimizer's slots made and the data batched first; then the
peak of the tensor memory held during one `fit` of two updates (2B
sequences), above what was held before it: activations, gradients, and
AccumModel's buffers (made in that `fit`), tensors only (not the traced
graphs, which RSS counts). In the same `fit`, the bytes the tensors
requested (`benchmarks.memory.requested_peak`, from the profiler's
allocation events): the allocator can hand a request up to twice its bytes,
so the peak moves with which chunks happen to be free, the requested bytes
with what the step holds. Two pipelines (`--pipelines`):

- `known`: `Dataset.batch(size, drop_remainder=True)`, a batch size the
  step knows before the first batch (as with arrays);
- `unknown`: `Dataset.batch(size)` (Keras's default): the size is known
  only from the first batch, which the step made for it learns
  (`engine/functions.py`'s `see_first`: traced, as every later step).

The criterion read from it: accumulation at the micro-batch m holds at
most 1.10x (plain at m + one float32 copy of the trainable variables), at
every B (on the `known` pipeline; the `unknown` one's beside it).

Time: every (way, B) in one process (the default allocator), each traced by
one epoch of `fit` of 2B sequences (after which each accumulating way's
weights are compared with plain's at the same B: the same training), then
`--rounds` rounds, each timing one update of B sequences of every (way, B)
in an order rotated by one place per round (round 0 dropped): time per
sample is the median over rounds of the update's time / B, by wall clock
and by CPU time, and `/ plain` the median of the ratio within a round.

Writes memory_curve.json, memory_curve.md and memory_curve.png into `--out`
(default: this directory).
"""

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # quiet TensorFlow start-up

import numpy as np  # noqa: E402

from benchmarks import memory, workloads  # noqa: E402
from benchmarks.noise_scale_cost import median_interval  # noqa: E402
from benchmarks.run import cpu_model, keras_accum_revision, load_average  # noqa: E402

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
WAYS = ("plain", "accum_steps", "micro_batch_size")
BATCHES = (8, 16, 32, 64, 128, 256)
MICRO_BATCH = 8
MEMORY_TARGET = 1.10  # accumulation at m / (plain at m + one weight copy)
COLORS = {"plain": "#9e9e9e", "accum_steps": "#2e7d32", "micro_batch_size": "#1565c0"}
LABELS = {
    "plain": "plain, batch B",
    "accum_steps": "accum_steps=B/m, batch m",
    "micro_batch_size": "micro_batch_size=m, batch B",
}


def spec(way, batch, micro):
    """`(how, batch size, train-function calls per update)` of a way at
    effective batch `batch` (benchmarks.xla's `_timer` spec)."""
    if way == "plain":
        return "plain", batch, 1
    if way == "accum_steps":
        return dict(accum_steps=batch // micro), micro, batch // micro
    return dict(micro_batch_size=micro), batch, 1


PIPELINES = ("known", "unknown")


def measure_memory(way, batch, micro, quick, jit_compile, pipeline="known"):
    """The fresh process's measurement of one (way, B, pipeline): a JSON-able dict."""
    import tensorflow as tf

    from benchmarks import xla

    workload = workloads.transformer(quick, samples=2 * batch)
    how, batch_size, _ = spec(way, batch, micro)
    model = xla._keras_model(workload, how, jit_compile)
    model.optimizer.build(model.trainable_variables)  # the same slots for all
    x, y = workload.data(np.random.default_rng(workloads.SEED))
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(
        batch_size, drop_remainder=pipeline == "known"
    )
    before = tf.config.experimental.get_memory_info("CPU:0")["current"]
    requested = {}

    def fit():
        requested.update(
            memory.requested_peak(lambda: model.fit(dataset, epochs=1, shuffle=False, verbose=0))
        )

    peak = memory.tensor_peak(fit)
    return {
        "way": way,
        "batch": batch,
        "pipeline": pipeline,
        "micro_batch": micro,
        "peak_bytes": round(peak["growth_mib"] * memory.MIB),
        "requested_bytes": requested["growth_bytes"],
        "held_before_bytes": int(before),
        "weight_copy_bytes": sum(  # one float32 copy, as AccumModel's buffers
            int(np.prod(v.shape)) * 4 for v in model.trainable_variables
        ),
        "updates": int(model.optimizer.iterations.numpy()),
        "method": peak["method"],
    }


def repeated(each):
    """One reading of a (way, B, pipeline) measured in several fresh processes:
    the median peak (the allocator's peak moves by a few tenths of a MB between
    processes, its free chunks split differently), every peak kept; the
    same of the requested bytes."""
    peaks = [r["peak_bytes"] for r in each]
    requested = [r["requested_bytes"] for r in each]
    return {
        **each[0],
        "peak_bytes": round(statistics.median(peaks)),
        "peak_bytes_each": peaks,
        "requested_bytes": round(statistics.median(requested)),
        "requested_bytes_each": requested,
    }


def _memory_in_fresh_process(way, batch, micro, quick, jit_compile, pipeline, path):
    command = [
        sys.executable,
        "-m",
        "benchmarks.memory_curve",
        "--memory-worker",
        way,
        str(batch),
        pipeline,
        "--micro-batch",
        str(micro),
        "--json",
        str(path),
    ]
    command += ["--quick"] if quick else []
    command += ["--jit-compile"] if jit_compile else []
    env = {
        **os.environ,
        "TF_CPU_ALLOCATOR_USE_BFC": "true",
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    if done.returncode:
        raise RuntimeError(f"memory of {way} at {batch} ({pipeline}): {done.stderr[-3000:]}")
    return json.loads(Path(path).read_text())


def measure_time(batches, micro, rounds, quick, jit_compile):
    """`(seconds, cpu seconds, weight differences)`: per (way, B) label, one
    update's times per round; each accumulating way's largest weight
    difference from plain at the same B after one epoch."""
    from benchmarks import xla
    from benchmarks.noise_scale_cost import rotated_rounds

    timers, weights = {}, {}
    for batch in batches:
        workload = workloads.transformer(quick, samples=2 * batch)
        x, y = workload.data(np.random.default_rng(workloads.SEED))
        for way in WAYS:
            label = f"{way} {batch}"
            print(f"  tracing {label}", flush=True)
            made = []
            timers[label], _ = xla._timer(
                spec(way, batch, micro),
                workload,
                x,
                y,
                hlo=False,
                jit_compile=jit_compile,
                model_out=made,
            )
            weights[label] = made[0].get_weights()
    difference = {
        f"{way} {batch}": max(
            float(np.max(np.abs(a - b)))
            for a, b in zip(weights[f"{way} {batch}"], weights[f"plain {batch}"])
        )
        for batch in batches
        for way in WAYS
        if way != "plain"
    }
    print(f"  {rounds} rounds, load {load_average()}", flush=True)
    measured = rotated_rounds(timers, rounds)
    wall = {label: [w for w, _ in values] for label, values in measured.items()}
    cpu = {label: [c for _, c in values] for label, values in measured.items()}
    return wall, cpu, difference


def _summary(values):
    return {
        "median": statistics.median(values),
        "median_ci95": median_interval(values),
        "min": min(values),
        "max": max(values),
        "rounds": len(values),
    }


def summarise(results):
    """Per way and B: peak bytes, time per sample (wall, CPU) and the paired
    ratio to plain at the same B; the criterion's allowances (peak and requested)."""
    micro = results["micro_batch"]
    memory_of = {(m["way"], m["batch"], m["pipeline"]): m for m in results["memory"]}
    pipelines = [p for p in PIPELINES if ("plain", micro, p) in memory_of]
    # The criterion on the first pipeline measured (`known` when it was).
    plain_m = memory_of[("plain", micro, pipelines[0])]
    allowance = plain_m["peak_bytes"] + plain_m["weight_copy_bytes"]
    # The same on the bytes the tensors requested (None in a run before it).
    plain_requested = plain_m.get("requested_bytes")
    requested_allowance = (
        None if plain_requested is None else plain_requested + plain_m["weight_copy_bytes"]
    )
    rows = {}
    for way in WAYS:
        for batch in results["batches"]:
            label = f"{way} {batch}"
            wall = results["seconds"][label]
            cpu = results["cpu_seconds"][label]
            plain = results["seconds"][f"plain {batch}"]
            plain_cpu = results["cpu_seconds"][f"plain {batch}"]
            held = memory_of[(way, batch, pipelines[0])]
            other = {p: memory_of[(way, batch, p)]["peak_bytes"] for p in pipelines}
            rows[label] = {
                "peak_bytes": held["peak_bytes"],
                "peak_bytes_each": held.get("peak_bytes_each", [held["peak_bytes"]]),
                "peak_bytes_by_pipeline": other,
                "ms_per_sample": 1000 * statistics.median(wall) / batch,
                "cpu_ms_per_sample": 1000 * statistics.median(cpu) / batch,
                "vs_plain": _summary([a / b for a, b in zip(wall, plain)]),
                "cpu_vs_plain": _summary([a / b for a, b in zip(cpu, plain_cpu)]),
                "requested_bytes": held.get("requested_bytes"),
                "requested_bytes_each": held.get("requested_bytes_each"),
                "weight_difference_vs_plain": results["weight_difference_vs_plain"].get(label),
            }
    return {
        "allowance_bytes": allowance,
        "requested_allowance_bytes": requested_allowance,
        "plain_at_m_bytes": plain_m["peak_bytes"],
        "plain_at_m_requested_bytes": plain_requested,
        "weight_copy_bytes": plain_m["weight_copy_bytes"],
        "rows": rows,
        "pipelines": pipelines,
    }


def _repeats_text(results):
    counts = {len(m.get("peak_bytes_each", [m["peak_bytes"]])) for m in results["memory"]}
    if counts == {1}:
        return "in a fresh process"
    return (
        "in fresh processes, the median of "
        + " (or ".join(str(c) for c in sorted(counts, reverse=True))
        + ")" * (len(counts) - 1)
    )


def _mb(value):
    return f"{value / 1e6:.1f}"


def markdown(results):
    summary = summarise(results)
    machine, versions = results["machine"], results["versions"]
    micro = results["micro_batch"]
    command = "python -m benchmarks.memory_curve" + (
        " --jit-compile" if results["jit_compile"] else ""
    )
    out = ["# Memory and time per sample against the effective batch", ""]
    if results["quick"]:
        out += ["**Quick mode**: a tiny decoder, a smoke run; the numbers mean nothing.", ""]
    out += [
        f"Written by `{command}` on {results['date']}: {machine['cpu']}, {machine['cores']} "
        f"cores, load average {machine['load_start']} at the start and {machine['load_end']} "
        f"at the end; Python {versions['python']}, TensorFlow {versions['tensorflow']}, "
        f"Keras {versions['keras']}; keras_accum at {machine['keras_accum']}"
        + (
            f"; the time columns from the run of {machine['timing_from']} (`--timing-from`)"
            if machine.get("timing_from")
            else ""
        )
        + (
            f"; the memory of pipelines not measured here from the run of "
            f"{machine['memory_from']} (`--memory-from`)."
            if machine.get("memory_from")
            else "."
        ),
        "",
        f"Workload: {results['description']}; {results['variables']} trainable variables, "
        f"{results['parameters']:,} parameters (one float32 copy: "
        f"{_mb(summary['weight_copy_bytes'])} MB). Adam; "
        + (
            "compiled with `jit_compile=True` (XLA). "
            if results["jit_compile"]
            else "compiled as Keras compiles on a CPU by default (no XLA). "
        )
        + f"Micro-batch m = {micro}; each way makes updates of B sequences:",
        "",
    ]
    out += [f"- `{way}`: {LABELS[way]}" for way in WAYS]
    out += [
        "",
        "Peak tensor memory: the most TensorFlow's CPU allocator held during one `fit` of "
        "two updates above what it held before (weights, optimizer slots and data "
        "already made; AccumModel's buffers, made in `fit`, counted), each (way, B) "
        f"{_repeats_text(results)}; `known`: batched with `drop_remainder=True` (the step knows the "
        "batch size, as with arrays); `unknown`: `Dataset.batch(size)`, Keras's default, "
        "whose first batch the step learns the size from (traced, as every later one). "
        "Requested: the most bytes the tensors made in that `fit` asked the allocator for "
        "and held at once (the profiler's allocation events; `benchmarks.memory."
        "requested_peak`), the same processes' median: what the tensors need, "
        "where the peak is what the allocator handed out, a request taking a whole "
        "free chunk when the best fit is under twice its size (so the same tensors "
        "weigh up to twice their bytes, by which chunks the run had freed before). "
        "Time per sample: one process, every (way, B) traced, then "
        f"{results['rounds']} rounds timing one update of each in a rotated order; the "
        "median update time / B, and the ratio to plain at the same B within a round "
        "(median, 95% CI).",
        "",
        f"| B | way | peak tensor memory, MB ({summary['pipelines'][0]}) | / plain at B "
        "| requested, MB "
        + "".join(f"| peak, MB ({p}) " for p in summary["pipelines"][1:])
        + "| ms per sample (wall) "
        "| ms per sample (CPU) | / plain at B, wall (95% CI) | / plain at B, CPU "
        "| weights vs plain at B |",
        "|---:|---|---:|---:|---:|"
        + "---:|" * (len(summary["pipelines"]) - 1)
        + "---:|---:|---|---:|---:|",
    ]
    for batch in results["batches"]:
        plain_peak = summary["rows"][f"plain {batch}"]["peak_bytes"]
        for way in WAYS:
            row = summary["rows"][f"{way} {batch}"]
            ratio = row["vs_plain"]
            diff = row["weight_difference_vs_plain"]
            out.append(
                f"| {batch} | {way} | {_mb(row['peak_bytes'])} | "
                f"{row['peak_bytes'] / plain_peak:.2f} | "
                + ("n/a" if row["requested_bytes"] is None else _mb(row["requested_bytes"]))
                + " | "
                + "".join(
                    f"{_mb(row['peak_bytes_by_pipeline'][p])} | " for p in summary["pipelines"][1:]
                )
                + f"{row['ms_per_sample']:.2f} | "
                f"{row['cpu_ms_per_sample']:.2f} | "
                + (
                    "-"
                    if way == "plain"
                    else f"{ratio['median']:.2f} ({ratio['median_ci95'][0]:.2f}-{ratio['median_ci95'][1]:.2f})"
                )
                + " | "
                + ("-" if way == "plain" else f"{row['cpu_vs_plain']['median']:.2f}")
                + f" | {'-' if diff is None else f'{diff:.1e}'} |"
            )
    out += [
        "",
        "## What must hold",
        "",
        f"Accumulation at the micro-batch m = {micro}, at every B (pipeline: "
        f"{summary['pipelines'][0]}): peak within "
        f"{MEMORY_TARGET:.2f}x (plain at m + one copy of the trainable variables) = "
        f"{MEMORY_TARGET:.2f} x ({summary['plain_at_m_bytes']:,} + "
        f"{summary['weight_copy_bytes']:,}) bytes = "
        f"{MEMORY_TARGET * summary['allowance_bytes']:,.0f} bytes.",
        "",
    ]
    for way in WAYS[1:]:
        for batch in results["batches"]:
            row = summary["rows"][f"{way} {batch}"]
            others = "".join(
                f"; {p}: {row['peak_bytes_by_pipeline'][p]:,} bytes = "
                f"{row['peak_bytes_by_pipeline'][p] / summary['allowance_bytes']:.3f}x"
                for p in summary["pipelines"][1:]
            )
            out.append(
                _criterion_line(
                    way,
                    batch,
                    row["peak_bytes"],
                    row["peak_bytes_each"],
                    summary["allowance_bytes"],
                )
                + others
            )
    if summary["requested_allowance_bytes"] is not None:
        out += [
            "",
            f"The same on the bytes requested (the allocator's rounding aside): within "
            f"{MEMORY_TARGET:.2f} x ({summary['plain_at_m_requested_bytes']:,} + "
            f"{summary['weight_copy_bytes']:,}) bytes = "
            f"{MEMORY_TARGET * summary['requested_allowance_bytes']:,.0f} bytes.",
            "",
        ]
        for way in WAYS[1:]:
            for batch in results["batches"]:
                row = summary["rows"][f"{way} {batch}"]
                out.append(
                    _criterion_line(
                        way,
                        batch,
                        row["requested_bytes"],
                        row["requested_bytes_each"] or [row["requested_bytes"]],
                        summary["requested_allowance_bytes"],
                    )
                )
    out.append("")
    return "\n".join(out)


def _criterion_line(way, batch, held, each, allowance):
    """One accumulating (way, B)'s line under "What must hold": `held` bytes
    (the median of the processes' `each`) against `allowance` (plain at m
    plus one weight copy, by the same measure)."""
    ratio = held / allowance
    spread = (
        f" (processes: {min(each) / allowance:.3f}-{max(each) / allowance:.3f}x)"
        if len(each) > 1
        else ""
    )
    return (
        f"- {'met' if ratio <= MEMORY_TARGET else '**missed**'}: {way}, B = {batch}: "
        f"{held:,} bytes = {ratio:.3f}x (plain at m + weights)" + spread
    )


def plot(results, path):
    """Two panels: peak tensor memory and time per sample against B."""
    import matplotlib

    matplotlib.use("Agg")  # no display; must precede pyplot
    import matplotlib.pyplot as plt

    summary = summarise(results)
    batches = results["batches"]
    micro = results["micro_batch"]
    fig, (mem, speed) = plt.subplots(1, 2, figsize=(11, 4.3))
    for way in WAYS:
        rows = [summary["rows"][f"{way} {b}"] for b in batches]
        style = dict(color=COLORS[way], marker="o", label=LABELS[way])
        mem.plot(batches, [r["peak_bytes"] / 2**20 for r in rows], **style)
        speed.plot(batches, [r["ms_per_sample"] for r in rows], **style)
        for pipeline in summary["pipelines"][1:]:
            if way != "plain":  # plain's first batch is traced too: the same curve
                mem.plot(
                    batches,
                    [r["peak_bytes_by_pipeline"][pipeline] / 2**20 for r in rows],
                    color=COLORS[way],
                    marker=".",
                    linestyle=":",
                    linewidth=1,
                    label=f"{way}, {pipeline} batch size",
                )
    mem.axhline(
        MEMORY_TARGET * summary["allowance_bytes"] / 2**20,
        color=COLORS["accum_steps"],
        linestyle="--",
        linewidth=0.8,
        label=f"{MEMORY_TARGET:.2f} x (plain at m = {micro} + weight copy)",
    )
    compile_name = "XLA" if results["jit_compile"] else "no XLA"
    for axis in (mem, speed):
        axis.set_xscale("log", base=2)
        axis.set_xticks(batches, [str(b) for b in batches])
        axis.set_xlabel("effective batch B (sequences per update)")
        axis.grid(alpha=0.3)
    mem.set_yscale("log", base=2)
    mem.set_ylabel("peak tensor memory during fit (MiB)")
    mem.set_title(f"Peak tensor memory (accumulating at m = {micro})", fontsize=10)
    mem.legend(fontsize=7)
    speed.set_ylim(bottom=0)
    speed.set_ylabel("median time per sequence (ms, wall)")
    speed.set_title("Time per sample", fontsize=10)
    speed.legend(fontsize=8)
    title = (
        f"{results['variables']}-variable decoder, {compile_name}, "
        f"{results['machine']['cpu']}, {results['machine']['cores']} cores"
    )
    if results["quick"]:
        title += " (quick mode: tiny, not meaningful)"
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--batches",
        type=int,
        nargs="+",
        default=None,
        help=f"effective batches B (default: {' '.join(map(str, BATCHES))})",
    )
    parser.add_argument(
        "--micro-batch",
        type=int,
        default=MICRO_BATCH,
        help="the micro-batch m (default: %(default)s)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="timed rounds after a warm-up round (default: 15, 1 with --quick)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="fresh processes per (way, B, pipeline), their median peak read (default: %(default)s)",
    )
    parser.add_argument("--jit-compile", action="store_true", help="compile with XLA")
    parser.add_argument("--quick", action="store_true", help="a tiny decoder: a smoke run")
    parser.add_argument(
        "--out",
        default=str(HERE),
        help="folder for memory_curve.{json,md,png} (default: %(default)s)",
    )
    parser.add_argument(
        "--pipelines",
        nargs="+",
        choices=PIPELINES,
        default=list(PIPELINES),
        help="the pipelines measured for memory (default: both; the criterion reads the first)",
    )
    parser.add_argument(
        "--memory-from",
        help="a previous run's JSON: its memory readings of pipelines not measured now are kept",
    )
    parser.add_argument(
        "--timing-from", help="a previous run's JSON: its timing is reused (no timing process)"
    )
    parser.add_argument(
        "--memory-worker", nargs=3, metavar=("WAY", "B", "PIPELINE"), help=argparse.SUPPRESS
    )
    parser.add_argument("--json", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1 (a process per reading), got {args.repeats}")
    micro = args.micro_batch
    if args.memory_worker:
        way, batch, pipeline = args.memory_worker
        result = measure_memory(way, int(batch), micro, args.quick, args.jit_compile, pipeline)
        Path(args.json).write_text(json.dumps(result))
        return
    batches = sorted(args.batches or BATCHES)
    if micro not in batches or any(b % micro for b in batches):
        parser.error(
            f"every B must be a multiple of the micro-batch {micro}, and B = {micro} "
            "must be among them (plain at the micro-batch is the reference)"
        )
    rounds = args.rounds or (1 if args.quick else 15)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    machine = {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "load_start": load_average(),
        "keras_accum": keras_accum_revision(),
    }
    print(
        f"memory curve: B = {batches}, m = {micro}, {rounds} rounds; load {machine['load_start']}",
        flush=True,
    )
    pipelines = [p for p in PIPELINES if p in args.pipelines]  # `known` first
    readings = []
    if args.memory_from:
        earlier = json.loads(Path(args.memory_from).read_text())
        machine["memory_from"] = f"{earlier['date']} at {earlier['machine']['keras_accum']}"
        readings = [r for r in earlier["memory"] if r["pipeline"] not in pipelines]
    # Each repeat goes over every configuration in turn, so a configuration's
    # processes are spread over the run, not one after another.
    each = {}
    for repeat in range(args.repeats):
        for pipeline in pipelines:
            for batch in batches:
                for way in WAYS:
                    reading = _memory_in_fresh_process(
                        way,
                        batch,
                        micro,
                        args.quick,
                        args.jit_compile,
                        pipeline,
                        out / "memory_curve_worker.json",
                    )
                    print(
                        f"  memory {way} {batch} ({pipeline}), process {repeat + 1}: "
                        f"{reading['peak_bytes'] / 1e6:.2f} MB",
                        flush=True,
                    )
                    each.setdefault((pipeline, batch, way), []).append(reading)
    readings += [repeated(r) for r in each.values()]
    (out / "memory_curve_worker.json").unlink(missing_ok=True)
    readings.sort(key=lambda r: PIPELINES.index(r["pipeline"]))  # the criterion's first
    import keras
    import tensorflow as tf

    if args.timing_from:
        earlier = json.loads(Path(args.timing_from).read_text())
        seconds, cpu_seconds = earlier["seconds"], earlier["cpu_seconds"]
        difference, rounds = earlier["weight_difference_vs_plain"], earlier["rounds"]
        # A run that reused timing names the run that measured it.
        machine["timing_from"] = earlier["machine"].get("timing_from", earlier["date"])
    else:
        seconds, cpu_seconds, difference = measure_time(
            batches, micro, rounds, args.quick, args.jit_compile
        )
    machine["load_end"] = load_average()
    workload = workloads.transformer(args.quick)
    keras.utils.set_random_seed(workloads.SEED)
    inputs, outputs = workload.build()
    model = keras.Model(inputs, outputs)
    results = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine,
        "versions": {
            "tensorflow": tf.__version__,
            "keras": keras.__version__,
            "python": platform.python_version(),
        },
        "quick": args.quick,
        "jit_compile": args.jit_compile,
        "description": workload.description.rsplit(",", 1)[0],  # sequences vary with B
        "variables": len(model.trainable_variables),
        "parameters": int(model.count_params()),
        "micro_batch": micro,
        "batches": batches,
        "rounds": rounds,
        "memory": readings,
        "seconds": seconds,
        "cpu_seconds": cpu_seconds,
        "weight_difference_vs_plain": difference,
    }
    (out / "memory_curve.json").write_text(json.dumps(results, indent=1) + "\n")
    text = markdown(results)
    (out / "memory_curve.md").write_text(text)
    plot(results, out / "memory_curve.png")
    print(text)
    print(
        f"wrote {out / 'memory_curve.md'}, {out / 'memory_curve.png'}, {out / 'memory_curve.json'}"
    )


if __name__ == "__main__":
    main()
