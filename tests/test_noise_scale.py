"""`noise_scale=True`: the gradient noise scale measured from the window, and
`AccumScheduler("noise_scale")` growing `accum_steps` to it.

The reference is numpy on per-example gradients of a model whose weights do
not move (learning rate 0): the logged value must be the estimator on the
same windows (exact to float32), and over random epochs the estimator must
land on the true `B_simple = tr(Sigma) / |G|^2` within its own spread.
Measuring must change nothing else: training is bit-identical on and off.
"""

import math
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_accum
from helpers import internals
from helpers.data import make_data, small_table_data
from helpers.models import functional, small_tables_net
from helpers.noise import (
    embedding_data,
    embedding_net,
    estimate,
    per_example_gradients,
    regression_data,
    regression_net,
    target,
    windows_of,
)
from helpers.tiers import wide

# float32 sums of squares against numpy's float64: the estimator subtracts
# close sums (S - L), which costs a few float32 ulps of relative accuracy.
RTOL = 1e-5


def _fit_estimates(model, x, y, batch_size, epochs=2, **kwargs):
    history = model.fit(
        x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0, **kwargs
    )
    return history.history["noise_scale"]


# -- the estimator, exactly --------------------------------------------------

WAYS = {
    # name: (model kwargs, fit kwargs, batch size, windows_of kwargs)
    "step mode": (dict(accum_steps=4), {}, 8, dict(accum_steps=4)),
    "micro_batch_size": (dict(micro_batch_size=8), {}, 32, dict(micro_batch_size=8)),
    "both": (
        dict(accum_steps=2, micro_batch_size=4),
        {},
        12,
        dict(accum_steps=2, micro_batch_size=4),
    ),
    "fit(accum_steps=)": ({}, dict(accum_steps=4), 8, dict(accum_steps=4)),
    "hidden layer": (dict(accum_steps=4, hidden=5), {}, 8, dict(accum_steps=4)),
}


# Step mode's case (slow) is "hidden layer"'s, without the layer.
@pytest.mark.parametrize("way", wide(list(WAYS), [w for w in WAYS if w != "step mode"]))
def test_the_logged_estimate_is_the_estimator_on_per_example_gradients(way):
    model_kwargs, fit_kwargs, batch_size, partition = WAYS[way]
    # 92 samples: uneven windows (8 x 4 leaves a last window of 3.5 batches).
    x, y = regression_data(92, noise=1.0)
    model = regression_net(keras_accum.AccumModel, noise_scale=True, **model_kwargs)
    logged = _fit_estimates(model, x, y, batch_size, **fit_kwargs)
    grads = per_example_gradients(model, x, y)
    expected = estimate(grads, windows_of(92, batch_size, **partition))
    np.testing.assert_allclose(logged, [expected, expected], rtol=RTOL)
    assert model.noise_scale == logged[-1]


class SubclassedRegression(keras_accum.AccumModel):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(1)

    def call(self, x):
        return self.dense(x)


def test_a_model_fit_builds_measures_and_goes_on_measuring_after_a_recompile():
    x, y = regression_data(92, noise=1.0)
    keras.utils.set_random_seed(1)
    model = SubclassedRegression(accum_steps=4, noise_scale=True)  # not built before fit
    model.compile(keras.optimizers.SGD(0.0), "mse")
    first = _fit_estimates(model, x, y, 8, epochs=1)
    model.compile(keras.optimizers.Adam(0.0), "mse")
    again = _fit_estimates(model, x, y, 8, epochs=1)
    grads = per_example_gradients(model, x, y)
    expected = estimate(grads, windows_of(92, 8, 4))
    np.testing.assert_allclose(first + again, [expected, expected], rtol=RTOL)


def test_wrap_measures_as_the_model_does():
    x, y = regression_data(92, noise=1.0)
    base = regression_net()
    model = keras_accum.wrap(base, accum_steps=4, noise_scale=True)
    model.compile(keras.optimizers.SGD(0.0), "mse")
    logged = _fit_estimates(model, x, y, 8, epochs=1)
    grads = per_example_gradients(model, x, y)
    np.testing.assert_allclose(logged, [estimate(grads, windows_of(92, 8, 4))], rtol=RTOL)


