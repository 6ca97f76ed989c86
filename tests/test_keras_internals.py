"""Fails loudly when the Keras internals keras_accum relies on move.

If one of these fails after a Keras upgrade, re-read the named Keras source
against keras_accum/_keras_internals.py and the code that mirrors it (named
there), adapt, then update the fingerprint.
"""

import hashlib
import inspect

import keras
import numpy as np
import pytest

from keras_accum import _keras_internals as internals

MESSAGE = (
    "Keras {found} changed {what}; keras_accum/_keras_internals.py was "
    f"written against Keras {internals.WRITTEN_AGAINST}. Re-read it, adapt "
    "AccumModel.train_step, then update the fingerprint."
)


def _mirrored():
    from keras.src.losses import loss
    from keras.src.trainers.compile_utils import CompileLoss

    trainer = internals.TensorFlowTrainer
    return {
        "TensorFlowTrainer.train_step": trainer.train_step,
        "TensorFlowTrainer._make_function": trainer._make_function,
        "Loss.__call__": loss.Loss.__call__,
        "reduce_values": loss.reduce_values,
        "apply_mask": loss.apply_mask,
        "CompileLoss.call": CompileLoss.call,
        "TensorFlowTrainer._maybe_symbolic_build": trainer._maybe_symbolic_build,
        "reduce_per_replica": internals.reduce_per_replica,
        "BatchNormalization.call": internals.BatchNormalization.call,
        "BatchNormalization._moments": internals.BatchNormalization._moments,
    }


@pytest.mark.parametrize("name", sorted(internals.MIRRORED_SOURCES))
def test_mirrored_keras_source_is_unchanged(name):
    source = inspect.getsource(_mirrored()[name])
    digest = hashlib.sha256(source.encode()).hexdigest()
    if digest != internals.MIRRORED_SOURCES[name]:
        pytest.fail(
            MESSAGE.format(found=keras.__version__, what=name)
            + f" New fingerprint: {digest}"
        )


def test_compiled_loss_terms_are_recorded_once_each():
    inputs = keras.Input((2,))
    model = keras.Model(
        inputs, {"a": keras.layers.Dense(1, name="a")(inputs), "b": keras.layers.Dense(1, name="b")(inputs)}
    )
    model.compile("sgd", {"a": "mse", "b": "mae"})
    x = np.zeros((4, 2), "float32")
    y = {"a": np.zeros((4, 1)), "b": np.zeros((4, 1))}
    internals.build_compiled_loss(model, (x, y))
    seen = []
    with internals.recording_loss_calls(model, lambda fn, *_: seen.append(fn.name)):
        model.compute_loss(x, y, model(x))
    assert sorted(seen) == ["mae", "mse"]
    assert len(model._compile_loss._flat_losses[0]) == 4  # (path, fn, weight, name)


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
