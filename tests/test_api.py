"""The public surface, the accum_steps argument, subclassing AccumModel,
flush(), weights and serialisation (wrap(): test_wrap.py)."""

import contextlib
import io

import keras
import numpy as np
import pytest

import keras_accum
from helpers import internals
from helpers.assertions import assert_weights_close
from helpers.data import make_data
from helpers.models import AccumNet, NetBody, functional, loss, subclassed
from keras_accum import AccumModel

BAD_ACCUM_STEPS = [
    (0, ValueError),
    (-3, ValueError),
    (2.5, TypeError),
    (4.0, TypeError),
    ("4", TypeError),
    (True, TypeError),
    (None, TypeError),
]


def reference_after(batches, make_optimizer=lambda: keras.optimizers.Adam(0.01)):
    """A plain model after one update per big batch in `batches`."""
    plain = functional()
    plain.compile(make_optimizer(), loss())
    for xb, yb in batches:
        plain.train_on_batch(xb, yb)
    return plain


@pytest.mark.unit
def test_public_surface():
    assert set(keras_accum.__all__) == {
        "AccumModel",
        "AccumOptimizer",
        "AccumScheduler",
        "BackupAndRestore",
        "SampleSchedule",
        "wrap",
        "__version__",
    }
    for name in keras_accum.__all__:
        assert hasattr(keras_accum, name)
    assert isinstance(keras_accum.__version__, str)


# -- accum_steps validation -------------------------------------------------


@pytest.mark.parametrize("value,error", BAD_ACCUM_STEPS)
@pytest.mark.unit
def test_bad_accum_steps_in_constructor(value, error):
    with pytest.raises(error, match=rf"`accum_steps`.*Received: accum_steps={value!r}"):
        functional(AccumModel, accum_steps=value)


@pytest.mark.parametrize("value,error", BAD_ACCUM_STEPS)
@pytest.mark.unit
def test_bad_accum_steps_in_setter_changes_nothing(value, error):
    model = functional(AccumModel, accum_steps=3)
    with pytest.raises(error, match=r"accum_steps"):
        model.accum_steps = value
    assert model.accum_steps == 3


@pytest.mark.parametrize("value,error", [v for v in BAD_ACCUM_STEPS if v[0] is not None])
def test_bad_accum_steps_in_fit_raises_before_training(value, error):
    x, y = make_data(32)
    model = functional(AccumModel, accum_steps=2)
    model.compile(keras.optimizers.SGD(0.1), loss())
    before = model.get_weights()
    with pytest.raises(error, match=r"accum_steps"):
        model.fit(x, y, batch_size=8, verbose=0, accum_steps=value)
    assert model.accum_steps == 2
    assert int(model.optimizer.iterations) == 0
    for a, b in zip(before, model.get_weights()):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("value,error", BAD_ACCUM_STEPS)
@pytest.mark.unit
def test_bad_accum_steps_in_wrap(value, error):
    with pytest.raises(error, match=r"accum_steps"):
        keras_accum.wrap(functional(), accum_steps=value)


# -- misspelt arguments, on every way in --------------------------------------

# (misspelt, the argument it is close to)
MISSPELT = [
    ("accum_step", "accum_steps"),
    ("gradient_accumulation_steps", "accum_steps"),
    ("micro_batch", "micro_batch_size"),
    ("noise_scales", "noise_scale"),
    ("skip_nonfinte", "skip_nonfinite"),
    ("batch_norm", "batchnorm"),
    ("accum_dtyp", "accum_dtype"),
]


class SubclassPassingKwargs(AccumModel):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(3)

    def call(self, x):
        return self.dense(x)


MADE_WITH = {
    "functional": lambda **kw: functional(AccumModel, **kw),
    "subclass_super_init": lambda **kw: SubclassPassingKwargs(**kw),
    "wrap_functional": lambda **kw: keras_accum.wrap(functional(), **kw),
    "wrap_subclassed": lambda **kw: keras_accum.wrap(subclassed(), **kw),
    "optimizer": lambda **kw: keras_accum.AccumOptimizer(keras.optimizers.SGD(), **kw),
}


