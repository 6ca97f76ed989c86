"""The README's and the documentation site's commands and code, and the
examples, do what they say.

Every code block of README.md and docs/**/*.md is covered (docs/development.md,
"The documentation site", states these rules for contributors):

* A page's `python` blocks run as a reader pastes them: top to bottom, as one
  program, in a fresh Python of its own, in an empty directory, with
  nothing defined for them (each page makes its own imports and data). A
  block marked `<!-- docs-test: two-devices -->` (the first of its page)
  splits the CPU into two logical devices: the page runs with it, and
  without it as on one device.
* `bash` blocks are checked, not run: each command must name what the
  project has (extras, nox sessions, test files, examples, benchmarks).
* `<!-- docs-test: multi-worker -->` marks a block that needs a cluster, and
  is allowed only on blocks that use MultiWorkerMirroredStrategy or
  TF_CONFIG. A `python` one runs in its page (one process, a cluster of
  one) and also as the whole program of two local workers
  (tests/helpers/processes.py); a `bash` one runs with a stand-in for
  `python` that records the TF_CONFIG each command gives it. No other kind of block may carry the marker.
* `<!-- docs-test: kerashub -->` marks a block that needs keras_hub (its
  page says `pip install keras-hub`): its page runs with it where keras_hub
  is installed, and without it (as a reader without KerasHub skips it)
  where not; no later block may read a name it binds (checked without
  keras_hub too); where keras-hub is required (KERAS_ACCUM_REQUIRE_KERAS_HUB=1:
  CI's slow tier, the `kerashub` nox session) the page runs whole, once.
* A page whose blocks make a `MirroredStrategy` starts with the
  two-devices block.
* `text` blocks are formulas.
* The public docstrings' examples (the API reference) run too, each after
  the API page's block of the names they use.
"""

import configparser
import os
import re
import shlex
import subprocess
import sys
import warnings

import numpy as np
import pytest

from helpers.assertions import assert_quickstart_matches_the_big_batch
from helpers.internals import WRAPPED_CLASSES
from helpers.internals import keras_internals as internals
from helpers.processes import run_python
from helpers.project import DOCS, PAGES, ROOT, blocks, nox_pairs

README = (ROOT / "README.md").read_text()


def code_blocks(language):
    return re.findall(rf"```{language}\n(.*?)```", README, flags=re.S)


@pytest.mark.unit
def test_ci_runs_the_readme_test_command():
    development = README.split("## Development", 1)[1]
    command = code_blocks("bash")[-1].strip()
    assert command in development
    assert command in (ROOT / ".ci" / "run").read_text().splitlines()


def test_readme_quickstart_trains_like_the_big_batch():
    import math

    namespace = {}
    exec(code_blocks("python")[0], namespace)  # it makes its own data
    model, samples = namespace["model"], len(namespace["x_train"])
    # batch_size=32 x accum_steps=8: one update per 256 samples, 5 epochs.
    assert model.accum_steps == 8
    assert int(model.optimizer.iterations) == 5 * math.ceil(samples / 256)


# The example, in a process of its own: before a release; CI runs it from
# the installed wheel with the same checks (test_wheel).
@pytest.mark.release
def test_quickstart_example_matches_the_big_batch():
    assert_quickstart_matches_the_big_batch(run_python(str(ROOT / "examples" / "quickstart.py")))


