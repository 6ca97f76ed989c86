"""Turns the workers' raw results into medians, ratios, a table and a chart.

Pure Python plus matplotlib: the driver imports it without TensorFlow.
"""

import statistics

from benchmarks import workloads

IMPLEMENTATIONS = workloads.IMPLEMENTATIONS
OTHERS = tuple(name for name in IMPLEMENTATIONS if name != "AccumModel")
# The targets the README reads the results against.
SPEED_TARGET = 1.00  # AccumModel / other, median paired ratio
MEMORY_TARGET = 1.10  # AccumModel b x N / (plain b + one float32 weight copy)
FAR_BELOW = 0.50  # AccumModel b x N / plain N*b counts as "far below" under this
WELL_UNDER_HALF = 0.50  # two workers: epoch at accum_steps N / at 1
PRICE_TARGET = 1.30  # micro_batch_size=b / big batch, median paired ratio
COLORS = {
    "plain": "#9e9e9e",
    "builtin": "#f0a030",
    "gradient-accumulator": "#7aa6d6",
    "AccumModel": "#2e7d32",
}


def summarise_timing(result):
    """Medians and paired ratios of one workload's timing result.

    Round 0 is skipped for everyone: it traces the train step. A paired
    ratio is AccumModel's epoch time over another implementation's epoch
    time in the same round, so both saw the same moment's machine load.

    Returns:
        `{implementation: {"median": s, "epochs": k, "ratio": r, "ratio_min":
        ..., "ratio_max": ...}}`, with None where an implementation did not
        run; "ratio*" only for implementations other than AccumModel.
    """
    seconds = result["seconds"]
    measured = range(1, result["rounds"])
    accum = seconds["AccumModel"]
    summary = {}
    for name in IMPLEMENTATIONS:
        times = [seconds[name][r] for r in measured if seconds[name][r] is not None]
        row = {"median": statistics.median(times) if times else None, "epochs": len(times)}
        if name != "AccumModel":
            ratios = [
                accum[r] / seconds[name][r]
                for r in measured
                if accum[r] is not None and seconds[name][r] is not None
            ]
            row["ratio"] = statistics.median(ratios) if ratios else None
            row["ratio_min"] = min(ratios) if ratios else None
            row["ratio_max"] = max(ratios) if ratios else None
            cpu = result.get("cpu_seconds")  # results before CPU time have none
            cpu_ratios = [
                cpu["AccumModel"][r] / cpu[name][r]
                for r in measured
                if cpu and cpu["AccumModel"][r] is not None and cpu[name][r] is not None
            ]
            row["cpu_ratio"] = statistics.median(cpu_ratios) if cpu_ratios else None
        summary[name] = row
    return summary


def summarise_price(result):
    """Medians and paired ratios to the big batch of each `PRICE_MODES` mode.

    As `summarise_timing`, with the plain model trained on the big batch as
    the denominator; "vs_step" is micro_batch_size=b's paired ratio to step
    mode. Empty for results from before the modes were measured.

    Returns:
        `{mode: {"median": s, "ratio": r, "ratio_min": ..., "ratio_max": ...}}`
        and, for micro_batch_size=b, "vs_step" (median paired ratio).
    """
    seconds = result["seconds"]
    if "big batch" not in seconds:
        return {}
    measured = range(1, result["rounds"])

    def paired(a, b):
        ratios = [
            seconds[a][r] / seconds[b][r]
            for r in measured
            if seconds[a][r] is not None and seconds[b][r] is not None
        ]
        if not ratios:
            return None, None, None
        return statistics.median(ratios), min(ratios), max(ratios)

    summary = {}
    for mode in workloads.PRICE_MODES:
        times = [seconds[mode][r] for r in measured if seconds[mode][r] is not None]
        ratio, low, high = paired(mode, "big batch")
        summary[mode] = {
            "median": statistics.median(times) if times else None,
            "ratio": ratio,
            "ratio_min": low,
            "ratio_max": high,
        }
    summary["micro_batch_size=b"]["vs_step"] = paired("micro_batch_size=b", "step mode")[0]
    return summary