# One pair in the inner loop (step mode's estimate is the logged one's
# tests' too); the other three (a few thousand samples each) in the slow
# tier.
@pytest.mark.parametrize(
    "mode, noise",
    wide(
        [
            ("step mode", 0.3),
            ("micro_batch_size", 6.0),
            ("step mode", 6.0),
            ("micro_batch_size", 0.3),
        ],
        [("micro_batch_size", 6.0)],
    ),
)
def test_the_estimate_lands_on_the_true_noise_scale(mode, noise):
    n, epochs = 2048, 6
    x, y = regression_data(n, noise=noise)
    if mode == "step mode":
        model_kwargs, batch_size, partition = dict(accum_steps=4), 8, dict(accum_steps=4)
    else:
        model_kwargs, batch_size, partition = dict(micro_batch_size=8), 32, dict(micro_batch_size=8)
    model = regression_net(keras_accum.AccumModel, noise_scale=True, **model_kwargs)
    grads = per_example_gradients(model, x, y)
    windows = windows_of(n, batch_size, **partition)
    rng = np.random.default_rng(0)
    logged, expected = [], []
    for _ in range(epochs):
        order = rng.permutation(n)
        logged += _fit_estimates(model, x[order], y[order], batch_size, epochs=1)
        expected.append(estimate(grads[order], windows))
    # Each epoch is the estimator on its own windows...
    np.testing.assert_allclose(logged, expected, rtol=RTOL)
    # ...and their mean is the true value within the estimator's spread: its
    # standard deviation over random epochs (numpy, 200 epochs), 4 standard
    # errors of a mean of `epochs` epochs.
    spread = np.std([estimate(grads[rng.permutation(n)], windows) for _ in range(200)])
    tolerance = 4 * spread / math.sqrt(epochs)
    expected_mean, true_value = target(grads)
    assert abs(np.mean(logged) - expected_mean) < tolerance
    assert abs(expected_mean - true_value) < tolerance  # the O(B/n) term is small
    # The tolerance is tight enough to tell the two noise levels apart: the
    # other level's value lies outside twice it.
    other, _ = target(
        per_example_gradients(model, *regression_data(n, noise=6.0 if noise < 1 else 0.3))
    )
    assert abs(other - expected_mean) > 2 * tolerance


# Slices in graph mode in the inner loop (XLA's measured value is
# test_a_sparse_gradients_squared_norm_is_its_dense_rows[xla-*]'s); the
# other three, the moments buffer's two included, in the slow tier.
@pytest.mark.parametrize(
    "vocab, jit_compile",
    [
        pytest.param(500, False, id="slices-graph"),
        pytest.param(12, True, id="moments-xla", marks=pytest.mark.slow),
        pytest.param(12, False, id="moments-graph", marks=pytest.mark.slow),
        pytest.param(500, True, id="slices-xla", marks=pytest.mark.slow),
    ],
)
def test_sparse_gradients_are_measured_by_their_dense_rows(vocab, jit_compile):
    # A window of 4 x 8 x 5 = 160 tokens: kept as slices in a table of 500
    # rows, as per-row moments in a table of 12 (window/slices.py).
    x, y = embedding_data(92, vocab)
    model = embedding_net(keras_accum.AccumModel, vocab, noise_scale=True, accum_steps=4)
    model.jit_compile = jit_compile
    logged = _fit_estimates(model, x, y, 8, epochs=1)
    assert model.layers[1].embeddings.shape == (vocab, 4)
    grads = per_example_gradients(model, x, y)
    np.testing.assert_allclose(logged, [estimate(grads, windows_of(92, 8, 4))], rtol=RTOL)


# Rows of an IndexedSlices: (table rows, indices). Each case takes one way
# of summing them: only the repeated rows (most rows seen once: a large
# table), every row (most repeated: a small table), or none to sum.
SPARSE_ROWS = {
    "each row once": (100_000, np.arange(0, 64_000, 1_000)),
    "a few repeated": (300, np.concatenate([np.arange(40), [3, 3, 7, 7, 7, 299, 299]])),
    "most repeated": (7, np.random.default_rng(5).integers(0, 7, size=64)),
    "one occurrence": (5, np.array([4])),
    "none": (5, np.zeros([0], "int64")),
}


@pytest.mark.parametrize("rows", list(SPARSE_ROWS))
@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("run", [pytest.param("eager", marks=pytest.mark.unit), "graph", "xla"])
def test_a_sparse_gradients_squared_norm_is_its_dense_rows(rows, dtype, run):
    table, indices = SPARSE_ROWS[rows]
    values = np.random.default_rng(6).normal(size=(len(indices), 3)).astype(dtype)
    dense = np.zeros((table, 3))
    np.add.at(dense, indices, values.astype(np.float64))
    slices = tf.IndexedSlices(
        tf.constant(values), tf.constant(indices, tf.int64), tf.constant([table, 3], tf.int64)
    )

    def norm():
        return internals.noise_scale.squared_norm([slices])

    if run != "eager":
        norm = tf.function(norm, jit_compile=run == "xla")
    np.testing.assert_allclose(float(norm()), np.sum(dense**2), rtol=1e-6)


