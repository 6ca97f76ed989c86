"""MirroredStrategy over two logical CPU devices, against one device's big batch.

The checks run in a fresh process (tests/mirrored_checks.py): logical
devices must be set up before TensorFlow starts its runtime.
"""

import json

import pytest
from reference import ATOL, ROOT, run_python


@pytest.fixture(scope="module")
def mirrored():
    result = run_python(str(ROOT / "tests" / "mirrored_checks.py"), timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


# Differences are max absolute weight differences; the weights are O(0.1-1),
# so ATOL stands for the reference tolerance here.


@pytest.mark.parametrize("optimizer", ["adam", "sgd_momentum", "adamw"])
def test_two_replicas_match_one_device_big_batch(mirrored, optimizer):
    # 100 samples at a global micro-batch of 8 (4 per replica) and N=4:
    # uneven last windows and an open window at each epoch's end.
    assert mirrored["moved"] > 1e-2
    assert mirrored["weights"][optimizer] < ATOL
    # Logged loss, accuracy and val_* equal the single-device run's.
    assert mirrored["history"][optimizer] < 1e-5


def test_gradients_cross_devices_only_on_updates(mirrored):
    # Without accumulation every micro-batch's gradients are reduced across
    # replicas; with accum_steps=4 only each update's are, as many per update.
    assert mirrored["updates_4"] == 8 and mirrored["updates_1"] == 26
    per_update = mirrored["reductions_1"] / mirrored["updates_1"]
    assert mirrored["reductions_4"] == per_update * mirrored["updates_4"]
    assert mirrored["reductions_4"] < mirrored["reductions_1"]


def test_flush_and_resume_across_replicas(mirrored):
    assert mirrored["flush"] < ATOL
    assert mirrored["resumed_pending"] == 2
    assert mirrored["resume"] < ATOL
