"""Workflows as users run them: models not built before `fit`, recompiling,
fine-tuning, callbacks that change the model, loops of `fit`.

Every model here is made from a seed and is neither built nor called before
training unless the case is about a built model; the reference is its plain
twin made from the same seed and trained on the big batch.
"""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_accum
from helpers import internals
from helpers.assertions import (
    assert_history_close,
    assert_no_open_window,
    assert_trained,
    assert_unchanged,
    assert_weights_close,
)
from helpers.data import FEATURES, make_data
from helpers.models import WAYS_IN, functional, initial_weights, loss
from helpers.tiers import WAYS, wide
from keras_accum import AccumModel

MICRO, N = 8, 4
BIG = MICRO * N


def _pair(way, accum_steps=N):
    make_accum, make_plain = WAYS_IN[way](accum_steps=accum_steps)
    return make_accum, make_plain


def _compile(model, make_optimizer=lambda: keras.optimizers.Adam(0.01), **kwargs):
    model.compile(make_optimizer(), loss(), metrics=["accuracy"], **kwargs)
    return model


# 76 samples at micro-batch 8 and N=4: windows of 4, 4 and 2 micro-batches,
# the last of 8+4 samples, so that every weighting mistake shows and the
# epoch-end flush runs.
@pytest.mark.parametrize("way", wide(sorted(WAYS_IN), WAYS))
def test_models_built_by_fit_train_like_the_big_batch(way):
    x, y = make_data(76)
    make_accum, make_plain = _pair(way)
    plain = _compile(make_plain())
    expected = plain.fit(x, y, batch_size=BIG, epochs=2, shuffle=False, verbose=0)
    model = _compile(make_accum())
    history = model.fit(x, y, batch_size=MICRO, epochs=2, shuffle=False, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 6
    assert_weights_close(plain, model)
    assert_history_close(expected, history)
    assert_trained(model, initial_weights(make_plain, x))


@pytest.mark.parametrize("way", ["subclass", "wrap_subclassed", "wrap_sequential_without_input"])
def test_train_on_batch_loop_on_a_model_never_built(way):
    x, y = make_data(44)
    make_accum, make_plain = _pair(way)
    plain = _compile(make_plain())
    for start in (0, 32):
        plain.train_on_batch(x[start : start + BIG], y[start : start + BIG])
    model = _compile(make_accum())
    for start in range(0, 44, MICRO):
        model.train_on_batch(x[start : start + MICRO], y[start : start + MICRO])
    model.flush()
    assert int(model.optimizer.iterations.numpy()) == 2
    assert_weights_close(plain, model)


@pytest.mark.parametrize("way", ["subclass", "wrap_subclassed"])
def test_evaluate_before_fit(way):
    x, y = make_data(92)
    make_accum, make_plain = _pair(way)
    plain = _compile(make_plain())
    before = plain.evaluate(x, y, batch_size=BIG, verbose=0)
    plain.fit(x, y, batch_size=BIG, shuffle=False, verbose=0)
    model = _compile(make_accum())
    np.testing.assert_allclose(model.evaluate(x, y, batch_size=MICRO, verbose=0), before, rtol=1e-5)
    model.fit(x, y, batch_size=MICRO, shuffle=False, verbose=0)
    assert_weights_close(plain, model)


def test_model_first_built_by_loading_a_saved_model(tmp_path):
    x, y = make_data(92)
    make_accum, make_plain = _pair("subclass")
    plain = _compile(make_plain())
    plain.fit(x, y, batch_size=BIG, epochs=2, shuffle=False, verbose=0)
    model = _compile(make_accum())
    model.fit(x, y, batch_size=MICRO, epochs=1, shuffle=False, verbose=0)
    model.save(tmp_path / "m.keras")
    loaded = keras.saving.load_model(tmp_path / "m.keras")
    loaded.fit(x, y, batch_size=MICRO, epochs=1, shuffle=False, verbose=0)
    assert_weights_close(plain, loaded)
    assert int(loaded.optimizer.iterations.numpy()) == 6


# -- recompiling and fine-tuning -------------------------------------------------


# A recompile after the model is built is AccumModel's whatever the class:
# the inner loop keeps the ways in that fit builds or that wrap (the
# functional model's case is slow).
@pytest.mark.parametrize("way", wide(["functional", "subclass", "wrap_subclassed"], WAYS))
def test_recompiling_with_another_optimizer_takes_effect_at_epoch_end_too(way):
    # 76 samples: windows of 4, 4 and 2 micro-batches (8+4 samples), so the
    # epoch-end flush applies the last one.
    x, y = make_data(76)
    make_accum, make_plain = _pair(way)
    model = _compile(make_accum())
    model.fit(x, y, batch_size=MICRO, shuffle=False, verbose=0)
    trained = model.get_weights()
    model.compile(keras.optimizers.SGD(0.0), loss())
    model.fit(x, y, batch_size=MICRO, shuffle=False, verbose=0)
    assert_unchanged(trained, model)
    assert int(model.optimizer.iterations.numpy()) == 3


@pytest.mark.parametrize(
    "way",
    # The wrapped subclass in the inner loop: it is the subclass, built by wrap.
    wide(
        ["functional", "subclass", "wrap_subclassed", "wrap_sequential_without_input"],
        ["wrap_subclassed"],
    ),
)
def test_fine_tuning_recipe_equals_the_big_batch(way):
    x, y = make_data(76)  # windows 4, 4 and a partial 2 (8+4 samples)
    make_accum, make_plain = _pair(way)

    def recipe(model, batch_size):
        # wrap() of a model that is not a layer graph holds it as its one
        # layer; users freeze through the model they wrapped.
        hidden = getattr(model, "wrapped", model).get_layer("hidden")
        iterations = []
        for trainable in (True, False, True):
            hidden.trainable = trainable
            _compile(model, lambda: keras.optimizers.Adam(0.02))
            model.fit(x, y, batch_size=batch_size, shuffle=False, verbose=0)
            iterations.append(int(model.optimizer.iterations.numpy()))
        return iterations

    plain, model = make_plain(), make_accum()
    plain_iterations = recipe(plain, BIG)
    assert recipe(model, MICRO) == plain_iterations == [3, 3, 3]
    assert_weights_close(plain, model)


@pytest.mark.parametrize("way", ["subclass", "wrap_sequential_without_input"])
def test_recompiling_with_another_loss_and_metrics(way):
    # A mean loss, then a summed one: the window's arithmetic follows the
    # compiled loss, as does what is logged.
    x, y = make_data(76)
    make_accum, make_plain = _pair(way)
    runs = []
    for make, batch_size in ((make_plain, BIG), (make_accum, MICRO)):
        m = _compile(make(), lambda: keras.optimizers.SGD(0.05))
        m.fit(x, y, batch_size=batch_size, shuffle=False, verbose=0)
        m.compile(
            keras.optimizers.SGD(0.002),
            keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="sum"),
            metrics=["sparse_categorical_crossentropy"],
        )
        history = m.fit(x, y, batch_size=batch_size, epochs=2, shuffle=False, verbose=0)
        runs.append((m, history))
    (plain, expected), (model, history) = runs
    assert_weights_close(plain, model)
    # The logged summed loss is Keras's per-batch sum averaged by batch
    # size, which differs between batch sizes (see the README); the metric
    # is a per-sample mean and must match.
    np.testing.assert_allclose(
        history.history["sparse_categorical_crossentropy"],
        expected.history["sparse_categorical_crossentropy"],
        rtol=1e-5,
    )


