"""Runs the speed and memory benchmarks and writes results.md and results.png.

    python -m benchmarks.run                  # full run (about 15 minutes on 2 cores)
    python -m benchmarks.run --quick --out DIR  # tiny smoke run (under 2 minutes)
    python -m benchmarks.run --quick --workloads mlp --out DIR  # one timing workload
    python -m benchmarks.run --timing-only --workloads transformer --rounds 31 --out benchmarks/transformer_eager

Run from the repository root. The driver itself never imports TensorFlow:
each workload's timing and each memory configuration runs in a fresh Python
(`benchmarks.timing`, `benchmarks.memory`), so no measurement inherits
another's traced functions, thread pools or allocator state. Outputs go to
`--out` (default: this directory): results.md, results.png and results.json
(the raw per-epoch times and memory readings behind them). `--timing-only`
runs the timing workloads alone (no memory configurations, no two-worker
run): a workload's rows beside the committed run, into a directory of their
own.
"""

import argparse
import datetime
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks import report, workloads

HERE = Path(__file__).resolve().parent
REPO = HERE.parent


def cpu_model():
    """The CPU's model name from /proc/cpuinfo, or what `platform` knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def load_average():
    try:
        return " / ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def keras_accum_revision():
    """The commit the measured keras_accum comes from, read-only git calls."""
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=REPO,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"
    changed = subprocess.run(
        ["git", "diff", "--quiet", "HEAD", "--", "keras_accum"], cwd=REPO
    ).returncode
    return commit + (" with uncommitted changes to keras_accum/" if changed else "")


def run_worker(module, arguments, timeout, extra_env=None, workers=1):
    """Runs `python -m module arguments --json FILE` in a fresh process.

    With `workers` > 1, runs that many at once as a TensorFlow cluster on
    localhost: each gets a TF_CONFIG naming all of them (on free ports) and
    its own index, as MultiWorkerMirroredStrategy expects.

    Progress lines go straight to our stdout; stderr (TensorFlow's start-up
    chatter) is shown only if a process fails.

    Returns:
        The JSON the (first) worker wrote.
    """
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    )
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    env.update(extra_env or {})
    cluster = {"worker": [f"localhost:{free_port()}" for _ in range(workers)]}
    with tempfile.TemporaryDirectory() as tmp:
        paths = [Path(tmp) / f"result{i}.json" for i in range(workers)]
        processes = []
        for index, path in enumerate(paths):
            if workers > 1:
                task = {"type": "worker", "index": index}
                env["TF_CONFIG"] = json.dumps({"cluster": cluster, "task": task})
            command = [sys.executable, "-m", module, *arguments, "--json", str(path)]
            processes.append(
                subprocess.Popen(
                    command,
                    cwd=REPO,
                    env=dict(env),
                    # One worker's progress is enough: they run in lockstep.
                    stdout=None if index == 0 else subprocess.DEVNULL,
                    stderr=subprocess.PIPE,
                    text=True,
                )
            )
        try:
            errors = [p.communicate(timeout=timeout)[1] for p in processes]
        finally:
            for p in processes:  # a worker whose peer died waits forever
                if p.poll() is None:
                    p.kill()
        for p, error in zip(processes, errors):
            if p.returncode != 0:
                sys.stderr.write(error[-5000:])
                raise RuntimeError(
                    f"{' '.join(p.args[1:4])} ... failed with exit code "
                    f"{p.returncode} (its stderr is above)."
                )
        return json.loads(paths[0].read_text())


def free_port():
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def main(argv=None):
    parser = argparse.ArgumentParser(
        description="Speed and memory benchmarks of keras_accum.AccumModel."
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="tiny models and data, 3 rounds: a smoke test, not a measurement",
    )
    parser.add_argument(
        "--out",
        default=str(HERE),
        help="directory for results.md, results.png, results.json (default: %(default)s)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="epochs per implementation, the first one dropped as warm-up "
        "(default: 15, or 3 with --quick)",
    )
    parser.add_argument(
        "--workloads",
        nargs="+",
        choices=workloads.ALL_WORKLOADS,
        default=list(workloads.TIMING_WORKLOADS),
        help="the timing workloads, each in a fresh process (default: %(default)s; "
        "`transformer` on request); the memory configurations and the "
        "two-worker run are the same whichever",
    )
    parser.add_argument(
        "--timing-only",
        action="store_true",
        help="only the timing workloads: no memory configurations, no two-worker run",
    )
    args = parser.parse_args(argv)
    rounds = args.rounds or (3 if args.quick else 15)
    if rounds < 2:
        parser.error("--rounds must be at least 2: the first round is dropped")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    quick = ["--quick"] if args.quick else []
    timeout = 300 if args.quick else 1200

    machine = {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "affinity": len(os.sched_getaffinity(0))
        if hasattr(os, "sched_getaffinity")
        else os.cpu_count(),
        "python": platform.python_version(),
        "load_start": load_average(),
        "keras_accum": keras_accum_revision(),
    }
    n, b = workloads.ACCUM_STEPS, workloads.MICRO_BATCH
    print(
        f"keras_accum benchmarks ({'quick' if args.quick else 'full'}): "
        f"micro-batch b={b}, accum_steps N={n}, {rounds} rounds; "
        f"load average {machine['load_start']}",
        flush=True,
    )

    timing = []
    for name in args.workloads:
        print(f"timing {name} (fresh process)", flush=True)
        timing.append(
            run_worker(
                "benchmarks.timing",
                ["--workload", name, "--rounds", str(rounds), *quick],
                timeout,
            )
        )

    memory = []
    for config in () if args.timing_only else workloads.MEMORY_CONFIGS:
        print(f"memory {config} (fresh process)", flush=True)
        result = run_worker(
            "benchmarks.memory",
            ["--config", config, *quick],
            timeout,
            # Pinned mmap threshold: freed tensors go back to the system at
            # once, so RSS tracks live memory (see benchmarks/memory.py).
            extra_env={"MALLOC_MMAP_THRESHOLD_": "131072"},
        )
        print(f"  {config}: +{result['growth_mib']:.0f} MiB", flush=True)
        memory.append(result)

    multi_worker = None
    if not args.timing_only:
        print("timing two workers, accum_steps 1 and N (two fresh processes)", flush=True)
        multi_worker = run_worker(
            "benchmarks.multi_worker", ["--rounds", str(rounds), *quick], timeout, workers=2
        )

    machine["load_end"] = load_average()
    results = {
        "quick": args.quick,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine,
        "versions": timing[0]["versions"],
        "rounds": rounds,
        "timing": timing,
        "memory": memory,
        "multi_worker": multi_worker,
    }
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    text = report.markdown(results)
    (out / "results.md").write_text(text)
    report.plot(results, out / "results.png")
    print()
    print(text)
    print(f"wrote {out / 'results.md'}, {out / 'results.png'}, {out / 'results.json'}")


if __name__ == "__main__":
    main()
