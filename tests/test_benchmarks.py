"""The benchmark suite runs end to end (in its quick mode) and writes its report.

Only that it runs and what it writes are checked, never timings or memory
numbers: those depend on the machine and on its load.
"""

import pytest

from helpers.processes import run_python

# Each runs a benchmark in a process of its own.
pytestmark = pytest.mark.slow

# Every smoke run is a `release` test (`python -m nox`, before a release),
# the quick benchmark's (the README's figures) too: fresh processes that
# check the benchmark scripts, about 300 CPU-seconds in all before the
# memory curve's smoke run took two processes a reading, the quick
# benchmark's 180 of them (a two-worker cluster and a process per memory
# reading), which CI's half hour no longer had room for. What they check of
# the library is tested directly: bit identity with and without measuring
# and the sparse rows' norm (test_noise_scale), remat against the big batch
# (test_remat), clusters (test_distributed, test_fault_tolerance).

IMPLEMENTATIONS = ("plain", "builtin", "gradient-accumulator", "AccumModel")
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.mark.release
def test_quick_benchmark_writes_its_report(tmp_path):
    result = run_python(
        # Two rounds, the fewest (the first is dropped), and one timing
        # workload (the report's every table reads whichever ran): what runs
        # is checked, not what it measures. The CNN: the MLP and embedding
        # workloads run in the `release` tests below (before_after,
        # noise_scale_cost).
        "-m",
        "benchmarks.run",
        "--quick",
        "--rounds",
        "2",
        "--workloads",
        "cnn",
        "--out",
        str(tmp_path),
        timeout=900,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]

    report = (tmp_path / "results.md").read_text()
    assert report.strip()
    for name in IMPLEMENTATIONS:
        # Listed even when unavailable (gradient-accumulator is optional).
        assert name in report, name
    assert "## Memory" in report
    # The price of the memory saved: every mode against the big batch itself,
    # and micro-batch mode's memory row.
    assert "## Price of the memory saved" in report
    for mode in ("big batch", "step mode", "micro_batch_size=b", "micro_batch_size='auto'"):
        assert f"| {mode} |" in report, mode
    assert "| micro_batch_size b of N*b |" in report
    # ... and the plain micro-batch fed the same input batches, for the memory
    # micro_batch_size holds beyond its input.
    assert "| plain b, input in N*b batches |" in report
    assert "## Two workers" in report

    assert (tmp_path / "results.png").read_bytes().startswith(PNG_SIGNATURE)