def price_markdown(results):
    """The "price of the memory saved" section, or nothing for older results."""
    timing = [r for r in results["timing"] if summarise_price(r)]
    if not timing:
        return []
    n, b = workloads.PRICE_ACCUM_STEPS, workloads.MICRO_BATCH
    out = [
        "",
        "## Price of the memory saved",
        "",
        f"Every mode below makes the same updates, of N*b = {n * b} samples "
        f"(b = {b}, N = {n}), as the plain model trained with that big batch "
        "itself: the run accumulation stands in for when the big batch does "
        "not fit. Timed in the same processes and rounds as the table above "
        "(modes rotated with the implementations). *Price*: the mode's epoch "
        "time divided by the big batch's epoch time in the same round, median "
        "over rounds (min-max): what the memory saved costs in time.",
        "",
    ]
    out += [f"- `{mode}`: {workloads.PRICE_NOTES[mode]}" for mode in workloads.PRICE_MODES]
    out += [
        "",
        "| workload | mode | batch per step | median epoch (s) | price: time / big batch's (min-max) |",
        "| --- | --- | ---: | ---: | ---: |",
    ]
    for result in timing:
        summary = summarise_price(result)
        for mode in workloads.PRICE_MODES:
            row = summary[mode]
            batch = result["price_batch_sizes"][mode]
            if row["median"] is None:
                reason = result["unavailable"].get(mode, "did not run")
                out.append(f"| {result['workload']} | {mode} | {batch} | unavailable: {reason} | |")
                continue
            price = (
                "1 (reference)"
                if mode == "big batch"
                else f"**{_fmt(row['ratio'])}** ({_fmt(row['ratio_min'])}-{_fmt(row['ratio_max'])})"
            )
            out.append(
                f"| {result['workload']} | {mode} | {batch} | {row['median']:.3f} | {price} |"
            )
    out += ["", "Largest weight difference from the big batch after the run:", ""]
    for result in timing:
        differences = ", ".join(
            f"{mode} {value:.1e}"
            for mode, value in result.get("max_weight_difference_vs_big_batch", {}).items()
        )
        out.append(f"- **{result['workload']}**: {differences or 'n/a'}")
    return out


def price_targets(results):
    """micro_batch_size=b within PRICE_TARGET of the big batch, and never
    slower than step mode, on every workload."""
    lines = []
    for result in results["timing"]:
        summary = summarise_price(result)
        if not summary:
            continue
        row = summary["micro_batch_size=b"]
        name = result["workload"]
        if row["ratio"] is None:
            lines.append((None, f"{name}: micro_batch_size=b: not measured."))
            continue
        lines.append(
            (
                round(row["ratio"], 2) <= PRICE_TARGET,
                f"{name}: micro_batch_size=b / big batch = {row['ratio']:.2f} "
                f"(target <= {PRICE_TARGET:.2f})",
            )
        )
        lines.append(
            (
                round(row["vs_step"], 2) <= 1.0,
                f"{name}: micro_batch_size=b / step mode = {row['vs_step']:.2f} "
                "(target: never slower, <= 1.00)",
            )
        )
    return lines


def summarise_multi_worker(result):
    """Median epoch times at accum_steps 1 and N, and their paired ratio.

    Round 0 (tracing) is skipped. The paired ratio is the epoch time at N
    over the epoch time at 1 in the same round.

    Returns:
        `{"1": median, "N": median, "ratio": r, "ratio_min": ..., "ratio_max": ...}`
        with N the benchmark's accum_steps.
    """
    seconds = result["seconds"]
    n = next(k for k in seconds if k != "1")
    one, many = seconds["1"][1:], seconds[n][1:]
    ratios = [b / a for a, b in zip(one, many)]
    return {
        "1": statistics.median(one),
        n: statistics.median(many),
        "ratio": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
    }


def memory_by_config(memory_results):
    """The memory workers' results keyed by configuration name."""
    return {result["config"]: result for result in memory_results or ()}


