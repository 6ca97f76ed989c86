"""The noise scale measured on a fixed probe (keras_accum/probe.py) and
`AccumScheduler("noise_scale", probe=...)`.

The reference is numpy on per-example gradients of a model whose weights do
not move: the probe's value must be the estimator on its own windows and
micro-batches (exact to float32), and its interval must hold the true
`B_simple` of the probe's examples. Measuring must change nothing: weights,
layers' statistics, dropout's seeds, what training does next. The
scheduler's decisions on a probe are replayed on a plain model in
test_noise_scale.py (`functional_probe`); under MirroredStrategy in its
mirrored fixture.
"""

import keras
import numpy as np
import pytest

import keras_accum
from helpers.noise import (
    embedding_data,
    embedding_net,
    estimate,
    per_example_gradients,
    regression_data,
    regression_net,
    target,
)
from helpers.tiers import wide
from keras_accum.growth.probe import NoiseProbe

# As test_noise_scale.py: float32 sums of squares against numpy's float64.
RTOL = 1e-5


def _probe_windows(probe, micro):
    """The probe's windows as index arrays into its data: equal
    micro-batches of its shuffled rows, the rest of the samples left out."""
    m = probe.samples // (probe.windows * micro)
    return [
        [probe.order[(k * m + j) * micro : (k * m + j + 1) * micro] for j in range(m)]
        for k in range(probe.windows)
    ]


@pytest.mark.parametrize(
    "kind, samples, windows, micro",
    [
        ("dense", 1024, 8, 8),
        ("dense", 1000, 3, 12),  # 996 samples used: 3 windows of 83 micro-batches
        # An Embedding's gradient (IndexedSlices), its rows repeated within a
        # micro-batch: the norm of the dense gradient it stands for.
        ("sparse", 512, 4, 8),
    ],
)
def test_the_probe_is_the_estimator_on_its_windows(kind, samples, windows, micro):
    # A noisy regression at its initial weights: the noise scale (~25)
    # above the micro-batch, below the probe's windows.
    if kind == "sparse":
        x, y = embedding_data(samples, vocab=50)
        model = embedding_net(keras_accum.AccumModel, 50, accum_steps=2, noise_scale=True)
    else:
        x, y = regression_data(samples, noise=3.0)
        model = keras_accum.AccumModel(*_layers(hidden=5), accum_steps=2, noise_scale=True)
        model.compile(keras.optimizers.SGD(0.0), "mse")
    model.fit(x[:32], y[:32], batch_size=8, verbose=0)  # built, as a user's
    probe = NoiseProbe((x, y), windows=windows)
    measured = probe.measure(model, micro)
    grads = per_example_gradients(model, x, y)
    assert measured.value == pytest.approx(estimate(grads, _probe_windows(probe, micro)), rel=RTOL)
    assert measured.windows == windows and measured.resolved
    if windows >= 8:  # a 95% interval from 3 windows' spread is too narrow to hold
        exact = target(grads)[0]
        assert measured.low < exact < measured.high, (measured, exact)


def _layers(hidden=0, dropout=False, batchnorm=False, seed=1):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((6,))
    h = keras.layers.Dense(hidden or 4, activation="tanh")(inputs)
    if dropout:
        h = keras.layers.Dropout(0.3)(h)
    if batchnorm:
        h = keras.layers.BatchNormalization()(h)
    return inputs, keras.layers.Dense(1)(h)


# Two outputs in the inner loop; the functional model (every other test's)
# and its wrap in the slow tier.
@pytest.mark.parametrize("way", wide(["functional", "wrap", "two_outputs"], ["two_outputs"]))
def test_measuring_changes_nothing(way):
    # Dropout's seed and BatchNormalization's moving statistics move in a
    # training-mode forward pass, and a two-output model's loss updates
    # each output's loss metric: put back, the next epoch (its weights and
    # its logs) is the one a twin never measured trains.
    x, y = regression_data(92, noise=1.0)
    held = regression_data(256, noise=1.0, seed=3)
    if way == "two_outputs":
        y, held = [y, -y], (held[0], [held[1], -held[1]])
    probe = NoiseProbe(held, windows=4)
    twins = []
    for measured in (True, False):
        inputs, outputs = _layers(dropout=True, batchnorm=True)
        if way == "wrap":
            model = keras_accum.wrap(keras.Model(inputs, outputs), accum_steps=4)
        elif way == "two_outputs":
            model = keras_accum.AccumModel(
                inputs, [outputs, keras.layers.Dense(1)(outputs)], accum_steps=4
            )
        else:
            model = keras_accum.AccumModel(inputs, outputs, accum_steps=4)
        model.compile(keras.optimizers.Adam(0.01), "mse")
        model.fit(x, y, batch_size=8, verbose=0)
        if measured:

            def state():
                variables = model.variables + model.optimizer.variables
                return [np.array(v) for v in variables + model.metrics_variables]

            before = state()
            assert np.isfinite(probe.measure(model, 8).value)
            for a, b in zip(before, state()):
                np.testing.assert_array_equal(a, b)
        history = model.fit(x, y, batch_size=8, verbose=0).history
        twins.append((model.get_weights(), history))
    (weights, history), (twin_weights, twin_history) = twins
    for a, b in zip(weights, twin_weights):
        np.testing.assert_array_equal(a, b)
    # (The twins' output layers differ in name only.)
    assert list(history.values()) == list(twin_history.values())


