"""Data-parallel training against one device's big batch.

MirroredStrategy runs in this process, on the two logical CPU devices
tests/conftest.py sets up (tests/helpers/mirrored.py trains, the tests
here assert). MultiWorkerMirroredStrategy runs as two
worker processes on localhost: the test run's one cluster (`cluster` in
tests/conftest.py, running tests/scripts/cluster_checks.py). Each also
runs with one replica (a CPU-only machine's `MirroredStrategy()`, a
`MultiWorkerMirroredStrategy()` without TF_CONFIG): the strategy path of
the step, where a one-replica bug would hide (issue 23).
"""

import json

import keras
import numpy as np
import pytest

from helpers import internals
from helpers import mirrored as mirrored_runs
from helpers.assertions import ATOL, FLOAT16_ATOL, FLOAT16_RTOL, RTOL, assert_history_close
from helpers.data import make_data, small_table_data
from helpers.models import OPTIMIZERS, functional, loss, small_tables_net
from helpers.processes import run_python, script

# Keras 3.8's metric variables are not summed over replicas when read: what
# it logs under a strategy (for plain models too) is not the one-device
# value, so only weights and predictions are compared there.
METRICS_EXACT = internals.keras_internals.metrics_summed_over_replicas()


# Dozens of trainings under a strategy in one fixture: two replicas in the
# slow tier (CI runs it once), one replica (two replicas' code with one
# component) before a release; the integration tier's one- and two-replica
# cases are the window-state file, the sparse sum, BatchNorm and the draws.
@pytest.fixture(
    scope="module",
    params=[pytest.param(1, marks=pytest.mark.release), pytest.param(2, marks=pytest.mark.slow)],
    ids=["one_replica", "two_replicas"],
)
def mirrored(request):
    out = mirrored_runs.checks(request.param)
    assert out["replicas"] == request.param
    return out


# Differences are max absolute weight differences; the weights are O(0.1-1),
# so ATOL stands for the reference tolerance here.


@pytest.mark.parametrize(
    "optimizer", ["adam", "sgd_momentum", "adamw", "adam_steps_per_execution_3"]
)
def test_two_replicas_match_one_device_big_batch(mirrored, optimizer):
    # 76 samples at a global micro-batch of 8 (4 per replica) and N=4:
    # uneven last windows and an open window at each epoch's end.
    assert mirrored["moved"] > 1e-2
    assert mirrored["weights"][optimizer] < ATOL
    # Logged loss, accuracy and val_* equal the single-device run's.
    if METRICS_EXACT:
        assert mirrored["history"][optimizer] < 1e-5


@pytest.mark.parametrize("accum_steps", [1, 2])
def test_micro_batch_size_splits_each_replicas_share(mirrored, accum_steps):
    result = mirrored["micro_batch"][f"accum_steps_{accum_steps}"]
    assert result["weights"] < ATOL
    assert result["iterations"][0] == result["iterations"][1] == 6
    if METRICS_EXACT:
        assert result["history"] < 1e-5


def test_keras_builtin_accumulation_fails_under_mirrored_strategy(mirrored):
    # keras-team/keras#20582: its conditional update is a cond inside the
    # replica function around a merge_call. If this starts failing, Keras
    # fixed it: update the README's comparison table.
    assert not mirrored["builtin"].startswith("trained"), mirrored["builtin"]
    assert "merge_call" in mirrored["builtin"], mirrored["builtin"]


def test_mixed_float16_across_replicas_matches_one_device(mirrored):
    run = mirrored["mixed_float16"]
    for w, v in zip(run["accum"], run["plain"]):
        np.testing.assert_allclose(w, v, rtol=FLOAT16_RTOL, atol=FLOAT16_ATOL)
    assert run["scales"][0] == run["scales"][1]


def test_gradients_cross_devices_only_on_updates(mirrored):
    # Without accumulation every micro-batch's gradients are reduced across
    # replicas; with accum_steps=4 only each update's are, as many per update.
    assert mirrored["updates_4"] == 6 and mirrored["updates_1"] == 20
    if mirrored["replicas"] == 1:
        # One replica: nothing to reduce, with or without accumulation.
        assert mirrored["reductions_1"] == mirrored["reductions_4"] == 0
        return
    per_update = mirrored["reductions_1"] / mirrored["updates_1"]
    assert mirrored["reductions_4"] == per_update * mirrored["updates_4"]
    assert mirrored["reductions_4"] < mirrored["reductions_1"]


def test_synchronized_batchnorm_across_replicas_has_big_batch_moving_statistics(mirrored):
    run = mirrored["batchnorm"]
    assert abs(np.array(run["plain"][0])).min() > 0.5  # the statistics moved
    for a, b in zip(run["accum"], run["plain"]):
        np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL)


