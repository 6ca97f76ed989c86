"""The steps-examples trade-off again, on a second task: a classifier trained
with Adam. Which learning-rate rule should `AccumScheduler("noise_scale")`
follow for Adam? ("auto" gives Adam "sqrt"; before 2026-12-05, the square
root of AdaScale's gain.)

    python -m benchmarks.batch_growth_adam             # the sweep and the rules
    python -m benchmarks.batch_growth_adam --schedule-only benchmarks/batch_growth_adam.json
    python -m benchmarks.batch_growth_adam --quick     # smoke run, not a measurement

The task: x ~ N(0, I_16); a fixed random teacher MLP (16-32-C, tanh, as
batch_growth's) gives C = 10 logits and the label is their argmax; a share
LABEL_NOISE (20%) of the training labels is replaced by a uniformly random
class (possibly the same). The student MLP (16-64-C, tanh) is trained with
`keras.optimizers.Adam` (Keras's defaults but the rate) on the sparse
categorical cross-entropy from logits until its held-out error rate
against the noise-free teacher labels (1 - accuracy) first reaches TARGET.
The error rate, not the excess cross-entropy: the cross-entropy's floor
on noisy labels would need the label distribution's own entropy, and the
cross-entropy against hard labels has none a student can reach; the error
against the teacher's labels has floor zero (uniform label noise leaves
the teacher's argmax the Bayes classifier), and is what a classifier is
for. It falls fast to about 0.22 (some 100,000 examples at any batch
size), then slowly: TARGET lies in that slow phase, reached at batch 16 in
some 11,000 updates.

Everything else is benchmarks/batch_growth.py's, through its `Task`
(carrying the optimizer, the loss, the outputs and the held-out measure):
the sqrt-2 learning-rate grid walked from the previous batch size's best,
the median over seeds, the checks every 2% of updates, the cutoff, the
caps, the fit S = S_min + E_min / B. Then the scheduler,
`AccumScheduler("noise_scale", max_accum_steps=128)` from batch 16
(micro-batch 8, accum_steps=2, an `AccumModel(noise_scale=True)`), with the
rate the sweep found best at batch 16, once per `learning_rate_rule`
("auto": "sqrt" for Adam, "adascale_sqrt" before 2026-12-05; "sqrt";
"adascale"; "adascale_sqrt"; "linear"; None: the rate left as it is), per seed; and "auto" from the rate tuned
for batch 256 with `tuned_batch=256`.

Writes benchmarks/batch_growth_adam.json (`--out`; the sweep's runs without
their checks, the scheduler's with their decisions and checks, floats
rounded) and its .md (the report).
"""

import argparse
import itertools
import json
import math
import os
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # quiet TensorFlow start-up

import numpy as np  # noqa: E402

from benchmarks import batch_growth as bg  # noqa: E402

CLASSES = 10
LABEL_NOISE = 0.2  # share of the training labels replaced by a random class
TARGET = 0.18  # held-out error rate against the teacher's labels to reach
N_TRAIN, N_TEST = 65536, 8192
INPUT_DIM = 16
TEACHER_HIDDEN = (32,)
STUDENT_HIDDEN = (64,)
TASK_SEED = 0

# From 16: batch 8 would need some 25,000 updates, near the cap (MAX_UPDATES).
# Up to 8192: the examples needed hardly grow up to 512, so the knee (and
# S_min) lies past 2048.
BATCH_SIZES = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
FIRST_LR = 2e-3  # Adam's: where the walk starts at the smallest batch size (on the grid: 0.00195)

# The scheduler's runs: each rule from batch 16 at the rate the sweep found
# best there (the names are the JSON's and the report's; the values
# `learning_rate_rule`'s).
RULES = {
    "auto": "auto",
    "sqrt": "sqrt",
    "adascale": "adascale",
    "adascale_sqrt": "adascale_sqrt",
    "linear": "linear",
    "None": None,
}
TUNED_256 = "auto, rate tuned for 256, tuned_batch=256"
# The scheduler's runs' cap, in examples (the sweep's is 4M): some 12 E_min
# here, several times what the rules that reach the target use. A rule
# whose rate is too high for Adam at the big batch ("linear": x64 at 1024)
# stays far from the target, and at micro-batches of 8 a run to the cap
# costs minutes.
SCHEDULE_MAX_EXAMPLES = 2_000_000


