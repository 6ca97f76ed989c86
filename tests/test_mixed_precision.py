"""Mixed precision at big-batch parity: mixed_float16 (its loss scale
checked and updated once per window, also under XLA and
steps_per_execution) and mixed_bfloat16, float32 gradient buffers, and
`accum_dtype`.

Mixed precision with other features: embeddings in test_sparse.py,
BatchNormalization in test_batchnorm.py, micro_batch_size in
test_micro_batch.py, skip_nonfinite in test_nonfinite.py.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from helpers import internals
from helpers.assertions import (
    BFLOAT16_ATOL,
    BFLOAT16_RTOL,
    FLOAT16_ATOL,
    FLOAT16_RTOL,
    assert_trained,
    assert_weights_close,
)
from helpers.data import FEATURES, make_data
from helpers.models import loss, mlp
from keras_accum import AccumModel, AccumOptimizer


@pytest.fixture
def policy(request):
    keras.mixed_precision.set_global_policy(request.param)
    yield request.param
    keras.mixed_precision.set_global_policy("float32")


def run_pair(x, y, make_optimizer, compile_kwargs=None, epochs=2, micro=8, n=4):
    compile_kwargs = dict(loss=loss(), metrics=["accuracy"], **(compile_kwargs or {}))
    fit = dict(epochs=epochs, shuffle=False, verbose=0)
    plain = mlp()
    initial = plain.get_weights()
    plain.compile(make_optimizer(), **compile_kwargs)
    plain.fit(x, y, batch_size=micro * n, **fit)
    acc = mlp(AccumModel, accum_steps=n)
    acc.compile(make_optimizer(), **compile_kwargs)
    acc.fit(x, y, batch_size=micro, **fit)
    assert_trained(plain, initial)
    return plain, acc


@pytest.mark.parametrize("policy", ["mixed_float16"], indirect=True)
@pytest.mark.parametrize(
    "make_optimizer",
    # SGD with momentum in the slow tier: Adam's case reads the loss scale alike.
    [
        pytest.param(lambda: keras.optimizers.SGD(0.2, momentum=0.9), marks=pytest.mark.slow),
        lambda: keras.optimizers.Adam(0.01),
    ],
    ids=["sgd_momentum", "adam"],
)
def test_mixed_float16_matches_the_big_batch(policy, make_optimizer):
    x, y = make_data(100)  # uneven last window
    plain, acc = run_pair(x, y, make_optimizer)
    assert isinstance(acc.optimizer, keras.optimizers.LossScaleOptimizer)
    assert_weights_close(plain, acc, FLOAT16_RTOL, FLOAT16_ATOL)
    assert float(acc.optimizer.dynamic_scale) == float(plain.optimizer.dynamic_scale)
    assert all(b.dtype == tf.float32 for b in internals.accumulator(acc).acc_grads)


@pytest.mark.parametrize("policy", ["mixed_float16"], indirect=True)
def test_mixed_float16_buffers_hold_unscaled_gradients(policy):
    x, y = make_data(8)
    model = mlp(AccumModel, accum_steps=4)
    model.compile(keras.optimizers.SGD(0.1), loss())
    model.train_on_batch(x, y)  # one micro-batch of 8: nothing applied yet
    assert float(model.optimizer.dynamic_scale) == 2.0**15
    with tf.GradientTape() as tape:
        value = loss()(y, model(x, training=True))
    expected = tape.gradient(value, model.trainable_variables)
    acc = internals.accumulator(model)
    for buf, g in zip(acc.acc_grads, expected):
        window_mean = buf.numpy() / float(acc.window_weight.numpy())
        np.testing.assert_allclose(window_mean, g.numpy(), rtol=1e-2, atol=1e-4)


@pytest.mark.parametrize("policy", ["mixed_float16"], indirect=True)
def test_overflow_skips_the_whole_window_like_the_big_batch(policy):
    x, y = make_data(128)
    x[45] = 1e5  # beyond float16's 65504: inf in the second window (32..63)
    plain, acc = run_pair(x, y, lambda: keras.optimizers.Adam(0.01), epochs=1)
    for model in (plain, acc):
        assert all(np.isfinite(w).all() for w in model.get_weights())
        # 4 windows, one skipped: 3 updates, and the scale was halved once.
        # The inner optimizer's count: Keras < 3.13's LossScaleOptimizer
        # reports its own `iterations`, which it never advances.
        assert int(model.optimizer.inner_optimizer.iterations) == 3
        assert float(model.optimizer.dynamic_scale) == 2.0**14
    assert_weights_close(plain, acc, FLOAT16_RTOL, FLOAT16_ATOL)


@pytest.mark.parametrize("policy", ["mixed_bfloat16"], indirect=True)
def test_mixed_bfloat16_matches_the_big_batch(policy):
    x, y = make_data(100)
    plain, acc = run_pair(x, y, lambda: keras.optimizers.SGD(0.2, momentum=0.9))
    assert not isinstance(acc.optimizer, keras.optimizers.LossScaleOptimizer)
    assert all(b.dtype == tf.float32 for b in internals.accumulator(acc).acc_grads)
    assert_weights_close(plain, acc, BFLOAT16_RTOL, BFLOAT16_ATOL)


def test_float16_variables_get_float32_buffers_and_accum_dtype_overrides():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((FEATURES,), dtype="float16")
    outputs = keras.layers.Dense(3, dtype="float16")(inputs)
    x, y = make_data(16)
    for accum_dtype, expected in ((None, tf.float32), ("float16", tf.float16)):
        model = AccumModel(inputs, outputs, accum_steps=2, accum_dtype=accum_dtype)
        model.compile(keras.optimizers.SGD(0.1), loss())
        model.train_on_batch(x.astype("float16"), y)
        assert [b.dtype for b in internals.accumulator(model).acc_grads] == [expected, expected]
    assert AccumModel.from_config(model.get_config()).get_config()["accum_dtype"] == "float16"


@pytest.mark.parametrize("value", ["int32", "nonsense", 3])
@pytest.mark.unit
def test_bad_accum_dtype(value):
    with pytest.raises(
        ValueError,
        match=rf"`accum_dtype` must be a floating-point dtype.*Received: accum_dtype={value!r}",
    ):
        AccumModel(accum_dtype=value)
    with pytest.raises(ValueError, match=r"`accum_dtype`"):
        AccumOptimizer(keras.optimizers.SGD(), accum_steps=2, accum_dtype=value)