def test_flush_and_resume_across_replicas(mirrored):
    assert mirrored["flush"] < ATOL
    assert mirrored["resumed_pending"] == 2
    assert mirrored["resume"] < ATOL


def test_accum_scheduler_across_replicas(mirrored):
    # Batch 8, 16, 32 over three epochs, as one device with that batch size.
    assert mirrored["schedule"] < ATOL
    assert mirrored["schedule_iterations"][0] == mirrored["schedule_iterations"][1] == 10 + 5 + 3


def test_skip_nonfinite_every_replica_agrees(mirrored):
    # The NaN is in one replica's data only, each replica's in turn; every
    # replica skips the window.
    replicas = mirrored["replicas"]
    assert sorted(mirrored["skip"]) == [f"nan_on_replica_{i}" for i in range(replicas)]
    for run in mirrored["skip"].values():
        assert run["finite"] and run["replicas"] == replicas and run["replicas_differ"] == 0
        assert run["diff"] < ATOL
        assert run["skipped"] == 2 and run["logged"] == [1, 2]
        assert run["iterations"] == 4  # 3 windows an epoch, one skipped


# -- MultiWorkerMirroredStrategy: two worker processes -------------------------


@pytest.fixture(
    scope="module",
    params=[
        pytest.param(1, marks=pytest.mark.slow),  # a process of its own
        pytest.param(2, marks=pytest.mark.multi_worker),
    ],
    ids=["one_worker", "two_workers"],
)
def workers(request):
    if request.param == 1:
        # MultiWorkerMirroredStrategy() with no TF_CONFIG: one worker.
        result = run_python(script("cluster_checks.py"), timeout=900)
        assert result.returncode == 0, result.stderr[-3000:]
        out = [json.loads(result.stdout.strip().splitlines()[-1])["distributed"]]
    else:
        # The test run's one cluster (tests/conftest.py).
        out = [worker["distributed"] for worker in request.getfixturevalue("cluster")]
    assert [w["replicas"] for w in out] == [request.param] * request.param
    return out


def assert_close_to(weights, model):
    assert len(weights) == len(model.get_weights())
    for w, v in zip(weights, model.get_weights()):
        np.testing.assert_allclose(np.array(w), v, rtol=RTOL, atol=ATOL)


def reference_fit(optimizer, batch_size):
    """One process, no strategy: what the workers' fit must reproduce."""
    model = functional()
    model.compile(OPTIMIZERS[optimizer](), loss(), metrics=["accuracy"])
    history = model.fit(
        *make_data(76),
        batch_size=batch_size,
        epochs=2,
        shuffle=False,
        verbose=0,
        validation_data=make_data(20, seed=3),
    )
    return model, history


def test_small_tables_across_workers_match_the_one_process_big_batch(workers):
    # Windows of moments: each worker's statistic buffers are made in its
    # traced replica step (through merge_call), its own share summed by the
    # optimizer's all-reduce as the big batch's occurrences are.
    reference = small_tables_net()
    reference.compile(OPTIMIZERS["adam"](), loss())
    reference.fit(*small_table_data(92), batch_size=32, epochs=2, shuffle=False, verbose=0)
    for worker in workers:
        assert_close_to(worker["small_tables"], reference)


def test_noise_scale_across_workers_is_agreed_and_changes_nothing(workers):
    from helpers.noise import (
        estimate,
        per_example_gradients,
        regression_data,
        regression_net,
        windows_of,
    )

    for worker in workers:
        on, off = worker["noise_scale"]["on"], worker["noise_scale"]["off"]
        for a, b in zip(on["weights"], off["weights"]):
            np.testing.assert_array_equal(np.array(a), np.array(b))
        assert {k: v for k, v in on["history"].items() if k != "noise_scale"} == off["history"]
        assert not any(np.isnan(on["history"]["noise_scale"]))
        # Every worker logs the same value: read from the global window.
        assert (
            on["history"]["noise_scale"]
            == workers[0]["noise_scale"]["on"]["history"]["noise_scale"]
        )
    if len(workers) == 1:
        # One worker: the estimator on the one-process windows, exactly.
        x, y = regression_data(92, noise=1.0)
        grads = per_example_gradients(regression_net(), x, y)
        expected = estimate(grads, windows_of(92, 8, 4))
        logged = workers[0]["noise_scale"]["still"]["history"]["noise_scale"]
        np.testing.assert_allclose(logged, [expected] * 2, rtol=1e-5)