@pytest.mark.parametrize("shape", [(), (7,), (64, 48), (3, 5, 2)])
@pytest.mark.parametrize("run", ["graph", "xla"])
def test_a_dense_gradients_squared_norm(shape, run):
    # Under XLA a product of the squares with ones, in as many rows as
    # divide the gradient's size (one for 7 and 1).
    grad = np.random.default_rng(7).normal(size=shape).astype("float32")
    norm = tf.function(
        lambda: internals.noise_scale.squared_norm([tf.constant(grad)]), jit_compile=run == "xla"
    )
    np.testing.assert_allclose(float(norm()), np.sum(grad.astype(np.float64) ** 2), rtol=1e-6)


def test_mixed_float16_measures_the_unscaled_gradients():
    x, y = regression_data(92, noise=1.0)
    plain = regression_net(keras_accum.AccumModel, accum_steps=4, hidden=5, noise_scale=True)
    expected = _fit_estimates(plain, x, y, 8, epochs=1)
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = regression_net(keras_accum.AccumModel, accum_steps=4, hidden=5, noise_scale=True)
        # A loss scale that does not overflow at the first window (the
        # default 2**15 does, and that window is rightly left out).
        model.compile(
            keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.0), initial_scale=16.0),
            "mse",
        )
        logged = _fit_estimates(model, x, y, 8, epochs=1)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    # float16 forward and backward passes: the gradients themselves differ
    # from float32's by ~1e-3; a loss scale left in would be off by 2**30.
    np.testing.assert_allclose(logged, expected, rtol=2e-2)


# -- measuring changes nothing else ----------------------------------------


def _classifier(**kwargs):
    return functional(keras_accum.AccumModel, **kwargs)


CONFIGS = {
    "step mode": (dict(accum_steps=4), {}),
    "micro_batch_size": (dict(micro_batch_size=2), {}),
    "both": (dict(accum_steps=4, micro_batch_size=3), {}),
    "xla": (dict(accum_steps=4), dict(jit_compile=True)),
    "skip_nonfinite": (dict(accum_steps=4, skip_nonfinite=True), {}),
}


def _trained(make, x, y, noise_scale, compile_kwargs=None, batch_size=8):
    model = make(noise_scale)
    model.compile(
        keras.optimizers.Adam(0.01),
        "sparse_categorical_crossentropy",
        metrics=["accuracy"],
        **(compile_kwargs or {}),
    )
    history = model.fit(x, y, batch_size=batch_size, epochs=2, shuffle=False, verbose=0)
    return model, history.history


def _assert_identical(on, off):
    (model_on, history_on), (model_off, history_off) = on, off
    for a, b in zip(model_on.get_weights(), model_off.get_weights()):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(model_on.optimizer.variables, model_off.optimizer.variables):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    assert int(model_on.optimizer.iterations) == int(model_off.optimizer.iterations) > 0
    assert set(history_on) - set(history_off) == {"noise_scale"}
    for key, values in history_off.items():
        assert history_on[key] == values, key
    assert all(np.isfinite(history_on["noise_scale"]))


# Step mode's case (slow) is xla's and skip_nonfinite's, without either.
@pytest.mark.parametrize("config", wide(list(CONFIGS), [c for c in CONFIGS if c != "step mode"]))
def test_training_is_bit_identical_with_and_without_measuring(config):
    kwargs, compile_kwargs = CONFIGS[config]
    x, y = make_data(92)

    def make(noise_scale):
        return _classifier(noise_scale=noise_scale, **kwargs)

    _assert_identical(
        _trained(make, x, y, True, compile_kwargs), _trained(make, x, y, False, compile_kwargs)
    )


@pytest.mark.slow  # 16 s; the inner loop has each of sparse and float16 measured
def test_training_is_bit_identical_with_and_without_measuring_sparse_and_float16():
    x, y = small_table_data(92)
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:

        def make(noise_scale):
            return small_tables_net(keras_accum.AccumModel, accum_steps=4, noise_scale=noise_scale)

        def trained(noise_scale):
            model = make(noise_scale)
            # A loss scale that does not overflow: every window applied.
            model.compile(
                keras.optimizers.LossScaleOptimizer(
                    keras.optimizers.Adam(0.01), initial_scale=16.0
                ),
                "sparse_categorical_crossentropy",
            )
            history = model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
            return model, history.history

        on, off = trained(True), trained(False)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    _assert_identical(on, off)


