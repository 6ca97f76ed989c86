"""One rule for window state: every piece of it follows the same decisions.

A window's state is its gradient buffers, the slices of a sparse variable,
the BatchNormalization moments, the non-finite decision (the count of
skipped windows) and the counters. Whatever ends a window (applied, skipped
for a non-finite gradient, discarded by `reset_window()`, or, loaded from a
mid-window file, flushed or discarded) must end all of it, and what it
leaves behind must be the plain model's big batches of the applied windows.

Table: {apply, skip, reset, flush after load, reset after load}
x {step mode (accum_steps=4, batch 4), micro_batch_size (accum_steps=2,
batch 8 split in 4s)} x {one device, MirroredStrategy with one replica,
MirroredStrategy with two}. Both modes make windows of the same 16 samples.
Both strategies run in this process, on the two logical CPU devices that
tests/conftest.py sets up.
"""

import contextlib
import itertools

import keras
import numpy as np
import pytest
import tensorflow as tf

from helpers import internals, references, replicas
from helpers.assertions import ATOL, RTOL, assert_trained
from helpers.models import loss
from helpers.tiers import wide
from keras_accum import AccumModel

FEATURES, VOCAB, WINDOW = 6, 40, 16
MOMENTUM = 0.6
MODES = {
    "step": dict(accum_steps=4, batch=4),
    "micro_batch_size": dict(accum_steps=2, batch=8, micro_batch_size=4),
}


def make_data(n=48, seed=0):
    rng = np.random.default_rng(seed)
    x = (rng.normal(size=(n, FEATURES)) * np.arange(1, FEATURES + 1) + 2).astype("float32")
    y = (x[:, 0] + x[:, 1] > 3).astype("int64") + (x[:, 2] > 3)
    return x, y


