"""The README's commands and code, and the examples, do what they say."""

import re

import numpy as np
import pytest
from reference import ROOT, run_python

from keras_accum import _keras_internals as internals

README = (ROOT / "README.md").read_text()


def code_blocks(language):
    return re.findall(rf"```{language}\n(.*?)```", README, flags=re.S)


def test_ci_runs_the_readme_test_command():
    development = README.split("## Development", 1)[1]
    command = code_blocks("bash")[-1].strip()
    assert command in development
    assert command in (ROOT / ".ci" / "run").read_text().splitlines()


def test_readme_quickstart_runs():
    rng = np.random.default_rng(0)
    namespace = {
        "x_train": rng.normal(size=(64, 784)).astype("float32"),
        "y_train": rng.integers(0, 10, size=64),
    }
    exec(code_blocks("python")[0], namespace)
    model = namespace["model"]
    # 64 samples are 2 micro-batches: one partial window per epoch, 5 epochs.
    assert int(model.optimizer.iterations) == 5 * 1
    assert model.accum_steps == 8


def test_quickstart_example_matches_the_big_batch():
    result = run_python(str(ROOT / "examples" / "quickstart.py"))
    assert result.returncode == 0, result.stderr[-3000:]
    accuracies = re.findall(r"test accuracy (\d\.\d+), (\d+) updates", result.stdout)
    assert len(accuracies) == 2 and accuracies[0] == accuracies[1], result.stdout
    diff = float(re.search(r"largest weight difference: (\S+)", result.stdout)[1])
    assert diff < 1e-4, result.stdout
    # It sets TF_CPP_MIN_LOG_LEVEL: none of TensorFlow's start-up log lines
    # ("I0000 ... cudart_stub.cc:31] Could not find cuda drivers", absl's
    # "All log messages before absl::InitializeLog()") reach its output.
    log_lines = re.findall(r"(?m)^(?:[IWEF]\d{4} .*|.*absl::InitializeLog.*)$", result.stderr)
    assert log_lines == [], result.stderr[-3000:]


@pytest.mark.skipif(
    not internals.metrics_summed_over_replicas(),
    reason="this Keras does not sum metrics over replicas (Keras 3.8): the "
    "example's accuracies are not one process's",
)
def test_multi_worker_example_matches_one_process():
    # Starts two workers itself; both must report what one process with the
    # big batch reports.
    result = run_python(str(ROOT / "examples" / "multi_worker.py"), timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    reports = re.findall(r"test accuracy (\d\.\d+), (\d+) updates", result.stdout)
    assert len(reports) == 3 and len(set(reports)) == 1, result.stdout
    assert "worker 0 of 2" in result.stdout and "worker 1 of 2" in result.stdout


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


def test_readme_custom_loop_runs():
    import keras
    import tensorflow as tf

    import keras_accum

    block = next(b for b in code_blocks("python") if "AccumOptimizer(" in b)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    rng = np.random.default_rng(0)
    dataset = tf.data.Dataset.from_tensor_slices(
        (rng.normal(size=(40, 4)).astype("float32"), np.zeros((40, 2), "float32"))
    ).batch(8)
    namespace = dict(keras=keras, tf=tf, keras_accum=keras_accum, model=model,
                     loss_fn=keras.losses.MeanSquaredError(), dataset=dataset)
    exec(block, namespace)
    assert int(namespace["opt"].iterations) == 2  # one full window, one flushed


_SCALING_OUT = """
import sys
import numpy as np, tensorflow as tf
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
import keras, keras_accum
rng = np.random.default_rng(0)
x = rng.normal(size=(256, 784)).astype("float32")
y = rng.integers(0, 10, size=256)
exec(sys.argv[1])
assert strategy.num_replicas_in_sync == 2
print("updates", int(model.optimizer.iterations.numpy()))
"""


def test_readme_scaling_out_snippet_runs_as_written():
    block = next(b for b in code_blocks("python") if "MirroredStrategy()" in b)
    result = run_python("-c", _SCALING_OUT, block)
    assert result.returncode == 0, result.stderr[-3000:]
    # 256 samples at a global micro-batch of 64: 4 micro-batches, one
    # partial window of accum_steps=8, applied at the epoch's end.
    assert "updates 1" in result.stdout, result.stdout