@pytest.mark.parametrize("misspelt,meant", MISSPELT)
@pytest.mark.parametrize("way", sorted(MADE_WITH))
def test_a_misspelt_argument_is_refused_naming_the_close_match(way, misspelt, meant):
    with pytest.raises(
        TypeError,
        match=rf"unexpected keyword argument `{misspelt}`\. "
        rf"Did you mean `{meant}`\?.*Received: {misspelt}=4",
    ):
        MADE_WITH[way](**{misspelt: 4})


@pytest.mark.parametrize(
    "misspelt,meant", [("accum_step", "accum_steps"), ("micro_batch", "micro_batch_size")]
)
def test_a_misspelt_fit_argument_is_refused_before_training(misspelt, meant):
    x, y = make_data(32)
    model = functional(AccumModel, accum_steps=2)
    model.compile(keras.optimizers.SGD(0.1), loss())
    before = model.get_weights()
    with pytest.raises(
        TypeError,
        match=rf"fit\(\) got an unexpected keyword argument "
        rf"`{misspelt}`\. Did you mean `{meant}`\?",
    ):
        model.fit(x, y, batch_size=8, verbose=0, **{misspelt: 4})
    with pytest.raises(TypeError, match=r"`noise_scale` is an argument of AccumModel"):
        model.fit(x, y, batch_size=8, verbose=0, noise_scale=True)
    assert model.accum_steps == 2 and int(model.optimizer.iterations) == 0
    for a, b in zip(before, model.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_keras_own_arguments_close_to_ours_still_reach_keras():
    # `dtype` is close to `accum_dtype`, `steps_per_epoch` to nothing of
    # ours: Keras's, passed on.
    x, y = make_data(32)
    model = functional(AccumModel, accum_steps=2, dtype="float32", trainable=True)
    model.compile(keras.optimizers.SGD(0.1), loss())
    model.fit(x, y, batch_size=8, verbose=0, steps_per_epoch=4, initial_epoch=0)
    assert int(model.optimizer.iterations) == 2


@pytest.mark.unit
def test_numpy_integer_accum_steps():
    model = functional(AccumModel, accum_steps=np.int64(4))
    assert model.accum_steps == 4 and type(model.accum_steps) is int
    model.accum_steps = np.int32(2)
    assert model.accum_steps == 2


def test_optimizer_with_builtin_accumulation_is_rejected_before_training():
    x, y = make_data(32)
    model = functional(AccumModel, accum_steps=4)
    model.compile(keras.optimizers.Adam(gradient_accumulation_steps=2), loss())
    before = model.get_weights()
    with pytest.raises(ValueError, match=r"gradient_accumulation_steps=2.*one or the other"):
        model.fit(x, y, batch_size=8, verbose=0)
    for a, b in zip(before, model.get_weights()):
        np.testing.assert_array_equal(a, b)


# -- subclassing AccumModel ------------------------------------------------------


def test_subclass_keeps_working_after_functional_instances():
    functional(AccumModel, accum_steps=2)  # Keras would re-base the class here
    assert internals.Functional not in AccumModel.__mro__  # not re-based
    assert AccumNet.__mro__[1:3] == (NetBody, AccumModel)
    x, y = make_data(64)
    model = subclassed(AccumModel, accum_steps=4)
    assert not isinstance(model, internals.Functional)
    model.compile(keras.optimizers.Adam(0.01), loss())
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    plain = subclassed()
    plain.compile(keras.optimizers.Adam(0.01), loss())
    plain.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    assert_weights_close(plain, model)
    # And functional ones still work after the subclass was used.
    assert isinstance(functional(AccumModel, accum_steps=2), AccumModel)


# -- accum_steps for one fit, and the open window ---------------------------------


def test_fit_accum_steps_applies_to_that_call_only():
    x, y = make_data(64)
    model = functional(AccumModel, accum_steps=2)
    model.compile(keras.optimizers.SGD(0.1), loss())
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0, accum_steps=8)
    assert int(model.optimizer.iterations) == 1  # 8 micro-batches, one window
    assert model.accum_steps == 2
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    assert int(model.optimizer.iterations) == 1 + 4