@pytest.mark.parametrize("way", ["functional", "wrap_subclassed"])
def test_freezing_between_fits_without_recompiling_is_as_in_keras(way):
    # Keras keeps training with the variables its step was traced with
    # until compile() is called again; so does AccumModel.
    x, y = make_data(76)
    make_accum, make_plain = _pair(way)
    models = []
    for make, batch_size in ((make_plain, BIG), (make_accum, MICRO)):
        m = _compile(make())
        m.fit(x, y, batch_size=batch_size, shuffle=False, verbose=0)
        getattr(m, "wrapped", m).get_layer("hidden").trainable = False
        m.fit(x, y, batch_size=batch_size, shuffle=False, verbose=0)
        models.append(m)
    assert_weights_close(*models)
    assert int(models[1].optimizer.iterations.numpy()) == 6


def _three_same_shaped_layers(cls=keras.Model, **kwargs):
    # Layers a, b, c of one shape: a gradient handed to the wrong one would
    # fit silently.
    keras.utils.set_random_seed(1)
    inputs = keras.Input((4,))
    h = inputs
    for name in "abc":
        h = keras.layers.Dense(4, activation="tanh", name=name)(h)
    return cls(inputs, keras.layers.Dense(1, name="out")(h), **kwargs)


class _FreezeAt(keras.callbacks.Callback):
    def __init__(self, batch, layer="a"):
        super().__init__()
        self.batch, self.layer, self.epoch = batch, layer, 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if self.epoch == 0 and batch == self.batch:
            self.model.get_layer(self.layer).trainable = False


