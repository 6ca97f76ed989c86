"""The TensorFlow/Keras pairs keras_accum is tested on, one session each.

    nox -l                                   # list the sessions
    nox -s "tests(newest)"                   # whole suite on one pair
    nox -s tests -- tests/test_saving.py     # pytest arguments, every pair
    nox -s "tests(floor)" -- -n 2 -m "not slow"

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
}

nox.options.sessions = ["tests"]


@nox.session
@nox.parametrize("pair", list(PAIRS), ids=list(PAIRS))
def tests(session, pair):
    tensorflow, keras = PAIRS[pair]
    session.install(
        "-e", ".[test]", f"tensorflow=={tensorflow}", f"keras=={keras}", "pytest-xdist"
    )
    session.run(
        "python", "-c",
        "import keras, tensorflow; print('Keras', keras.__version__, 'TensorFlow', tensorflow.__version__)",
        env={"TF_CPP_MIN_LOG_LEVEL": "3"},
    )
    session.run("python", "-m", "pytest", *session.posargs)
