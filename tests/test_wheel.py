"""The wheel, not the checkout: built from the project's files, installed in
a fresh virtual environment, it runs the quickstart example.

Offline and quick on purpose: the wheel is built with the setuptools already
installed (`--no-build-isolation`), the virtual environment reuses this
Python's TensorFlow and Keras (`--system-site-packages`) and gets the wheel
alone (`--no-deps`, `--no-index`, `--ignore-installed`: the checkout may be
installed editable in this Python). Also: `python -m build` makes an sdist
and a wheel that pass `twine check --strict` (when the docs extra, which has
build and twine, is installed). Marked `wheel`: deselect with
`-m "not wheel"`.
"""

import importlib.util
import re
import shutil
import site
import subprocess
import sys
import tarfile
import venv
import zipfile
from pathlib import Path

import pytest

import keras_accum
from helpers.assertions import assert_quickstart_matches_the_big_batch
from helpers.project import ROOT

pytestmark = pytest.mark.wheel

# What `python -m build` reads: the metadata, the package and the files the
# metadata points at.
SOURCES = [
    "setup.py",
    "setup.cfg",
    "pyproject.toml",
    "MANIFEST.in",
    "LICENSE",
    "README.md",
    "CHANGELOG.md",
]


def run(*args, cwd, timeout=600, quiet_tensorflow=True):
    """Runs `args` (its CompletedProcess, text output); with
    `quiet_tensorflow=False` TensorFlow's log level is left as the program
    sets it."""
    env = {"PATH": "/usr/bin:/bin", "HOME": str(cwd)}
    if quiet_tensorflow:
        env["TF_CPP_MIN_LOG_LEVEL"] = "3"
    result = subprocess.run(
        [str(a) for a in args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    assert result.returncode == 0, (args, result.stdout[-3000:], result.stderr[-3000:])
    return result


def test_the_wheel_installs_in_a_fresh_venv_and_runs_the_quickstart(tmp_path):
    source = tmp_path / "source"
    _copy_sources(source)
    dist = tmp_path / "dist"
    run(
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "--no-deps",
        "--no-build-isolation",
        "--no-index",
        "-w",
        dist,
        source,
        cwd=tmp_path,
    )
    (wheel,) = dist.glob("keras_accum-*.whl")
    assert wheel.name == f"keras_accum-{keras_accum.__version__}-py3-none-any.whl"
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
    assert any(
        re.fullmatch(r"keras_accum-[^/]+\.dist-info/(licenses/)?LICENSE", n) for n in names
    ), names
    assert not any(n.startswith(("tests/", "benchmarks/", "docs/")) for n in names), names

    env = tmp_path / "venv"
    venv.create(env, system_site_packages=True, with_pip=True)
    python = env / "bin" / "python"
    # The test run's own packages (TensorFlow, Keras) too: `system_site_packages`
    # reaches the base interpreter's, not those of a virtualenv the tests
    # run in: where TensorFlow is installed only there, the import failed.
    site_dir = run(
        python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))", cwd=tmp_path
    ).stdout
    Path(site_dir.strip(), "test-run.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    run(
        python,
        "-m",
        "pip",
        "install",
        "--no-deps",
        "--no-index",
        "--ignore-installed",
        wheel,
        cwd=tmp_path,
    )

    work = tmp_path / "work"  # neither the checkout nor the source copy
    work.mkdir()
    shutil.copy(ROOT / "examples" / "quickstart.py", work / "quickstart.py")
    where = run(python, "-c", "import keras_accum; print(keras_accum.__file__)", cwd=work).stdout
    assert where.strip().startswith(str(env)), where
    # The quickstart as the README runs it, with TensorFlow's log level its
    # own: its test from the checkout (test_docs) runs before a release.
    assert_quickstart_matches_the_big_batch(
        run(python, "quickstart.py", cwd=work, quiet_tensorflow=False)
    )


def _copy_sources(target):
    target.mkdir()
    for name in SOURCES:
        shutil.copy(ROOT / name, target / name)
    shutil.copytree(
        ROOT / "keras_accum", target / "keras_accum", ignore=shutil.ignore_patterns("__pycache__")
    )


@pytest.mark.skipif(
    not all(importlib.util.find_spec(m) for m in ("build", "twine")),
    reason='needs build and twine: python -m pip install -e ".[docs]"',
)
def test_build_makes_an_sdist_and_a_wheel_that_pass_twine_check(tmp_path):
    source = tmp_path / "source"
    _copy_sources(source)
    dist = tmp_path / "dist"
    # --no-isolation: the installed setuptools, no download.
    run(sys.executable, "-m", "build", "--no-isolation", "--outdir", dist, source, cwd=tmp_path)
    (sdist,) = dist.glob("keras_accum-*.tar.gz")
    (wheel,) = dist.glob("keras_accum-*.whl")
    output = run(
        sys.executable, "-m", "twine", "check", "--strict", sdist, wheel, cwd=tmp_path
    ).stdout
    assert output.count("PASSED") == 2, output
    with tarfile.open(sdist) as archive:
        names = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
    assert {"LICENSE", "README.md", "CHANGELOG.md", "pyproject.toml", "setup.cfg"} <= names, names