@pytest.mark.skipif(
    not internals.metrics_summed_over_replicas(),
    reason="this Keras does not sum metrics over replicas (Keras 3.8): the "
    "example's accuracies are not one process's",
)
@pytest.mark.multi_worker
def test_multi_worker_example_matches_one_process():
    # Starts two workers itself; both must report what one process with the
    # big batch reports.
    result = run_python(str(ROOT / "examples" / "multi_worker.py"), timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    reports = re.findall(r"test accuracy (\d\.\d+), (\d+) updates", result.stdout)
    assert len(reports) == 3 and len(set(reports)) == 1, result.stdout
    assert "worker 0 of 2" in result.stdout and "worker 1 of 2" in result.stdout


@pytest.mark.unit
def test_import_refuses_another_keras_backend(monkeypatch):
    import importlib

    import keras

    import keras_accum

    monkeypatch.setattr(keras.backend, "backend", lambda: "jax")
    try:
        with pytest.raises(ImportError, match=r"'jax' backend.*KERAS_BACKEND=tensorflow"):
            importlib.reload(keras_accum)
    finally:
        monkeypatch.undo()
        importlib.reload(keras_accum)


def test_readme_custom_loop_flushes_the_partial_window():
    import keras

    import keras_accum

    block = next(b for b in code_blocks("python") if "AccumOptimizer(" in b)
    rng = np.random.default_rng(0)
    # The names the quickstart above it defines; 150 samples are 5
    # micro-batches of 32 (the last of 22): one window of 4, and one of 1
    # that flush applies.
    namespace = dict(
        keras=keras,
        keras_accum=keras_accum,
        x_train=rng.normal(size=(150, 784)).astype("float32"),
        y_train=rng.integers(0, 10, size=150),
    )
    exec(block, namespace)
    assert int(namespace["opt"].iterations) == 2


# -- the documentation site ---------------------------------------------------

LANGUAGES = {"python", "bash", "text"}
MARKERS = {"multi-worker", "kerashub", "two-devices"}
# A block marker naming an optional package: the module its block imports.
NEEDS = {"kerashub": "keras_hub"}


def page_id(path):
    return str(path.relative_to(ROOT))


def python_blocks(path):
    return [b for b in blocks(path.read_text()) if b.lang == "python"]


def api_names():
    """The API page's block: the names the docstrings' examples start from."""
    (names,) = [b.code for b in python_blocks(DOCS / "api.md")]
    return names


def test_every_code_block_is_of_a_kind_the_tests_cover():
    for path in PAGES:
        text = path.read_text()
        assert text.count("```") == 2 * len(blocks(text)), (
            f"{page_id(path)}: a fence the tests do not see"
        )
        for block in blocks(text):
            where = f"{page_id(path)}: {block.code[:60]!r}"
            assert block.lang in LANGUAGES, f"{where}: language {block.lang!r}"
            assert block.marker in MARKERS | {None}, f"{where}: marker {block.marker!r}"
            if block.marker == "multi-worker":
                assert re.search(r"MultiWorkerMirroredStrategy|TF_CONFIG", block.code), (
                    f"{where}: the multi-worker marker is for blocks that need a cluster"
                )
                # The multi-worker tests run every such block of these two
                # languages; one of another would be run by none.
                assert block.lang in {"python", "bash"}, (
                    f"{where}: a multi-worker block no test runs"
                )
            if block.marker in NEEDS:
                module = NEEDS[block.marker]
                assert block.lang == "python" and f"import {module}" in block.code, where
                # The reader is told what to install, before the block.
                package = module.replace("_", "-")
                assert f"pip install {package}" in text[: text.index(block.code)], (
                    f"{where}: the page does not say `pip install {package}`"
                )
            if block.marker == "two-devices":
                # First thing, before any other TensorFlow work.
                assert python_blocks(path)[0].marker == "two-devices", (
                    f"{where}: two-devices on a later block"
                )
                assert "set_logical_device_configuration" in block.code, where
            if (
                block.lang == "python"
                and block.marker is None
                and ".MirroredStrategy(" in block.code
            ):
                # A reader without two GPUs sees the setup, and the page is
                # tested with two replicas.
                assert python_blocks(path)[0].marker == "two-devices", (
                    f"{where}: MirroredStrategy on a page without the two-devices block"
                )
            if block.lang == "text":  # formulas: Python code would have to run
                with pytest.raises(SyntaxError):
                    compile(block.code, where, "exec")
    for path in PAGES:
        for line in path.read_text().splitlines():
            assert line.startswith("<!-- docs-test:") <= bool(
                re.fullmatch(rf"<!-- docs-test: ({'|'.join(sorted(MARKERS))}) -->", line)
            ), f"{page_id(path)}: unknown marker {line}"


def _bound_and_free(code):
    """The names `code` binds at top level other than by imports, and those it
    reads before binding them (as far as a reader's snippet goes: a name
    bound anywhere in a statement counts as bound for that statement)."""
    import ast
    import builtins

    bound, imported, free = set(), set(), set()
    for statement in ast.parse(code).body:
        stored = {
            n.id
            for n in ast.walk(statement)
            if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)
        }
        stored |= {n.arg for n in ast.walk(statement) if isinstance(n, ast.arg)}
        free |= (
            {
                n.id
                for n in ast.walk(statement)
                if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)
            }
            - bound
            - imported
            - stored
            - set(dir(builtins))
        )
        if isinstance(statement, (ast.Import, ast.ImportFrom)):
            imported |= {(a.asname or a.name).split(".")[0] for a in statement.names}
        elif isinstance(statement, (ast.FunctionDef, ast.ClassDef)):
            bound.add(statement.name)
        else:
            bound |= {
                n.id
                for n in ast.walk(statement)
                if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)
            }
    return bound, free


