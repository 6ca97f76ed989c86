"""`keras_accum.wrap`: the model it is given, trained in place; the models
it refuses (whose overrides it would ignore or drop); configs and exports
of wrapped models.

Checks of an argument every way in takes (`accum_steps`, `micro_batch_size`,
`batchnorm`, `skip_nonfinite`) are with that argument's tests, and wrapped
models train in most files among the ways in of `helpers.models.WAYS_IN`.
"""

import json

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_accum
from helpers import internals
from helpers.assertions import assert_trained, assert_weights_close
from helpers.data import CLASSES, FEATURES, make_data
from helpers.models import WAYS_IN, TiedLM, functional, loss, subclassed, tied_graph
from helpers.processes import run_python
from keras_accum import AccumModel


@pytest.mark.unit
def test_wrap_rejects_non_models():
    with pytest.raises(TypeError, match=r"`model` must be a keras.Model. Received: model="):
        keras_accum.wrap(keras.layers.Dense(3), accum_steps=2)
    with pytest.raises(ValueError, match=r"already an AccumModel"):
        keras_accum.wrap(functional(AccumModel, accum_steps=2), accum_steps=4)


@pytest.mark.parametrize("make", [functional, subclassed], ids=["functional", "subclassed"])
def test_wrap_takes_accum_dtype_as_accum_model_does(make):
    x, y = make_data(16)
    model = keras_accum.wrap(make(), accum_steps=2, accum_dtype="float16")
    model.compile(keras.optimizers.SGD(0.1), loss())
    model.train_on_batch(x, y)
    assert {b.dtype for b in internals.accumulator(model).acc_grads} == {tf.float16}
    assert model.get_config()["accum_dtype"] == "float16"
    clone = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(model))
    assert clone.get_config()["accum_dtype"] == "float16"
    with pytest.raises(ValueError, match=r"`accum_dtype` must be a floating-point dtype"):
        keras_accum.wrap(make(), accum_dtype="int32")


def _sequential():
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [
            keras.Input((FEATURES,)),
            keras.layers.Dense(16, activation="tanh", name="hidden"),
            keras.layers.Dense(3, name="logits"),
        ],
        name="net",
    )


def _unbuilt_sequential():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(3)])
    return model


# The unbuilt Sequential and the subclass in the inner loop; the built
# Sequential and the functional model in the slow tier.
@pytest.mark.parametrize(
    "make",
    [
        pytest.param(_sequential, marks=pytest.mark.slow),
        _unbuilt_sequential,
        pytest.param(functional, marks=pytest.mark.slow),
        subclassed,
    ],
    ids=["sequential", "unbuilt_sequential", "functional", "subclassed"],
)
def test_wrap_trains_the_original_model(make):
    x, y = make_data(100)
    original = make()
    original(x[:1])  # build, so weights exist to compare
    reference = make()
    reference(x[:1])
    reference.set_weights(original.get_weights())
    initial = original.get_weights()

    wrapped = keras_accum.wrap(original, accum_steps=4)
    assert isinstance(wrapped, AccumModel) and wrapped.accum_steps == 4
    assert [id(v) for v in wrapped.weights] == [id(v) for v in original.weights]
    assert wrapped.count_params() == original.count_params()
    wrapped.compile(keras.optimizers.Adam(0.01), loss())
    wrapped.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)

    reference.compile(keras.optimizers.Adam(0.01), loss())
    reference.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    assert_trained(original, initial)
    assert_weights_close(reference, original)
    np.testing.assert_allclose(
        original.predict(x, verbose=0), wrapped.predict(x, verbose=0), rtol=1e-6
    )


class _NoTrainingArgument(keras.Model):
    """A subclassed model whose `call` takes no `training`: Keras's fit calls
    it without one, so its BatchNormalization runs as in inference."""

    def __init__(self):
        super().__init__(name="no_training_argument")
        self.hidden = keras.layers.Dense(16, activation="tanh")
        self.norm = keras.layers.BatchNormalization()
        self.logits = keras.layers.Dense(CLASSES)

    def call(self, x):
        return self.logits(self.norm(self.hidden(x)))


@pytest.mark.parametrize("accum_steps", [1, 4])
def test_wrap_calls_a_model_without_training_as_keras_fit_does(accum_steps):
    # The moving statistics and the normalisation both follow `training`:
    # were the wrapper to pass `training=True`, the statistics would move
    # and the weights train on batch statistics, unlike the plain fit's.
    x, y = make_data(92)
    keras.utils.set_random_seed(0)
    model = _NoTrainingArgument()
    keras.utils.set_random_seed(0)
    reference = _NoTrainingArgument()

    wrapped = keras_accum.wrap(model, accum_steps=accum_steps)
    wrapped.compile(keras.optimizers.SGD(0.1), loss())
    wrapped.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    reference.compile(keras.optimizers.SGD(0.1), loss())
    reference.fit(x, y, batch_size=8 * accum_steps, shuffle=False, verbose=0)

    keras.utils.set_random_seed(0)
    initial = _NoTrainingArgument()
    initial(x[:1])  # the weights both started from
    assert_trained(model, initial.get_weights())
    assert_weights_close(reference, model)  # the moving statistics too