def targets(results):
    """The README's targets, each as `(met: bool or None, sentence)`."""
    lines = []
    for result in results["timing"]:
        summary = summarise_timing(result)
        name = result["workload"]
        for other in OTHERS:
            ratio = summary[other]["ratio"]
            if ratio is None:
                lines.append(
                    (None, f"{name}: AccumModel vs {other}: not measured ({other} unavailable).")
                )
                continue
            # Judged at the precision shown: 1.004 reads as 1.00 and meets it.
            met = round(ratio, 2) <= SPEED_TARGET
            if round(ratio, 2) == 1:
                reading = f"the same time as {other}'s, to within 0.5%"
            elif ratio < 1:
                reading = f"{(1 - ratio) * 100:.0f}% less time than {other}'s"
            else:
                reading = f"{(ratio - 1) * 100:.0f}% more time than {other}'s"
            lines.append(
                (
                    met,
                    f"{name}: AccumModel / {other} = {ratio:.2f}: AccumModel's "
                    f"epochs take {reading} (target <= {SPEED_TARGET:.2f})",
                )
            )
    memory = memory_by_config(results["memory"])
    if not memory:  # a timing-only run
        return lines + price_targets(results)
    accum = memory["AccumModel b x N"]
    plain_b = memory["plain b"]
    big = memory["plain N*b"]
    allowance = plain_b["growth_mib"] + accum["weight_copy_mib"]
    ratio = accum["growth_mib"] / allowance
    lines.append(
        (
            ratio <= MEMORY_TARGET,
            f"memory: AccumModel b x N / (plain b + one float32 weight copy) = "
            f"{accum['growth_mib']:.0f} / ({plain_b['growth_mib']:.0f} + "
            f"{accum['weight_copy_mib']:.2f}) MiB = {ratio:.2f} (target <= {MEMORY_TARGET:.2f})",
        )
    )
    ratio = accum["growth_mib"] / big["growth_mib"]
    lines.append(
        (
            ratio <= FAR_BELOW,
            f"memory: AccumModel b x N / plain N*b = {accum['growth_mib']:.0f} / "
            f'{big["growth_mib"]:.0f} MiB = {ratio:.2f} ("far below": target <= {FAR_BELOW:.2f})',
        )
    )
    micro = memory.get("micro_batch_size b of N*b")
    if micro is not None:
        ratio = micro["growth_mib"] / plain_b["growth_mib"]
        lines.append(
            (
                ratio <= MEMORY_TARGET,
                f"memory: micro_batch_size b of N*b / plain b = "
                f"{micro['growth_mib']:.0f} / {plain_b['growth_mib']:.0f} MiB = "
                f"{ratio:.2f} (target <= {MEMORY_TARGET:.2f}; includes the "
                f"{workloads.ACCUM_STEPS * workloads.MICRO_BATCH}-sample input "
                "batches the pipeline holds)",
            )
        )
        fed = memory.get("plain b, input in N*b batches")
        if fed is not None:
            ratio = micro["growth_mib"] / fed["growth_mib"]
            lines.append(
                (
                    ratio <= MEMORY_TARGET,
                    f"memory: micro_batch_size b of N*b / plain b with the same "
                    f"input batches = {micro['growth_mib']:.0f} / "
                    f"{fed['growth_mib']:.0f} MiB = {ratio:.2f} (target <= "
                    f"{MEMORY_TARGET:.2f}: training at the micro-batch's memory)",
                )
            )
    lines += price_targets(results)
    if not results.get("multi_worker"):
        return lines
    summary = summarise_multi_worker(results["multi_worker"])
    lines.append(
        (
            summary["ratio"] < WELL_UNDER_HALF,
            f"two workers: epoch at accum_steps {workloads.ACCUM_STEPS} / at 1 = "
            f'{summary["ratio"]:.2f} ("well under half": target < {WELL_UNDER_HALF:.2f})',
        )
    )
    return lines


def _fmt(value, digits=2, suffix=""):
    return "n/a" if value is None else f"{value:.{digits}f}{suffix}"


