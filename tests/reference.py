"""Shared fixtures: tiny models built from a seed, and a big-batch reference.

Every exactness test trains a plain `keras.Model` on the big batch and an
`AccumModel` on micro-batches from the same initial weights, then compares.
"""

import subprocess
import sys

import keras
import numpy as np

import keras_accum
from workers import ROOT, environment, run_workers  # noqa: F401 (shared)

RTOL, ATOL = 1e-5, 1e-6
FEATURES, CLASSES = 6, 3


# The optimizers the reference tests run, each made fresh per model.
OPTIMIZERS = {
    "sgd_momentum": lambda: keras.optimizers.SGD(0.1, momentum=0.9),
    "sgd_nesterov": lambda: keras.optimizers.SGD(0.1, momentum=0.9, nesterov=True),
    "adam": lambda: keras.optimizers.Adam(0.01),
    "adamw": lambda: keras.optimizers.AdamW(0.01, weight_decay=0.1),
    "rmsprop": lambda: keras.optimizers.RMSprop(0.01, momentum=0.5),
    "adam_ema": lambda: keras.optimizers.Adam(
        0.01, use_ema=True, ema_momentum=0.5
    ),
    "sgd_clipnorm": lambda: keras.optimizers.SGD(0.5, clipnorm=0.05),
    "adam_global_clipnorm": lambda: keras.optimizers.Adam(
        0.01, global_clipnorm=0.05
    ),
    "sgd_clipvalue": lambda: keras.optimizers.SGD(0.5, clipvalue=0.005),
    "adam_exponential_decay": lambda: keras.optimizers.Adam(
        keras.optimizers.schedules.ExponentialDecay(0.02, 2, 0.5)
    ),
    "sgd_piecewise": lambda: keras.optimizers.SGD(
        keras.optimizers.schedules.PiecewiseConstantDecay([2, 5], [0.3, 0.1, 0.01]),
        momentum=0.9,
    ),
}


def make_data(n=100, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, FEATURES)).astype("float32")
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).astype("int64") + (x[:, 2] > 1)
    return x, y


def functional(cls=keras.Model, seed=0, regularizer=None, **kwargs):
    """A small MLP; `cls` is keras.Model or AccumModel, same weights by seed."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((FEATURES,), name="x")
    h = keras.layers.Dense(
        16, activation="tanh", kernel_regularizer=regularizer, name="hidden"
    )(inputs)
    outputs = keras.layers.Dense(CLASSES, name="logits")(h)
    return cls(inputs, outputs, name="net", **kwargs)


class _Net:
    """Body of the subclassed test model, mixed into either base class."""

    def __init__(self, **kwargs):
        kwargs.setdefault("name", "net")
        super().__init__(**kwargs)
        self.hidden = keras.layers.Dense(16, activation="tanh", name="hidden")
        self.logits = keras.layers.Dense(CLASSES, name="logits")

    def call(self, x):
        return self.logits(self.hidden(x))


@keras.saving.register_keras_serializable(package="keras_accum_tests")
class PlainNet(_Net, keras.Model):
    pass


@keras.saving.register_keras_serializable(package="keras_accum_tests")
class AccumNet(_Net, keras_accum.AccumModel):
    pass


def _sequential_without_input():
    return keras.Sequential(
        [
            keras.layers.Dense(16, activation="tanh", name="hidden"),
            keras.layers.Dense(CLASSES, name="logits"),
        ],
        name="net",
    )


# Every way into keras_accum, as users take it: (accumulating model, plain
# twin), both made from the same seed and neither built nor called, except
# where the way in starts from a built model. `WAYS_IN[name](**kwargs)`
# returns the pair's two makers; `kwargs` (accum_steps=..., ...) go to the
# accumulating one.
def _seeded(make):
    def seeded():
        keras.utils.set_random_seed(0)
        return make()

    return seeded


WAYS_IN = {
    "functional": lambda **kw: (
        lambda: functional(keras_accum.AccumModel, **kw),
        functional,
    ),
    "subclass": lambda **kw: (
        _seeded(lambda: AccumNet(**kw)),
        _seeded(PlainNet),
    ),
    "wrap_functional": lambda **kw: (
        lambda: keras_accum.wrap(functional(), **kw),
        functional,
    ),
    "wrap_subclassed": lambda **kw: (
        _seeded(lambda: keras_accum.wrap(PlainNet(), **kw)),
        _seeded(PlainNet),
    ),
    "wrap_built_subclassed": lambda **kw: (
        lambda: keras_accum.wrap(subclassed(), **kw),
        subclassed,
    ),
    "wrap_sequential_without_input": lambda **kw: (
        _seeded(lambda: keras_accum.wrap(_sequential_without_input(), **kw)),
        _seeded(_sequential_without_input),
    ),
}


def initial_weights(make, x):
    """The initial weights `make()` gives, for `assert_trained` (built here on
    purpose: a throwaway copy, never the model under test)."""
    model = make()
    model(x[:1])
    return model.get_weights()


def subclassed(cls=keras.Model, seed=0, **kwargs):
    keras.utils.set_random_seed(seed)
    model = (AccumNet if cls is keras_accum.AccumModel else PlainNet)(**kwargs)
    model(np.zeros((1, FEATURES), "float32"))
    return model


def loss():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def assert_weights_close(a, b, rtol=RTOL, atol=ATOL):
    wa, wb = a.get_weights(), b.get_weights()
    assert len(wa) == len(wb)
    for va, vb in zip(wa, wb):
        np.testing.assert_allclose(va, vb, rtol=rtol, atol=atol)


def assert_unchanged(before, model):
    """`model`'s weights are exactly `before` (a `get_weights()` list)."""
    after = model.get_weights()
    assert len(before) == len(after)
    for a, b in zip(before, after):
        np.testing.assert_array_equal(a, b)


def assert_history_close(ha, hb, rtol=RTOL, atol=ATOL):
    """Compares two `fit` histories: `History` objects or their `.history` dicts."""
    ha, hb = (getattr(h, "history", h) for h in (ha, hb))
    assert sorted(ha) == sorted(hb)
    for key in ha:
        np.testing.assert_allclose(ha[key], hb[key], rtol=rtol, atol=atol, err_msg=key)


def assert_trained(model, initial):
    """Guards against comparisons that pass because nothing moved."""
    moved = max(
        np.abs(w - w0).max() for w, w0 in zip(model.get_weights(), initial)
    )
    assert moved > 1e-3, f"weights barely moved ({moved}); the test is vacuous"


def run_python(*args, timeout=600, **env):
    """Runs a fresh Python (`python *args`) from the repository root, with the
    repository importable; returns the CompletedProcess (text output)."""
    return subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=environment(**env),
    )


class InterruptAt(keras.callbacks.Callback):
    """Ctrl-C after batch `batch` (0-based) of epoch `epoch` ends."""

    def __init__(self, epoch, batch):
        super().__init__()
        self.at = (epoch, batch)

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if (self._epoch, batch) == self.at:
            raise KeyboardInterrupt