def test_trainable_change_from_a_callback_mid_window_matches_the_plain_model():
    # 88 samples: micro-batches of 8 make windows of 4, 4 and 3, big
    # batches 32, 32, 24. The freeze lands in the last, partial window
    # (micro-batch 9), so the epoch-end flush is traced after it; the plain
    # model freezes after its last batch. Keras applies a trainable change
    # when the step is traced again (compile()), and so does AccumModel:
    # until then both keep training `a`, and the window's gradients go to
    # the variables they were computed for.
    rng = np.random.default_rng(0)
    x = rng.normal(size=(88, 4)).astype("float32")
    y = x.sum(axis=1, keepdims=True) ** 2
    plain = _three_same_shaped_layers()
    model = _three_same_shaped_layers(AccumModel, accum_steps=N)
    for m, batch_size, freeze_at in ((plain, BIG, 2), (model, MICRO, 9)):
        m.compile(keras.optimizers.SGD(0.05), "mse")
        m.fit(
            x,
            y,
            batch_size=batch_size,
            epochs=2,
            shuffle=False,
            verbose=0,
            callbacks=[_FreezeAt(freeze_at)],
        )
    assert_weights_close(plain, model)
    for m, batch_size in ((plain, BIG), (model, MICRO)):
        frozen = m.get_layer("a").get_weights()
        m.compile(keras.optimizers.SGD(0.05), "mse")
        m.fit(x, y, batch_size=batch_size, epochs=1, shuffle=False, verbose=0)
        for a, b in zip(frozen, m.get_layer("a").get_weights()):
            np.testing.assert_array_equal(a, b)
    assert_weights_close(plain, model)
    assert int(model.optimizer.iterations.numpy()) == 3


def test_an_open_window_for_other_variables_is_refused_by_name():
    x, y = make_data(16)
    model = _compile(functional(AccumModel, accum_steps=N))
    model.train_on_batch(x[:8], y[:8])
    model.get_layer("hidden").trainable = False
    _compile(model)
    before = model.get_weights()
    with pytest.raises(ValueError, match=r"(?s)hidden/kernel.*reset_window"):
        model.train_on_batch(x[8:], y[8:])
    assert_unchanged(before, model)
    # The new optimizer was built for the new set: it cannot apply it either.
    with pytest.raises(ValueError, match=r"(?s)hidden/kernel.*not built for.*reset_window"):
        model.flush()
    model.reset_window()
    model.train_on_batch(x[8:], y[8:])  # a new window, for the new set
    assert internals.pending(model) == 1
    assert internals.accumulator(model).window_variables == model.trainable_variables


def test_flush_before_a_trainable_change_applies_the_window_where_it_belongs():
    x, y = make_data(16)
    model = _compile(functional(AccumModel, accum_steps=N))
    model.train_on_batch(x[:8], y[:8])
    plain = _compile(functional())
    plain.train_on_batch(x[:8], y[:8])
    model.get_layer("hidden").trainable = False
    model.flush()  # the optimizer still trains both layers
    assert_weights_close(plain, model)


# In the inner loop: test_one_callback_not_in_a_list, the lazily built
# subclass's history (test_models_built_by_fit...), and freezing with a
# recompile (test_fine_tuning_recipe_equals_the_big_batch[subclass]).
@pytest.mark.slow
def test_trainable_change_between_fits_with_recompile_and_a_callback():
    x, y = make_data(76)
    make_accum, make_plain = _pair("subclass")
    results = []
    for make, batch_size in ((make_plain, BIG), (make_accum, MICRO)):
        m = _compile(make())
        history = m.fit(
            x,
            y,
            batch_size=batch_size,
            shuffle=False,
            verbose=0,
            callbacks=keras.callbacks.History(),
        )
        m.logits.trainable = False
        _compile(m)
        m.fit(x, y, batch_size=batch_size, epochs=2, shuffle=False, verbose=0)
        results.append((m, history))
    (plain, plain_history), (model, history) = results
    assert_weights_close(plain, model)
    assert_history_close(plain_history, history)