def net(cls=keras.Model, seed=0, **kwargs):
    """An Embedding (slices), a BatchNormalization on the raw input (whose
    moving statistics are the big batch's exactly) and Dense layers. The
    normalised values enter the loss times 0: the gradients are the big
    batch's too, though each micro-batch is normalised by its own moments."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((FEATURES,))
    ids = keras.ops.cast(keras.ops.clip(keras.ops.abs(inputs[:, :2]) * 4, 0, VOCAB - 1), "int32")
    embedded = keras.layers.Flatten()(keras.layers.Embedding(VOCAB, 4)(ids))
    h = keras.layers.Dense(8, activation="tanh")(keras.layers.Concatenate()([inputs, embedded]))
    normalised = keras.layers.BatchNormalization(momentum=MOMENTUM)(inputs)
    outputs = keras.layers.Dense(3)(h) + 0.0 * keras.ops.sum(normalised, axis=-1, keepdims=True)
    return cls(inputs, outputs, **kwargs)


# Where the window lives: one device, and MirroredStrategy with one
# replica (the strategy path of the step) and two (each replica holding
# its own share of the window: sync-on-read buffers, per-replica
# BatchNorm moments).
WHERE = {"one_device": 0, "one_replica_mirrored": 1, "two_replica_mirrored": 2}


def scope(where):
    if where == "one_device":
        return contextlib.nullcontext()
    return replicas.mirrored(WHERE[where]).scope()


def accumulating(mode, where, seed=0):
    settings = dict(MODES[mode])
    settings.pop("batch")
    with scope(where):
        model = net(AccumModel, seed=seed, skip_nonfinite=True, **settings)
        model.compile(keras.optimizers.Adam(0.01), loss())
        # Built, so that `load_weights` restores its state (as in Keras, an
        # unbuilt optimizer skips it).
        model.optimizer.build(model.trainable_variables)
    return model


def train(model, mode, data, start, stop):
    x, y, w = data
    batch = MODES[mode]["batch"]
    for i in range(start, stop, batch):
        model.train_on_batch(x[i : i + batch], y[i : i + batch], sample_weight=w[i : i + batch])


def plain_big_batches(windows, where="one_device"):
    """The plain model after one big batch per window (samples a to b of
    `make_data()`, weight 1), trained once per test process for each
    (windows, strategy): every mode and decision that applies the same
    windows reads the same reference."""
    # On two replicas the reference is Keras's own big batch on the same
    # strategy: Keras's cross-replica sum of an Embedding's IndexedSlices
    # makes Adam's update differ from one device's (0.011 here, for a plain
    # model alone), and keras_accum reproduces Keras's (4.8e-7).
    on_two = where == "two_replica_mirrored"

    def train():
        x, y = make_data()
        with scope(where) if on_two else contextlib.nullcontext():
            plain = net()
            plain.compile(keras.optimizers.Adam(0.01), loss())
        for a, b in windows:
            plain.train_on_batch(x[a:b], y[a:b])
        assert_trained(plain, net().get_weights())
        return plain

    return references.once(("window_state", tuple(windows), on_two), train)


def state(model):
    """Every piece of window state, by name, as numpy."""
    acc = internals.accumulator(model)
    out = {
        "micro_step": acc.micro_step.numpy(),
        "window_weight": acc.window_weight.numpy(),
        "skipped": model.skipped_windows,
    }
    for i, (buf, count) in enumerate(zip(acc.acc_grads, acc.slice_counts)):
        out[f"slice_count_{i}"] = count.numpy()
        if i not in internals.sparse_indices(acc):
            # A sparse buffer's rows past its count are stale by design.
            out[f"acc_grad_{i}"] = buf.numpy()
    for key, window in internals.batchnorm_windows(model).items():
        for part, v in zip(("count", "mean", "m2"), window.state()):
            out[f"bn_{part}_{key}"] = v.numpy()
    out["bn_parked"] = len(internals.parked_batchnorm_moments(model))
    return out


def assert_window_closed(model, skipped):
    closed = state(model)
    assert closed.pop("skipped") == skipped
    assert closed.pop("bn_parked") == 0
    assert any(k.startswith("bn_count") for k in closed), sorted(closed)
    assert internals.sparse_indices(model), "the embedding's window is not slices"
    for name, value in closed.items():
        np.testing.assert_array_equal(value, np.zeros_like(value), err_msg=name)


def assert_as_plain(model, plain):
    for a, b in zip(model.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL)
    assert int(model.optimizer.iterations.numpy()) == int(plain.optimizer.iterations.numpy())


def scenario_apply(mode, where, data, tmp_path):
    model = accumulating(mode, where)
    train(model, mode, data, 0, 2 * WINDOW)
    return model, [(0, 16), (16, 32)], 0


def scenario_skip(mode, where, data, tmp_path):
    x, y, w = data
    w = w.copy()
    w[20] = np.nan  # the second window's gradient is not finite, its moments are
    model = accumulating(mode, where)
    train(model, mode, (x, y, w), 0, 3 * WINDOW)
    return model, [(0, 16), (32, 48)], 1


def scenario_reset(mode, where, data, tmp_path):
    model = accumulating(mode, where)
    train(model, mode, data, 0, WINDOW + 8)
    model.reset_window()
    train(model, mode, data, 2 * WINDOW, 3 * WINDOW)
    return model, [(0, 16), (32, 48)], 0


def _loaded_mid_window(mode, where, data, tmp_path):
    saved = accumulating(mode, where)
    train(saved, mode, data, 0, WINDOW + 8)
    before = state(saved)
    path = str(tmp_path / "mid.weights.h5")
    saved.save_weights(path)
    model = accumulating(mode, where, seed=1)
    model.load_weights(path)
    assert internals.pending(model) == internals.pending(saved) > 0
    return model, before


def scenario_flush_after_load(mode, where, data, tmp_path):
    model, _ = _loaded_mid_window(mode, where, data, tmp_path)
    model.flush()
    return model, [(0, 16), (16, 24)], 0


def scenario_reset_after_load(mode, where, data, tmp_path):
    model, _ = _loaded_mid_window(mode, where, data, tmp_path)
    model.reset_window()
    # Nothing of the discarded window comes back in the next one.
    train(model, mode, data, 2 * WINDOW, 3 * WINDOW)
    return model, [(0, 16), (32, 48)], 0


SCENARIOS = {
    "apply": scenario_apply,
    "skip": scenario_skip,
    "reset": scenario_reset,
    "flush_after_load": scenario_flush_after_load,
    "reset_after_load": scenario_reset_after_load,
}


# The whole table before a release; in CI all but the one-replica column
# (two replicas' code with one component). The inner loop keeps each decision once on one
# device, in step mode or micro-batch mode in turn (each mode's buffers are
# the same window's); two replicas (which take the one-replica strategy
# path of the step, and more) in the slow tier, a 10-16 s training each:
# the inner loop's two replicas are the file test's below.
ONE_DEVICE = {
    ("skip", "micro_batch_size"),
    ("reset", "step"),
    ("flush_after_load", "micro_batch_size"),
    ("reset_after_load", "step"),
}


TABLE = list(itertools.product(SCENARIOS, sorted(MODES), WHERE))


# The rest: two replicas in the slow tier, one replica (two replicas' code
# with one component) before a release.
@pytest.mark.parametrize(
    "decision, mode, where",
    [
        *wide(
            [t for t in TABLE if t[2] != "one_replica_mirrored"],
            [
                (d, m, w)
                for d, m, w in TABLE
                # "apply" on one device is in every other scenario's last window
                # (skip, reset and reset_after_load end with an in-step apply).
                if w == "one_device" and (d, m) in ONE_DEVICE
            ],
        ),
        *wide([t for t in TABLE if t[2] == "one_replica_mirrored"], [], pytest.mark.release),
    ],
)
def test_every_piece_of_window_state_follows_the_decision(decision, mode, where, tmp_path):
    x, y = make_data()
    data = (x, y, np.ones(len(x), "float32"))
    model, windows, skipped = SCENARIOS[decision](mode, where, data, tmp_path)
    assert_window_closed(model, skipped)
    assert_as_plain(model, plain_big_batches(windows, where))


# One device and two replicas' file in micro-batch mode in the inner loop;
# two replicas' other in the slow tier; one replica's (two replicas' with
# one component) before a release.
FILES = list(itertools.product(sorted(MODES), WHERE))


@pytest.mark.parametrize(
    "mode, where",
    [
        *wide(
            [f for f in FILES if f[1] != "one_replica_mirrored"],
            [
                f
                for f in FILES
                if f[1] == "one_device" or f == ("micro_batch_size", "two_replica_mirrored")
            ],
        ),
        *wide([f for f in FILES if f[1] == "one_replica_mirrored"], [], pytest.mark.release),
    ],
)
def test_a_mid_window_file_restores_every_piece_of_window_state(mode, where, tmp_path):
    x, y = make_data()
    data = (x, y, np.ones(len(x), "float32"))
    model, before = _loaded_mid_window(mode, where, data, tmp_path)
    # BatchNorm moments loaded before their windows exist wait, parked, for
    # the next step (or flush / reset_window): made here to be read.
    internals.batchnorm(model).build(model.distribute_strategy)
    after = state(model)
    assert sorted(after) == sorted(before)
    for name in before:
        np.testing.assert_allclose(after[name], before[name], rtol=RTOL, atol=ATOL, err_msg=name)


# The strategy's case on one replica in the inner loop (one device is
# test_every_piece_of_window_state_follows_the_decision's flush_after_load
# case, and test_saving's load into an untrained model); two in the slow tier.
@pytest.mark.parametrize("where", wide(list(WHERE), ["one_replica_mirrored"]))
def test_flush_after_load_with_an_unbuilt_optimizer(where, tmp_path):
    # The file holds optimizer state, so load_weights builds the optimizer
    # (outside the strategy's scope: its variables must still be the
    # strategy's) and loads it; flush() then applies the half window: the
    # big batches of the uninterrupted run, exactly.
    x, y = make_data()
    data = (x, y, np.ones(len(x), "float32"))
    saved = accumulating("step", where)
    train(saved, "step", data, 0, WINDOW + 8)
    path = str(tmp_path / "mid.weights.h5")
    saved.save_weights(path)
    with scope(where):
        model = net(AccumModel, seed=1, skip_nonfinite=True, accum_steps=4)
        model.compile(keras.optimizers.Adam(0.01), loss())
    model.load_weights(path)
    model.flush()
    assert int(model.optimizer.iterations.numpy()) == 2
    assert_window_closed(model, skipped=0)
    assert_as_plain(model, plain_big_batches([(0, 16), (16, 24)], where))


# -- the rule itself, on one variable -------------------------------------------------


class _Observer:
    """Records what the window's rule tells an observer (state.py's protocol)."""

    def __init__(self):
        self.events = []

    def build(self, strategy):
        pass

    def close(self, closed):
        self.events.append(
            (
                "close",
                [g.numpy().tolist() for g in closed.gradients],
                float(closed.micro_steps),
                closed.skipping,
            )
        )

    def discard(self):
        self.events.append(("discard",))

    def snapshot(self):
        return None

    def restore(self, snapshot):
        pass


def _window_of(skip, grads):
    weights = keras.Variable(np.ones(2, "float32"))
    acc = internals.GradientAccumulator()
    acc.build([weights], accum_steps=len(grads))
    observer = _Observer()
    state = internals.AccumState(acc, moments=observer, skip=skip)
    for g in grads:
        acc.add([tf.constant(g, "float32")], weight=1.0)
    return state, weights, observer


@pytest.mark.unit
def test_every_window_end_reaches_every_observer_through_one_rule():
    # A window applied: the observer closes with the gradient as applied.
    state, weights, observer = _window_of(internals.NonFiniteWindows(), [[1.0, 3.0], [3.0, 5.0]])
    internals.close(state, keras.optimizers.SGD(1.0))
    assert observer.events == [("close", [[2.0, 4.0]], 2.0, True)]
    np.testing.assert_array_equal(weights.numpy(), [-1.0, -3.0])
    # A window skipped: the observer discards it, nothing moves.
    state, weights, observer = _window_of(internals.NonFiniteWindows(), [[np.nan, 1.0]])
    internals.close(state, keras.optimizers.SGD(1.0))
    assert observer.events == [("discard",)] and state.skipped_windows == 1
    np.testing.assert_array_equal(weights.numpy(), [1.0, 1.0])
    # The default policy applies every window.
    state, weights, observer = _window_of(None, [[np.nan, 1.0]])
    internals.close(state, keras.optimizers.SGD(1.0))
    assert [e[0] for e in observer.events] == ["close"] and state.skipped_windows == 0
    # A batch without buffers is a window of one step, closed by the same rule.
    observer = _Observer()
    state = internals.AccumState(internals.GradientAccumulator(), moments=observer)
    variable = keras.Variable(np.ones(2, "float32"))
    batch = internals.MicroBatch(
        [tf.constant([4.0, 8.0])], None, tf.constant(4.0), True, None, None, None
    )
    internals.close_batch(state, keras.optimizers.SGD(1.0), batch, None, [variable])
    assert observer.events == [("close", [[1.0, 2.0]], 1.0, False)]
    np.testing.assert_array_equal(variable.numpy(), [0.0, -1.0])
