"""BatchNormalization under accumulation: moving statistics of the big batch.

A BatchNormalization whose input does not depend on another batch-normalised
layer (here: the raw input) sees the same values in the micro-batches as in
the big batch, so its moving statistics must be the big batch's to float
tolerance, whatever the model's weights do (those differ: each micro-batch's
forward pass is normalised with its own moments, "ghost batch norm").
"""

import inspect

import keras
import numpy as np
import pytest

import keras_accum
from helpers import internals, training
from helpers.assertions import (
    ATOL,
    RTOL,
    assert_moved,
    assert_moving_close,
    assert_no_open_window,
)
from helpers.data import BN_SHAPES, bn_data
from helpers.models import BN_MOMENTUM, bn_layer, bn_net, bn_of, loss, moving, subclassed_bn_net
from helpers.tiers import each_once, wide
from keras_accum import AccumModel

MICRO, N = 8, 4


def wrapped(make):
    def build(cls=keras.Model, accum_steps=None, batchnorm="window", **kwargs):
        model = make(**kwargs)
        if cls is keras.Model:
            return model
        return keras_accum.wrap(model, accum_steps=accum_steps, batchnorm=batchnorm)

    return build


MAKERS = {
    "functional": bn_net,
    "subclass": subclassed_bn_net,
    "wrap_functional": wrapped(bn_net),
    "wrap_subclass": wrapped(subclassed_bn_net),
}


def fit_pair(make, x, y, compile_kwargs=None, **kwargs):
    """`make(cls, **kwargs)`'s plain big batch and its micro-batches with
    accumulation, both trained with SGD: `(plain, accum)`."""
    trained = training.fit_pair(
        lambda: make(AccumModel, accum_steps=N, **kwargs),
        lambda: make(keras.Model, **kwargs),
        x,
        y,
        lambda: keras.optimizers.SGD(0.1),
        big_batch=MICRO * N,
        accum_batch=MICRO,
        **(compile_kwargs or {}),
    )
    return trained.plain, trained.accum


def replay(x, updates, momentum=BN_MOMENTUM):
    """Keras's moving-statistics update in numpy (rank-2 `x`), once per batch
    of `updates`, a list of sample slices."""
    x = x.astype("float64")
    mean, variance = np.zeros(x.shape[-1]), np.ones(x.shape[-1])
    for batch in updates:
        mean = mean * momentum + x[batch].mean(0) * (1 - momentum)
        variance = variance * momentum + x[batch].var(0) * (1 - momentum)
    return mean, variance


# -- 1. exactly the big batch's update for a layer that sees the raw input ------


# Each way and each window length once in the inner loop.
@pytest.mark.parametrize(
    "kind, n",
    each_once(sorted(MAKERS), [92, 64], [("subclass", 92), ("wrap_subclass", 64)]),
    ids=lambda v: {92: "uneven", 64: "even"}.get(v, v) if isinstance(v, int) else v,
)
def test_moving_statistics_are_the_big_batch(kind, n):
    # 92 samples: windows of 8+8+8+8 and 8+8+8+4 (the last applied at the
    # epoch's end), so micro-batch moments must be weighted by their counts.
    x, y = bn_data(n)
    plain, acc = fit_pair(MAKERS[kind], x, y)
    assert_moved(plain)
    assert_moving_close(plain, acc)


@pytest.mark.parametrize(
    "kind, bn_kwargs",
    [
        ("rank2", {"center": False, "scale": False}),
        ("rank4", {}),
        ("rank4", {"axis": 1}),
        ("rank4", {"axis": 2, "center": False}),
        ("masked", {}),
    ],
    ids=["rank2_no_center_scale", "rank4_last_axis", "rank4_axis1", "rank4_axis2", "masked"],
)
def test_axes_ranks_and_masks(kind, bn_kwargs):
    x, y = bn_data(92, kind)
    plain, acc = fit_pair(bn_net, x, y, kind=kind, bn_kwargs=bn_kwargs)
    assert_moved(plain)
    assert_moving_close(plain, acc)