@pytest.mark.parametrize("fit_accum_steps", [None, 8], ids=["own", "fit_argument"])
def test_accum_steps_set_from_a_callback_during_fit_takes_effect_and_stays(fit_accum_steps):
    x, y = make_data(64)
    model = functional(AccumModel, accum_steps=2)
    model.compile(keras.optimizers.Adam(0.01), loss())

    def set_at_second_epoch(epoch, logs):
        if epoch == 1:
            model.accum_steps = 4

    model.fit(
        x,
        y,
        batch_size=8,
        epochs=2,
        shuffle=False,
        verbose=0,
        accum_steps=fit_accum_steps,
        callbacks=[keras.callbacks.LambdaCallback(on_epoch_begin=set_at_second_epoch)],
    )
    first = fit_accum_steps or 2
    assert int(model.optimizer.iterations) == 8 // first + 2
    assert model.accum_steps == 4  # the user's own value, not fit's
    plain = functional()
    plain.compile(keras.optimizers.Adam(0.01), loss())
    plain.fit(x, y, batch_size=8 * first, epochs=1, shuffle=False, verbose=0)
    plain.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    assert_weights_close(plain, model)


def test_fit_interrupted_with_its_own_accum_steps_leaves_the_window_to_choose():
    x, y = make_data(64)
    model = functional(AccumModel, accum_steps=2)
    model.compile(keras.optimizers.SGD(0.1), loss())

    def interrupt(batch, logs):
        if batch == 4:
            raise RuntimeError("interrupted")

    with pytest.raises(RuntimeError):
        model.fit(
            x,
            y,
            batch_size=8,
            verbose=0,
            shuffle=False,
            accum_steps=8,
            callbacks=[keras.callbacks.LambdaCallback(on_train_batch_end=interrupt)],
        )
    assert model.accum_steps == 2 and internals.pending(model) == 5
    with pytest.raises(ValueError, match=r"accumulated with accum_steps=8"):
        model.train_on_batch(x[:8], y[:8])
    model.accum_steps = 8  # finish it as it began
    assert internals.pending(model) == 5


def test_setting_accum_steps_applies_the_pending_window_first():
    x, y = make_data(48)
    model = functional(AccumModel, accum_steps=4)
    model.compile(keras.optimizers.Adam(0.01), loss())
    for i in range(6):
        model.train_on_batch(x[8 * i : 8 * i + 8], y[8 * i : 8 * i + 8])
    model.accum_steps = 2  # 2 micro-batches pending: applied as one update
    assert int(model.optimizer.iterations) == 2
    assert_weights_close(reference_after([(x[:32], y[:32]), (x[32:], y[32:])]), model)


