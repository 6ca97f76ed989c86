"""Rematerialisation (`keras.RematScope`) with `micro_batch_size` and with
`accum_steps`: the big batch's training, exactly.

A layer made inside a `RematScope` recomputes its activations (mode
"activations") or its whole call (mode "larger_than", for outputs above a
size) in the backward pass, through `tf.recompute_grad`, a custom gradient:
the accumulating step must differentiate through it as Keras's own does.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_accum
from helpers.assertions import assert_history_close, assert_weights_close
from helpers.models import OPTIMIZERS, loss

pytestmark = pytest.mark.skipif(
    not hasattr(keras, "RematScope"),
    reason=f"keras.RematScope is Keras >= 3.9; this is Keras {keras.__version__}",
)

# 92 samples: at batch 32 the last batch has 28 (micro-batches of 8: 8+8+8+4);
# at batch 8 with accum_steps=4 the last window is 8+8+8+4 as well.
SAMPLES, BIG, MICRO = 92, 32, 8
FIT = dict(epochs=2, shuffle=False, verbose=0)
# "larger_than" counts the batch in a layer's output size: the convolutions'
# (8*8*4 per sample) are above the threshold, the Dense layer's (3 per
# sample) below it up to batch 66. (A Dense layer's call takes `training`,
# which Keras cannot rematerialise on TensorFlow, keras-team/keras#21207.)
MODES = {"activations": {}, "larger_than": {"output_size_threshold": 200}}

CALLS = {"call": 0, "activation": 0}


def counted_relu(x):
    CALLS["activation"] += 1
    return keras.activations.relu(x)


class CountedConv(keras.layers.Conv2D):
    def call(self, inputs):
        CALLS["call"] += 1
        return super().call(inputs)


def cnn(mode):
    """A small CNN whose layers are made inside `RematScope(mode)`, as a
    Sequential without an input shape: `fit` builds it. (The model itself
    is made outside the scope: a scope around a model rematerialises the
    model's whole call, which Keras cannot do on TensorFlow when the call
    takes keyword arguments, keras-team/keras#21207.)"""
    keras.utils.set_random_seed(0)
    with keras.RematScope(mode=mode, **MODES[mode]):
        layers = [
            CountedConv(4, 3, padding="same", activation=counted_relu),
            CountedConv(4, 3, padding="same", activation=counted_relu),
            keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(3),
        ]
    return keras.Sequential(layers)


def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(SAMPLES, 8, 8, 3)).astype("float32")
    return x, rng.integers(0, 3, SAMPLES)


def assert_rematerialised(model, x):
    """Each convolution's activation ("activations") or call ("larger_than")
    runs twice when a gradient is traced: forward, and recomputed backward."""
    model(x[:1])
    for key in CALLS:
        CALLS[key] = 0

    @tf.function
    def gradient(x):
        with tf.GradientTape() as tape:
            out = tf.reduce_sum(model(x, training=True))
        return tape.gradient(out, model.trainable_variables)

    gradient(x[:BIG])
    assert max(CALLS.values()) == 2 * 2, CALLS  # 2 convolutions, each twice


def train(model, x, y, batch, jit_compile=False, **fit_kwargs):
    model.compile(OPTIMIZERS["adam"](), loss(), metrics=["accuracy"], jit_compile=jit_compile)
    return model.fit(x, y, batch_size=batch, **FIT, **fit_kwargs).history


@pytest.mark.parametrize(
    # "larger_than" on every way in the slow tier.
    "mode",
    [m if m == "activations" else pytest.param(m, marks=pytest.mark.slow) for m in MODES],
)
@pytest.mark.parametrize(
    "way, batch",
    [
        ("micro_batch_size", BIG),
        ("accum_steps", MICRO),
        # Both at once in the slow tier: each is above.
        pytest.param("both", 2 * MICRO, marks=pytest.mark.slow),
    ],
)
def test_remat_trains_as_the_big_batch(mode, way, batch):
    x, y = data()
    assert_rematerialised(cnn(mode), x)
    plain = cnn(mode)
    plain_history = train(plain, x, y, BIG)
    settings = {
        "micro_batch_size": dict(micro_batch_size=MICRO),
        "accum_steps": dict(accum_steps=BIG // MICRO),
        "both": dict(micro_batch_size=MICRO, accum_steps=2),
    }[way]
    if way == "both":  # through fit, for one call
        accum = keras_accum.wrap(cnn(mode))
        accum_history = train(accum, x, y, batch, **settings)
    else:
        accum = keras_accum.wrap(cnn(mode), **settings)
        accum_history = train(accum, x, y, batch)
    assert_weights_close(plain, accum)
    assert int(accum.optimizer.iterations) == int(plain.optimizer.iterations)
    assert_history_close(plain_history, accum_history)


@pytest.mark.slow  # XLA compiles each micro-batch's step (about 18 s)
@pytest.mark.parametrize("mode", MODES)
def test_remat_under_xla_trains_as_the_big_batch(mode):
    # The recomputed forward pass inside XLA's cluster, micro-batches and
    # window together (accum_steps=2, micro-batches of 8 of each batch of 16).
    x, y = data()
    plain = cnn(mode)
    plain_history = train(plain, x, y, BIG)
    accum = keras_accum.wrap(cnn(mode), accum_steps=2, micro_batch_size=MICRO)
    accum_history = train(accum, x, y, 2 * MICRO, jit_compile=True)
    assert_weights_close(plain, accum)
    assert int(accum.optimizer.iterations) == int(plain.optimizer.iterations)
    assert_history_close(plain_history, accum_history)