def test_opt_out_is_keras_per_micro_batch_update():
    x, y = bn_data(92)
    model = bn_net(AccumModel, accum_steps=N, batchnorm="micro_batch")
    model.compile(keras.optimizers.SGD(0.1), loss())
    model.fit(x, y, batch_size=MICRO, epochs=1, shuffle=False, verbose=0)
    micro = [slice(i, min(i + MICRO, 92)) for i in range(0, 92, MICRO)]
    for got, expected in zip(moving(model), replay(x, micro)):
        np.testing.assert_allclose(got, expected, rtol=RTOL, atol=ATOL)
    # ... and the default is once per window.
    model = bn_net(AccumModel, accum_steps=N)
    model.compile(keras.optimizers.SGD(0.1), loss())
    model.fit(x, y, batch_size=MICRO, epochs=1, shuffle=False, verbose=0)
    windows = [slice(0, 32), slice(32, 64), slice(64, 92)]
    for got, expected in zip(moving(model), replay(x, windows)):
        np.testing.assert_allclose(got, expected, rtol=RTOL, atol=ATOL)


# -- 2. deeper layers: much closer than per-micro-batch updates -------------------


def deep_net(cls=keras.Model, seed=0, **kwargs):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((6,))
    h = inputs
    for width in (16, 16, 16):
        h = keras.layers.Dense(width)(h)
        h = keras.layers.BatchNormalization(momentum=0.9)(h)
        h = keras.layers.Activation("relu")(h)
    return cls(inputs, keras.layers.Dense(3)(h), **kwargs)


def moving_distance(a, b):
    """Mean absolute difference of every moving statistic, relative to the big
    batch's typical size."""
    va = [v.numpy() for v in a.non_trainable_variables]
    vb = [v.numpy() for v in b.non_trainable_variables]
    return float(np.mean([np.abs(u - v).mean() / np.abs(v).mean() for u, v in zip(va, vb)]))


def test_several_layers_much_closer_than_per_micro_batch_updates():
    x, y = bn_data(256)
    distances = {}
    plain = deep_net()
    plain.compile(keras.optimizers.SGD(0.05), loss())
    plain.fit(x, y, batch_size=64, epochs=3, shuffle=False, verbose=0)
    for mode in ("window", "micro_batch"):
        acc = deep_net(AccumModel, accum_steps=8, batchnorm=mode)
        acc.compile(keras.optimizers.SGD(0.05), loss())
        acc.fit(x, y, batch_size=8, epochs=3, shuffle=False, verbose=0)
        distances[mode] = moving_distance(acc, plain)
    # Measured 0.034 vs 0.41; a clear margin, not a tuned threshold.
    assert distances["window"] < 0.25 * distances["micro_batch"], distances


# -- 3. automatic, frozen layers, nested models ----------------------------------


def test_nested_model_layers_are_handled():
    def make(cls=keras.Model, **kwargs):
        keras.utils.set_random_seed(0)
        inner = keras.Sequential([keras.Input((6,)), bn_layer()], name="inner")
        inputs = keras.Input((6,))
        return cls(inputs, keras.layers.Dense(3)(inner(inputs)), **kwargs)

    x, y = bn_data(92)
    plain, acc = fit_pair(make, x, y)
    assert_moved(plain)
    assert_moving_close(plain, acc)