def test_flush_applies_a_partial_window_and_is_a_noop_otherwise():
    x, y = make_data(48)
    model = functional(AccumModel, accum_steps=4)
    model.compile(keras.optimizers.Adam(0.01), loss())
    model.flush()  # nothing built, nothing pending
    for i in range(6):
        model.train_on_batch(x[8 * i : 8 * i + 8], y[8 * i : 8 * i + 8])
    assert int(model.optimizer.iterations) == 1
    model.flush()
    assert int(model.optimizer.iterations) == 2
    expected = reference_after([(x[:32], y[:32]), (x[32:], y[32:])])
    assert_weights_close(expected, model)
    weights = model.get_weights()
    model.flush()
    assert int(model.optimizer.iterations) == 2
    for a, b in zip(weights, model.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_flush_in_eager_mode():
    x, y = make_data(48)
    model = functional(AccumModel, accum_steps=4)
    model.compile(keras.optimizers.Adam(0.01), loss(), run_eagerly=True)
    for i in range(6):
        model.train_on_batch(x[8 * i : 8 * i + 8], y[8 * i : 8 * i + 8])
    model.flush()
    assert_weights_close(reference_after([(x[:32], y[:32]), (x[32:], y[32:])]), model)


# -- weights are the plain model's --------------------------------------------


def _summary(model):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        model.summary()
    return out.getvalue()


@pytest.mark.parametrize("build", [functional, subclassed], ids=["functional", "subclassed"])
def test_weights_and_summary_are_the_plain_models(build):
    x, y = make_data(40)
    plain = build()
    plain.compile("adam", loss())
    plain.fit(x, y, batch_size=32, epochs=1, verbose=0)
    acc = build(AccumModel, accum_steps=4)
    acc.compile("adam", loss())
    acc.fit(x, y, batch_size=8, epochs=1, verbose=0)  # buffers now exist
    assert internals.accumulator(acc).built
    assert [v.path for v in acc.weights] == [v.path for v in plain.weights]
    assert acc.count_params() == plain.count_params()
    assert len(acc.non_trainable_weights) == len(plain.non_trainable_weights)
    assert _summary(acc).replace("AccumNet", "PlainNet") == _summary(plain)
    # get_weights / set_weights interchange both ways.
    plain.set_weights(acc.get_weights())
    np.testing.assert_array_equal(plain.predict(x, verbose=0), acc.predict(x, verbose=0))
    fresh = build(AccumModel, accum_steps=2)
    fresh.set_weights(plain.get_weights())
    np.testing.assert_array_equal(fresh.predict(x, verbose=0), acc.predict(x, verbose=0))


# -- serialisation --------------------------------------------------------------


@pytest.mark.parametrize(
    "make",
    [
        lambda: functional(AccumModel, accum_steps=3),
        lambda: subclassed(AccumModel, accum_steps=3),
        lambda: keras_accum.wrap(functional(), accum_steps=3),
        lambda: keras_accum.wrap(subclassed(), accum_steps=3),
    ],
    ids=["functional", "subclassed", "wrap_functional", "wrap_subclassed"],
)
def test_serialisation_round_trip(make):
    x, _ = make_data(10)
    model = make()
    config = keras.saving.serialize_keras_object(model)
    assert config["config"]["accum_steps"] == 3
    assert config["registered_name"].startswith(("keras_accum>", "keras_accum_tests>"))
    clone = keras.saving.deserialize_keras_object(config)
    assert type(clone) is type(model) or type(clone).__mro__[1] is type(model).__mro__[1]
    assert isinstance(clone, AccumModel) and clone.accum_steps == 3
    clone.set_weights(model.get_weights())
    np.testing.assert_array_equal(clone.predict(x, verbose=0), model.predict(x, verbose=0))


# -- settings that silently do less than a user expects: one warning each ----


def _warnings_of(fit):
    import warnings

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        fit()
    return [str(w.message) for w in seen if "keras_accum" in w.filename or "fit" in str(w.message)]


def test_steps_per_epoch_that_ends_each_epoch_mid_window_warns():
    x, y = make_data(96)
    model = AccumModel(*_graph(), accum_steps=4)
    model.compile("sgd", loss())

    def fit(steps):
        return lambda: model.fit(x, y, batch_size=8, steps_per_epoch=steps, verbose=0)

    told = [m for m in _warnings_of(fit(6)) if "steps_per_epoch=6" in m]
    assert len(told) == 1 and "not a multiple of accum_steps=4" in told[0]
    assert "window of 2 micro-batches" in told[0]
    assert not [m for m in _warnings_of(fit(8)) if "steps_per_epoch" in m]
    model.accum_steps = 1
    told = [
        m
        for m in _warnings_of(
            lambda: model.fit(x, y, batch_size=8, steps_per_epoch=6, accum_steps=3, verbose=0)
        )
        if "steps_per_epoch" in m
    ]
    assert not told  # fit's own accum_steps: 6 is a multiple of 3


def test_a_micro_batch_larger_than_the_batch_warns_once():
    x, y = make_data(64)
    model = AccumModel(*_graph(), micro_batch_size=64)
    model.compile("sgd", loss())

    def fit():
        model.fit(x, y, batch_size=16, epochs=1, verbose=0)

    told = [m for m in _warnings_of(fit) + _warnings_of(fit) if "micro_batch_size=64" in m]
    assert len(told) == 1 and "larger than the batch fit draws (16 samples" in told[0]
    model.micro_batch_size = 8
    assert not [m for m in _warnings_of(fit) if "micro_batch_size" in m]


def _graph():
    inputs = keras.Input((6,))
    return inputs, keras.layers.Dense(3)(inputs)
