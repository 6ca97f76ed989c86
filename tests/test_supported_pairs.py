"""The supported TensorFlow/Keras range is stated once per place, and agrees:
setup.cfg, the import check, noxfile.py's tested pairs, README's table and
what CI runs."""

import configparser
import os
import re

import pytest

from helpers.internals import keras_internals as internals
from helpers.processes import run_python
from helpers.project import ROOT, nox_constant, nox_pairs


@pytest.mark.unit
def test_readme_install_table_lists_the_tested_pairs():
    install = (ROOT / "README.md").read_text().split("## Install", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(
        r"^\| ((?:tf-nightly )?\d+\.\d+\.\d+(?:\.dev\d+)?) \| "
        r"((?:keras-nightly )?\d+\.\d+\.\d+(?:\.dev\d+)?) \|",
        install,
        flags=re.M,
    )
    # noxfile.py names a nightly "nightly:VERSION"; the README
    # "tf-nightly VERSION" and "keras-nightly VERSION".
    rows = [
        (tf.replace("tf-nightly ", "nightly:"), keras.replace("keras-nightly ", "nightly:"))
        for tf, keras in rows
    ]
    assert sorted(rows) == sorted(nox_pairs().values())


@pytest.mark.unit
def test_setup_cfg_admits_every_tested_pair_and_nothing_older():
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    requires = config["options"]["install_requires"]
    assert "keras>=3.8,<4" in requires
    assert internals.MIN_KERAS == (3, 8) and internals.MIN_TENSORFLOW == (2, 18)
    for extra in ("tensorflow", "examples", "test"):
        assert "tensorflow>=2.18" in config["options.extras_require"][extra]
    for tensorflow, keras in nox_pairs().values():
        internals.check_versions(keras, tensorflow)  # raises if refused


@pytest.mark.unit
def test_ci_runs_the_next_pair_the_floor_pair_and_kerashub():
    run = (ROOT / ".ci" / "run").read_text()
    pairs = nox_pairs()
    assert pairs["floor"] == ("2.18.1", "3.8.0") and pairs["colab"] == ("2.20.0", "3.13.2")
    assert pairs["next"][0].startswith("nightly:2.23") and pairs["next"][1].startswith(
        "nightly:3.16"
    )
    # The slow tier once, on the newest pair, after the README's command,
    # with the KerasHub of the kerashub session (its tests must run).
    lines = run.splitlines()
    slow = 'KERAS_ACCUM_REQUIRE_KERAS_HUB=1 python -m pytest -n 3 -m "slow and not release"'
    hub = f'python -m pip install keras-hub=={nox_constant("KERAS_HUB")} "tensorflow==$tensorflow"'
    assert slow in lines and hub in lines and lines.index(hub) < lines.index(slow), run
    nox_lines = [line for line in lines if line.startswith("python -m nox")]
    # The next and floor pairs run the core tests (noxfile.py's CORE), for
    # CI's time, in the README's tiers (their slow cases run on every pair
    # before a release); the newest pair runs every tier but `release`. Their
    # virtualenvs install in the background during the slow tier, and the
    # sessions reuse them (-R) once that install has succeeded; the two
    # sessions run side by side, and CI fails if either does.
    install = 'python -m nox --install-only -s "core(next)" "core(floor)" >nox-install.log 2>&1 &'
    waited = 'wait "$virtualenvs" || { cat nox-install.log; exit 1; }'
    assert nox_lines == [
        install,
        'python -m nox -R -s "core(next)" -- -n 2 -m "not slow" >core-next.log 2>&1 &',
        'python -m nox -R -s "core(floor)" -- -n 2 -m "not slow" >core-floor.log 2>&1 &',
    ], nox_lines
    assert (
        lines.index(install) < lines.index(slow) < lines.index(waited) < lines.index(nox_lines[1])
    )
    ends = ['wait "$next" || status=1', 'wait "$floor" || status=1', '[ "$status" = 0 ]']
    assert all(end in lines for end in ends), run
    assert lines.index(nox_lines[2]) < lines.index(ends[0]) < lines.index(ends[2]), run
    core = nox_constant("CORE")
    assert core and all((ROOT / path).is_file() for path in core), core


@pytest.mark.slow  # a fresh process
def test_import_on_an_older_keras_names_the_supported_range():
    result = run_python("-c", "import keras; keras.__version__ = '3.4.1'; import keras_accum")
    assert result.returncode != 0
    assert (
        "ImportError: keras_accum supports Keras >= 3.8, < 4 with TensorFlow >= 2.18; "
        "found Keras 3.4.1" in result.stderr
    ), result.stderr[-2000:]


@pytest.mark.slow  # a fresh process
def test_import_without_tensorflow_says_what_to_install():
    # sys.modules[name] = None makes `import tensorflow` raise ImportError.
    result = run_python("-c", "import sys; sys.modules['tensorflow'] = None; import keras_accum")
    assert result.returncode != 0
    assert "keras_accum needs TensorFlow >= 2.18, which is not installed" in result.stderr
    assert "pip install 'tensorflow>=2.18'" in result.stderr, result.stderr[-2000:]


@pytest.mark.unit
@pytest.mark.xdist_group("probe")
def test_xdist_applies_the_groups_of_shared_fixtures(request):
    # Under `-n N --dist loadgroup` (setup.cfg), pytest-xdist sends a group's
    # tests to one worker by suffixing their ids with "@group": the shared
    # fixtures (tests/conftest.py: the cluster, the runs across replicas)
    # are then set up once, not once per worker. A pytest that xdist does not
    # know keeps the plain id and every group is silently ignored.
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        pytest.skip("not under pytest-xdist")
    assert request.node.nodeid.endswith("@probe"), (
        f"pytest-xdist did not apply the test groups (pytest {pytest.__version__}): "
        "cap pytest in setup.cfg's test extra to a version it supports"
    )