# -- fit's arguments --------------------------------------------------------------


def test_one_callback_not_in_a_list():
    x, y = make_data(40)
    model = _compile(functional(AccumModel, accum_steps=N))
    history = keras.callbacks.History()
    model.fit(x, y, batch_size=MICRO, epochs=2, callbacks=history, verbose=0)
    assert history.epoch == [0, 1]
    # 5 micro-batches an epoch: a window of 4 and one of 1, applied at its end.
    assert int(model.optimizer.iterations.numpy()) == 4
    assert_no_open_window(model)


@pytest.mark.parametrize("value", [2**63, np.uint64(2**64 - 1), 10**30])
def test_accum_steps_beyond_int64_is_refused_before_anything_changes(value):
    match = r"`accum_steps` must be at most .*Received: accum_steps="
    with pytest.raises(ValueError, match=match):
        functional(AccumModel, accum_steps=value)
    with pytest.raises(ValueError, match=match):
        keras_accum.wrap(functional(), accum_steps=value)
    x, y = make_data(40)
    model = _compile(functional(AccumModel, accum_steps=N))
    model.train_on_batch(x[:8], y[:8])
    before = model.get_weights()
    with pytest.raises(ValueError, match=match):
        model.accum_steps = value
    with pytest.raises(ValueError, match=match):
        model.fit(x, y, batch_size=MICRO, accum_steps=value, verbose=0)
    assert model.accum_steps == N and internals.pending(model) == 1
    assert_unchanged(before, model)


# -- state restored with a window ---------------------------------------------------


def _sum_loss():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="sum")


@pytest.mark.parametrize("into", ["unbuilt", "built"])
def test_flush_right_after_loading_a_sum_window(tmp_path, into):
    x, y = make_data(40)
    original = functional(AccumModel, accum_steps=N)
    original.compile(keras.optimizers.SGD(0.01), _sum_loss())
    for start in (0, 8, 16):
        original.train_on_batch(x[start : start + 8], y[start : start + 8])
    path = tmp_path / "w.weights.h5"
    original.save_weights(path)
    restored = functional(AccumModel, accum_steps=N)
    restored.compile(keras.optimizers.SGD(0.01), _sum_loss())
    if into == "built":
        # An accumulator that has trained (and is built) before the load.
        restored.train_on_batch(x[32:], y[32:])
        restored.flush()
        restored.optimizer.iterations.assign(0)
    restored.load_weights(path)
    assert internals.pending(restored) == 3
    original.flush()
    restored.flush()
    assert_weights_close(original, restored)


