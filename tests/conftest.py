"""The test run's set-up: tiers, two logical CPUs, threads, process groups.

Tiers (docs/development.md, "Tests"), each a marker:

- `unit`: pure and eager checks on tiny tensors, seconds in all
  (`python -m pytest -m unit`);
- `integration`: every test marked neither `unit` nor `slow` (this file
  marks it): the comparisons with the plain big batch, graph and XLA;
- `slow`: fresh processes (clusters, kill points, the wheel, KerasHub,
  the docs' pages as pasted), and the fixtures that train dozens of
  models under a strategy. A test marked `multi_worker`, `wheel` or
  `release` is `slow` too; `release` tests run before a release only
  (`python -m nox`, and `python -m nox -s kerashub` for KerasHub's), not
  in CI: cases CI runs in another form (kill points beyond one of each
  cluster shape; one replica under a strategy where CI runs two; KerasHub
  cases beyond GPT-2's every way and call, each task's defaults and
  everything, and BERT's wrap and micro-batches; XLA alone where CI runs
  the case under XLA with several steps per execution; the small-table
  optimizers beyond the five that read moments most differently; the
  quickstart example from the checkout, which CI runs from the wheel) and
  the benchmarks' smoke runs.

The README's test command runs `-m "not slow"`; CI runs that, then
`-m "slow and not release"` once.
"""

import gc
import json
import os

import pytest

# Quiet TensorFlow's C++ start-up chatter in test output; set before import.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

# XLA's CPU backend compiles each program without LLVM's optimisation
# passes. The tests check what XLA's own passes make of the step (the HLO
# program, its order, its buffers) and the numbers it gives, not how fast
# its machine code runs, and LLVM's passes were a third of an XLA test:
# the XLA tests of the README tier took 273 s with them, 170 s without
# (the tier's CPU time 5% less). Benchmarks do not read this file.
# Inherited by the processes the tests start.
_NO_LLVM_PASSES = "--xla_backend_optimization_level=0"
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_NO_LLVM_PASSES}".strip()


def _overcommits_always():
    try:
        with open("/proc/sys/vm/overcommit_memory") as f:
            return f.read().strip() == "1"
    except OSError:
        return False


# The out-of-memory errors of tests/helpers/oom.py without the wait: the
# CPU's default (oneDNN) allocator retries a failed allocation for 10 s
# before it raises, idle time that was a quarter of the slow tier. oneDNN's
# own switch sends allocations to malloc instead, which refuses the
# impossible tensor at once: the same ResourceExhaustedError ("OOM when
# allocating tensor"), the same kernels and numbers. Not where the kernel
# grants any allocation (vm.overcommit_memory=1): there malloc would
# succeed and the tensor would be written. Inherited by the processes the
# tests start.
if not _overcommits_always():
    os.environ.setdefault("TF_ONEDNN_USE_SYSTEM_ALLOCATOR", "1")

# The shared helpers' asserts (tests/helpers/) report the values they
# compared when they fail, as a test module's own asserts do.
pytest.register_assert_rewrite("helpers")

from helpers import replicas  # noqa: E402

# Two logical CPUs for in-process replicas, and each xdist worker's share
# of the cores, both before TensorFlow starts its runtime.
replicas.configure(workers=int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))

# Fixtures whose set-up is expensive and shared by several tests (a
# trained run across replicas). pytest-xdist sets a module or session
# fixture up in every worker that runs one of its tests, so the tests of
# one such fixture and parameter go to one worker (`--dist loadgroup`, in
# setup.cfg); every other test is spread as before.
SHARED_FIXTURES = ("mirrored", "workers", "runs")
# The parameters of those fixtures that read the test run's one cluster
# (`cluster` below): their tests, in whichever file, share one group.
ON_THE_CLUSTER = {("workers", 2), ("runs", "two_workers")}


@pytest.fixture(scope="session")
def cluster():
    """The test run's one two-worker cluster on localhost: each worker runs
    tests/scripts/cluster_checks.py once, and every test that needs a
    cluster reads its results (one dict per worker, in task order).
    Worker 1 is the one short of memory in the `micro_batch_size="auto"`
    checks. Each worker is bounded by a timeout (a hang fails the tests)."""
    from helpers.processes import run_workers, script

    results = run_workers(script("cluster_checks.py"), workers=2, timeout=1200, SMALL_TASK="1")
    for result in results:
        assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads(r.stdout.strip().splitlines()[-1]) for r in results]


@pytest.fixture(autouse=True)
def _garbage_collected_after_each_test():
    """Frees each test's garbage when the test ends, then freezes what
    survives (`gc.freeze`: later collections skip it, so each stays cheap).

    Why: a Keras model lives in reference cycles, so its tf.data iterators
    go only when Python's collector next runs, often minutes and many tests
    later, and destroying an iterator that old can block for tens of
    seconds inside TensorFlow (`RootDataset::Iterator::~Iterator` waiting
    on its threads): README-tier workers sat idle 35-171 s that way, inside
    whichever test the collector happened to run in. Collected at the end
    of the test that made them, they go at once: the README tier's last
    runs took 7:31 to 9:40 (the longest with a 171-s wait), and 7:04 with
    this, its workers using 1.92 of the 2 cores (1.46 in the 9:40 run).
    """
    yield
    gc.collect()
    gc.freeze()


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(config, items):
    for item in items:
        marks = {mark.name for mark in item.iter_markers()}
        if marks & {"multi_worker", "wheel", "release"}:
            item.add_marker(pytest.mark.slow)
            marks.add("slow")
        if not marks & {"unit", "slow"}:
            item.add_marker(pytest.mark.integration)
        path = item.nodeid.split("::")[0]
        params = getattr(getattr(item, "callspec", None), "params", {})
        if any(params.get(name, None) == value for name, value in ON_THE_CLUSTER):
            item.add_marker(pytest.mark.xdist_group("cluster"))
            continue
        for name in SHARED_FIXTURES:
            if name in getattr(item, "fixturenames", ()):
                # No "]" or "@" in a group's name: xdist reads the group
                # from the node id after the last "@", if no "]" follows.
                group = f"{path}::{name}:{params.get(name, '')}"
                item.add_marker(pytest.mark.xdist_group(group))
