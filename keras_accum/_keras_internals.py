"""Every place keras_accum reaches into Keras internals, and nowhere else.

Written against Keras 3.15.1 on the TensorFlow backend. Keras 3.x releases
move these names; `tests/test_keras_internals.py` fails loudly, naming this
module, when one of them moves or when the TF trainer's `train_step` (which
`AccumModel.train_step` mirrors) changes.
"""

import tensorflow as tf
from keras import tree
from keras.src.backend.tensorflow.trainer import TensorFlowTrainer
from keras.src.losses.loss import unscale_loss_for_distribution
from keras.src.models.functional import Functional
from keras.src.models.model import functional_init_arguments
from keras.src.saving.keras_saveable import KerasSaveable
from keras.src.utils.tracking import no_automatic_dependency_tracking

WRITTEN_AGAINST = "3.15.1"

# A `KerasSaveable` attribute of a model is visited by Keras's saving
# (`save`, `save_weights`, `load_weights`) under its own path, which is how
# the pending window travels in `.keras` and `.weights.h5` files without a
# plain model that loads the same file ever seeing it.

# `AccumModel.train_step` is `TensorFlowTrainer.train_step` with the optimizer
# call replaced by accumulation. If Keras edits its train_step, ours must be
# re-read against it; the test compares this fingerprint.
TRAIN_STEP_SOURCE_SHA256 = (
    "debf0efab9d5794b017ade2937acbcc51886fc1dc5cf021e7d7e80f974ee707c"
)

__all__ = [
    "Functional",
    "KerasSaveable",
    "TensorFlowTrainer",
    "WRITTEN_AGAINST",
    "batch_size",
    "call_for_training",
    "compute_loss",
    "functional_init_arguments",
    "no_automatic_dependency_tracking",
    "track_loss",
]


def call_for_training(model, x):
    """The forward pass exactly as Keras's train_step makes it."""
    if model._call_has_training_arg:
        return model(x, training=True)
    return model(x)


def compute_loss(model, x, y, y_pred, sample_weight):
    """`model.compute_loss`, also for overrides without a `training` arg."""
    return model._compute_loss(
        x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True
    )


def batch_size(x):
    """Number of samples in a batch, counted as Keras's loss tracker does."""
    return tf.shape(next(i for i in tree.flatten(x) if i is not None))[0]


def track_loss(model, loss, n):
    """Updates the model's logged `loss` exactly as Keras's train_step does."""
    model._loss_tracker.update_state(
        unscale_loss_for_distribution(loss), sample_weight=n
    )