def test_no_block_reads_what_an_optional_block_defines():
    # Where the optional package is installed the page runs whole, and where
    # not, without that block: a later block reading a name it (re)binds
    # would train on the KerasHub model in one and on another in the other.
    # Checked here, without the package: the names read before being bound.
    for path in PAGES:
        page = python_blocks(path)
        for i, block in enumerate(page):
            if block.marker in NEEDS:
                binds, _ = _bound_and_free(block.code)
                _, reads = _bound_and_free("\n".join(b.code for b in page[i + 1 :]))
                assert not binds & reads, (
                    f"{page_id(path)}: {sorted(binds & reads)} after the {block.marker} block"
                )


def _installed(module):
    import importlib.util

    return importlib.util.find_spec(module) is not None


# After a page with a two-devices block: what it trained on. 256 samples at
# a global micro-batch of 64 are 4 micro-batches, one partial window of
# accum_steps=8, applied at the epoch's end.
_TWO_DEVICES_CHECKS = """

# -- the test's checks, after the page --
assert len(tf.config.list_logical_devices("CPU")) == {devices}
assert strategy.num_replicas_in_sync == {devices}
assert int(model.optimizer.iterations.numpy()) == 1
"""


@pytest.mark.slow
@pytest.mark.parametrize("path", [p for p in PAGES if python_blocks(p)], ids=page_id)
def test_page_runs_top_to_bottom_in_a_fresh_python(path, tmp_path):
    """The page as a reader pastes it: its python blocks, in order, as one
    program in a fresh interpreter, in an empty directory."""
    from helpers.processes import run_program

    page = python_blocks(path)
    # A reader without an optional package skips its block; nothing after
    # it may need it. Where the package is installed (the slow tier in CI,
    # KERAS_ACCUM_REQUIRE_KERAS_HUB=1, where its absence fails) the page
    # runs whole: the KerasHub blocks run as pasted here, once.
    if os.environ.get("KERAS_ACCUM_REQUIRE_KERAS_HUB"):
        missing = {NEEDS[b.marker] for b in page if b.marker in NEEDS} - {
            m for m in NEEDS.values() if _installed(m)
        }
        assert not missing, f"{page_id(path)} needs {sorted(missing)}, not installed"
    page = [b for b in page if b.marker not in NEEDS or _installed(NEEDS[b.marker])]
    runs = [("page", [b.code for b in page], "")]
    if page[0].marker == "two-devices":
        # As pasted, with two logical CPU devices; and without that block:
        # the page on a one-GPU or CPU-only machine (one replica).
        runs = [
            ("page", [b.code for b in page], _TWO_DEVICES_CHECKS.format(devices=2)),
            ("one-device", [b.code for b in page[1:]], _TWO_DEVICES_CHECKS.format(devices=1)),
        ]
    for name, codes, checks in runs:
        workdir = tmp_path / name
        workdir.mkdir()
        code = "\n".join(codes) + checks
        result = run_program(code, workdir)
        if result.returncode < 0 and any(b.marker in NEEDS for b in page):
            # Killed by a signal in native code: glibc found TensorFlow's
            # heap corrupted ("corrupted double-linked list"), on
            # docs/contrastive.md twice in about six slow-tier runs (TF
            # 2.21.0, oneDNN), never in 40 runs of the page alone. TF
            # 2.21's oneDNN batch matmul is known to write past its
            # buffers (tensorflow/tensorflow#117700, #123109). Run once
            # more; the first crash's tracebacks (faulthandler) are kept
            # as a warning. A second crash, or any Python error, fails.
            warnings.warn(
                f"{page_id(path)}: died by signal {-result.returncode}, "
                f"run again:\n{result.stderr[-3000:]}"
            )
            workdir = tmp_path / f"{name}-again"
            workdir.mkdir()
            result = run_program(code, workdir)
        assert result.returncode == 0, (
            f"{page_id(path)} ({workdir / 'program.py'}):\n{result.stderr[-3000:]}"
        )
        if '"lm.keras"' in code:  # the ways-in page's model, saved
            assert (workdir / "lm.keras").exists()