def test_coupled_from_across_workers_is_the_one_process_big_batch(workers):
    # The representations all-gathered across workers; every worker
    # computes the loss on the global batch and backpropagates its rows.
    from helpers.coupled import FIT, InBatchSoftmax, data, two_tower

    plain = two_tower()
    plain.compile(keras.optimizers.Adam(0.01), InBatchSoftmax())
    history = plain.fit(*data(), **FIT)
    for worker in workers:
        assert_close_to(worker["coupled"]["weights"], plain)
        if METRICS_EXACT:
            assert_history_close(worker["coupled"]["history"], history)


def test_plain_keras_fit_fails_across_workers(workers):
    # Why AccumModel replaces Keras's symbolic build and log reduction there
    # (tensorflow/tensorflow#72388). If this starts failing, Keras fixed it
    # and the workarounds in keras_accum/_internals/trainer.py may be dropped.
    for worker in workers:
        if len(workers) == 1:
            # One worker is not multi-worker mode: Keras's own fit works.
            assert worker["plain_keras"] == "trained", worker["plain_keras"]
        else:
            assert worker["plain_keras"].startswith("ValueError"), worker["plain_keras"]


@pytest.mark.parametrize(
    "optimizer, data",
    [("adam", "tf.data"), ("sgd_momentum", "tf.data"), ("adamw", "tf.data"), ("adam", "numpy")],
)
def test_two_workers_match_one_process_big_batch(workers, optimizer, data):
    # Global micro-batch 8 (4 per worker), N=4, 76 samples: windows of
    # 4, 4 and 2 micro-batches (8 and 4 samples) each epoch, the last applied by the
    # epoch-end flush. Both workers hold the same weights: the big batch's.
    runs = [w["fit"][optimizer] if data == "tf.data" else w["numpy"] for w in workers]
    a = runs[0]
    assert all(run["weights"] == a["weights"] for run in runs)
    plain, history = reference_fit(optimizer, batch_size=32)
    assert_close_to(a["weights"], plain)
    # Logged loss, accuracy and val_* on every worker, as on one device.
    for run in runs:
        if METRICS_EXACT:
            assert_history_close(run["history"], history)


def test_evaluate_and_predict_across_workers(workers):
    plain, _ = reference_fit("adamw", batch_size=32)
    expected = plain.evaluate(*make_data(20, seed=3), verbose=0, return_dict=True)
    predictions = plain.predict(make_data(76)[0], verbose=0)
    for worker in workers:
        assert sorted(worker["evaluate"]) == sorted(expected)
        for key, value in expected.items():
            if METRICS_EXACT:
                np.testing.assert_allclose(worker["evaluate"][key], value, rtol=RTOL, atol=ATOL)
        np.testing.assert_allclose(worker["predict"], predictions, rtol=RTOL, atol=ATOL)


def test_accum_steps_1_trains_across_workers_like_one_process(workers):
    # Plain Keras fit fails here; AccumModel at accum_steps=1 is that fit.
    plain, history = reference_fit("adam", batch_size=8)
    for worker in workers:
        assert_close_to(worker["accum_1"]["weights"], plain)
        if METRICS_EXACT:
            assert_history_close(worker["accum_1"]["history"], history)


def test_mid_window_checkpoint_resumes_and_flushes_across_workers(workers):
    for worker in workers:
        # Saved after 6 micro-batches: the second window is half done.
        assert worker["resumed_pending"] == 2
        for w, v in zip(worker["resumed"], worker["uninterrupted"]):
            np.testing.assert_allclose(w, v, rtol=RTOL, atol=ATOL)
    # flush() right after loading applies the half window: a big batch of
    # 32 samples, then one of the next 16.
    x, y = make_data(100)
    plain = functional()
    plain.compile(OPTIMIZERS["adam"](), loss())
    plain.train_on_batch(x[:32], y[:32])
    plain.train_on_batch(x[32:48], y[32:48])
    for worker in workers:
        assert_close_to(worker["flushed"], plain)


def test_skip_nonfinite_every_worker_agrees(workers):
    # The NaN is in one worker's data only, each worker's in turn; every
    # worker skips the window: the big batches without it.
    x, y = make_data(76)
    plain = functional()
    plain.compile(OPTIMIZERS["adam"](), loss())
    for _ in range(2):
        for batch in (slice(0, 32), slice(64, 76)):
            plain.train_on_batch(x[batch], y[batch])
    keys = [f"nan_on_worker_{k}" for k in range(len(workers))]
    for worker in workers:
        assert sorted(worker["skip"]) == keys
        for key in keys:
            run = worker["skip"][key]
            assert run["skipped"] == 2 and run["logged"] == [1, 2]
            assert run["iterations"] == 4  # 3 windows an epoch, one skipped
            assert_close_to(run["weights"], plain)
