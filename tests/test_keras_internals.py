"""Fails loudly when the Keras internals keras_accum relies on move.

If one of these fails after a Keras upgrade, re-read the named Keras source
against keras_accum/_keras_internals.py (and AccumModel.train_step, which
mirrors TensorFlowTrainer.train_step), adapt, then update the fingerprint.
"""

import hashlib
import inspect

import keras
import pytest

from keras_accum import _keras_internals as internals

MESSAGE = (
    "Keras {found} changed {what}; keras_accum/_keras_internals.py was "
    f"written against Keras {internals.WRITTEN_AGAINST}. Re-read it, adapt "
    "AccumModel.train_step, then update the fingerprint."
)


def test_train_step_is_the_one_accum_model_mirrors():
    source = inspect.getsource(internals.TensorFlowTrainer.train_step)
    digest = hashlib.sha256(source.encode()).hexdigest()
    if digest != internals.TRAIN_STEP_SOURCE_SHA256:
        pytest.fail(
            MESSAGE.format(found=keras.__version__, what="TensorFlowTrainer.train_step")
            + f" New fingerprint: {digest}"
        )


@pytest.mark.parametrize(
    "attribute", ["_call_has_training_arg", "_compute_loss", "_loss_tracker"]
)
def test_model_private_attributes_exist(attribute):
    inputs = keras.Input((2,))
    model = keras.Model(inputs, keras.layers.Dense(1)(inputs))
    model.compile("sgd", "mse")
    if not hasattr(model, attribute):
        pytest.fail(MESSAGE.format(found=keras.__version__, what=f"Model.{attribute}"))


def test_functional_init_arguments_signature_detection():
    a, b = keras.Input((2,)), keras.Input((2,))
    assert internals.functional_init_arguments((a, b), {})
    assert internals.functional_init_arguments((), {"inputs": a, "outputs": b})
    assert not internals.functional_init_arguments((), {"name": "x"})
    assert issubclass(internals.Functional, keras.Model)


def test_keras_still_rebases_model_subclasses_called_functionally():
    # The behaviour AccumModel.__new__ guards against; if Keras stops doing
    # this, the guard may be simplified.
    class Probe(keras.Model):
        pass

    inputs = keras.Input((2,))
    Probe(inputs, keras.layers.Dense(1)(inputs))
    assert Probe.__bases__ == (internals.Functional,)
