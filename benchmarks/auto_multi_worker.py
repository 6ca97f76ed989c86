"""What `micro_batch_size="auto"` costs across two workers when memory
never runs out: its per-step agreement (one all-gather of an integer) and
its step in three calls, against the integer `micro_batch_size` of the same
size, paired epoch by epoch in the same two worker processes.

    python -m benchmarks.auto_multi_worker --rounds 8

Runs benchmarks/multi_worker.py with `--auto` as two workers on localhost;
writes benchmarks/auto_multi_worker.json and prints the paired ratios
(auto / integer, per round) and the medians.
"""

import argparse
import json
import statistics
from pathlib import Path

from benchmarks import workloads
from benchmarks.run import run_worker

OUT = Path(__file__).with_name("auto_multi_worker.json")


def summarise(result):
    """Per accum_steps: the medians and the paired ratios auto / integer."""
    seconds = result["seconds"]
    summary = {}
    for n in (1, workloads.ACCUM_STEPS):
        auto = seconds[f"auto_accum_{n}"]
        (integer_name,) = [k for k in seconds if k.endswith(f"_accum_{n}") and "auto" not in k]
        integer = seconds[integer_name]
        ratios = [a / b for a, b in zip(auto, integer)]
        steps = result["micro_batches_per_epoch"]
        summary[f"accum_steps={n}"] = {
            "median_auto_s": statistics.median(auto),
            "median_integer_s": statistics.median(integer),
            "paired_ratios": ratios,
            "median_ratio": statistics.median(ratios),
            "median_extra_ms_per_step": 1000
            * statistics.median([a - b for a, b in zip(auto, integer)])
            / steps,
        }
    return summary


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--timeout", type=int, default=3600)
    args = parser.parse_args(argv)
    quick = ["--quick"] if args.quick else []
    result = run_worker(
        "benchmarks.multi_worker",
        ["--rounds", str(args.rounds), "--auto", *quick],
        args.timeout,
        workers=2,
    )
    result["summary"] = summarise(result)
    OUT.write_text(json.dumps(result, indent=1) + "\n")
    for name, row in result["summary"].items():
        print(
            f"{name}: median epoch auto {row['median_auto_s']:.3f} s, integer "
            f"{row['median_integer_s']:.3f} s; paired ratio median "
            f"{row['median_ratio']:.3f} (range {min(row['paired_ratios']):.3f}-"
            f"{max(row['paired_ratios']):.3f}); "
            f"{row['median_extra_ms_per_step']:.2f} ms per step"
        )


if __name__ == "__main__":
    main()