class _WithUnused(AccumModel):
    """`unused` is built but never called: it gets no gradient."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.used = keras.layers.Dense(3)
        self.unused = keras.layers.Dense(2)

    def build(self, input_shape):
        self.used.build(input_shape)
        self.unused.build(input_shape)

    def call(self, x):
        return self.used(x)


def test_absent_gradients_stay_absent_after_loading(tmp_path):
    # The big batch's optimizer sees None for `unused`, so AdamW's weight
    # decay must not touch it, also when a restored window is flushed.
    def make():
        keras.utils.set_random_seed(0)
        model = _WithUnused(accum_steps=N, name="with_unused")
        model.compile(keras.optimizers.AdamW(0.01, weight_decay=0.5), loss())
        return model

    x, y = make_data(16)
    original = make()
    original.train_on_batch(x[:8], y[:8])
    original.save_weights(tmp_path / "w.weights.h5")
    restored = make()
    restored.build((None, FEATURES))
    restored.load_weights(tmp_path / "w.weights.h5")
    unused = restored.unused.get_weights()
    restored.flush()
    original.flush()
    assert_weights_close(original, restored)
    assert int(restored.optimizer.iterations.numpy()) == 1
    for a, b in zip(unused, restored.unused.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_loading_into_a_trained_model_restores_the_window_length(tmp_path):
    x, y = make_data(40)
    saved = _compile(functional(AccumModel, accum_steps=4))
    saved.train_on_batch(x[:8], y[:8])
    saved.save_weights(tmp_path / "w.weights.h5")
    model = _compile(functional(AccumModel, accum_steps=2))
    model.fit(x[:32], y[:32], batch_size=8, verbose=0)  # built, window length 2
    model.load_weights(tmp_path / "w.weights.h5")
    before = model.get_weights()
    with pytest.raises(ValueError, match=r"accum_steps=4.*accum_steps=2"):
        model.train_on_batch(x[8:16], y[8:16])
    assert_unchanged(before, model)
    model.accum_steps = 4
    for start in (8, 16, 24):
        model.train_on_batch(x[start : start + 8], y[start : start + 8])
    assert int(model.optimizer.iterations.numpy()) == 1
    assert_no_open_window(model)


# -- discarding a window --------------------------------------------------------


class _RaiseOnNaN(keras.callbacks.Callback):
    # What TerminateOnNaN(raise_error=True) does on Keras releases that have
    # it (not 3.8).
    def on_train_batch_end(self, batch, logs=None):
        if not np.isfinite(logs["loss"]):
            raise RuntimeError(f"NaN loss at batch {batch}")


def test_reset_window_after_terminate_on_nan():
    x, y = make_data(96)
    x_nan = x.copy()
    x_nan[44] = np.nan  # micro-batch 5: the second window
    model = _compile(functional(AccumModel, accum_steps=N))
    with pytest.raises(RuntimeError, match="NaN"):
        model.fit(x_nan, y, batch_size=MICRO, shuffle=False, verbose=0, callbacks=[_RaiseOnNaN()])
    assert internals.pending(model) == 2
    model.reset_window()
    assert_no_open_window(model)
    assert all(np.isfinite(w).all() for w in model.get_weights())
    model.fit(x, y, batch_size=MICRO, epochs=2, shuffle=False, verbose=0)

    plain = _compile(functional())
    plain.train_on_batch(x[:32], y[:32])
    plain.fit(x, y, batch_size=BIG, epochs=2, shuffle=False, verbose=0)
    assert_weights_close(plain, model)
    assert int(model.optimizer.iterations.numpy()) == 7


def test_fit_on_no_data_leaves_an_open_window_open():
    x, y = make_data(16)
    model = _compile(functional(AccumModel, accum_steps=N))
    model.train_on_batch(x[:8], y[:8])
    before = model.get_weights()
    empty = tf.data.Dataset.from_tensor_slices((x[:0], y[:0])).batch(MICRO)
    with warnings.catch_warnings():
        # Keras < 3.16 warns that the input ran out of data; 3.16 takes the
        # batch of a one-step execution outside the traced step and says
        # nothing. Either way no step ran.
        warnings.simplefilter("ignore", UserWarning)
        model.fit(empty, verbose=0)
    # Not applied: the open window waits for data.
    assert internals.pending(model) >= 1
    assert int(model.optimizer.iterations.numpy()) == 0
    assert_unchanged(before, model)


def test_a_data_set_of_unknown_length_loses_no_window():
    # A generator's data set has no known length: Keras calls the train
    # function once more per epoch and its iterator fails inside it. The
    # step's writes that read no data (a window's count, a reset) ran
    # before that in a graph: the last window (3 of 4 micro-batches here)
    # was lost. Plain Keras's weights do not move at that call.
    x, y = make_data(44)

    def unknown_length(batch):
        return tf.data.Dataset.from_generator(
            lambda: zip(x, y),
            output_signature=(tf.TensorSpec(x.shape[1:], tf.float32), tf.TensorSpec((), tf.int64)),
        ).batch(batch)

    plain = functional()
    initial = initial_weights(functional, x)
    plain.compile(keras.optimizers.SGD(0.1), loss())
    plain.fit(unknown_length(4 * N), epochs=2, verbose=0)
    accum = functional(AccumModel, accum_steps=N)
    accum.compile(keras.optimizers.SGD(0.1), loss())
    accum.fit(unknown_length(4), epochs=2, verbose=0)
    assert_trained(plain, initial)
    assert_weights_close(plain, accum)
