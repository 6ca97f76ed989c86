"""AccumOptimizer in custom loops and in compile(), against the big batch."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_accum
from helpers import internals
from helpers.assertions import assert_trained, assert_weights_close
from helpers.data import make_data
from helpers.models import functional, loss
from helpers.tiers import each_once
from keras_accum import AccumModel, AccumOptimizer

X, Y = make_data(64)
INNER = {
    "adam": lambda: keras.optimizers.Adam(0.02),
    "sgd_schedule": lambda: keras.optimizers.SGD(
        keras.optimizers.schedules.ExponentialDecay(0.5, 1, 0.5), momentum=0.9
    ),
}


def gradients(model, x, y):
    with tf.GradientTape() as tape:
        value = loss()(y, model(x, training=True))
    return tape.gradient(value, model.trainable_variables)


def big_batch_steps(make_inner, sizes):
    """The reference: the inner optimizer on consecutive big batches."""
    model = functional()
    opt = make_inner()
    start = 0
    for size in sizes:
        grads = gradients(model, X[start : start + size], Y[start : start + size])
        opt.apply(grads, model.trainable_variables)
        start += size
    return model, opt


def accumulate(opt, model, micro_sizes, weighted, compiled):
    def step(x, y):
        grads = gradients(model, x, y)
        opt.apply(grads, model.trainable_variables, weight=len(x) if weighted else None)

    step = tf.function(step) if compiled else step
    start = 0
    for size in micro_sizes:
        step(X[start : start + size], Y[start : start + size])
        start += size


# Each optimizer and each compilation once in the inner loop.
@pytest.mark.parametrize(
    "name, compiled",
    each_once(sorted(INNER), [False, True], [("adam", True), ("sgd_schedule", False)]),
    ids=lambda v: {False: "eager", True: "tf_function"}.get(v, v) if isinstance(v, bool) else v,
)
def test_custom_loop_equals_two_big_batch_steps(name, compiled):
    reference, ref_opt = big_batch_steps(INNER[name], [32, 32])
    model = functional()
    initial = model.get_weights()
    opt = AccumOptimizer(INNER[name](), accum_steps=4)
    accumulate(opt, model, [8] * 8, weighted=False, compiled=compiled)
    assert int(opt.iterations) == 2
    np.testing.assert_allclose(float(opt.learning_rate), float(ref_opt.learning_rate))
    assert_trained(model, initial)
    assert_weights_close(reference, model)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "tf_function"])
def test_weights_make_uneven_windows_and_flush_exact(compiled):
    # Micro-batches 8, 8, 8, 8 | 4, 12, 4: the second window is partial
    # (flushed) and uneven (weighted by sample counts).
    reference, _ = big_batch_steps(INNER["adam"], [32, 20])
    model = functional()
    opt = AccumOptimizer(INNER["adam"](), accum_steps=4)
    accumulate(opt, model, [8, 8, 8, 8, 4, 12, 4], weighted=True, compiled=compiled)
    assert int(opt.iterations) == 1
    flush = tf.function(opt.flush) if compiled else opt.flush
    flush()
    assert int(opt.iterations) == 2
    assert_weights_close(reference, model)
    flush()  # nothing pending: no update
    assert int(opt.iterations) == 2


@pytest.mark.unit
def test_apply_gradients_and_learning_rate_delegate_to_the_inner_optimizer():
    inner = keras.optimizers.SGD(0.1)
    opt = AccumOptimizer(inner, accum_steps=2)
    model = functional()
    for i in range(4):
        grads = gradients(model, X[8 * i : 8 * i + 8], Y[8 * i : 8 * i + 8])
        result = opt.apply_gradients(zip(grads, model.trainable_variables))
    assert int(result) == int(inner.iterations) == 2
    opt.learning_rate = 0.05
    assert float(inner.learning_rate) == pytest.approx(0.05)


def test_compiled_on_a_plain_model_equal_windows():
    plain = functional()
    plain.compile(INNER["adam"](), loss(), metrics=["accuracy"])
    h_plain = plain.fit(X, Y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    model = functional()
    model.compile(AccumOptimizer(INNER["adam"](), accum_steps=4), loss(), metrics=["accuracy"])
    h_acc = model.fit(X, Y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    assert_weights_close(plain, model)
    np.testing.assert_allclose(h_plain.history["loss"], h_acc.history["loss"], rtol=1e-5)


@pytest.mark.parametrize("how", ["config", "serialize"])
@pytest.mark.unit
def test_serialisation_round_trip(how):
    opt = AccumOptimizer(keras.optimizers.Adam(0.003, beta_1=0.8), accum_steps=3, name="acc")
    if how == "config":
        clone = AccumOptimizer.from_config(opt.get_config())
    else:
        clone = keras.optimizers.deserialize(keras.optimizers.serialize(opt))
    assert isinstance(clone, AccumOptimizer) and clone.accum_steps == 3
    assert clone.name == "acc"
    assert isinstance(clone.inner_optimizer, keras.optimizers.Adam)
    assert clone.inner_optimizer.get_config() == opt.inner_optimizer.get_config()


def test_saved_and_restored_with_the_model_pending_window_included(tmp_path):
    def compiled_model():
        model = functional()
        model.compile(AccumOptimizer(INNER["adam"](), accum_steps=4), loss())
        return model

    def train(model, steps):
        for i in steps:
            model.train_on_batch(X[8 * i : 8 * i + 8], Y[8 * i : 8 * i + 8])
        return model

    uninterrupted = train(compiled_model(), range(8))
    model = train(compiled_model(), range(6))
    model.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras")
    assert isinstance(loaded.optimizer, AccumOptimizer)
    assert internals.pending(loaded.optimizer) == 2
    train(loaded, range(6, 8))
    assert_weights_close(uninterrupted, loaded, rtol=0, atol=0)

    ckpt = tf.train.Checkpoint(model=model, optimizer=model.optimizer)
    prefix = ckpt.save(str(tmp_path / "ckpt"))
    restored = compiled_model()
    restored.optimizer.build(restored.trainable_variables)
    tf.train.Checkpoint(model=restored, optimizer=restored.optimizer).restore(prefix)
    train(restored, range(6, 8))
    assert_weights_close(uninterrupted, restored, rtol=0, atol=0)


@pytest.mark.parametrize(
    "value,error", [(0, ValueError), (2.5, TypeError), ("4", TypeError), (True, TypeError)]
)
@pytest.mark.unit
def test_bad_accum_steps(value, error):
    with pytest.raises(error, match=rf"`accum_steps`.*Received: accum_steps={value!r}"):
        AccumOptimizer(keras.optimizers.SGD(), accum_steps=value)


@pytest.mark.unit
def test_bad_optimizer_arguments():
    with pytest.raises(
        TypeError,
        match=r"`optimizer` must be a keras.optimizers.Optimizer. Received: optimizer='adam'",
    ):
        AccumOptimizer("adam", accum_steps=2)
    with pytest.raises(ValueError, match=r"gradient_accumulation_steps=2.*one or the other"):
        AccumOptimizer(keras.optimizers.SGD(gradient_accumulation_steps=2), accum_steps=2)
    with pytest.raises(ValueError, match=r"no optimizer arguments of its own.*clipnorm=1.0"):
        AccumOptimizer(keras.optimizers.SGD(), accum_steps=2, clipnorm=1.0)


def test_accum_model_refuses_an_accum_optimizer():
    model = functional(AccumModel, accum_steps=2)
    model.compile(AccumOptimizer(keras.optimizers.SGD(), accum_steps=2), loss())
    with pytest.raises(ValueError, match=r"is an AccumOptimizer.*one or the other"):
        model.fit(X, Y, batch_size=8, verbose=0)


@pytest.mark.unit
def test_exported_from_the_package():
    assert keras_accum.AccumOptimizer is AccumOptimizer
    assert "AccumOptimizer" in keras_accum.__all__


@pytest.mark.unit
def test_variables_in_any_order_or_subset():
    reference, _ = big_batch_steps(INNER["adam"], [32])
    model = functional()
    opt = AccumOptimizer(INNER["adam"](), accum_steps=2)
    variables = model.trainable_variables
    for i, order in enumerate((variables, variables[::-1])):
        grads = gradients(model, X[16 * i : 16 * i + 16], Y[16 * i : 16 * i + 16])
        index = {id(v): k for k, v in enumerate(variables)}
        opt.apply([grads[index[id(v)]] for v in order], order)
    assert_weights_close(reference, model)
    # A subset: the other variables get no gradient, as with a plain optimizer.
    frozen = [v.numpy() for v in variables[:2]]
    for i in range(2):
        grads = gradients(model, X[16 * i : 16 * i + 16], Y[16 * i : 16 * i + 16])
        opt.apply(grads[2:], variables[2:])
    assert int(opt.iterations) == 2
    for before, v in zip(frozen, variables[:2]):
        np.testing.assert_array_equal(before, v.numpy())


# -- bad input to apply: refused, nothing added --------------------------------


def _one_micro_batch_in(opt, model):
    opt.apply(gradients(model, X[:8], Y[:8]), model.trainable_variables, weight=8)
    return [b.numpy() for b in internals.accumulator(opt).acc_grads]


def _assert_window_unchanged(opt, buffers):
    assert internals.pending(opt) == 1
    for a, b in zip(buffers, internals.accumulator(opt).acc_grads):
        np.testing.assert_array_equal(a, b.numpy())


def test_apply_refuses_a_variable_it_was_not_built_with():
    model, other = functional(), functional(seed=1)
    opt = AccumOptimizer(keras.optimizers.SGD(0.1), accum_steps=4)
    buffers = _one_micro_batch_in(opt, model)
    grads = gradients(other, X[:8], Y[:8])
    with pytest.raises(
        ValueError, match=r"not built with: \[.*hidden/kernel.*Pass those variables"
    ):
        opt.apply(grads, other.trainable_variables)
    _assert_window_unchanged(opt, buffers)


@pytest.mark.parametrize(
    "weight,error,match",
    [
        ("8", TypeError, r"`weight` must be a number >= 0.*Received: weight='8'"),
        (True, TypeError, r"`weight` must be a number >= 0.*Received: weight=True"),
        (-8, ValueError, r"`weight` must be >= 0.*Received: weight=-8"),
        (np.float32(-0.5), ValueError, r"`weight` must be >= 0.*Received: weight=-0.5"),
        (tf.constant(-8.0), ValueError, r"`weight` must be >= 0.*Received: weight=-8.0"),
        (keras.Variable(-2.0), ValueError, r"`weight` must be >= 0.*Received: weight=-2.0"),
        (np.array([8, 8]), ValueError, r"`weight` must be a scalar.*shape \(2,\)"),
    ],
    ids=[
        "string",
        "bool",
        "negative",
        "negative_numpy",
        "negative_tensor",
        "negative_variable",
        "vector",
    ],
)
def test_apply_refuses_a_weight_that_is_not_a_number_at_least_0(weight, error, match):
    model = functional()
    opt = AccumOptimizer(keras.optimizers.SGD(0.1), accum_steps=4)
    buffers = _one_micro_batch_in(opt, model)
    with pytest.raises(error, match=match):
        opt.apply(gradients(model, X[8:16], Y[8:16]), model.trainable_variables, weight=weight)
    _assert_window_unchanged(opt, buffers)


def test_apply_refuses_unequal_numbers_of_gradients_and_variables():
    model = functional()
    opt = AccumOptimizer(keras.optimizers.SGD(0.1), accum_steps=4)
    buffers = _one_micro_batch_in(opt, model)
    with pytest.raises(ValueError, match=r"3 gradients for 4 variables"):
        opt.apply(gradients(model, X[:8], Y[:8])[:3], model.trainable_variables)
    _assert_window_unchanged(opt, buffers)