@pytest.mark.parametrize("micro_batch_size, needed", [(None, 64), (4, 32)])
def test_a_probe_too_small_for_the_batch_is_refused_before_training(micro_batch_size, needed):
    # 4 windows of 2 micro-batches of 8 (the batch) need 64 samples; a step
    # split into micro-batches of 4 (memory) makes the probe's 4 too.
    x, y = regression_data(92, noise=1.0)
    model = regression_net(
        keras_accum.AccumModel, accum_steps=2, noise_scale=True, micro_batch_size=micro_batch_size
    )
    model.build((None, 6))
    weights = model.get_weights()
    scheduler = keras_accum.AccumScheduler(
        "noise_scale",
        max_accum_steps=8,
        probe=regression_data(needed - 4, noise=1.0),
        probe_windows=4,
    )
    with pytest.raises(ValueError, match=rf"`probe` has {needed - 4} samples.*need {needed}\."):
        model.fit(x, y, batch_size=8, callbacks=[scheduler], verbose=0)
    for a, b in zip(weights, model.get_weights()):
        np.testing.assert_array_equal(a, b)
    assert int(model.optimizer.iterations) == 0


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (
            dict(schedule={0: 2}, probe=(np.zeros((64, 6)), np.zeros((64, 1)))),
            r'`probe` is for AccumScheduler\("noise_scale"\).*schedule=\{0: 2\}',
        ),
        (
            dict(schedule="noise_scale", max_accum_steps=8, probe_windows=4),
            r"`probe_windows`.*probe_windows=4, probe=None",
        ),
        (
            dict(
                schedule="noise_scale",
                max_accum_steps=8,
                probe_windows=2,
                probe=(np.zeros((64, 6)), np.zeros((64, 1))),
            ),
            r"`probe_windows` must be an int >= 3.*probe_windows=2",
        ),
        (
            dict(
                schedule="noise_scale",
                max_accum_steps=8,
                probe_windows=4.0,
                probe=(np.zeros((64, 6)), np.zeros((64, 1))),
            ),
            r"`probe_windows` must be an int >= 3.*probe_windows=4.0",
        ),
        (
            dict(
                schedule="noise_scale",
                max_accum_steps=8,
                probe=(np.zeros((64, 6)), np.zeros((63, 1))),
            ),
            r"same number of samples.*\[63, 64\]",
        ),
        (
            dict(schedule="noise_scale", max_accum_steps=8, probe=np.zeros((64, 6))),
            r"`probe` must be `\(x,\)`, `\(x, y\)`.*ndarray",
        ),
    ],
)
@pytest.mark.unit
def test_bad_probe_arguments_are_refused_naming_them(kwargs, match):
    with pytest.raises(ValueError, match=match):
        keras_accum.AccumScheduler(**kwargs)


# The wrapped model under XLA (18 s) in the slow tier.
@pytest.mark.parametrize("way", ["functional", pytest.param("wrap_xla", marks=pytest.mark.slow)])
def test_the_scheduler_acts_on_the_probe_of_the_loss_compiled_now(way):
    # At learning rate 0 the weights stay where they are, so each probed
    # decision's estimate is the probe's measure now; after a recompile to
    # another loss (between fits), it is that loss's, not the traced old
    # one's. Keras's default on one GPU (XLA), through wrap, too.
    x, y = regression_data(92, noise=3.0)
    held = regression_data(256, noise=3.0, seed=3)
    compile_kwargs = dict(jit_compile=True) if way == "wrap_xla" else {}
    if way == "wrap_xla":
        model = keras_accum.wrap(keras.Model(*_layers()), accum_steps=2, noise_scale=True)
    else:
        model = keras_accum.AccumModel(*_layers(), accum_steps=2, noise_scale=True)
    fresh = NoiseProbe(held, windows=4)
    values = []
    for loss in ("mse", "mae"):
        model.compile(keras.optimizers.SGD(0.0), loss, **compile_kwargs)
        scheduler = keras_accum.AccumScheduler(
            "noise_scale", max_accum_steps=64, every_updates=3, probe=held, probe_windows=4
        )
        model.fit(x, y, batch_size=8, verbose=0, callbacks=[scheduler])
        probed = [d for d in scheduler.path if d.probed]
        assert probed, scheduler.path
        now = fresh.measure(model, 8)
        for d in probed:
            assert d.estimate.value == pytest.approx(now.value, rel=RTOL)
        values.append(now.value)
    assert values[0] != pytest.approx(values[1], rel=0.01)  # the loss matters