def test_wrap_of_a_functional_subclass_without_step_overrides_trains():
    class Plain(keras.Model):
        pass

    inputs = keras.Input((FEATURES,))
    model = keras_accum.wrap(Plain(inputs, keras.layers.Dense(CLASSES)(inputs)), accum_steps=2)
    model.compile("sgd", "sparse_categorical_crossentropy")
    x, y = make_data(16)
    model.fit(x, y, batch_size=8, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 1


# -- models whose overrides wrap() cannot honour --------------------------------


class _CustomLoss(keras.Model):
    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(3)

    def call(self, x):
        return self.dense(x)

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        return keras.ops.mean(keras.ops.square(y_pred))


class _CustomStep(keras.Model):
    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(3)

    def call(self, x):
        return self.dense(x)

    def train_step(self, data):
        return super().train_step(data)


class _CustomFit(keras.Model):
    # As KerasHub's text-to-image tasks: `fit` refuses to train it.
    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(3)

    def call(self, x):
        return self.dense(x)

    def fit(self, *args, **kwargs):
        raise NotImplementedError("not trained by fit")


@pytest.mark.parametrize(
    "cls,method",
    [(_CustomLoss, "compute_loss"), (_CustomStep, "train_step"), (_CustomFit, "fit")],
)
@pytest.mark.unit
def test_wrap_refuses_a_model_whose_overrides_it_would_ignore(cls, method):
    with pytest.raises(ValueError, match=rf"(?s)_{cls.__name__[1:]}.*`{method}`.*AccumModel"):
        keras_accum.wrap(cls(), accum_steps=2)


class _FunctionalCustomStep(keras.Model):
    """Built functionally, `_FunctionalCustomStep(inputs, outputs)`."""

    def train_step(self, data):
        return super().train_step(data)


class _FunctionalCustomLoss(keras.Model):
    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        return keras.ops.mean(keras.ops.square(y_pred))


@pytest.mark.parametrize(
    "cls,method", [(_FunctionalCustomStep, "train_step"), (_FunctionalCustomLoss, "compute_loss")]
)
@pytest.mark.unit
def test_wrap_refuses_a_functional_subclass_whose_overrides_it_would_drop(cls, method):
    # wrap() rebuilds a functional model from its graph: the override would
    # be dropped silently (issue 23: 0 calls of the custom train_step).
    inputs = keras.Input((FEATURES,))
    model = cls(inputs, keras.layers.Dense(CLASSES)(inputs))
    with pytest.raises(
        ValueError,
        match=rf"(?s)`model` is a {cls.__name__}, which overrides `{method}`.*"
        rf"Received: model=.*keras_accum.AccumModel.*{cls.__name__}\(inputs, outputs\)",
    ):
        keras_accum.wrap(model, accum_steps=2)


def test_wrap_refuses_a_functional_subclass_that_overrides_train_step():
    class Custom(keras.Model):
        def train_step(self, data):
            return super().train_step(data)

    tokens, logits = tied_graph()
    with pytest.raises(
        ValueError,
        match=r"`model` is a Custom, which overrides `train_step`; wrap\(\) cannot honour",
    ):
        keras_accum.wrap(Custom(tokens, logits), accum_steps=2)


# -- configs and exports of wrapped models --------------------------------------


@pytest.mark.unit
def test_wrap_of_a_functional_subclass_keeps_its_class_config():
    model = keras_accum.wrap(TiedLM(seed=3), accum_steps=2, micro_batch_size=4)
    config = model.get_config()
    assert config["model"]["class_name"] == "TiedLM" and config["model"]["config"]["seed"] == 3
    assert config["accum_steps"] == 2 and config["micro_batch_size"] == 4
    again = type(model).from_config(config)
    assert again.accum_steps == 2 and again.micro_batch_size == 4


_SERVE = """
import json, sys
import numpy as np, tensorflow as tf
assert "keras_accum" not in sys.modules
x = np.load(sys.argv[1] + "/x.npy")
for name in json.loads(sys.argv[2]):
    loaded = tf.saved_model.load(sys.argv[1] + "/" + name)
    fn = loaded.signatures["serving_default"]
    out = list(fn(tf.constant(x)).values())[0].numpy()
    np.testing.assert_allclose(out, np.load(sys.argv[1] + "/" + name + ".npy"), rtol=1e-5, atol=1e-6)
    assert "keras_accum" not in sys.modules
print("served", len(json.loads(sys.argv[2])))
"""


@pytest.mark.slow  # serves in a fresh process, without keras_accum
def test_export_of_wrapped_subclassed_models_serves_without_keras_accum(tmp_path):
    x, y = make_data(40)
    names = []
    for way in ("wrap_subclassed", "wrap_built_subclassed"):
        model = WAYS_IN[way](accum_steps=4)[0]()
        model.compile(keras.optimizers.Adam(0.01), loss(), metrics=["accuracy"])
        model.fit(x, y, batch_size=8, verbose=0)
        model.export(str(tmp_path / f"{way}_export"), verbose=False)
        tf.saved_model.save(model, str(tmp_path / f"{way}_saved"))
        expected = keras.ops.convert_to_numpy(model(x, training=False))
        for kind in ("export", "saved"):
            names.append(f"{way}_{kind}")
            np.save(tmp_path / f"{names[-1]}.npy", expected)
    np.save(tmp_path / "x.npy", x)
    result = run_python("-c", _SERVE, str(tmp_path), json.dumps(names))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "served 4" in result.stdout