def multi_worker_blocks(lang):
    return [
        pytest.param(b.code, id=f"{page_id(path)}:{i}")
        for path in PAGES
        for i, b in enumerate(blocks(path.read_text()))
        if b.marker == "multi-worker" and b.lang == lang
    ]


# Runs a page's multi-worker block as this worker's whole program, then
# reports what it trained.
_WORKER = """
import json, runpy, sys
namespace = runpy.run_path(sys.argv[1], run_name="__main__")
model, backup = namespace["model"], namespace.get("backup")
print(json.dumps({
    "task": namespace["strategy"].cluster_resolver.task_id,
    "workers": namespace["strategy"].num_replicas_in_sync,
    "updates": int(model.optimizer.iterations.numpy()),
    "weights": [w.tolist() for w in model.get_weights()],
    "backup_dir": backup and str(backup.backup_dir),
}))
"""


@pytest.mark.multi_worker
@pytest.mark.parametrize("code", multi_worker_blocks("python"))
def test_multi_worker_block_runs_on_two_workers(code, tmp_path):
    import json

    from helpers.processes import run_workers

    program = tmp_path / "train.py"
    program.write_text(code)
    backups = tmp_path / "backups"
    results = run_workers(
        "-c",
        _WORKER,
        str(program),
        timeout=300,
        logs=tmp_path / "logs",
        BACKUP_DIR=str(backups),
        TF_CPP_MIN_LOG_LEVEL="3",
    )
    for result in results:
        assert result.returncode == 0, result.stderr[-3000:]
    reports = [json.loads(r.stdout.strip().splitlines()[-1]) for r in results]
    assert [r["task"] for r in reports] == [0, 1]
    assert all(r["workers"] == 2 for r in reports)  # one replica per worker, in one cluster
    assert reports[0]["updates"] == reports[1]["updates"] > 0
    for w0, w1 in zip(reports[0]["weights"], reports[1]["weights"], strict=True):
        np.testing.assert_array_equal(w0, w1)  # all-reduced: the same on both
    dirs = [r["backup_dir"] for r in reports]
    if any(dirs):  # a directory of its own for each, where BACKUP_DIR says
        assert len(set(dirs)) == 2, dirs
        assert all(os.path.dirname(d) == str(backups) for d in dirs), dirs


_STAND_IN = """#!{python}
import json, os, sys
with open(os.environ["INVOCATIONS"], "a") as f:
    f.write(json.dumps({{"argv": sys.argv[1:], "TF_CONFIG": os.environ.get("TF_CONFIG")}}) + "\\n")
"""


def _cluster_and_task(config, monkeypatch):
    """What MultiWorkerMirroredStrategy's resolver reads from a TF_CONFIG."""
    import tensorflow as tf

    monkeypatch.setenv("TF_CONFIG", config)
    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    return resolver.cluster_spec().as_dict(), resolver.task_type, resolver.task_id


