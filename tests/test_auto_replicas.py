"""`micro_batch_size="auto"` under MirroredStrategy (two logical CPUs, this
process) and MultiWorkerMirroredStrategy (two worker processes, only one of
them short of memory): a genuine out-of-memory error on any replica is
retried on every replica with one agreed smaller size, and the training is
the one-device big batch's.

The runs are in tests/helpers/auto_replicas.py; across workers they run
on the test run's one cluster (`cluster` in tests/conftest.py), each
worker bounded by a timeout (a hang fails the test).
"""

import keras
import numpy as np
import pytest

from helpers import replicas
from helpers.assertions import ATOL, RTOL
from helpers.auto_replicas import AutoRuns
from helpers.data import make_data
from helpers.models import functional, loss


@pytest.fixture(
    scope="module",
    # Under MirroredStrategy, a dozen trainings with out-of-memory retries
    # in one fixture: slow, as the cluster's.
    params=[
        pytest.param("mirrored", marks=pytest.mark.slow),
        pytest.param("two_workers", marks=pytest.mark.multi_worker),
    ],
)
def runs(request):
    """One result per process: one under MirroredStrategy, one per worker."""
    if request.param == "mirrored":
        out = [AutoRuns(replicas.mirrored(2)).run()]
    else:
        # The test run's one cluster (tests/conftest.py), worker 1 short of
        # memory.
        out = [worker["auto"] for worker in request.getfixturevalue("cluster")]
    assert all(o["replicas"] == 2 for o in out)
    return out


def big_batch(samples, batch_size):
    """One device, no strategy: 2 epochs, then 1 more in a second fit."""
    model = functional()
    model.compile(keras.optimizers.Adam(0.01), loss())
    data = make_data(samples)
    model.fit(*data, batch_size=batch_size, epochs=2, shuffle=False, verbose=0)
    model.fit(*data, batch_size=batch_size, epochs=1, shuffle=False, verbose=0)
    return model


def assert_close_to(weights, model):
    assert len(weights) == len(model.get_weights())
    for w, v in zip(weights, model.get_weights()):
        np.testing.assert_allclose(np.array(w), v, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize(
    "name, samples, batch_size, chosen",
    [
        # Batches of 16 (8 per replica), out of memory above 4.
        ("accum_1", 56, 16, 4),
        # Micro-batches of 8 (4 per replica), windows of 4: 32, 32 and 28
        # samples; out of memory above 2.
        ("accum_4", 92, 32, 2),
    ],
)
def test_auto_across_replicas_trains_as_the_big_batch(runs, name, samples, batch_size, chosen):
    reference = big_batch(samples, batch_size)
    for run in runs:
        result = run[name]
        assert_close_to(result["weights"], reference)
        assert result["iterations"] == int(reference.optimizer.iterations.numpy())
        # One size, the smallest any worker needed, chosen by every worker
        # (even the one with memory to spare), and kept for the later fit.
        assert result["chosen"] == result["chosen_later"] == chosen
        assert result["warnings"] == [1, 0]
    # Every worker holds the same weights.
    assert all(run[name]["weights"] == runs[0][name]["weights"] for run in runs)


def test_a_retry_leaves_no_trace_batchnorm_and_dropout(runs):
    # Auto, out of memory at 4 per replica, trains as micro_batch_size=2 from
    # the start: weights, BatchNormalization moving statistics, dropout.
    for run in runs:
        result = run["batchnorm"]
        assert result["chosen"] == 2
        assert result["iterations"] == [6, 6]
        for a, b in zip(result["auto"], result["integer"], strict=True):
            np.testing.assert_allclose(np.array(a), np.array(b), rtol=RTOL, atol=ATOL)


def test_nothing_fits_raises_the_same_error_everywhere_and_changes_nothing(runs):
    messages = set()
    for run in runs:
        result = run["nothing_fits"]
        assert result["raised"] is not None, "trained although nothing fits"
        assert "micro-batches of 1 sample" in result["raised"]
        assert "no micro-batch size fits" in result["raised"]
        messages.add(result["raised"])
        # Weights, optimizer, metrics, window, moving statistics, seeds: on
        # every replica of every worker, as before the step.
        assert result["values"] > 40  # 49 per replica
        assert result["changed"] == []
        assert result["chosen"] == 1
    assert len(messages) == 1


def test_a_collective_in_the_forward_pass_is_refused_across_workers(runs):
    # A synchronized BatchNormalization all-reduces in its forward pass: one
    # worker running out of memory before it would block the others there.
    # (On CPUs, MirroredStrategy reduces with ordinary ops, cancelled with
    # the failed step: allowed; on GPUs its NCCL ops are refused.)
    if "synchronized" not in runs[0]:
        pytest.skip("MirroredStrategy on CPUs: no collective op to refuse")
    for run in runs:
        assert "micro_batch_size='auto' across replicas" in run["synchronized"]
        assert "Collective" in run["synchronized"]
        assert "Received: micro_batch_size='auto'" in run["synchronized"]
        assert run["synchronized_iterations"] == 0


def test_another_error_on_one_worker_stops_every_worker(runs):
    # Not out of memory: the failing worker raises its own error; the others
    # raise too, instead of waiting for it in a collective.
    if "other_error" not in runs[0]:
        pytest.skip("one process: the error is raised once, for every replica")
    failing, other = runs[1]["other_error"], runs[0]["other_error"]
    assert failing.startswith("InvalidArgumentError") and "not this worker" in failing
    assert other.startswith("AbortedError") and "Another worker's training step failed" in other
    assert runs[0]["other_error_iterations"] == runs[1]["other_error_iterations"] == 0