def error_rate(logits, labels):
    """The held-out measure: the share of `labels` (the noise-free
    teacher's) that the student's argmax misses. NaN when a logit is not
    finite (the argmax of NaNs is some class: this makes it divergence)."""
    import tensorflow as tf

    wrong = tf.not_equal(tf.argmax(logits, axis=-1, output_type=tf.int32), labels)
    rate = tf.reduce_mean(tf.cast(wrong, tf.float32))
    finite = tf.reduce_all(tf.math.is_finite(logits))
    return tf.where(finite, rate, tf.constant(math.nan, tf.float32))


def make_task(
    seed=TASK_SEED,
    n_train=N_TRAIN,
    n_test=N_TEST,
    target=TARGET,
    classes=CLASSES,
    label_noise=LABEL_NOISE,
    input_dim=INPUT_DIM,
    teacher_hidden=TEACHER_HIDDEN,
    student_hidden=STUDENT_HIDDEN,
):
    """The classification task from `seed` as a `batch_growth.Task`: int32
    labels (shape `(n,)`), `y_test` the teacher's, `y_test_noisy` with the
    training set's label noise; `noise_floor` is the error rate of the
    teacher itself against noisy labels, `label_noise * (1 - 1 / classes)`."""
    rng = np.random.default_rng(seed)
    # The teacher as batch_growth's: N(0, 1/fan_in) weights, tanh. The
    # logits' scale does not matter (only their argmax is used).
    widths = (input_dim, *teacher_hidden)
    weights = [rng.normal(0, 1 / math.sqrt(a), (a, b)) for a, b in itertools.pairwise(widths)]
    biases = [rng.normal(0, 0.1, b) for b in widths[1:]]
    head = rng.normal(0, 1 / math.sqrt(widths[-1]), (widths[-1], classes))
    head_bias = rng.normal(0, 0.1, classes)

    def labels(x):
        h = x.astype(np.float64)
        for w, b in zip(weights, biases):
            h = np.tanh(h @ w + b)
        return np.argmax(h @ head + head_bias, axis=-1).astype(np.int32)

    def noisy(y):
        flip = rng.random(len(y)) < label_noise
        return np.where(flip, rng.integers(0, classes, len(y)), y).astype(np.int32)

    x_train = rng.normal(size=(n_train, input_dim)).astype(np.float32)
    y_train = noisy(labels(x_train))
    x_test = rng.normal(size=(n_test, input_dim)).astype(np.float32)
    y_test = labels(x_test)
    y_test_noisy = noisy(y_test)
    return bg.Task(
        x_train,
        y_train,
        x_test,
        y_test,
        y_test_noisy,
        noise_floor=label_noise * (1 - 1 / classes),
        target=target,
        seed=seed,
        input_dim=input_dim,
        student_hidden=tuple(student_hidden),
        output_dim=classes,
        optimizer="Adam",
        loss=_loss(),
        held_out=error_rate,
        held_out_name="held-out error rate",
    )


def _loss():
    import keras

    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def auto_is():
    """The rule name "auto" resolves to for this benchmark's optimizer."""
    import keras

    from keras_accum import rate_rules

    chosen = rate_rules.for_optimizer("auto", keras.optimizers.Adam())
    return next(name for name, rule in rate_rules.RULES.items() if rule is chosen)


def schedule(
    task,
    best,
    fit,
    seeds,
    rules=tuple(RULES),
    tuned_256=True,
    max_examples=SCHEDULE_MAX_EXAMPLES,
    **scheduler_kwargs,
):
    """`batch_growth.schedule_runs` once per rule (`RULES`' names), from
    batch 16 at its swept best rate; with `tuned_256`, also "auto" from
    batch 16 at the rate swept best at 256, told so (`tuned_batch=256`).
    Each run stops at `max_examples` (not reached). Returns `{name:
    summary}` (the medians over the seeds that reached the target, in S_min
    and E_min too, and each run)."""
    reach_kwargs = dict(max_examples=max_examples)
    out = {}
    first = min(best, key=int)  # 16, unless the sweep began elsewhere
    for name in rules:
        starts = {name: dict(rate_of=int(first), tuned_batch=None)}
        out.update(
            bg.schedule_runs(
                task,
                best,
                fit,
                seeds,
                starts,
                reach_kwargs=reach_kwargs,
                learning_rate_rule=RULES[name],
                **scheduler_kwargs,
            )
        )
        out[name]["rule"] = name
    if tuned_256 and "256" in best:
        starts = {TUNED_256: dict(rate_of=256, tuned_batch=256)}
        out.update(
            bg.schedule_runs(
                task,
                best,
                fit,
                seeds,
                starts,
                reach_kwargs=reach_kwargs,
                learning_rate_rule="auto",
                **scheduler_kwargs,
            )
        )
        out[TUNED_256]["rule"] = "auto"
    for summary in out.values():
        for run in summary["runs"]:
            # What the run ended at: the batch, and the rate's factor over
            # the start's (the rule's doing; a rule sets the rate only
            # when the batch changes, the decision's rate None otherwise,
            # and always without a rule).
            decisions = run["decisions"]
            run["final_batch"] = (
                decisions[-1]["batch"] if decisions else bg.SCHEDULE_MICRO * bg.SCHEDULE_START
            )
            rates = [d["learning_rate"] for d in decisions if d["learning_rate"] is not None]
            run["final_rate_factor"] = rates[-1] / summary["learning_rate"] if rates else None
    return out