@pytest.mark.parametrize("code", multi_worker_blocks("bash"))
def test_tf_config_commands_name_one_cluster_and_each_worker(code, tmp_path, monkeypatch):
    import json

    from helpers.processes import tf_configs

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python").write_text(_STAND_IN.format(python=sys.executable))
    (bin_dir / "python").chmod(0o755)
    invocations = tmp_path / "invocations"
    result = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
        env={
            **os.environ,
            "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
            "INVOCATIONS": str(invocations),
        },
    )
    assert result.returncode == 0, result.stderr
    runs = [json.loads(line) for line in invocations.read_text().splitlines()]
    assert len(runs) >= 2, runs  # a cluster: the command of each worker
    assert len({tuple(r["argv"]) for r in runs}) == 1, runs  # one program on every worker
    parsed = [_cluster_and_task(r["TF_CONFIG"], monkeypatch) for r in runs]
    clusters = {json.dumps(c, sort_keys=True) for c, _, _ in parsed}
    assert len(clusters) == 1, f"workers in different clusters: {clusters}"
    cluster = json.loads(clusters.pop())
    assert list(cluster) == ["worker"], cluster
    # Each worker of the cluster once, as the tests' local clusters (which
    # run the multi-worker python blocks) hand them out.
    assert sorted((t, i) for _, t, i in parsed) == [
        ("worker", i) for i in range(len(cluster["worker"]))
    ]
    local = [_cluster_and_task(c, monkeypatch) for c in tf_configs(len(runs))]
    assert [(t, i) for _, t, i in local] == sorted((t, i) for _, t, i in parsed)
    assert all(list(c) == ["worker"] and len(c["worker"]) == len(runs) for c, _, _ in local)


def _extras():
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    return set(config["options.extras_require"])


def _check_command(words, errors):
    """Appends to `errors` what in one shell command the project does not have."""
    import keras_accum

    if words[:1] == ["pip"] or words[:1] == ["!pip"]:
        words = ["python", "-m", "pip", *words[1:]]
    if words[:2] != ["python", "-m"] and not (len(words) == 2 and words[0] == "python"):
        errors.append(f"not a python command: {words}")
        return
    if words[0] == "python" and len(words) == 2:
        if not (ROOT / words[1]).is_file():
            errors.append(f"no file {words[1]}")
        return
    module, args = words[2], words[3:]
    if module == "pip":
        assert args[0] == "install", words
        for arg in args[1:]:
            if arg.startswith("-"):
                continue
            extras = re.fullmatch(r"(\.|keras_accum)(?:\[([\w,-]+)\])?", arg)
            wheel = re.fullmatch(r"(?:dist/)?keras_accum-(.+)-py3-none-any\.whl", arg)
            if extras:
                missing = set(filter(None, (extras[2] or "").split(","))) - _extras()
                if missing:
                    errors.append(f"no extra {missing} in setup.cfg: {arg}")
            elif wheel:
                if wheel[1] != keras_accum.__version__:
                    errors.append(f"wheel of version {wheel[1]}, not {keras_accum.__version__}")
            elif not re.fullmatch(r"[A-Za-z][\w.-]*", arg):
                errors.append(f"pip install of {arg}")
    elif module == "nox":
        sessions = {"tests", "kerashub", *(f"tests({pair})" for pair in nox_pairs())}
        options, _, pytest_args = " ".join(args).partition(" -- ")
        options = shlex.split(options)
        for i, option in enumerate(options):
            if option == "-s":
                for name in options[i + 1 :]:
                    if name not in sessions:
                        errors.append(f"no nox session {name}")
        _check_test_paths(shlex.split(pytest_args), errors)
    elif module == "pytest":
        _check_test_paths(args, errors)
    elif module.startswith("benchmarks."):
        if not (ROOT / "benchmarks" / f"{module.split('.', 1)[1]}.py").is_file():
            errors.append(f"no module {module}")
    elif module == "mkdocs":
        if args not in (["build", "--strict"], ["serve"]):
            errors.append(f"mkdocs {args}")
    elif module == "ruff":
        if args not in (["check", "."], ["format", "--check", "."]):
            errors.append(f"ruff {args}")
    elif module == "twine":
        if args[:2] != ["check", "--strict"]:
            errors.append(f"twine {args}")
    elif module != "build":
        errors.append(f"unknown command python -m {module}")