def markdown(results):
    """The whole results.md text."""
    machine = results["machine"]
    versions = results["versions"]
    n, b = workloads.ACCUM_STEPS, workloads.MICRO_BATCH
    out = ["# keras_accum benchmarks", ""]
    if results["quick"]:
        out += [
            "**Quick mode**: tiny models and data, 2 measured epochs. A smoke "
            "test of the benchmark itself; the numbers mean nothing.",
            "",
        ]
    ga = versions.get("gradient-accumulator")
    out += [
        f"- **Date**: {results['date']}",
        f"- **Machine**: {machine['cpu']}, {machine['cores']} cores "
        f"({machine['affinity']} usable), load average {machine['load_start']} "
        f"at the start and {machine['load_end']} at the end of the run",
        f"- **Software**: Python {machine['python']}, TensorFlow "
        f"{versions['tensorflow']}, Keras {versions['keras']}, numpy "
        f"{versions['numpy']}, gradient-accumulator {ga or 'not installed'}; "
        f"keras_accum at {machine.get('keras_accum', 'unknown')}",
        f"- **Settings**: micro-batch b = {b}, accum_steps N = {n} (updates "
        f"of {n * b} samples), Adam (learning rate {workloads.LEARNING_RATE}), "
        "float32, CPU, Keras defaults otherwise (no XLA on CPU), no metrics, "
        "`shuffle=False`",
        "",
        "## Speed",
        "",
        "Implementations, each trained with micro-batch b:",
        "",
    ]
    out += [f"- `{name}`: {workloads.IMPLEMENTATION_NOTES[name]}" for name in IMPLEMENTATIONS]
    rounds = results["timing"][0]["rounds"]
    # Results from before CPU time was recorded have no CPU column.
    with_cpu = any(r.get("cpu_seconds") for r in results["timing"])
    out += [
        "",
        f"Method: one fresh Python process per workload builds every "
        f"implementation from the same seed (same initial weights) and then "
        f"runs {rounds} rounds; each round trains every implementation for "
        "one epoch on the same data, in an order rotated by one place per "
        "round. Round 1 (tracing, warm-up) is dropped. An epoch's time is "
        "wall-clock from `on_epoch_begin` to `on_epoch_end` (AccumModel's "
        "end-of-epoch flush included). *Paired ratio*: AccumModel's epoch "
        "time divided by the other implementation's epoch time **in the same "
        "round**; the table gives the median over rounds (and min-max). Paired "
        "ratios cancel most background load, which hits both epochs of a pair "
        "alike; lower than 1.00 means AccumModel is faster.",
        "",
        "| workload | implementation | median epoch (s) | vs plain | "
        "AccumModel / this: median paired ratio (min-max) |"
        + (" by CPU time: median |" if with_cpu else ""),
        "| --- | --- | ---: | ---: | ---: |" + (" ---: |" if with_cpu else ""),
    ]
    for result in results["timing"]:
        summary = summarise_timing(result)
        plain = summary["plain"]["median"]
        for name in IMPLEMENTATIONS:
            row = summary[name]
            if row["median"] is None:
                reason = result["unavailable"].get(name, "did not run")
                out.append(
                    f"| {result['workload']} | {name} | unavailable: {reason} | | |"
                    + (" |" if with_cpu else "")
                )
                continue
            ratio = (
                "-"
                if name == "AccumModel"
                else f"**{_fmt(row['ratio'])}** ({_fmt(row['ratio_min'])}-{_fmt(row['ratio_max'])})"
            )
            cpu = (
                ""
                if not with_cpu
                else (" - |" if name == "AccumModel" else f" {_fmt(row.get('cpu_ratio'))} |")
            )
            out.append(
                f"| {result['workload']} | {name} | {row['median']:.3f} | "
                f"{row['median'] / plain:.2f} | {ratio} |{cpu}"
            )
    out += ["", "Workloads (samples are a multiple of N*b: every window is full):", ""]
    for result in results["timing"]:
        differences = ", ".join(
            f"{name} {value:.1e}"
            for name, value in result["max_weight_difference_vs_AccumModel"].items()
        )
        out.append(
            f"- **{result['workload']}**: {result['description']}; "
            f"{result['parameters']:,} parameters, {result['steps_per_epoch']} "
            f"micro-batches per epoch. Largest weight difference from "
            f"AccumModel after the run: {differences or 'n/a'}."
        )
    memory = memory_by_config(results["memory"])
    if not memory:  # a timing-only run (`--timing-only`)
        return _end(out, results)
    first = next(iter(memory.values()))
    big, plain_b = memory["plain N*b"], memory["plain b"]
    out += [
        "",
        "## Memory",
        "",
        f"Workload: {first['description']}; {first['parameters']:,} "
        f"parameters, so one float32 copy of the trainable weights (what "
        f"AccumModel's gradient buffers take) is {first['weight_copy_mib']:.2f} MiB.",
        "",
        "Method: one fresh Python process per configuration. After importing "
        "TensorFlow, building and compiling the model, creating the optimizer's "
        "slots and batching the data into a `tf.data.Dataset`, the peak RSS "
        "is reset (`echo 5 > /proc/self/clear_refs`); one `fit` epoch of "
        f"{first['samples']} samples then runs, and the table gives VmHWM "
        "after `fit` minus VmRSS before it (/proc/self/status): the most "
        "memory `fit` held at once, including tracing the step and "
        "AccumModel's buffers. The processes run with "
        f"`MALLOC_MMAP_THRESHOLD_={first.get('malloc_mmap_threshold')}` so "
        "that glibc returns freed tensor memory at once instead of caching "
        "it depending on allocation history (with glibc's adaptive default "
        "the same configuration varies by tens of MiB between processes). "
        f"Method actually used: {first['method']}.",
        "",
        "| configuration | batch | updates | peak RSS growth in fit (MiB) | / plain b | / plain N*b |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for config in workloads.MEMORY_CONFIGS:
        row = memory.get(config)
        if row is None:
            continue  # results from before this configuration was measured
        if row.get("micro_batch_size"):
            batch = f"{row['batch_size']} split into {row['micro_batch_size']}s"
        elif row.get("input_batch", row["batch_size"]) != row["batch_size"]:
            batch = f"{row['batch_size']} (input in {row['input_batch']}s)"
        elif row["accum_steps"] > 1:
            batch = f"{row['batch_size']} x {row['accum_steps']}"
        else:
            batch = str(row["batch_size"])
        out.append(
            f"| {config} | {batch} | {row['updates']} | {row['growth_mib']:.0f} | "
            f"{row['growth_mib'] / plain_b['growth_mib']:.2f} | "
            f"{row['growth_mib'] / big['growth_mib']:.2f} |"
        )
    return _end(out, results)


def _end(out, results):
    """The price, two-worker and targets sections after the tables above."""
    out += price_markdown(results)
    if results.get("multi_worker"):
        out += multi_worker_markdown(results["multi_worker"])
    out += ["", "## Targets", ""]
    marks = {True: "met", False: "**missed**", None: "not measured"}
    out += [f"- {marks[met]}: {sentence}" for met, sentence in targets(results)]
    out.append("")
    return "\n".join(out)


def multi_worker_markdown(result):
    summary = summarise_multi_worker(result)
    n = str(workloads.ACCUM_STEPS)
    return [
        "",
        "## Two workers",
        "",
        f"Workload: {result['description']}; {result['parameters']:,} "
        f"parameters, {result['micro_batches_per_epoch']} global micro-batches "
        "per epoch: parameters large next to compute, so an update's "
        "all-reduce of the gradients is most of a step.",
        "",
        "Method: two worker processes on this machine under "
        "`MultiWorkerMirroredStrategy` (TF_CONFIG on localhost ports, "
        "`tf.data` with `AutoShardPolicy.DATA`, one op thread each so they "
        "do not oversubscribe the cores). Both train two AccumModels from the "
        "same seed, at accum_steps 1 and N, one epoch each per round, the "
        f"order alternating; {result['rounds']} rounds, the first dropped. "
        "Paired ratio: the epoch at N over the epoch at 1 in the same round. "
        "Plain `keras.Model.fit` and Keras's `gradient_accumulation_steps` do "
        "not run under this strategy on TensorFlow 2.21 (tests/"
        "test_distributed.py), so accum_steps=1 is AccumModel's own "
        "no-accumulation path.",
        "",
        "| accum_steps | updates per epoch | median epoch (s) | paired ratio to accum_steps 1: median (min-max) |",
        "| ---: | ---: | ---: | ---: |",
        f"| 1 | {result['updates_per_epoch']['1']} | {summary['1']:.3f} | - |",
        f"| {n} | {result['updates_per_epoch'][n]} | {summary[n]:.3f} | "
        f"**{summary['ratio']:.2f}** ({summary['ratio_min']:.2f}-{summary['ratio_max']:.2f}) |",
    ]


def plot(results, path):
    """Writes the chart: epoch time normalised to plain, memory, two workers."""
    import matplotlib

    matplotlib.use("Agg")  # no display; must precede pyplot
    import matplotlib.pyplot as plt

    timing_only = not results["memory"] or not results.get("multi_worker")
    if timing_only:  # `--timing-only`: the speed panel alone
        fig, speed = plt.subplots(1, 1, figsize=(7, 4.6))
    else:
        fig, (speed, memory_axis, workers_axis) = plt.subplots(
            1, 3, figsize=(15, 4.6), gridspec_kw={"width_ratios": [2.2, 1, 0.8]}
        )
    timing = results["timing"]
    width = 0.8 / len(IMPLEMENTATIONS)
    for i, name in enumerate(IMPLEMENTATIONS):
        xs, heights = [], []
        for w, result in enumerate(timing):
            summary = summarise_timing(result)
            if summary[name]["median"] is not None:
                xs.append(w + (i - (len(IMPLEMENTATIONS) - 1) / 2) * width)
                heights.append(summary[name]["median"] / summary["plain"]["median"])
        bars = speed.bar(xs, heights, width, label=name, color=COLORS[name])
        speed.bar_label(bars, fmt="%.2f", fontsize=7, padding=1)
    speed.axhline(1.0, color="black", linewidth=0.6)
    speed.set_xticks(
        range(len(timing)),
        [
            f"{r['workload']}\n(plain {summarise_timing(r)['plain']['median']:.2f} s/epoch)"
            for r in timing
        ],
    )
    speed.set_ylabel("median epoch time / plain's (lower is faster)")
    n, b = workloads.ACCUM_STEPS, workloads.MICRO_BATCH
    speed.set_title(f"Epoch time, micro-batch {b}, N = {n}")
    top = max(bar.get_height() for bar in speed.patches)
    speed.set_ylim(0, top * 1.22)  # headroom for the legend above the bars
    speed.legend(
        fontsize=8, ncols=len(IMPLEMENTATIONS) // (2 if timing_only else 1), loc="upper center"
    )
    if not timing_only:
        _plot_memory_and_workers(results, memory_axis, workers_axis)
    title = "keras_accum benchmarks" + (
        " (quick mode: tiny, not meaningful)" if results["quick"] else ""
    )
    fig.suptitle(
        f"{title} - {results['machine']['cpu']}, {results['machine']['cores']} cores", fontsize=10
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_memory_and_workers(results, memory_axis, workers_axis):
    n, b = workloads.ACCUM_STEPS, workloads.MICRO_BATCH
    memory = memory_by_config(results["memory"])
    configs = [c for c in workloads.MEMORY_CONFIGS if c in memory]
    values = [memory[c]["growth_mib"] for c in configs]
    colors = [COLORS["plain"] if c.startswith("plain") else COLORS["AccumModel"] for c in configs]
    bars = memory_axis.bar(range(len(configs)), values, color=colors)
    memory_axis.bar_label(bars, fmt="%.0f", fontsize=8)
    allowance = MEMORY_TARGET * (
        memory["plain b"]["growth_mib"] + memory["AccumModel b x N"]["weight_copy_mib"]
    )
    memory_axis.axhline(
        allowance,
        color=COLORS["AccumModel"],
        linestyle="--",
        linewidth=0.8,
        label=f"target: {MEMORY_TARGET:.2f} x (plain {b} + weight copy)",
    )
    memory_axis.legend(fontsize=7, loc="upper right")
    labels = {
        "plain N*b": f"plain\nbatch {n * b}",
        "plain b": f"plain\nbatch {b}",
        "AccumModel b x N": f"AccumModel\n{b} x {n}",
        "plain b, input in N*b batches": f"plain {b}\nfed {n * b}s",
        "micro_batch_size b of N*b": f"micro_batch_size\n{n * b} in {b}s",
    }
    memory_axis.set_xticks(range(len(configs)), [labels[c] for c in configs], fontsize=8)
    memory_axis.set_ylabel("peak RSS growth during fit (MiB)")
    memory_axis.set_title("Training memory, activation-heavy CNN")
    summary = summarise_multi_worker(results["multi_worker"])
    labels = ["accum_steps\n1", f"accum_steps\n{n}"]
    bars = workers_axis.bar(
        range(2), [summary["1"], summary[str(n)]], color=[COLORS["plain"], COLORS["AccumModel"]]
    )
    workers_axis.bar_label(bars, fmt="%.2f s", fontsize=8)
    workers_axis.set_xticks(range(2), labels, fontsize=8)
    workers_axis.set_ylabel("median epoch time (s)")
    workers_axis.set_title(f"Two workers: {summary['ratio']:.2f}x the time", fontsize=10)