@pytest.mark.release
def test_quick_memory_curve_writes_its_report_and_plot(tmp_path):
    # The README's memory picture: every way at two effective batches and
    # both pipelines (each in two processes of its own for its memory, their
    # median read), one timed round.
    result = run_python(
        "-m",
        "benchmarks.memory_curve",
        "--quick",
        "--batches",
        "2",
        "4",
        "--micro-batch",
        "2",
        "--rounds",
        "1",
        "--repeats",
        "2",
        "--out",
        str(tmp_path),
        timeout=900,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    import json

    measured = json.loads((tmp_path / "memory_curve.json").read_text())
    for m in measured["memory"]:  # the median of the two processes' peaks
        assert len(m["peak_bytes_each"]) == 2
        assert m["peak_bytes"] == round(sum(m["peak_bytes_each"]) / 2)
    # Both pipelines: a batch size the step knows, and one it learns from the
    # first batch (trained by the traced step).
    assert {(m["way"], m["batch"], m["pipeline"]) for m in measured["memory"]} == {
        (way, batch, pipeline)
        for way in ("plain", "accum_steps", "micro_batch_size")
        for batch in (2, 4)
        for pipeline in ("known", "unknown")
    }
    assert all(m["peak_bytes"] > 0 and m["updates"] == 2 for m in measured["memory"])
    # The bytes requested, beside the allocator's peak: the median of the same processes.
    for m in measured["memory"]:
        assert m["requested_bytes"] > 0
        assert m["requested_bytes"] == round(sum(m["requested_bytes_each"]) / 2)
    # The accumulating ways trained as plain at the same effective batch.
    assert max(measured["weight_difference_vs_plain"].values()) < 1e-4
    report = (tmp_path / "memory_curve.md").read_text()
    for way in ("plain", "accum_steps", "micro_batch_size"):
        assert f"| 4 | {way} |" in report, way
    assert "## What must hold" in report and "(plain at m + weights)" in report
    assert "The same on the bytes requested" in report
    assert (tmp_path / "memory_curve.png").read_bytes().startswith(PNG_SIGNATURE)


@pytest.mark.release
def test_transformer_benchmark_times_every_mode_eagerly_and_under_xla(tmp_path):
    result = run_python(
        "-m",
        "benchmarks.transformer",
        "--quick",
        "--rounds",
        "1",
        "--out",
        str(tmp_path),
        timeout=900,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    import json

    measured = json.loads((tmp_path / "transformer.json").read_text())["transformer"]
    assert measured["variables"] == 38  # 2 blocks of 16, 2 embeddings, a norm, the output
    for compile_name in ("eager", "XLA"):
        compiled = measured["compiles"][compile_name]
        for key in ("ratios", "cpu_ratios"):
            for pair in ("step mode / built-in", "micro_batch_size / built-in"):
                assert compiled[key][pair]["rounds"] == 1, (compile_name, key, pair)
        # keras_accum's two ways train as the big batch (the built-in and
        # gradient-accumulator sum the token table's gradient densely: the
        # sparse Adam gap, docs/sparse.md).
        differences = compiled["max_weight_difference_vs_big_batch"]
        assert differences["step mode"] < 1e-4 and differences["micro_batch_size"] < 1e-4
    report = (tmp_path / "transformer.md").read_text()
    assert "| XLA | step mode / built-in |" in report and "## What must hold" in report


@pytest.mark.release
def test_timing_only_run_times_the_transformer(tmp_path):
    # The transformer beside the committed timing run: its rows alone, with
    # CPU time, and no memory or two-worker sections.
    result = run_python(
        "-m",
        "benchmarks.run",
        "--quick",
        "--timing-only",
        "--rounds",
        "2",
        "--workloads",
        "transformer",
        "--out",
        str(tmp_path),
        timeout=900,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = (tmp_path / "results.md").read_text()
    assert "| transformer | builtin |" in report and "by CPU time" in report
    assert "## Memory" not in report and "## Two workers" not in report
    import json

    (timing,) = json.loads((tmp_path / "results.json").read_text())["timing"]
    assert timing["cpu_seconds"]["AccumModel"][1] > 0
    assert (tmp_path / "results.png").read_bytes().startswith(PNG_SIGNATURE)


@pytest.mark.release
def test_xla_benchmark_runs_the_transformer_and_its_floors(tmp_path):
    out = tmp_path / "xla.json"
    result = run_python(
        "-m",
        "benchmarks.xla",
        "--quick",
        "--rounds",
        "1",
        "--workloads",
        "transformer",
        "--out",
        str(out),
        timeout=900,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    import json

    workload = json.loads(out.read_text())["workloads"]["transformer"]
    # The floors' summed gradients join the token table's slices.
    assert workload["median_window_ms"]["floor in Keras's step"] > 0
    assert set(workload["cpu_ratios"]) == set(workload["ratios"])


@pytest.mark.release
def test_micro_batch_split_timing_runs():
    result = run_python(
        "-m",
        "benchmarks.micro_batch_split",
        "--quick",
        "--rounds",
        "1",
        "--workloads",
        "mlp",
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for label in ("big batch", "micro_batch_size=32", "step mode", "summed"):
        assert label in result.stdout, label


@pytest.mark.release
@pytest.mark.parametrize("unit", ["epoch", "window"])
def test_before_after_runs_and_writes_its_json(tmp_path, unit):
    out = tmp_path / "before_after.json"
    result = run_python(
        "-m",
        "benchmarks.before_after",
        "--before",
        "HEAD",
        "--quick",
        "--rounds",
        "1",
        "--workloads",
        "mlp",
        "--unit",
        unit,
        "--out",
        str(out),
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    import json

    mlp = json.loads(out.read_text())["workloads"]["mlp"]
    assert mlp["unit"] == unit
    for key in ("ratios", "cpu_ratios"):
        for mode in ("step", "micro"):
            for pair in ("after / builtin", "before / builtin", "after / before"):
                assert mlp[key][mode][pair]["rounds"] == 1, (key, mode, pair)
    # Both versions were really trained, side by side.
    assert set(mlp["max_weight_difference_after_vs_before"]) == {"step", "micro"}


@pytest.mark.release
def test_noise_scale_cost_runs_and_checks_bit_identity(tmp_path):
    out = tmp_path / "noise_scale_cost.json"
    result = run_python(
        "-m",
        "benchmarks.noise_scale_cost",
        "--quick",
        "--rounds",
        "1",
        "--workloads",
        "mlp",
        "embedding",
        "--out",
        str(out),
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    import json

    for name, workload in json.loads(out.read_text())["workloads"].items():
        assert workload["bit_identical_after_one_epoch"] == {"step": True, "split": True}, name
        for key in ("ratios", "cpu_ratios"):
            for mode in ("step", "split"):
                assert workload[key][mode]["rounds"] == 1
    assert "| mlp | step |" in result.stdout


@pytest.mark.release
def test_sparse_norm_runs_and_both_ways_give_the_same_norm():
    result = run_python("-m", "benchmarks.sparse_norm", "--quick", timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = [line for line in result.stdout.splitlines() if line.startswith("| ") and "µs" in line]
    assert len(rows) == 5 and all(row.endswith("| yes |") for row in rows), result.stdout


@pytest.mark.release
@pytest.mark.slow  # five fresh processes (about two minutes)
@pytest.mark.skipif(
    not hasattr(__import__("keras"), "RematScope"),
    reason="keras.RematScope is Keras >= 3.9",
)
def test_remat_benchmark_runs_and_writes_its_report(tmp_path):
    result = run_python(
        "-m",
        "benchmarks.remat",
        "--quick",
        "--rounds",
        "1",
        "--workloads",
        "ffn",
        "--out",
        str(tmp_path),
        timeout=900,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    import json

    report = (tmp_path / "remat.md").read_text()
    for config in ("big batch", "micro_batch_size=b", "remat", "remat + micro_batch_size=b"):
        assert f"| {config} |" in report, config
    ffn = json.loads((tmp_path / "remat.json").read_text())["ffn"]
    assert ffn["max_weight_difference"] < 1e-4  # the four trained alike
    assert all(m["median"] > 0 for m in ffn["memory"].values())


@pytest.mark.release
@pytest.mark.slow  # five fresh processes
def test_contrastive_benchmark_runs_and_writes_its_report(tmp_path):
    result = run_python(
        "-m",
        "benchmarks.contrastive",
        "--quick",
        "--rounds",
        "1",
        "--out",
        str(tmp_path),
        timeout=900,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    import json

    report = (tmp_path / "contrastive.md").read_text()
    for config in (
        "big batch",
        "coupled_from, b",
        "plain at b",
        "ordinary micro-batching, b",
        "big batch, XLA",
        "coupled_from, b, XLA",
    ):
        assert f"| {config} |" in report, config
    assert "the encoders' forward pass" in report
    measured = json.loads((tmp_path / "contrastive.json").read_text())
    assert measured["max_weight_difference"] < 1e-4  # coupled trained as the big batch
    assert all(m["growth_mib"] > 0 for m in measured["memory"].values())


@pytest.mark.release
@pytest.mark.timeout(960)  # a process per mode for its memory
def test_xla_benchmark_runs_and_reads_each_steps_traffic(tmp_path):
    out = tmp_path / "xla.json"
    result = run_python(
        "-m",
        "benchmarks.xla",
        "--quick",
        "--rounds",
        "1",
        "--workloads",
        "mlp",
        "--memory",
        "--out",
        str(out),
        timeout=900,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    import json

    workload = json.loads(out.read_text())["workloads"]["mlp"]
    traffic = workload["hlo_bytes_per_window"]
    # Step mode's update is a branch: its micro-batches that only add move
    # less than the one that updates, and the window less than the built-in's
    # (which runs its update, all elementwise, at every micro-batch).
    accumulate, _, update, _ = workload["hlo_bytes_per_step"]["step mode"]
    assert 0 < accumulate < update
    assert traffic["step mode"][0] < traffic["built-in"][0]
    assert "| mlp | step mode / built-in |" in result.stdout
    # Every mode's peak read in a process of its own.
    assert set(workload["peak_tensor_bytes"]) == set(workload["median_window_ms"])
    assert all(held > 0 for held in workload["peak_tensor_bytes"].values())


@pytest.mark.release
def test_batch_growth_benchmark_sweeps_fits_and_runs_the_scheduler(tmp_path):
    out = tmp_path / "batch_growth.json"
    result = run_python(
        "-m",
        "benchmarks.batch_growth",
        "--quick",
        "--out",
        str(out),
        "--plot",
        str(tmp_path / "batch_growth.png"),
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    import json

    report = json.loads(out.read_text())
    assert report["fit"]["S_min"] > 0 and report["best"]
    (schedule,) = report["schedule"].values()
    assert schedule["reached"] == 1 and schedule["runs"][0]["decisions"]
    assert "AccumScheduler" in out.with_suffix(".md").read_text()
    assert (tmp_path / "batch_growth.png").read_bytes().startswith(PNG_SIGNATURE)


@pytest.mark.release
def test_batch_growth_adam_benchmark_sweeps_fits_and_runs_a_rule(tmp_path):
    # The classifier trained with Adam, through batch_growth's sweep and
    # scheduler runs (its Task carrying the optimizer, loss and measure).
    out = tmp_path / "batch_growth_adam.json"
    result = run_python(
        "-m",
        "benchmarks.batch_growth_adam",
        "--quick",
        "--out",
        str(out),
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    import json

    report = json.loads(out.read_text())
    assert report["fit"]["S_min"] > 0 and report["best"]
    assert report["sweep"]["optimizer"].startswith("keras.optimizers.Adam")
    (schedule,) = report["schedule"].values()
    assert schedule["rule"] == "auto"
    assert schedule["reached"] == 1 and schedule["runs"][0]["decisions"]
    assert "| auto |" in out.with_suffix(".md").read_text()


@pytest.mark.release
def test_noise_probe_benchmark_compares_windows_and_probe_with_the_exact_value(tmp_path):
    out = tmp_path / "noise_probe.json"
    result = run_python("-m", "benchmarks.noise_probe", "--quick", "--out", str(out), timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    import json

    report = json.loads(out.read_text())
    (point,) = report["checkpoints"]
    assert point["exact"] > 0
    assert set(point["estimators"]) == {"windows of 16", "probe of 2048"}
    assert "| probe of 2048 |" in out.with_suffix(".md").read_text()