def _check_test_paths(args, errors):
    for arg in args:
        if arg.startswith("tests/") and not (ROOT / arg.split("::")[0]).exists():
            errors.append(f"no test file {arg}")


@pytest.mark.unit
def test_shell_commands_name_what_the_project_has():
    errors = []
    for path in PAGES:
        for block in blocks(path.read_text()):
            if block.lang != "bash" or block.marker == "multi-worker":
                continue
            for line in block.code.splitlines():
                line = re.sub(r"\s+#.*", "", line).strip()
                if not line or line.startswith("#"):
                    continue
                for command in line.split("&&"):
                    _check_command(shlex.split(command.replace("dist/*", "dist")), errors)
    assert not errors, errors


@pytest.mark.unit
def test_docs_page_has_the_readme_test_command_and_ci_lints_and_builds_the_site():
    page = (DOCS / "development.md").read_text()
    assert code_blocks("bash")[-1].strip() in page
    build = 'python -m pip install -e ".[docs]" && python -m mkdocs build --strict'
    assert build in page and build in README
    assert build in (ROOT / ".ci" / "run").read_text().splitlines()
    lint = 'python -m pip install -e ".[lint]" && python -m ruff check . && python -m ruff format --check .'
    assert lint in page and lint in (ROOT / ".ci" / "run").read_text().splitlines()


@pytest.mark.unit
def test_docs_pictures_are_the_committed_results():
    assert (DOCS / "assets" / "results.png").read_bytes() == (
        ROOT / "benchmarks" / "results.png"
    ).read_bytes(), "copy benchmarks/results.png to docs/assets/"


@pytest.mark.unit
def test_every_page_is_in_the_nav_and_every_public_name_in_the_api_reference():
    import keras_accum

    config = (ROOT / "mkdocs.yml").read_text()
    for path in DOCS.rglob("*.md"):
        assert f": {path.relative_to(DOCS).as_posix()}\n" in config, f"{path} not in nav"
    api = (DOCS / "api.md").read_text()
    for name in keras_accum.__all__:
        if name != "__version__":
            # Under its own name, or (`wrap`, whose function hides its
            # module's name) under a heading giving the name it has.
            assert f"::: keras_accum.{name}\n" in api or f"heading: keras_accum.{name}\n" in api, (
                name
            )
    assert "keras_accum.__version__" in api
    readme = README.split("## The four ways in", 1)[1]
    names = re.search(r"`__all__` is (.*?)\.\s", readme, flags=re.S)[1]
    assert sorted(re.findall(r"`(\w+)`", names)) == sorted(keras_accum.__all__)


@pytest.mark.unit
def test_readme_stays_the_front_door():
    assert len(README.splitlines()) <= 300
    assert 'python -m pip install ".[tensorflow]"' in README.split("## Install", 1)[1][:300]
    assert "once a release is published" in README.lower().replace("\n", " ")


def _public_members():
    """The public objects, and them with their public members (each once)."""
    import inspect

    import keras_accum

    objects = [getattr(keras_accum, n) for n in keras_accum.__all__ if n != "__version__"]
    objects += list(WRAPPED_CLASSES)  # wrap's results
    members = []
    for obj in objects:
        members.append(obj)
        if inspect.isclass(obj):
            # Its own members and those of its keras_accum base classes
            # (the API reference shows them too), not of the internals'.
            for base in inspect.getmro(obj):
                module = base.__module__
                if module.startswith("keras_accum") and "_internals" not in module:
                    members += [
                        m
                        for n, m in vars(base).items()
                        if not n.startswith("_")
                        and inspect.getattr_static(obj, n) is m  # not overridden
                        and not any(m is k for k in members)
                    ]
    return objects, members


