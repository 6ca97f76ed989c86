"""The reference comparisons and their tolerances."""

import re

import numpy as np

from helpers.models import moving

# Two float32 runs of the same training, the big batch and its micro-batches.
RTOL, ATOL = 1e-5, 1e-6
# mixed_float16 computes every layer in float16, whose 11-bit mantissa
# rounds at ~5e-4: the big batch and the micro-batches round differently
# (different reduction sizes), so weights agree to float16, not float32.
FLOAT16_RTOL, FLOAT16_ATOL = 2e-3, 2e-4
# bfloat16 keeps only 8 mantissa bits (~4e-3 relative rounding).
BFLOAT16_RTOL, BFLOAT16_ATOL = 2e-2, 2e-3


def assert_weights_close(a, b, rtol=RTOL, atol=ATOL):
    wa, wb = a.get_weights(), b.get_weights()
    assert len(wa) == len(wb)
    for va, vb in zip(wa, wb):
        np.testing.assert_allclose(va, vb, rtol=rtol, atol=atol)


def assert_unchanged(before, model):
    """`model`'s weights are exactly `before` (a `get_weights()` list)."""
    after = model.get_weights()
    assert len(before) == len(after)
    for a, b in zip(before, after):
        np.testing.assert_array_equal(a, b)


def assert_history_close(ha, hb, rtol=RTOL, atol=ATOL):
    """Compares two `fit` histories: `History` objects or their `.history` dicts."""
    ha, hb = (getattr(h, "history", h) for h in (ha, hb))
    assert sorted(ha) == sorted(hb)
    for key in ha:
        np.testing.assert_allclose(ha[key], hb[key], rtol=rtol, atol=atol, err_msg=key)


def assert_trained(model, initial):
    """Guards against comparisons that pass because nothing moved."""
    moved = max(np.abs(w - w0).max() for w, w0 in zip(model.get_weights(), initial))
    assert moved > 1e-3, f"weights barely moved ({moved}); the test is vacuous"


def assert_no_open_window(model):
    """No window is open on `model` (an AccumModel, or a model compiled with
    an AccumOptimizer): `flush()` changes nothing.

    Observed through the public API: an open window's flush makes an update
    (or skips one), which moves the optimizer's variables or
    `skipped_windows`; with none open, flush is a no-op, so the check leaves
    the model as it was.
    """
    owner = model if hasattr(model, "flush") else model.optimizer
    before = _flush_visible(model, owner)
    owner.flush()
    after = _flush_visible(model, owner)
    assert before[0] == after[0], f"flush() skipped a window: {before[0]} -> {after[0]}"
    assert len(before[1]) == len(after[1])
    for a, b in zip(before[1], after[1]):
        np.testing.assert_array_equal(a, b, err_msg="flush() applied an open window")


def _flush_visible(model, owner):
    optimizer = model.optimizer
    values = [*model.get_weights()]
    if optimizer is not None:
        values += [v.numpy() for v in optimizer.variables]
        values.append(np.asarray(int(optimizer.iterations)))
    return owner.skipped_windows, values


def assert_moving_close(a, b, rtol=RTOL, atol=ATOL):
    """The moving statistics of two models' BatchNormalization layers agree."""
    for u, v in zip(moving(a), moving(b)):
        np.testing.assert_allclose(u, v, rtol=rtol, atol=atol)


def assert_moved(model):
    """The model's BatchNormalization moving statistics left their initial
    values (0 and 1) far behind: a comparison of them is not vacuous."""
    mean, variance = moving(model)
    assert np.abs(mean).min() > 0.5 and np.abs(variance - 1).max() > 0.5, (mean, variance)


def assert_quickstart_matches_the_big_batch(result):
    """examples/quickstart.py's run (a CompletedProcess): both models report
    the same test accuracy and updates, their weights agree, and none of
    TensorFlow's start-up log lines ("I0000 ... cudart_stub.cc:31] Could
    not find cuda drivers", absl's "All log messages before
    absl::InitializeLog()") reach its output: the example sets
    TF_CPP_MIN_LOG_LEVEL itself, which this checks where the environment
    does not set it (the wheel's run)."""
    out, err = result.stdout, result.stderr
    assert result.returncode == 0, err[-3000:]
    accuracies = re.findall(r"test accuracy (\d\.\d+), (\d+) updates", out)
    assert len(accuracies) == 2 and accuracies[0] == accuracies[1], out
    assert float(re.search(r"largest weight difference: (\S+)", out)[1]) < 1e-4, out
    log_lines = re.findall(r"(?m)^(?:[IWEF]\d{4} .*|.*absl::InitializeLog.*)$", err)
    assert log_lines == [], err[-3000:]