def _rounded(value, digits=4):
    """Floats to `digits` significant digits, through lists and dicts."""
    if isinstance(value, float):
        return float(f"{value:.{digits}g}") if math.isfinite(value) else value
    if isinstance(value, dict):
        return {k: _rounded(v, digits) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_rounded(v, digits) for v in value]
    return value


def _thinned(path, growth=0.1):
    """A run's checks, one per `growth` (relative) of the updates, and the
    last: the curve, not every check."""
    kept = []
    for check in path:
        if not kept or check[0] >= kept[-1][0] * (1 + growth) or check is path[-1]:
            kept.append(check)
    return kept


def _thinned_decisions(decisions, growth=0.1):
    """The scheduler's decisions that changed the batch, and otherwise one
    per `growth` (relative) of the updates, and the last."""
    kept = []
    for d in decisions:
        if (
            not kept
            or d["batch"] != kept[-1]["batch"]
            or d["updates"] >= kept[-1]["updates"] * (1 + growth)
            or d is decisions[-1]
        ):
            kept.append(d)
    return kept


def compact_json(results):
    """The JSON written: floats rounded, the sweep's runs without their
    checks, the scheduler's with a thinned path (one check per 10% of
    updates) and thinned decisions (each change of the batch, else one per
    10% of updates), one run's path or decisions per line."""
    results = dict(
        results, runs=[{k: v for k, v in run.items() if k != "path"} for run in results["runs"]]
    )
    results = _rounded(results)
    inline = {}
    for summary in results.get("schedule", {}).values():
        for run in summary["runs"]:
            run["path"] = _thinned(run["path"])
            run["decisions"] = _thinned_decisions(run["decisions"])
            for key in ("path", "decisions"):
                marker = f"@{key}{len(inline)}@"
                inline[marker] = "[" + ", ".join(json.dumps(x) for x in run[key]) + "]"
                run[key] = marker
    text = json.dumps(results, indent=1)
    for marker, line in inline.items():
        text = text.replace(json.dumps(marker), line)
    return text + "\n"