def _squared_norms_in_split_step(reduction):
    # The `L2Loss` ops (noise_scale.squared_norms) of a traced split step
    # without buffers: the batch closed as its own window (state.close_batch).
    model = _classifier(noise_scale=True, micro_batch_size=2)
    model.compile(
        "sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=reduction)
    )
    x, y = make_data(8)
    model.fit(x, y, batch_size=4, epochs=1, verbose=0)
    step = tf.function(model.train_step).get_concrete_function(
        (tf.TensorSpec((4, x.shape[1])), tf.TensorSpec((4,), tf.int64))
    )
    graph = step.graph.as_graph_def()
    nodes = [*graph.node, *(n for f in graph.library.function for n in f.node_def)]
    return sum(node.op == "L2Loss" for node in nodes)


def test_a_sum_loss_is_not_measured_and_costs_no_norm():
    # A sum has no mean gradient: nothing to estimate, so the step computes
    # no squared norm for it (a mean loss's step does: the test can see one).
    assert _squared_norms_in_split_step("sum_over_batch_size") > 0
    assert _squared_norms_in_split_step("sum") == 0


# -- what fit logs, and where -------------------------------------------------


class _Seen(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.values = []

    def on_epoch_end(self, epoch, logs=None):
        self.values.append(logs["noise_scale"])


def test_callbacks_and_tensorboard_see_the_estimate(tmp_path):
    pytest.importorskip("tensorboard")  # installed with tensorflow from PyPI
    x, y = regression_data(92, noise=1.0)
    model = regression_net(keras_accum.AccumModel, accum_steps=4, noise_scale=True)
    seen = _Seen()
    board = keras.callbacks.TensorBoard(str(tmp_path))
    history = model.fit(x, y, batch_size=8, epochs=2, verbose=0, callbacks=[seen, board])
    assert seen.values == history.history["noise_scale"]
    written = []
    for path in (tmp_path / "train").glob("events.out.tfevents.*"):
        for event in tf.compat.v1.train.summary_iterator(str(path)):
            for value in event.summary.value:
                if value.tag == "epoch_noise_scale":
                    written.append(float(tf.make_ndarray(value.tensor)))
    np.testing.assert_allclose(written, history.history["noise_scale"], rtol=1e-6)


def test_one_micro_batch_per_update_logs_nan_with_one_warning():
    x, y = regression_data(92, noise=1.0)
    model = regression_net(keras_accum.AccumModel, noise_scale=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = model.fit(x, y, batch_size=8, epochs=3, verbose=0)
    assert all(math.isnan(v) for v in history.history["noise_scale"])
    messages = [str(w.message) for w in caught if "noise_scale is NaN" in str(w.message)]
    assert len(messages) == 1 and "accum_steps >= 2" in messages[0]
    assert math.isnan(model.noise_scale)


def test_off_by_default_and_none_before_training():
    x, y = regression_data(92, noise=1.0)
    model = regression_net(keras_accum.AccumModel, accum_steps=4)
    assert model.noise_scale is None
    history = model.fit(x, y, batch_size=8, verbose=0)
    assert "noise_scale" not in history.history and model.noise_scale is None


def test_a_skipped_window_adds_nothing():
    x, y = regression_data(92, noise=1.0)
    x[40] = np.nan  # in the second window (samples 32-63)
    model = regression_net(
        keras_accum.AccumModel, accum_steps=4, noise_scale=True, skip_nonfinite=True
    )
    logged = _fit_estimates(model, x, y, 8, epochs=1)
    assert model.skipped_windows == 1
    clean = np.nan_to_num(x)
    grads = per_example_gradients(model, clean, y)
    windows = windows_of(92, 8, 4)
    np.testing.assert_allclose(logged, [estimate(grads, windows[:1] + windows[2:])], rtol=RTOL)


def test_a_window_resumed_from_a_file_is_not_estimated(tmp_path):
    # Its first micro-batches were measured by another process: the window
    # is left out, not estimated from part of it.
    x, y = regression_data(92, noise=1.0)
    first = regression_net(keras_accum.AccumModel, accum_steps=4, noise_scale=True)
    first.fit(x[:16], y[:16], batch_size=8, verbose=0, epochs=1)  # flushed: no window
    first.train_on_batch(x[:8], y[:8])  # an open window of 1 micro-batch
    path = str(tmp_path / "mid.weights.h5")
    first.save_weights(path)
    resumed = regression_net(keras_accum.AccumModel, accum_steps=4, noise_scale=True)
    resumed.build((None, 6))
    resumed.load_weights(path)
    logged = _fit_estimates(resumed, x[8:], y[8:], 8, epochs=1)
    grads = per_example_gradients(resumed, x, y)
    # The resumed window ends with sample 31; after it, windows from 32 on.
    rest = [[m + 32 for m in w] for w in windows_of(60, 8, 4)]
    np.testing.assert_allclose(logged, [estimate(grads, rest)], rtol=RTOL)


def test_an_epoch_estimates_its_own_windows_only():
    # Windows trained before fit (train_on_batch) or in an interrupted fit
    # are not part of the next epoch's estimate.
    x, y = regression_data(92, noise=1.0)
    model = regression_net(keras_accum.AccumModel, accum_steps=4, noise_scale=True)
    for _ in range(4):
        model.train_on_batch(x[:8] * 10, y[:8])  # one window, far from the rest
    assert int(model.optimizer.iterations) == 1
    logged = _fit_estimates(model, x, y, 8, epochs=1)
    grads = per_example_gradients(model, x, y)
    np.testing.assert_allclose(logged, [estimate(grads, windows_of(92, 8, 4))], rtol=RTOL)


def test_config_and_saved_file_keep_noise_scale(tmp_path):
    model = regression_net(keras_accum.AccumModel, accum_steps=4, noise_scale=True)
    config = model.get_config()
    assert config["noise_scale"] is True
    assert "noise_scale" not in regression_net(keras_accum.AccumModel).get_config()
    clone = keras_accum.AccumModel.from_config(config)
    assert internals.settings(clone).noise_scale
    x, y = regression_data(92, noise=1.0)
    model.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    path = str(tmp_path / "m.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    loaded.compile(keras.optimizers.SGD(0.0), "mse")
    history = loaded.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    np.testing.assert_allclose(history.history["noise_scale"], [model.noise_scale], rtol=RTOL)
    # The file is the unwrapped model's: no measurement in it.
    plain = regression_net(keras_accum.AccumModel, accum_steps=4)
    plain.fit(x, y, batch_size=8, verbose=0)
    plain_path = str(tmp_path / "plain.keras")
    plain.save(plain_path)
    import zipfile

    with zipfile.ZipFile(path) as a, zipfile.ZipFile(plain_path) as b:
        assert sorted(a.namelist()) == sorted(b.namelist())


@pytest.mark.parametrize("value, error", [("yes", TypeError), (1, TypeError), (None, TypeError)])
@pytest.mark.unit
def test_bad_noise_scale_is_refused_naming_it(value, error):
    with pytest.raises(error, match=r"noise_scale.*Received: noise_scale="):
        functional(keras_accum.AccumModel, noise_scale=value)
    with pytest.raises(error, match=r"noise_scale.*Received: noise_scale="):
        keras_accum.wrap(functional(), noise_scale=value)


# -- AccumScheduler("noise_scale") -----------------------------------------------


def _batches(changes, n, micro_batch, epochs, accum_steps):
    """The (start, stop) of each update's samples, epoch after epoch, with
    `accum_steps` from `changes[update]` after that many updates."""
    batches = []
    for _ in range(epochs):
        start = 0
        while start < n:
            stop = min(n, start + micro_batch * accum_steps)
            batches.append((start, stop))
            start = stop
            accum_steps = changes.get(len(batches), accum_steps)
    return batches


def _plain_fed(path, x, y, micro, epochs, make_optimizer, start=2, **compile_kwargs):
    """A plain model fed the batches and rates of a schedule's `path`, as
    (updates, accum_steps, learning_rate) rows; and those batches."""
    batches = _batches({u: steps for u, steps, _ in path}, len(x), micro, epochs, start)
    rates = {u: rate for u, _, rate in path if rate is not None}
    plain = regression_net()
    plain.compile(make_optimizer(), "mse", **compile_kwargs)
    for update, (first, stop) in enumerate(batches):
        if update in rates:
            plain.optimizer.learning_rate = rates[update]
        plain.train_on_batch(x[first:stop], y[first:stop])
    return plain, batches


def _rows(path):
    return [(d.updates, d.accum_steps, d.learning_rate) for d in path]


@pytest.mark.parametrize(
    "rule, optimizer, every, way",
    [
        ("sqrt", "adam", dict(every_updates=3), "functional"),
        # 40 samples fall inside a window: the decision waits for its end.
        ("adascale", "sgd", dict(every_samples=40), "functional"),
        # Keras's default on one GPU: each value's step compiled by XLA; a
        # wrapped model, recompiled before fit (14 s: the slow tier).
        pytest.param(
            "sqrt", "adam", dict(every_updates=3), "wrap_xla_recompiled", marks=pytest.mark.slow
        ),
        # Decisions on a probe's estimate (the window outgrown), which the rule
        # follows too; measuring on it trains nothing.
        ("adascale", "sgd", dict(every_updates=3), "functional_probe"),
    ],
)
def test_deciding_every_k_updates_is_a_plain_model_fed_those_batches_and_rates(
    rule, optimizer, every, way
):
    # Learning rate > 0: the noise scale changes as the model trains.
    x, y = regression_data(344, noise=4.0)
    micro, cap, epochs, tuned = 8, 12, 3, dict(adam=0.05, sgd=0.02)[optimizer]
    make = dict(adam=keras.optimizers.Adam, sgd=keras.optimizers.SGD)[optimizer]
    compile_kwargs, probe = {}, {}
    if way.startswith("functional"):
        model = regression_net(keras_accum.AccumModel, accum_steps=2, noise_scale=True)
        if way == "functional_probe":
            probe = dict(probe=regression_data(512, noise=4.0, seed=5), probe_windows=4)
    else:
        compile_kwargs = dict(jit_compile=True)
        model = keras_accum.wrap(regression_net(), accum_steps=2, noise_scale=True)
        model.compile(make(1.0), "mae")
    model.compile(make(tuned), "mse", **compile_kwargs)
    scheduler = keras_accum.AccumScheduler(
        "noise_scale", max_accum_steps=cap, learning_rate_rule=rule, **every, **probe
    )
    history = model.fit(
        x, y, batch_size=micro, epochs=epochs, shuffle=False, verbose=0, callbacks=[scheduler]
    ).history
    path = scheduler.path
    steps = [d.accum_steps for d in path]
    assert steps[-1] > 2 and steps == sorted(steps), steps  # it grew, never shrank
    # Probed while below the cap and the window outgrown, never after.
    assert any(d.probed for d in path) == bool(probe), path
    for in_force, d in zip([2] + steps, path):
        assert not (d.probed and in_force == cap), d  # nothing left to decide
        assert not d.probed or d.estimate.windows == 4, d
    assert all(b <= 2 * a for a, b in zip([2] + steps, steps)), steps  # doubling at most
    # Every 3 updates, or at the first window's end after 40 samples; the
    # first decisions sooner: the gap is half the fit so far, from a third
    # of that (at least 1) up.
    n_updates = int(model.optimizer.iterations)
    if "every_updates" in every:
        expected, last = [], 0
        for update in range(1, n_updates + 1):  # each update ends a window
            if update - last >= min(3, max(1, update // 2)):
                expected.append(update)
                last = update
        assert [d.updates for d in path] == expected
        assert np.diff(expected)[-5:].tolist() == [3] * 5
    else:
        previous = [0] + [d.samples for d in path]
        for before, d, window in zip(previous, path, [2] + steps):
            gap, due = d.samples - before, min(40, max(40 // 3, d.samples // 2))
            assert due <= gap, (d, before)
            if d.samples // len(x) == before // len(x):  # an epoch's end flushes a short window
                assert gap < due + micro * window, (d, before)
    plain, batches = _plain_fed(
        _rows(path), x, y, micro, epochs, lambda: make(tuned), **compile_kwargs
    )
    assert len(batches) == n_updates
    # Some change came mid-epoch (at a window's end, not an epoch's).
    changes = [
        d
        for prev, d in zip([None] + path, path)
        if d.accum_steps != (prev.accum_steps if prev else 2)
    ]
    assert any(batches[d.updates - 1][1] != len(x) for d in changes), changes
    # Each change set the rate by the rule, from the tuned rate at batch 16.
    for d in path:
        if d.learning_rate is not None:
            factor = keras_accum.growth.rate_rules.RULES[rule](
                micro * d.accum_steps, 16, d.estimate
            )
            assert d.learning_rate == pytest.approx(tuned * factor, rel=1e-6)
    # The same training as a plain model fed those batches at those rates.
    for a, b in zip(model.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert n_updates == int(plain.optimizer.iterations)
    # For this fit only: the model's own accum_steps and the tuned rate back.
    assert model.accum_steps == 2
    assert float(model.optimizer.learning_rate) == pytest.approx(tuned)
    assert history["accum_steps"][-1] == steps[-1]


def test_the_scheduler_needs_a_measuring_model():
    x, y = regression_data(92, noise=1.0)
    model = regression_net(keras_accum.AccumModel, accum_steps=2)
    with pytest.raises(ValueError, match="noise_scale=True"):
        model.fit(
            x,
            y,
            batch_size=8,
            verbose=0,
            callbacks=[keras_accum.AccumScheduler("noise_scale", max_accum_steps=4)],
        )
    assert int(model.optimizer.iterations) == 0


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(schedule="noise_scale"), ValueError, r"needs `max_accum_steps`.*None"),
        (dict(schedule="noise_scale", max_accum_steps=0), ValueError, "max_accum_steps=0"),
        (dict(schedule="noise_scale", max_accum_steps=2.0), TypeError, "max_accum_steps=2.0"),
        (dict(schedule={0: 2}, max_accum_steps=4), ValueError, "max_accum_steps=4"),
        (dict(schedule="noise"), TypeError, r'must be "noise_scale".*noise'),
    ],
)
@pytest.mark.unit
def test_bad_scheduler_arguments_are_refused_naming_them(kwargs, error, match):
    with pytest.raises(error, match=match):
        keras_accum.AccumScheduler(**kwargs)


# -- under MirroredStrategy ---------------------------------------------------


# Dozens of trainings under a strategy in one fixture: two replicas in the
# slow tier (CI runs it once), one replica (two replicas' code with one
# component) before a release.
@pytest.fixture(
    scope="module",
    params=[pytest.param(1, marks=pytest.mark.release), pytest.param(2, marks=pytest.mark.slow)],
    ids=["one_replica", "two_replicas"],
)
def mirrored(request):
    from helpers import mirrored as mirrored_runs

    out = mirrored_runs.noise_checks(request.param)
    assert out["replicas"] == request.param
    return out


@pytest.mark.parametrize("config", ["step mode", "micro_batch_size", "both", "auto", "sparse"])
def test_under_mirrored_strategy_each_replicas_share_is_a_micro_batch(mirrored, config):
    # b is the per-replica micro-batch, B the global window.
    result = mirrored["estimates"][config]
    if result["expected"] is None:  # one replica, whole batches: one micro-batch
        assert all(math.isnan(v) for v in result["logged"])
        return
    np.testing.assert_allclose(result["logged"], [result["expected"]] * 2, rtol=RTOL)
    assert result["last"] == result["logged"][-1]


@pytest.mark.parametrize("config", ["step mode", "micro_batch_size", "both", "auto"])
def test_under_mirrored_strategy_training_is_bit_identical(mirrored, config):
    result = mirrored["identical"][config]
    assert result["weights"] and result["history"]
    assert result["iterations"][0] == result["iterations"][1] > 0
    # Measured every epoch (inf is a measurement: the noise dominates).
    assert not any(math.isnan(v) for v in result["noise_scale"])


@pytest.mark.parametrize("run_name", ["schedule", "schedule_probe"])
def test_under_mirrored_strategy_the_schedule_is_a_plain_model_fed_its_batches(mirrored, run_name):
    from helpers.mirrored import SCHEDULE_MICRO, SCHEDULE_N, SCHEDULE_TUNED

    run = mirrored[run_name]
    steps = [accum_steps for _, accum_steps, _ in run["path"]]
    assert steps[-1] > 2, run["path"]  # it grew
    assert any(run["probed"]) == (run_name == "schedule_probe"), run
    if run_name == "schedule_probe":
        # The probe measures the trained weights as on one device.
        strategy_value, one_device = run["probe_values"]
        assert strategy_value == pytest.approx(one_device, rel=RTOL)
    x, y = regression_data(SCHEDULE_N, noise=4.0)
    plain, batches = _plain_fed(
        run["path"], x, y, SCHEDULE_MICRO, 3, lambda: keras.optimizers.Adam(SCHEDULE_TUNED)
    )
    assert run["iterations"] == len(batches)
    # Samples counted globally (the model sees each replica's share).
    trained = np.cumsum([stop - first for first, stop in batches])
    assert run["samples"] == [int(trained[u - 1]) for u, _, _ in run["path"]]
    for a, b in zip(run["weights"], plain.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def _resumable(way, rate):
    """The resume tests' model: functional or wrapped, Adam at a number or
    at a SampleSchedule."""
    if way == "wrap":
        model = keras_accum.wrap(regression_net(), accum_steps=2, noise_scale=True)
    else:
        model = regression_net(keras_accum.AccumModel, accum_steps=2, noise_scale=True)
    schedule = keras.optimizers.schedules.ExponentialDecay(0.05, 30, 0.5)
    model.compile(
        keras.optimizers.Adam(0.05 if rate == "number" else keras_accum.SampleSchedule(schedule)),
        "mse",
    )
    return model


def _resumable_scheduler():
    return keras_accum.AccumScheduler(
        "noise_scale", max_accum_steps=12, every_updates=3, learning_rate_rule="sqrt"
    )


@pytest.mark.parametrize(
    "order, rate",
    [
        pytest.param("scheduler_first", "number", marks=pytest.mark.slow),
        ("backup_first", "number"),
        # A SampleSchedule's count is not an optimizer variable: the
        # scheduler's state brings it back (from a .keras file in the inner
        # loop, below).
        pytest.param("scheduler_first", "sample_schedule", marks=pytest.mark.slow),
    ],
)
def test_a_schedule_resumed_from_a_backup_continues_exactly(tmp_path, order, rate):
    from helpers.training import InterruptAt

    x, y = regression_data(344, noise=4.0)
    fit = dict(batch_size=8, epochs=3, shuffle=False, verbose=0)

    def compiled():
        return _resumable("functional", rate)

    def callbacks(scheduler, *more):
        backup = keras_accum.BackupAndRestore(str(tmp_path / "backup"), save_freq=7)
        pair = [scheduler, backup] if order == "scheduler_first" else [backup, scheduler]
        return pair + list(more)

    scheduler = _resumable_scheduler

    reference, uninterrupted = compiled(), scheduler()
    reference.fit(x, y, callbacks=[uninterrupted], **fit)
    with pytest.raises(KeyboardInterrupt):
        # Epoch 2, batch 24: the last backup (after batch 21) is mid-window,
        # two windows after a decision, after the batch grew and the rate
        # moved: the open window, the windows since the decision and the
        # smoothed estimate must all come back.
        compiled().fit(x, y, callbacks=callbacks(scheduler(), InterruptAt(1, 23)), **fit)
    model, resumed = compiled(), scheduler()  # as a new process would
    model.fit(x, y, callbacks=callbacks(resumed), **fit)
    assert resumed.path and resumed.path[0].updates > 3
    later = [d for d in uninterrupted.path if d.updates >= resumed.path[0].updates]
    assert [(d.updates, d.accum_steps, d.learning_rate) for d in resumed.path] == [
        (d.updates, d.accum_steps, d.learning_rate) for d in later
    ]
    np.testing.assert_allclose(
        [d.estimate.value for d in resumed.path], [d.estimate.value for d in later], rtol=1e-9
    )
    for a, b in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    assert float(model.optimizer.learning_rate) == pytest.approx(
        float(reference.optimizer.learning_rate)
    )


# A number rate resumed is the backup's test's in the inner loop.
@pytest.mark.parametrize(
    "way, rate",
    [pytest.param("functional", "number", marks=pytest.mark.slow), ("wrap", "sample_schedule")],
)
def test_a_schedule_resumed_from_a_keras_file_continues_exactly(tmp_path, way, rate):
    # ModelCheckpoint writes a .keras file at each epoch's end, mid-fit: the
    # schedule's state rides in the model's config, and the first fit of the
    # model loaded from it continues the schedule and the rate.
    from helpers.training import InterruptAt

    x, y = regression_data(344, noise=4.0)
    fit = dict(batch_size=8, epochs=4, shuffle=False, verbose=0)
    path = str(tmp_path / "checkpoint.keras")

    def compiled():
        return _resumable(way, rate)

    scheduler = _resumable_scheduler

    reference, uninterrupted = compiled(), scheduler()
    reference.fit(x, y, callbacks=[uninterrupted], **fit)
    with pytest.raises(KeyboardInterrupt):
        compiled().fit(
            x,
            y,
            callbacks=[scheduler(), keras.callbacks.ModelCheckpoint(path), InterruptAt(2, 3)],
            **fit,
        )
    model, resumed = keras.saving.load_model(path), scheduler()  # as a new process would
    # A file written mid-fit holds the value in force (its window's).
    assert model.accum_steps == [d for d in uninterrupted.path if d.epoch < 2][-1].accum_steps
    model.fit(x, y, initial_epoch=2, callbacks=[resumed], **fit)
    later = [d for d in uninterrupted.path if d.epoch >= 2]
    assert later and [(d.updates, d.accum_steps) for d in resumed.path] == [
        (d.updates, d.accum_steps) for d in later
    ]
    np.testing.assert_allclose(
        [d.learning_rate or 0 for d in resumed.path],
        [d.learning_rate or 0 for d in later],
        rtol=1e-6,
    )
    np.testing.assert_allclose(
        [d.estimate.value for d in resumed.path], [d.estimate.value for d in later], rtol=1e-6
    )
    for a, b in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(
        float(model.optimizer.learning_rate), float(reference.optimizer.learning_rate), rtol=1e-6
    )
    # Handed over once: a later fit of the loaded model starts afresh.
    again = scheduler()
    model.fit(x, y, batch_size=8, epochs=1, callbacks=[again], shuffle=False, verbose=0)
    # (Its first decision at its first window's end: a fit's first gap.)
    assert again.path[0].updates == int(reference.optimizer.iterations) + 1


@pytest.mark.parametrize("replicas", [1, 2])
@pytest.mark.unit
def test_a_backup_keeps_the_open_windows_measure_on_one_replica_only(replicas):
    # Across replicas each holds a share: a backup leaves the window out.
    from helpers.replicas import mirrored
    from keras_accum.window.noise_scale import NoiseScale

    noise = NoiseScale()
    noise.build(mirrored(replicas))
    assert (noise.open_window() is None) == (replicas == 2)
