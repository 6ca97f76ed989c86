"""skip_nonfinite: a window whose gradient is not finite is skipped, and counted."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_accum
from helpers import internals
from helpers.assertions import assert_no_open_window, assert_trained, assert_weights_close
from helpers.data import make_data
from helpers.models import OPTIMIZERS, WAYS_IN, functional, initial_weights, loss, mlp
from helpers.tiers import each_way_once
from helpers.training import plain_on_batches
from keras_accum import AccumModel, AccumOptimizer, AccumScheduler

# 92 samples, micro-batch 8, N=4: windows of 32, 32 and 28 samples
# (8+8+8+4: exact only if weighted). One NaN sample in the second window.
X, Y = make_data(92)
X_NAN = X.copy()
X_NAN[40, 1] = np.nan
MICRO, N = 8, 4
WINDOWS = [slice(0, 32), slice(32, 64), slice(64, 92)]
FIT = dict(shuffle=False, verbose=0)


def big_batches(windows, epochs=2, optimizer="adam", make=functional, x=X):
    """A plain model after `train_on_batch` on each big batch in `windows`."""
    return plain_on_batches(x, Y, windows, epochs, optimizer, make)


def assert_finite(model):
    for w in model.get_weights():
        assert np.isfinite(w).all()


# Never built before fit; each way and each optimizer once in the inner loop.
@pytest.mark.parametrize(
    "kind, optimizer",
    each_way_once(["adam_exponential_decay", "sgd_momentum"]),
)
def test_fit_skips_the_nan_window_as_if_it_were_not_there(kind, optimizer):
    model = WAYS_IN[kind](accum_steps=N, skip_nonfinite=True)[0]()
    model.compile(OPTIMIZERS[optimizer](), loss())
    history = model.fit(X_NAN, Y, batch_size=MICRO, epochs=2, **FIT)
    plain = big_batches([WINDOWS[0], WINDOWS[2]], optimizer=optimizer, make=WAYS_IN[kind]()[1])
    assert_trained(plain, initial_weights(WAYS_IN[kind]()[1], X))
    assert_finite(model)
    assert_weights_close(plain, model)
    # Only applied updates count: the LR schedule saw 4 steps, as the plain run.
    assert int(model.optimizer.iterations.numpy()) == 4
    assert model.skipped_windows == 2
    assert history.history["skipped_windows"] == [1, 2]
    assert np.isnan(history.history["loss"]).all()  # as Keras logs a NaN sample
    assert_no_open_window(model)


def test_default_applies_the_nan_window_as_the_big_batch_does():
    model = functional(AccumModel, accum_steps=N)
    model.compile(OPTIMIZERS["adam"](), loss())
    history = model.fit(X_NAN, Y, batch_size=MICRO, epochs=1, **FIT)
    plain = big_batches(WINDOWS, epochs=1, x=X_NAN)
    assert all(np.isnan(w).all() for w in plain.get_weights())
    assert_weights_close(plain, model)  # NaN where the big batch has NaN
    assert int(model.optimizer.iterations.numpy()) == 3
    assert "skipped_windows" not in history.history
    assert model.skipped_windows == 0 and not model.skip_nonfinite


def test_finite_data_trains_as_without_skipping():
    model = functional(AccumModel, accum_steps=N, skip_nonfinite=True)
    model.compile(OPTIMIZERS["adam"](), loss(), metrics=["accuracy"])
    history = model.fit(X, Y, batch_size=MICRO, epochs=2, **FIT)
    assert_weights_close(big_batches(WINDOWS), model)
    assert model.skipped_windows == 0
    assert history.history["skipped_windows"] == [0, 0]


def test_accum_steps_1_skips_a_nan_batch():
    model = functional(AccumModel, skip_nonfinite=True)
    model.compile(OPTIMIZERS["adam"](), loss())
    model.fit(X_NAN, Y, batch_size=MICRO, epochs=1, **FIT)
    batches = [slice(i, min(i + MICRO, 92)) for i in range(0, 92, MICRO) if i != 40]
    assert_weights_close(big_batches(batches, epochs=1), model)
    assert model.skipped_windows == 1
    assert int(model.optimizer.iterations.numpy()) == 11


def test_a_split_batch_with_metrics_skips_as_step_mode_does():
    # micro_batch_size splits each batch of 32 into the micro-batches step
    # mode is fed one by one: the NaN sample's batch is skipped, and the
    # accuracy of every sample, the skipped batch's too, is logged as step
    # mode logs it (each micro-batch's metrics updated, as Keras updates a
    # NaN batch's).
    split = functional(AccumModel, micro_batch_size=MICRO, skip_nonfinite=True)
    split.compile(OPTIMIZERS["adam"](), loss(), metrics=["accuracy"])
    h_split = split.fit(X_NAN, Y, batch_size=MICRO * N, epochs=2, **FIT)
    step = functional(AccumModel, accum_steps=N, skip_nonfinite=True)
    step.compile(OPTIMIZERS["adam"](), loss(), metrics=["accuracy"])
    h_step = step.fit(X_NAN, Y, batch_size=MICRO, epochs=2, **FIT)
    assert_weights_close(big_batches([WINDOWS[0], WINDOWS[2]]), split)
    assert split.skipped_windows == 2
    assert int(split.optimizer.iterations.numpy()) == 4  # applied updates only
    assert h_split.history["skipped_windows"] == [1, 2]
    assert np.isnan(h_split.history["loss"]).all()
    np.testing.assert_allclose(
        h_split.history["accuracy"], h_step.history["accuracy"], rtol=1e-5, atol=1e-6
    )


def test_xla():
    model = functional(AccumModel, accum_steps=N, skip_nonfinite=True)
    model.compile(OPTIMIZERS["adam"](), loss(), jit_compile=True)
    model.fit(X_NAN, Y, batch_size=MICRO, epochs=2, **FIT)
    assert_weights_close(big_batches([WINDOWS[0], WINDOWS[2]]), model)
    assert model.skipped_windows == 2


def test_train_on_batch_and_flush_skip_a_partial_nan_window():
    model = functional(AccumModel, accum_steps=N, skip_nonfinite=True)
    model.compile(OPTIMIZERS["adam"](), loss())
    for i in range(6):  # a full window, then micro-batches 4 and 5 (NaN)
        model.train_on_batch(X_NAN[MICRO * i : MICRO * (i + 1)], Y[MICRO * i : MICRO * (i + 1)])
    assert internals.pending(model) == 2
    model.flush()
    assert model.skipped_windows == 1
    assert_no_open_window(model)
    for i in range(6, 10):
        model.train_on_batch(X_NAN[MICRO * i : MICRO * (i + 1)], Y[MICRO * i : MICRO * (i + 1)])
    assert_weights_close(big_batches([slice(0, 32), slice(48, 80)], epochs=1), model)
    assert int(model.optimizer.iterations.numpy()) == 2


def test_inf_gradient_is_skipped_too():
    x = X.copy()
    x[70, 0] = np.inf  # third window
    model = functional(AccumModel, accum_steps=N, skip_nonfinite=True)
    model.compile(OPTIMIZERS["sgd_momentum"](), loss())
    model.fit(x, Y, batch_size=MICRO, epochs=1, **FIT)
    assert_weights_close(big_batches(WINDOWS[:2], epochs=1, optimizer="sgd_momentum"), model)
    assert model.skipped_windows == 1


def test_with_a_schedule():
    model = functional(AccumModel, skip_nonfinite=True)
    model.compile(OPTIMIZERS["adam"](), loss())
    model.fit(X_NAN, Y, batch_size=MICRO, epochs=2, callbacks=[AccumScheduler({1: N})], **FIT)
    plain = big_batches(
        [slice(i, min(i + MICRO, 92)) for i in range(0, 92, MICRO) if i != 40], epochs=1
    )
    for window in (WINDOWS[0], WINDOWS[2]):
        plain.train_on_batch(X[window], Y[window])
    assert_weights_close(plain, model)
    assert model.skipped_windows == 2


def test_mixed_float16_keeps_the_loss_scale_behaviour():
    # The LossScaleOptimizer skips the window and lowers its scale, with or
    # without skip_nonfinite; skip_nonfinite only counts it.
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        runs = []
        for skip in (False, True):
            model = mlp(AccumModel, accum_steps=N, skip_nonfinite=skip)
            model.compile(OPTIMIZERS["adam"](), loss())
            model.fit(X_NAN, Y, batch_size=MICRO, epochs=2, **FIT)
            runs.append(model)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    default, skipping = runs
    assert_weights_close(default, skipping, rtol=0, atol=0)
    assert_finite(skipping)
    scales = [float(m.optimizer.dynamic_scale.numpy()) for m in runs]
    assert scales[0] == scales[1] < 32768.0  # lowered once per NaN window
    assert skipping.skipped_windows == 2


@pytest.mark.unit
def test_accum_optimizer_skips_a_nan_window():
    model = functional()
    opt = AccumOptimizer(keras.optimizers.Adam(0.02), accum_steps=2, skip_nonfinite=True)
    reference = functional()
    inner = keras.optimizers.Adam(0.02)

    def gradients(m, x, y):
        with tf.GradientTape() as tape:
            value = loss()(y, m(x, training=True))
        return tape.gradient(value, m.trainable_variables)

    for i in range(6):  # windows (0, 1), (2, 3) with NaN, (4, 5)
        batch = slice(16 * i, 16 * (i + 1))
        grads = gradients(model, X_NAN[batch], Y[batch])
        opt.apply(grads, model.trainable_variables, weight=len(X_NAN[batch]))
    for window in (WINDOWS[0], WINDOWS[2]):  # 16+16 and 16+12 samples
        inner.apply(gradients(reference, X[window], Y[window]), reference.trainable_variables)
    assert_weights_close(reference, model)
    assert opt.skipped_windows == 1
    assert int(opt.iterations.numpy()) == 2


# -- configuration and saving ---------------------------------------------------


@pytest.mark.parametrize("kind", sorted(WAYS_IN))  # never built before fit
@pytest.mark.unit
def test_serialisation_round_trip(kind):
    model = WAYS_IN[kind](accum_steps=3, skip_nonfinite=True)[0]()
    config = keras.saving.serialize_keras_object(model)
    assert config["config"]["skip_nonfinite"] is True
    clone = keras.saving.deserialize_keras_object(config)
    assert isinstance(clone, AccumModel) and clone.skip_nonfinite and clone.accum_steps == 3
    default = WAYS_IN[kind](accum_steps=3)[0]()
    assert "skip_nonfinite" not in default.get_config()
    assert not keras.saving.deserialize_keras_object(
        keras.saving.serialize_keras_object(default)
    ).skip_nonfinite


@pytest.mark.unit
def test_accum_optimizer_serialisation_round_trip():
    opt = AccumOptimizer(keras.optimizers.Adam(), accum_steps=3, skip_nonfinite=True)
    clone = keras.optimizers.deserialize(keras.optimizers.serialize(opt))
    assert isinstance(clone, AccumOptimizer) and clone.get_config()["skip_nonfinite"] is True
    assert AccumOptimizer.from_config(opt.get_config()).get_config() == opt.get_config()


def trained_with_one_skip():
    model = functional(AccumModel, accum_steps=N, skip_nonfinite=True)
    model.compile(OPTIMIZERS["adam"](), loss())
    model.fit(X_NAN[:64], Y[:64], batch_size=MICRO, **FIT)
    assert model.skipped_windows == 1
    return model


def test_the_count_is_saved_in_keras_files(tmp_path):
    model = trained_with_one_skip()
    model.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras")
    assert loaded.skip_nonfinite and loaded.skipped_windows == 1
    model.save_weights(tmp_path / "m.weights.h5")
    fresh = functional(AccumModel, accum_steps=N, skip_nonfinite=True)
    fresh.compile(OPTIMIZERS["adam"](), loss())
    fresh.optimizer.build(fresh.trainable_variables)  # as fit() would
    fresh.load_weights(tmp_path / "m.weights.h5")
    assert fresh.skipped_windows == 1
    assert_weights_close(model, fresh, rtol=0, atol=0)


def test_the_count_is_saved_by_tf_train_checkpoint(tmp_path):
    model = trained_with_one_skip()
    prefix = tf.train.Checkpoint(model=model).save(str(tmp_path / "ckpt"))
    fresh = functional(AccumModel, accum_steps=N, skip_nonfinite=True)
    tf.train.Checkpoint(model=fresh).restore(prefix)
    assert fresh.skipped_windows == 1


def test_weights_saved_without_skipping_load_with_a_count_of_zero(tmp_path):
    model = trained_with_one_skip()
    plain = functional(AccumModel, accum_steps=N)
    plain.compile(OPTIMIZERS["adam"](), loss())
    plain.fit(X[:32], Y[:32], batch_size=MICRO, **FIT)
    plain.save_weights(tmp_path / "plain.weights.h5")
    model.load_weights(tmp_path / "plain.weights.h5")
    assert model.skipped_windows == 0
    assert_weights_close(plain, model, rtol=0, atol=0)


@pytest.mark.parametrize(
    "make",
    [
        lambda v: functional(AccumModel, skip_nonfinite=v),
        lambda v: keras_accum.wrap(functional(), skip_nonfinite=v),
        lambda v: AccumOptimizer(keras.optimizers.Adam(), skip_nonfinite=v),
    ],
    ids=["AccumModel", "wrap", "AccumOptimizer"],
)
@pytest.mark.parametrize("value", ["yes", 1, None])
@pytest.mark.unit
def test_bad_skip_nonfinite(make, value):
    with pytest.raises(
        TypeError,
        match=rf"`skip_nonfinite` must be True or False. Received: skip_nonfinite={value!r}",
    ):
        make(value)