def report(results):
    """The Markdown report (benchmarks/batch_growth_adam.md): the task, the
    sweep's best per batch size, the fit, the rules' table."""
    task, sweep = results["task"], results["sweep"]
    lines = [
        "# Batch growth on a classifier trained with Adam",
        "",
        f"Task: x ~ N(0, I_{task['input_dim']}); labels the argmax of a fixed random "
        f"teacher MLP ({task['input_dim']}-{'-'.join(map(str, task['teacher_hidden']))}-"
        f"{task['classes']}, tanh), {task['label_noise']:.0%} of the training labels "
        f"replaced by a uniformly random class; {task['n_train']:,} training and "
        f"{task['n_test']:,} held-out samples. Student "
        f"{task['input_dim']}-{'-'.join(map(str, task['student_hidden']))}-"
        f"{task['classes']} (tanh), `{sweep['optimizer']}`, {sweep['loss']}. Target: "
        f"held-out error rate against the noise-free teacher labels <= {task['target']}.",
        "",
        "| batch B | best rate | updates S | examples E | rates tried: median updates |",
        "|---|---|---|---|---|",
    ]
    for b, v in results["best"].items():
        edge = " (grid edge)" if v["best_at_grid_edge"] else ""
        tried = ", ".join(f"{lr}: {'-' if u is None else f'{u:g}'}" for lr, u in v["tried"].items())
        lines.append(
            f"| {b} | {v['learning_rate']:.3g}{edge} | {v['updates']:g} | "
            f"{v['examples']:,.0f} | {tried} |"
        )
    fit = results["fit"]
    residuals = ", ".join(f"{r:+.2f}" for r in fit["relative_residuals"])
    lines += [
        "",
        f"Medians over seeds {', '.join(map(str, sweep['seeds']))} (a seed draws the "
        "student's weights and the data order; '-': a seed did not reach the target "
        "before the cutoff or cap). Fit S = S_min + E_min/B: "
        f"`S_min` = {fit['S_min']:.0f} updates, `E_min` = {fit['E_min']:,.0f} examples, "
        f"`B_crit` = {fit['B_crit']:.0f} (relative residuals {residuals}).",
        "",
        '| AccumScheduler("noise_scale", max_accum_steps=128) from batch 16, '
        "learning_rate_rule | rate | updates (in `S_min`) | examples (in `E_min`) | "
        "per seed: updates / examples (final batch, rate factor) | reached |",
        "|---|---|---|---|---|---|",
    ]
    for name, summary in results.get("schedule", {}).items():
        per_seed = "; ".join(
            (f"{r['updates']} / {r['examples']:,}" if r["reached"] else f"{r['stopped']}")
            + f" ({r['final_batch']}, "
            + ("-" if r["final_rate_factor"] is None else f"x{r['final_rate_factor']:.3g}")
            + ")"
            for r in summary["runs"]
        )
        count = f"{summary['reached']} of {len(summary['runs'])}"
        if "updates" not in summary:
            lines.append(
                f"| {name} | {summary['learning_rate']:.3g} | - | - | {per_seed} | {count} |"
            )
            continue
        lines.append(
            f"| {name} | {summary['learning_rate']:.3g} | {summary['updates']:g} "
            f"({summary['updates_in_S_min']:.2f}) | {summary['examples']:,.0f} "
            f"({summary['examples_in_E_min']:.2f}) | {per_seed} | {count} |"
        )
    # The start, and the batch the scheduler's cap allows (1024): the
    # swept best there, for comparison.
    cap = str(bg.SCHEDULE_MICRO * bg.SCHEDULE_CAP)
    for b in dict.fromkeys((min(results["best"], key=int), "256", cap)):
        if b in results["best"]:
            v = results["best"][b]
            lines.append(
                f"| fixed batch {b}, its best rate (the sweep) | {v['learning_rate']:.3g} | "
                f"{v['updates']:g} ({v['updates'] / fit['S_min']:.2f}) | "
                f"{v['examples']:,.0f} ({v['examples'] / fit['E_min']:.2f}) | | |"
            )
    lines += [
        "",
        "| learning_rate_rule | per seed: batch 1024 (the cap) from update (examples) | "
        "last noise-scale estimate (low-high) |",
        "|---|---|---|",
    ]
    for name, summary in results.get("schedule", {}).items():
        grown, last = [], []
        for r in summary["runs"]:
            at = next((d for d in r["decisions"] if d["batch"] == int(cap)), None)
            grown.append("-" if at is None else f"{at['updates']} ({at['samples']:,})")
            d = r["decisions"][-1] if r["decisions"] else None
            last.append(
                "-" if d is None else f"{d['noise_scale']:,.0f} ({d['low']:,.0f}-{d['high']:,.0f})"
            )
        lines.append(f"| {name} | {'; '.join(grown)} | {'; '.join(last)} |")
    lines += [
        "",
        'Medians over the seeds that reached the target; "auto" is '
        f'"{results.get("auto_is", "adascale_sqrt")}" for Adam. Per seed, "cap": not reached within '
        f"{results.get('schedule_max_examples', bg.MAX_EXAMPLES):,} examples. Final batch: the "
        "scheduler's last decision's; rate factor: the last rate its rule set over the "
        "start's (a rule sets it only when the batch changes; '-': no rule).",
        "",
        f"Run {results['date']}, TensorFlow {results['versions']['tensorflow']}, "
        f"Keras {results['versions']['keras']}, {results['threads']} thread(s), "
        f"{results['wall_seconds']:.0f} s",
    ]
    if "sweep_run" in results:
        sweep_run = results["sweep_run"]
        lines[-1] += (
            f" for the scheduler's runs, on the sweep of {sweep_run['date']} "
            f"({sweep_run['wall_seconds']:.0f} s)"
        )
    elif "sweep_seconds" in results:
        lines[-1] += f" (the sweep {results['sweep_seconds']:.0f} s)"
    lines[-1] += "."
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=list(BATCH_SIZES))
    parser.add_argument(
        "--seeds",
        type=int,
        nargs="+",
        default=[0, 1, 2],
        help="the sweep's student and shuffle seeds; the median is used",
    )
    parser.add_argument(
        "--rule-seeds",
        type=int,
        nargs="+",
        default=[0, 1, 2],
        help="the scheduler's seeds, per rule",
    )
    parser.add_argument("--rules", nargs="+", default=list(RULES), choices=list(RULES))
    parser.add_argument(
        "--no-256", action="store_true", help='without "auto" from the rate tuned for 256'
    )
    parser.add_argument("--task-seed", type=int, default=TASK_SEED)
    parser.add_argument("--target", type=float, default=TARGET)
    parser.add_argument(
        "--first-lr",
        type=float,
        default=FIRST_LR,
        help="learning rate the walk starts from at the first batch size",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="TensorFlow intra- and inter-op threads (default: 1; the machine is shared)",
    )
    parser.add_argument("--quick", action="store_true", help="a smoke run, not a measurement")
    parser.add_argument(
        "--out",
        default=None,
        help="JSON path (default: benchmarks/batch_growth_adam.json; none when --quick)",
    )
    parser.add_argument(
        "--schedule-only",
        metavar="JSON",
        help="skip the sweep: take it from this JSON and run the scheduler only",
    )
    parser.add_argument("--no-schedule", action="store_true", help="the sweep only")
    parser.add_argument(
        "--report", metavar="JSON", help="only rewrite the .md next to this JSON, from it"
    )
    args = parser.parse_args(argv)
    if args.report:
        path = Path(args.report)
        path.with_suffix(".md").write_text(report(json.loads(path.read_text())))
        return
    import tensorflow as tf

    # Before any op runs: the thread pools are fixed at their first use.
    tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    tf.config.threading.set_inter_op_parallelism_threads(args.threads)

    out = args.out or (
        None if args.quick else str(Path(__file__).parent / "batch_growth_adam.json")
    )
    task = make_task(args.task_seed, target=args.target)
    batch_sizes, seeds, rule_seeds = args.batch_sizes, tuple(args.seeds), tuple(args.rule_seeds)
    rules, tuned_256, every = args.rules, not args.no_256, {}
    if args.quick:
        # An easy target (the fast first phase), three batch sizes, one
        # seed, one rule deciding early: seconds, not a measurement.
        task.target = 0.3
        seeds, rule_seeds, rules, tuned_256 = seeds[:1], rule_seeds[:1], ["auto"], False
        batch_sizes = [b for b in batch_sizes if b >= 64][:5:2] or batch_sizes[-2:]
        args.first_lr = max(args.first_lr, 0.01)  # near batch 64's best: a short walk
        every = dict(every_updates=5)
    began = time.perf_counter()
    if args.schedule_only:
        swept = json.loads(Path(args.schedule_only).read_text())
        results = {k: swept[k] for k in ("runs", "best", "fit")}
        results["sweep_run"] = {k: swept[k] for k in ("date", "wall_seconds", "threads")}
        sweep_meta = swept["sweep"]
        task.target = swept["task"]["target"]
    else:
        results = bg.sweep(task, batch_sizes, seeds, first_lr=args.first_lr)
        results["sweep_seconds"] = round(time.perf_counter() - began, 1)
        sweep_meta = {
            "seeds": list(seeds),
            "batch_sizes": list(batch_sizes),
            "lr_factor": bg.LR_FACTOR,
            "first_lr": args.first_lr,
            "resolution": bg.RESOLUTION,
            "cutoff": bg.CUTOFF,
            "max_examples": bg.MAX_EXAMPLES,
            "max_updates": bg.MAX_UPDATES,
            "optimizer": "keras.optimizers.Adam, Keras's defaults but the rate",
            "loss": "sparse categorical cross-entropy from logits",
        }
    if not args.no_schedule and results["fit"]:
        results["schedule"] = schedule(
            task, results["best"], results["fit"], rule_seeds, rules, tuned_256, **every
        )
    seconds = time.perf_counter() - began
    results = {
        **bg.run_record(args.threads, seconds, args.quick),
        "task": {
            "seed": args.task_seed,
            "n_train": len(task.x_train),
            "n_test": len(task.x_test),
            "input_dim": task.input_dim,
            "teacher_hidden": list(TEACHER_HIDDEN),
            "student_hidden": list(task.student_hidden),
            "activation": "tanh",
            "classes": task.output_dim,
            "label_noise": LABEL_NOISE,
            "noise_floor": task.noise_floor,
            "target": task.target,
            "held_out": "error rate (1 - accuracy) against the noise-free teacher labels",
        },
        "sweep": sweep_meta,
        "schedule_seeds": list(rule_seeds),
        "auto_is": auto_is(),
        "schedule_max_examples": SCHEDULE_MAX_EXAMPLES,
        **results,
    }
    bg.print_summary(results)
    print(f"{seconds:.0f} s with {args.threads} thread(s)")
    if out:
        Path(out).write_text(compact_json(results))
        Path(out).with_suffix(".md").write_text(report(results))
        print(f"wrote {out} and its .md")


if __name__ == "__main__":
    main()