def _doc(member):
    import inspect

    return inspect.getdoc(member.fget if isinstance(member, property) else member) or ""


@pytest.mark.unit
def test_every_public_name_and_member_has_an_example():
    # Keras's own hooks that a class implements (get_config, call, ...) are
    # Keras's to document; every name of keras_accum's own shows its use.
    import keras

    keras_names = set(dir(keras.Model)) | set(dir(keras.callbacks.Callback))
    keras_names |= set(dir(keras.optimizers.Optimizer))
    keras_names |= set(dir(keras.optimizers.schedules.LearningRateSchedule))
    _, members = _public_members()
    members = [m for m in members if isinstance(m, property) or callable(m)]
    missing = [
        getattr(m, "__qualname__", None) or getattr(m.fget, "__qualname__", repr(m))
        for m in members
        if "```python" not in _doc(m)
        and getattr(m, "__name__", getattr(getattr(m, "fget", None), "__name__", ""))
        not in keras_names
    ]
    assert not missing, f"no example in the docstrings of {missing}"


@pytest.mark.slow  # dozens of models, serially, as the pages are
def test_docstring_examples_run(tmp_path, monkeypatch):
    """The examples in the public docstrings, which the API reference shows."""

    import keras

    monkeypatch.chdir(tmp_path)
    objects, members = _public_members()
    ran = 0
    for member in members:
        for code in re.findall(r"```python\n(.*?)```", _doc(member), flags=re.S):
            namespace = {"__name__": "docstring"}
            exec(api_names(), namespace)
            try:
                exec(compile(code, f"<docstring of {member}>", "exec"), namespace)
            finally:
                keras.mixed_precision.set_global_policy("float32")
            ran += 1
    assert ran >= len(objects)


@pytest.mark.skipif(
    not __import__("importlib").util.find_spec("mkdocs"),
    reason='the docs extra is not installed: python -m pip install -e ".[docs]"',
)
@pytest.mark.slow  # mkdocs, in a process of its own
def test_site_builds_strictly_without_warnings(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "WARNING" not in result.stderr, result.stderr[-3000:]


@pytest.mark.unit
def test_the_site_and_the_readme_list_the_same_tested_pairs():
    def rows(text):
        install = text.split("## Install", 1)[1].split("\n## ", 1)[0]
        return re.findall(r"^\| \d+\.\d+.*\|$", install, flags=re.M)

    assert rows(README) == rows((DOCS / "getting-started.md").read_text())


@pytest.mark.slow  # the example, in a process of its own
def test_noise_scale_example_grows_the_batch_by_the_rule():
    result = run_python(str(ROOT / "examples" / "noise_scale.py"), "--epochs", "4", timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    number = r"(-?[\d.]+|inf|nan)"
    decisions = re.findall(
        rf"^\s*(\d+)\s+{number}\s+\({number}, {number}\)\s+(True|False)\s+(\d+)\s*([\d.]*)$",
        result.stdout,
        flags=re.M,
    )
    epochs = [
        line
        for line in result.stdout.splitlines()
        if re.match(r"\s*\d+\s+\S+\s+\d+\s+\d+\s+\S+$", line)
    ]
    assert len(epochs) == 4 and len(decisions) >= 3, result.stdout
    steps = 2
    for update, value, low, _, resolved, accum_steps, rate in decisions:
        # Towards 1.5 times the smoothed estimate (its lower bound unresolved),
        # in 16-sample steps: at most doubling, never shrinking, up to 32.
        # The printed estimate is rounded to 0.1: a tie may round either way.
        target = 1.5 * float(value if resolved == "True" else low) / 16
        wanted = [min(32, 2 * steps, max(steps, round(t))) for t in (target - 0.01, target + 0.01)]
        assert int(accum_steps) in wanted, (update, value, low, resolved, accum_steps, steps)
        assert bool(rate) == (int(accum_steps) != steps)  # a rate is set at each change
        steps = int(accum_steps)
    assert steps > 2, result.stdout  # it grew
