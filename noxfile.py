"""The TensorFlow/Keras pairs keras_accum is tested on, one session each.

    nox -l                                   # list the sessions
    nox -s "tests(newest)"                   # whole suite on one pair
    nox -s tests -- tests/test_saving.py     # pytest arguments, every pair
    nox -s "tests(floor)" -- -n 3 -m "not slow"   # the README's tiers
    nox -s "tests(next)"                     # the next TensorFlow and Keras (pinned nightlies)
    nox -s "core(floor)" -- -n 2             # CI's subset (CORE) on one pair
    nox -s kerashub                          # KerasHub models (tests/test_kerashub.py)

Each session installs keras_accum with its pair into its own virtualenv
(`nox -r` reuses it) and runs pytest, by default on the whole suite. The
interpreter is the one nox runs on; pick another with `--force-python 3.12`
(TensorFlow publishes wheels for Python 3.10-3.12 on every pair here).
"""

import nox

# name: (TensorFlow, Keras). Keep README's "Install" table and .ci/run in
# step with these.
PAIRS = {
    "floor": ("2.18.1", "3.8.0"),  # the oldest supported
    "colab": ("2.20.0", "3.13.2"),  # Colab's and Kaggle's image today
    "newest": ("2.21.0", "3.15.1"),
    # The next TensorFlow and Keras, before their release: pinned nightlies
    # (tf-nightly, keras-nightly), so CI stays reproducible. Move the pins
    # as docs/keras-versions.md says ("Moving the next pair").
    "next": ("nightly:2.23.0.dev20261026", "nightly:3.16.0.dev2026102704"),
}

# What CI runs on the next and the floor pair (the newest runs the whole
# suite): what another Keras breaks first, each checked against the plain
# big batch or a reviewed fingerprint: its internals (test_keras_internals),
# the public surface and its errors (test_api), big-batch equality on the
# reference models (test_exactness) and in every execution mode, XLA first
# (test_execution_modes), files written by the last release (test_file_compat) and
# the traced step (test_step_graph). CI runs their unit and integration
# tiers (`-m "not slow"`); every tier on every pair, `nox`, runs before a
# release: CI keeps within its time.
CORE = [
    "tests/test_keras_internals.py",
    "tests/test_api.py",
    "tests/test_exactness.py",
    "tests/test_execution_modes.py",
    "tests/test_file_compat.py",
    "tests/test_step_graph.py",
]

# KerasHub's release tested by the `kerashub` session, on the newest pair.
KERAS_HUB = "0.32.0"

nox.options.sessions = ["tests"]


@nox.session
@nox.parametrize("pair", list(PAIRS), ids=list(PAIRS))
def tests(session, pair):
    _tests(session, pair)


@nox.session
@nox.parametrize("pair", list(PAIRS), ids=list(PAIRS))
def core(session, pair):
    """The CORE tests on one pair (CI's run on the next and floor pairs)."""
    _tests(session, pair, *CORE)


def _tests(session, pair, *paths):
    tensorflow, keras = PAIRS[pair]
    _install(session, tensorflow, keras)
    _print_versions(session)
    session.run("python", "-m", "pytest", *paths, *session.posargs)


@nox.session
def kerashub(session):
    """tests/test_kerashub.py with keras-hub on the newest pair; a missing
    keras-hub fails the session instead of skipping the tests."""
    tensorflow, keras = PAIRS["newest"]
    _install(session, tensorflow, keras, f"keras-hub=={KERAS_HUB}")
    _print_versions(session)
    session.run(
        "python",
        "-m",
        "pytest",
        "tests/test_kerashub.py",
        *session.posargs,
        env={"KERAS_ACCUM_REQUIRE_KERAS_HUB": "1"},
    )


def _install(session, tensorflow, keras, *extra):
    """keras_accum with its test extra, then the pair: a "nightly:VERSION"
    is tf-nightly or keras-nightly, which provide the same `tensorflow` and
    `keras` modules as the releases the test extra pulls in, so those are
    replaced after it (both nightlies in one command, each pinned)."""
    released = [
        f"tensorflow=={tensorflow}" if not tensorflow.startswith("nightly:") else None,
        f"keras=={keras}" if not keras.startswith("nightly:") else None,
    ]
    session.install("-e", ".[test]", "pytest-xdist", *filter(None, released), *extra)
    nightlies = {
        "tensorflow": ("tf-nightly", tensorflow),
        "keras": ("keras-nightly", keras),
    }
    replaced = [name for name, (_, version) in nightlies.items() if version.startswith("nightly:")]
    if replaced:
        # run_install: part of the install step, so `--install-only` (CI
        # prepares the virtualenvs while its tiers run) swaps them too.
        session.run_install("python", "-m", "pip", "uninstall", "-y", *replaced, silent=True)
        session.install(
            *[f"{nightlies[name][0]}=={nightlies[name][1].split(':', 1)[1]}" for name in replaced]
        )


def _print_versions(session):
    session.run(
        "python",
        "-c",
        "import keras, tensorflow; print('Keras', keras.__version__, 'TensorFlow', tensorflow.__version__)",
        env={"TF_CPP_MIN_LOG_LEVEL": "3"},
    )