class InferenceBN(AccumModel):
    """Calls its BatchNormalization in inference mode, as fine-tuning code
    calls a frozen backbone (`base(x, training=False)`)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.bn = bn_layer()
        self.logits = keras.layers.Dense(3)

    def call(self, x):
        return self.logits(self.bn(x, training=False))


@pytest.mark.parametrize("frozen", ["trainable_false", "inference_call"])
def test_frozen_layers_are_untouched(frozen):
    keras.utils.set_random_seed(0)
    if frozen == "trainable_false":
        inputs = keras.Input((6,))
        bn = bn_layer()
        bn.trainable = False
        model = AccumModel(inputs, keras.layers.Dense(3)(bn(inputs)), accum_steps=N)
    else:
        model = InferenceBN(accum_steps=N)
        model(np.zeros((1, 6), "float32"))
    before = moving(model)
    model.compile(keras.optimizers.SGD(0.1), loss())
    x, y = bn_data(92)
    model.fit(x, y, batch_size=MICRO, epochs=1, shuffle=False, verbose=0)
    for u, v in zip(moving(model), before):
        np.testing.assert_array_equal(u, v)
    assert float(np.abs(model.get_weights()[-1]).max()) > 0  # it trained


def test_train_on_batch_then_flush():
    x, y = bn_data(64)
    model = bn_net(AccumModel, accum_steps=N)
    model.compile(keras.optimizers.SGD(0.1), loss())
    for i in range(6):
        model.train_on_batch(x[MICRO * i : MICRO * (i + 1)], y[MICRO * i : MICRO * (i + 1)])
    pending = replay(x, [slice(0, 32)])
    for got, expected in zip(moving(model), pending):
        np.testing.assert_allclose(got, expected, rtol=RTOL, atol=ATOL)
    model.flush()
    for got, expected in zip(moving(model), replay(x, [slice(0, 32), slice(32, 48)])):
        np.testing.assert_allclose(got, expected, rtol=RTOL, atol=ATOL)


@pytest.mark.skipif(
    "renorm" not in inspect.signature(keras.layers.BatchNormalization).parameters,
    reason="this Keras has no batch renormalisation (Keras <= 3.13)",
)
def test_renorm_layers_keep_the_per_micro_batch_update():
    # Batch renormalisation's extra statistics also steer training; such
    # layers are left to Keras, as with batchnorm="micro_batch".
    x, y = bn_data(92)
    moving_stats = []
    for mode in ("window", "micro_batch"):
        model = bn_net(AccumModel, accum_steps=N, batchnorm=mode, bn_kwargs={"renorm": True})
        model.compile(keras.optimizers.SGD(0.1), loss())
        model.fit(x, y, batch_size=MICRO, epochs=1, shuffle=False, verbose=0)
        moving_stats.append(moving(model))
        assert not internals.batchnorm_windows(model)
    for u, v in zip(*moving_stats):
        np.testing.assert_array_equal(u, v)


@pytest.mark.parametrize("value", ["windows", None, True, "MICRO_BATCH"])
def test_bad_batchnorm_argument(value):
    with pytest.raises(ValueError, match=rf"`batchnorm` must be .*Received: batchnorm={value!r}"):
        bn_net(AccumModel, accum_steps=N, batchnorm=value)
    with pytest.raises(ValueError, match="`batchnorm` must be"):
        keras_accum.wrap(bn_net(), accum_steps=N, batchnorm=value)


@pytest.mark.parametrize("mode", ["window", "micro_batch"])
def test_config_round_trip(mode):
    model = bn_net(AccumModel, accum_steps=N, batchnorm=mode)
    config = model.get_config()
    assert config["batchnorm"] == mode
    clone = AccumModel.from_config(config)
    # The clone's config reads back the mode its BatchNormalization window has.
    assert clone.get_config()["batchnorm"] == mode


# -- saving and resuming a pending window -------------------------------------------


def train(model, x, y, steps):
    for i in steps:
        model.train_on_batch(x[MICRO * i : MICRO * (i + 1)], y[MICRO * i : MICRO * (i + 1)])
    return model


def compiled(model):
    model.compile(keras.optimizers.SGD(0.1), loss())
    return model


@pytest.mark.parametrize("suffix", [".weights.h5", ".keras"])
def test_resume_mid_window_restores_pending_statistics(suffix, tmp_path):
    x, y = bn_data(64)
    uninterrupted = train(compiled(bn_net(AccumModel, accum_steps=N)), x, y, range(8))
    interrupted = train(compiled(bn_net(AccumModel, accum_steps=N)), x, y, range(6))
    path = str(tmp_path / f"m{suffix}")
    if suffix == ".keras":
        interrupted.save(path)
        resumed = keras.models.load_model(path)
    else:
        interrupted.save_weights(path)
        resumed = compiled(bn_net(AccumModel, accum_steps=N, seed=1))
        resumed.load_weights(path)
    assert internals.pending(resumed) == 2
    train(resumed, x, y, range(6, 8))
    for u, v in zip(moving(uninterrupted), moving(resumed)):
        np.testing.assert_array_equal(u, v)


@pytest.mark.parametrize("built", [True, False], ids=["built", "restored_on_build"])
def test_tf_train_checkpoint_restores_pending_statistics(built, tmp_path):
    import tensorflow as tf

    x, y = bn_data(64)
    uninterrupted = train(compiled(bn_net(AccumModel, accum_steps=N)), x, y, range(8))
    interrupted = train(compiled(bn_net(AccumModel, accum_steps=N)), x, y, range(6))
    prefix = tf.train.Checkpoint(model=interrupted, optimizer=interrupted.optimizer).save(
        str(tmp_path / "ckpt")
    )
    resumed = compiled(bn_net(AccumModel, accum_steps=N, seed=1))
    if built:
        resumed.optimizer.build(resumed.trainable_variables)
        internals.batchnorm(resumed).build()
    tf.train.Checkpoint(model=resumed, optimizer=resumed.optimizer).restore(prefix)
    train(resumed, x, y, range(6, 8))
    for u, v in zip(moving(uninterrupted), moving(resumed)):
        np.testing.assert_array_equal(u, v)


def test_resume_a_subclassed_model(tmp_path):
    x, y = bn_data(64)

    def make(seed=0):
        model = compiled(subclassed_bn_net(AccumModel, accum_steps=N, seed=seed))
        model(x[:1])  # built, as load_weights needs; its windows are not
        return model

    uninterrupted = train(make(), x, y, range(8))
    interrupted = train(make(), x, y, range(6))
    path = str(tmp_path / "m.weights.h5")
    interrupted.save_weights(path)
    resumed = make(seed=1)
    resumed.load_weights(path)
    train(resumed, x, y, range(6, 8))
    for u, v in zip(moving(uninterrupted), moving(resumed)):
        np.testing.assert_array_equal(u, v)


def test_a_failed_load_leaves_the_pending_statistics_unchanged(tmp_path):
    import h5py

    x, y = bn_data(64)
    saved = train(compiled(bn_net(AccumModel, accum_steps=N)), x, y, range(2))
    path = str(tmp_path / "m.weights.h5")
    saved.save_weights(path)
    # Corrupt what Keras loads after the pending window: the optimizer's state.
    with h5py.File(path, "a") as f:
        del f["optimizer/vars/0"]
        f["optimizer/vars/0"] = np.zeros((7, 7))
    model = train(compiled(bn_net(AccumModel, accum_steps=N)), x, y, range(3))
    window, _ = internals.batchnorm(model).snapshot()
    with pytest.raises(ValueError):
        model.load_weights(path)
    after, _ = internals.batchnorm(model).snapshot()
    assert sorted(after) == sorted(window) == ["0"]
    for u, v in zip(window["0"], after["0"]):
        np.testing.assert_array_equal(u, v)


# -- precision, XLA, steps_per_execution ------------------------------------------------


def test_mixed_float16():
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        x, y = bn_data(92)
        plain, acc = fit_pair(bn_net, x, y)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert bn_of(acc).moving_mean.dtype == "float32"
    assert_moved(plain)
    # The layer's input is rounded to float16 identically in both runs; the
    # moments and the moving statistics are float32.
    assert_moving_close(plain, acc)


def test_a_discarded_or_skipped_window_leaves_the_moving_statistics():
    # reset_window() and skip_nonfinite drop the window's statistics with its
    # gradients: the moving statistics are those of the big batches without
    # that window (on the raw input, exactly).
    x, y = bn_data(96)
    x_nan = x.copy()
    x_nan[40, 0] = np.nan  # the second window
    plain = bn_net()
    plain.compile(keras.optimizers.SGD(0.1), loss())
    for start in (0, 64):
        plain.train_on_batch(x[start : start + 32], y[start : start + 32])
    skipping = bn_net(AccumModel, accum_steps=N, skip_nonfinite=True)
    skipping.compile(keras.optimizers.SGD(0.1), loss())
    skipping.fit(x_nan, y, batch_size=MICRO, shuffle=False, verbose=0)
    resetting = bn_net(AccumModel, accum_steps=N)
    resetting.compile(keras.optimizers.SGD(0.1), loss())
    for start in range(0, 96, MICRO):
        if start == 56:
            # Three micro-batches into the NaN window: drop it, and its last
            # micro-batch with it.
            resetting.reset_window()
            continue
        resetting.train_on_batch(x_nan[start : start + MICRO], y[start : start + MICRO])
    for model in (skipping, resetting):
        for a, b in zip(moving(model), moving(plain)):
            assert np.isfinite(a).all()
            np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL)


def _scope(strategy):
    import contextlib

    if strategy == "one_device":
        return contextlib.nullcontext()
    # A CPU-only machine's MirroredStrategy(): one replica, the strategy
    # path of the step (issue 23).
    from helpers import replicas

    return replicas.mirrored(1).scope()


@pytest.mark.parametrize("strategy", ["one_device", "one_replica_mirrored"])
def test_a_window_skipped_for_its_loss_leaves_the_moving_statistics(strategy):
    # A NaN sample weight in the second window: its gradient is not finite,
    # its moments are. The skip decides for the moments too: the moving
    # statistics are those of the big batches without that window.
    x, y = bn_data(96)
    weights = np.ones(96, "float32")
    weights[40] = np.nan
    plain = bn_net()
    plain.compile(keras.optimizers.SGD(0.1), loss())
    for start in (0, 64):
        plain.train_on_batch(
            x[start : start + 32], y[start : start + 32], sample_weight=weights[start : start + 32]
        )
    with _scope(strategy):
        model = bn_net(AccumModel, accum_steps=N, skip_nonfinite=True)
        model.compile(keras.optimizers.SGD(0.1), loss())
    model.fit(x, y, sample_weight=weights, batch_size=MICRO, shuffle=False, verbose=0)
    assert model.skipped_windows == 1
    assert int(model.optimizer.iterations.numpy()) == 2
    assert_moved(plain)
    assert_moving_close(plain, model)


def test_a_synchronized_layer_under_two_replicas_splits_into_micro_batches():
    # A synchronized BatchNormalization all-reduces its moments in the
    # forward pass (a `merge_call`), which TensorFlow refuses inside a nested
    # function: under a strategy the micro-batches stay unrolled, not a call
    # each of one shared pass (engine/shared_pass.py). 96 samples, global
    # batch 32: 16 per replica, micro-batches of 4, windows of 2 batches.
    from helpers import replicas

    x, y = bn_data(96)
    plain = bn_net(bn_kwargs={"synchronized": True})
    plain.compile(keras.optimizers.SGD(0.1), loss())
    plain.fit(x, y, batch_size=64, epochs=1, shuffle=False, verbose=0)
    with replicas.mirrored(2).scope():
        model = bn_net(
            AccumModel, accum_steps=2, micro_batch_size=4, bn_kwargs={"synchronized": True}
        )
        model.compile(keras.optimizers.SGD(0.1), loss())
    model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 2
    assert_moved(plain)
    assert_moving_close(plain, model)


def _mid_window_copy(interrupted, suffix, tmp_path):
    path = str(tmp_path / f"m{suffix}")
    if suffix == ".keras":
        interrupted.save(path)
        return keras.models.load_model(path)
    interrupted.save_weights(path)
    resumed = compiled(bn_net(AccumModel, accum_steps=N, seed=1))
    resumed.load_weights(path)
    return resumed


# .weights.h5 (slow): test_window_state's flush_after_load and
# reset_after_load cases load that file into a model with parked BatchNorm
# moments, then flush or reset.
@pytest.mark.parametrize("suffix", wide([".weights.h5", ".keras"], [".keras"]))
def test_flush_after_loading_a_mid_window_file_applies_its_statistics(suffix, tmp_path):
    x, y = bn_data(64)
    interrupted = train(compiled(bn_net(AccumModel, accum_steps=N)), x, y, range(6))
    loaded = _mid_window_copy(interrupted, suffix, tmp_path)
    assert internals.pending(loaded) == 2
    loaded.flush()
    interrupted.flush()
    expected = replay(x, [slice(0, 32), slice(32, 48)])
    for model in (interrupted, loaded):
        for got, want in zip(moving(model), expected):
            np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)
    # Nothing left over for the next window: two more micro-batches and a
    # flush give the big batch of those 16 samples.
    for model in (interrupted, loaded):
        train(model, x, y, range(6, 8)).flush()
    for u, v in zip(moving(interrupted), moving(loaded)):
        np.testing.assert_array_equal(u, v)


@pytest.mark.parametrize("suffix", wide([".weights.h5", ".keras"], [".keras"]))
def test_reset_window_after_loading_a_mid_window_file_discards_its_statistics(suffix, tmp_path):
    x, y = bn_data(64)
    interrupted = train(compiled(bn_net(AccumModel, accum_steps=N)), x, y, range(6))
    loaded = _mid_window_copy(interrupted, suffix, tmp_path)
    loaded.reset_window()
    assert_no_open_window(loaded)
    for got, want in zip(moving(loaded), replay(x, [slice(0, 32)])):
        np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)
    # The discarded moments do not come back in the next window.
    train(loaded, x, y, range(6, 8)).flush()
    for got, want in zip(moving(loaded), replay(x, [slice(0, 32), slice(48, 64)])):
        np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)


def shared_bn_net(cls=keras.Model, seed=0, **kwargs):
    """One BatchNormalization called twice per forward pass, on the raw
    input and on `2 * input + 1`."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input(BN_SHAPES["rank2"])
    bn = bn_layer()
    h = keras.layers.Concatenate()([bn(inputs), bn(inputs * 2.0 + 1.0)])
    h = keras.layers.Dense(4, activation="relu")(h)
    return cls(inputs, keras.layers.Dense(3)(h), **kwargs)


@pytest.mark.parametrize("mode", ["accum_steps", "micro_batch_size"])
def test_a_layer_called_twice_pools_both_calls_once_per_window(mode):
    # Every call's moments go to the layer's window; Keras's own update at
    # each call is held off (momentum 1), the second call's too, so the
    # moving statistics are one update per window from both calls' values.
    x, y = bn_data(92)
    if mode == "accum_steps":
        model = shared_bn_net(AccumModel, accum_steps=N)
        batch = MICRO
    else:
        model = shared_bn_net(AccumModel, micro_batch_size=MICRO)
        batch = MICRO * N
    model.compile(keras.optimizers.SGD(0.1), loss())
    model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)
    both = np.concatenate([x, (x * np.float32(2.0) + np.float32(1.0))], axis=-1)
    mean, variance = np.zeros(x.shape[-1]), np.ones(x.shape[-1])
    for window in (slice(0, 32), slice(32, 64), slice(64, 92)):
        values = np.concatenate(np.split(both[window].astype("float64"), 2, axis=-1))
        mean = mean * BN_MOMENTUM + values.mean(0) * (1 - BN_MOMENTUM)
        variance = variance * BN_MOMENTUM + values.var(0) * (1 - BN_MOMENTUM)
    for got, want in zip(moving(model), (mean, variance)):
        np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)
