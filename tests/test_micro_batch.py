"""`micro_batch_size`: each batch split inside the step is the big batch's training."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_accum
from helpers import internals, training
from helpers.assertions import (
    FLOAT16_ATOL,
    FLOAT16_RTOL,
    assert_history_close,
    assert_no_open_window,
    assert_trained,
    assert_weights_close,
)
from helpers.data import CLASSES, FEATURES, bn_data, make_data, sequences
from helpers.models import (
    OPTIMIZERS,
    WAYS_IN,
    Gate,
    bn_net,
    functional,
    initial_weights,
    loss,
    mlp,
    moving,
    per_sample_model,
    tagger,
    token_loss,
)
from helpers.tiers import wide
from keras_accum import AccumModel

# 76 samples at batch 32: batches of 32, 32 and 12. Micro-batches of 8 cut
# the last batch into 8 + 4 (and two empty ones: the step is traced for
# batches of 32); 12 does not divide 32 (12 + 12 + 8, last batch 12).
SAMPLES = 76
FIT = dict(epochs=2, shuffle=False, verbose=0)


def fit_pair(make_accum, make_plain, x, y, batch, accum_batch, optimizer="adam", fit_kwargs=None):
    """The plain model on `batch`, the accumulating one on `accum_batch`."""
    return training.fit_pair(
        make_accum,
        make_plain,
        x,
        y,
        OPTIMIZERS[optimizer],
        big_batch=batch,
        accum_batch=accum_batch,
        fit_kwargs=fit_kwargs,
        metrics=["accuracy"],
    )


def assert_same_training(plain, acc, plain_history, acc_history, rtol=1e-5, atol=1e-6):
    assert_weights_close(plain, acc, rtol, atol)
    assert int(acc.optimizer.iterations) == int(plain.optimizer.iterations)
    assert_history_close(plain_history, acc_history, rtol, atol)


# (micro_batch_size, accum_steps, batch fit draws): the plain model trains on
# batches of 32 in every case.
SPLITS = {
    "even": (8, 1, 32),
    "not_dividing": (12, 1, 32),
    "with_accum_steps": (8, 2, 16),
}


# The functional model's splits are in test_sample_weighted_loss (micro 8,
# accum 2) and test_optimizers; its cases here are in the slow tier.
WAYS_KEPT = ("subclass",)

# Every way in on the even split; the others on one of each kind of model
# (functional, subclassed, wrapped subclassed), to keep the suite fast. The
# inner loop: the wrapped subclass on the even split, the subclass on the
# others.
CASES = [
    (way, "even") if way == "wrap_subclassed" else pytest.param(way, "even", marks=pytest.mark.slow)
    for way in sorted(WAYS_IN)
] + wide(
    # The wrapped model's other splits in the slow tier.
    [
        (way, split)
        for split in ("not_dividing", "with_accum_steps")
        for way in ("functional", "subclass", "wrap_subclassed")
    ],
    [(way, split) for split in ("not_dividing", "with_accum_steps") for way in WAYS_KEPT],
)


@pytest.mark.parametrize("way,split", CASES)
def test_matches_the_big_batch(way, split):
    micro, accum_steps, batch = SPLITS[split]
    x, y = make_data(SAMPLES)
    val = make_data(20, seed=3)
    make_accum, make_plain = WAYS_IN[way](micro_batch_size=micro, accum_steps=accum_steps)
    initial = initial_weights(make_plain, x)
    plain, acc, hp, ha = fit_pair(
        make_accum, make_plain, x, y, 32, batch, fit_kwargs={"validation_data": val}
    )
    assert_trained(plain, initial)
    assert_same_training(plain, acc, hp, ha)
    # One update per batch of 32 (the last window of each epoch applied when
    # the epoch ends): 3 per epoch.
    assert int(acc.optimizer.iterations) == 6


# sgd_momentum (slow) is sgd_piecewise without its schedule.
@pytest.mark.parametrize(
    "optimizer",
    wide(
        ["sgd_momentum", "adam_global_clipnorm", "sgd_piecewise"],
        ["adam_global_clipnorm", "sgd_piecewise"],
    ),
)
def test_optimizers(optimizer):
    x, y = make_data(SAMPLES)
    make_accum, make_plain = WAYS_IN["functional"](micro_batch_size=8)
    assert_same_training(*fit_pair(make_accum, make_plain, x, y, 32, 32, optimizer))


def gated(cls=keras.Model, **kwargs):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((FEATURES,))
    h = Gate()(keras.layers.Dense(16, activation="tanh")(inputs))
    return cls(inputs, keras.layers.Dense(CLASSES)(h), **kwargs)


def test_a_scalar_weight_trains_as_the_big_batch():
    # A split sums a sparse gradient by the rows of its variable: a scalar
    # has none (an IndexError here once), and its gradient is summed as any.
    x, y = make_data(SAMPLES)
    trained = fit_pair(lambda: gated(AccumModel, micro_batch_size=8), gated, x, y, 32, 32)
    assert_same_training(*trained)
    gate = next(layer for layer in trained.accum.layers if isinstance(layer, Gate))
    assert float(gate.alpha.numpy()) != 1.0  # learnt


def test_a_static_batch_size_is_split_statically():
    # drop_remainder: the traced step knows the batch size (no hint needed).
    x, y = make_data(SAMPLES)

    def dataset(batch):
        return tf.data.Dataset.from_tensor_slices((x, y)).batch(batch, drop_remainder=True)

    plain = functional()
    plain.compile(OPTIMIZERS["adam"](), loss(), metrics=["accuracy"])
    hp = plain.fit(dataset(32), epochs=2, shuffle=False, verbose=0)
    acc = functional(AccumModel, micro_batch_size=12)
    acc.compile(OPTIMIZERS["adam"](), loss(), metrics=["accuracy"])
    ha = acc.fit(dataset(32), epochs=2, shuffle=False, verbose=0)
    assert_same_training(plain, acc, hp, ha)


def _outputs_of_the_step(model, batch):
    x, y = make_data(batch)
    model.train_on_batch(x, y)  # builds the model and the step
    spec = (tf.TensorSpec((batch, x.shape[1])), tf.TensorSpec((batch,), tf.int64))
    graph = tf.function(model.train_step).get_concrete_function(spec).graph
    return [t.shape.as_list() for op in graph.get_operations() for t in op.outputs]


@pytest.mark.parametrize("override", [False, True], ids=["keras_metrics", "own_compute_metrics"])
def test_metrics_are_updated_per_micro_batch_not_on_the_whole_batchs_predictions(override):
    # A language model's predictions of the whole batch (batch x tokens x
    # vocabulary) were a split step's largest tensor, kept for its metrics
    # (split/metrics.py). The logged metrics are the big batch's: the tests
    # above. A model's own `compute_metrics` still gets the whole batch.
    class Own(AccumModel):
        def compute_metrics(self, x, y, y_pred, sample_weight=None):
            return super().compute_metrics(x, y, y_pred, sample_weight)

    model = functional(Own if override else AccumModel, micro_batch_size=8)
    model.compile(OPTIMIZERS["adam"](), loss(), metrics=["accuracy"])
    whole_batch = [32, model.output_shape[-1]]
    assert (whole_batch in _outputs_of_the_step(model, 32)) == override


def test_a_stand_in_past_a_short_batchs_end_updates_no_metric():
    # 76 samples at 32: the last batch (12) is cut into 8 + 4 and two
    # stand-ins of its last sample, not live. A metric of each update's mean
    # is NaN on no rows; a stand-in's update must leave every metric as it was.
    def mean_prediction(y_true, y_pred):
        return keras.ops.mean(y_pred)  # one value per update, not per sample

    model = functional(AccumModel, micro_batch_size=8)
    model.compile(
        OPTIMIZERS["adam"](),
        loss(),
        metrics=[keras.metrics.MeanMetricWrapper(mean_prediction, name="mean_prediction")],
    )
    history = model.fit(*make_data(SAMPLES), batch_size=32, **FIT)
    assert np.all(np.isfinite(history.history["mean_prediction"])), history.history


# -- losses ---------------------------------------------------------------------


@pytest.mark.parametrize("accum_steps,batch", [(1, 16), (2, 8)])
def test_masked_token_loss(accum_steps, batch):
    # Sorted by length: micro-batches of very different token counts; the
    # update and the logged loss divide by the batch's real tokens. The
    # embedding's gradients are sparse (tf.IndexedSlices): concatenated
    # across micro-batches, as the big batch's rows are.
    x, y = sequences(40)
    plain = tagger()
    initial = plain.get_weights()
    plain.compile(keras.optimizers.SGD(0.5, momentum=0.9), token_loss(), metrics=["accuracy"])
    hp = plain.fit(x, y, batch_size=16, **FIT)
    acc = tagger(AccumModel, micro_batch_size=4, accum_steps=accum_steps)
    acc.compile(keras.optimizers.SGD(0.5, momentum=0.9), token_loss(), metrics=["accuracy"])
    ha = acc.fit(x, y, batch_size=batch, **FIT)
    assert_trained(plain, initial)
    if accum_steps == 1:
        assert_same_training(plain, acc, hp, ha)
    else:
        # Across the steps of a window Keras's loss tracker weighs each
        # step's loss by its samples, not its tokens (as in step mode):
        # the logged loss is not the big batch's there, the training is.
        assert_weights_close(plain, acc)
        assert int(acc.optimizer.iterations) == int(plain.optimizer.iterations)


@pytest.mark.parametrize("accum_steps,batch", [(1, 32), (2, 16)])
def test_sample_weighted_loss(accum_steps, batch):
    x, y = make_data(SAMPLES)
    # Weights concentrated in a few micro-batches: their sums differ widely.
    sw = np.where(np.arange(SAMPLES) % 16 < 3, 5.0, 0.1).astype("float32")
    compile_kwargs = dict(
        loss=token_loss(reduction="mean_with_sample_weight"),
        weighted_metrics=["accuracy"],
    )
    fit = dict(FIT, sample_weight=sw)
    plain = per_sample_model()
    plain.compile(OPTIMIZERS["adam"](), **compile_kwargs)
    hp = plain.fit(x, y, batch_size=32, **fit)
    acc = per_sample_model(AccumModel, micro_batch_size=8, accum_steps=accum_steps)
    acc.compile(OPTIMIZERS["adam"](), **compile_kwargs)
    ha = acc.fit(x, y, batch_size=batch, **fit)
    assert_same_training(plain, acc, hp, ha)


def test_mixed_float16():
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        x, y = make_data(SAMPLES)
        plain = mlp()
        plain.compile(OPTIMIZERS["adam"](), loss())
        plain.fit(x, y, batch_size=32, **FIT)
        acc = mlp(AccumModel, micro_batch_size=8)
        acc.compile(OPTIMIZERS["adam"](), loss())
        acc.fit(x, y, batch_size=32, **FIT)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert isinstance(acc.optimizer, keras.optimizers.LossScaleOptimizer)
    # float16 activations round at ~5e-4, and the micro-batches' reductions
    # round differently from the big batch's: weights agree to float16.
    assert_weights_close(plain, acc, FLOAT16_RTOL, FLOAT16_ATOL)
    assert float(acc.optimizer.dynamic_scale) == float(plain.optimizer.dynamic_scale)
    assert int(acc.optimizer.iterations) == int(plain.optimizer.iterations)


def test_skip_nonfinite_skips_the_batch():
    # A NaN sample in the second batch of 32: that update is skipped, the
    # others are the big batch's.
    x, y = make_data(SAMPLES)
    x_nan = x.copy()
    x_nan[40, 0] = np.nan
    plain = functional()
    plain.compile(OPTIMIZERS["adam"](), loss())
    for _ in range(2):
        for batch in (slice(0, 32), slice(64, 76)):
            plain.train_on_batch(x[batch], y[batch])
    acc = functional(AccumModel, micro_batch_size=8, skip_nonfinite=True)
    acc.compile(OPTIMIZERS["adam"](), loss())
    history = acc.fit(x_nan, y, batch_size=32, **FIT)
    assert_weights_close(plain, acc)
    assert acc.skipped_windows == 2 and history.history["skipped_windows"] == [1, 2]
    assert int(acc.optimizer.iterations) == 4


# -- BatchNormalization -------------------------------------------------------


# In the inner loop, test_combinations'
# test_micro_batches_with_batchnorm_and_a_schedule splits at accum_steps 1,
# then 2, against step mode and the plain moving statistics.
@pytest.mark.slow
@pytest.mark.parametrize("accum_steps", [1, 2])
def test_batchnorm_is_the_step_mode_window(accum_steps):
    # Each micro-batch is normalised with its own moments, as in step mode
    # (not the big batch's); the moving statistics are pooled over the
    # update's samples. So splitting inside the step trains exactly as
    # step-mode accumulation over the same micro-batches.
    x, y = bn_data(SAMPLES)
    step = bn_net(AccumModel, accum_steps=4)
    step.compile(keras.optimizers.SGD(0.1), loss())
    step.fit(x, y, batch_size=8, **FIT)
    split = bn_net(AccumModel, micro_batch_size=8, accum_steps=accum_steps)
    split.compile(keras.optimizers.SGD(0.1), loss())
    split.fit(x, y, batch_size=32 // accum_steps, **FIT)
    assert_weights_close(step, split)
    for a, b in zip(moving(step), moving(split)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    plain = bn_net()
    assert np.abs(moving(split)[0] - moving(plain)[0]).min() > 0.5  # they moved


# -- saving -------------------------------------------------------------------------


# In the inner loop: test_combinations' micro-batches resumed from a batch
# backup, and test_window_state's micro-batch file restored and flushed.
@pytest.mark.slow
def test_resume_mid_window(tmp_path):
    # accum_steps=2 over batches of 16 split into 8s: a weights file saved
    # after an odd number of batches holds an open window.
    x, y = make_data(64)

    def compiled():
        model = functional(AccumModel, accum_steps=2, micro_batch_size=8)
        model.compile(OPTIMIZERS["adam"](), loss())
        # As for any Keras resume: the optimizer's variables exist to load into.
        model.optimizer.build(model.trainable_variables)
        return model

    def train(model, batches):
        for i in batches:
            model.train_on_batch(x[16 * i : 16 * i + 16], y[16 * i : 16 * i + 16])
        return model

    uninterrupted = train(compiled(), range(4))
    interrupted = train(compiled(), range(3))
    assert internals.pending(interrupted) == 1
    path = str(tmp_path / "m.weights.h5")
    interrupted.save_weights(path)
    resumed = compiled()
    resumed.load_weights(path)
    train(resumed, range(3, 4))
    assert_weights_close(uninterrupted, resumed)
    assert int(resumed.optimizer.iterations) == 2

    plain = functional()
    plain.compile(OPTIMIZERS["adam"](), loss())
    for i in range(2):
        plain.train_on_batch(x[32 * i : 32 * i + 32], y[32 * i : 32 * i + 32])
    assert_weights_close(plain, resumed)


@pytest.mark.unit
def test_config_round_trip():
    model = functional(AccumModel, accum_steps=2, micro_batch_size=8)
    clone = AccumModel.from_config(model.get_config())
    assert (clone.micro_batch_size, clone.accum_steps) == (8, 2)
    wrapped = keras_accum.wrap(keras.Sequential([keras.layers.Dense(2)]), micro_batch_size=4)
    assert type(wrapped).from_config(wrapped.get_config()).micro_batch_size == 4
    assert "micro_batch_size" not in functional(AccumModel).get_config()


# -- micro-batches are the size asked for -------------------------------------------


class AtMost(keras.layers.Layer):
    """The identity, failing the step if it sees more than `limit` samples."""

    def __init__(self, limit, **kwargs):
        super().__init__(**kwargs)
        self.limit = limit

    def call(self, x):
        check = tf.debugging.assert_less_equal(
            tf.shape(x)[0], self.limit, message="too many samples at once"
        )
        with tf.control_dependencies([check]):
            return tf.identity(x)


def limited(limit, cls=keras.Model, **kwargs):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6,))
    h = keras.layers.Dense(8, activation="tanh")(AtMost(limit)(inputs))
    return cls(inputs, keras.layers.Dense(3)(h), **kwargs)


def test_setting_micro_batch_size_changes_the_next_step():
    x, y = make_data(SAMPLES)
    model = limited(8, AccumModel, micro_batch_size=16)
    model.compile(OPTIMIZERS["adam"](), loss())
    with pytest.raises(tf.errors.InvalidArgumentError, match="too many samples"):
        model.fit(x, y, batch_size=32, **FIT)
    model.micro_batch_size = 8
    model.fit(x, y, batch_size=32, **FIT)
    model.fit(x, y, batch_size=32, micro_batch_size=4, **FIT)  # for one call
    assert model.micro_batch_size == 8
    model.fit(x, y, batch_size=32, **FIT)
    # A bigger batch after the first: a new split for it, still 8 at a time.
    model.fit(x, y, batch_size=64, **FIT)
    plain = limited(8)
    plain.compile(OPTIMIZERS["adam"](), loss())
    with pytest.raises(tf.errors.InvalidArgumentError, match="too many samples"):
        plain.fit(x, y, batch_size=32, **FIT)


# -- a step that fails part-way changes nothing ---------------------------------------


class FailsOn(keras.layers.Layer):
    """The identity, failing the step when a sample's first feature is huge."""

    def call(self, x):
        check = tf.debugging.assert_less(x[:, 0], 1e6, message="poisoned sample")
        with tf.control_dependencies([check]):
            return tf.identity(x)


class Snapshot(keras.callbacks.Callback):
    """Keeps `state()`'s values as they were after each batch."""

    def __init__(self, state):
        super().__init__()
        self.state = state
        self.values = None

    def on_train_batch_end(self, batch, logs=None):
        self.values = [v.numpy() for v in self.state()]


@pytest.mark.parametrize("accum_steps", [1, 2])
def test_a_step_failing_in_its_last_micro_batch_writes_no_state(accum_steps):
    # What an out-of-memory error in the last micro-batch would do: the
    # step fails after every other micro-batch's forward and backward pass
    # ran. Nothing may have been written: weights, optimizer, loss tracker,
    # metrics, the open window (accum_steps=2: batch 2 is a window's first),
    # BatchNormalization's moving statistics and pooled moments.
    x, y = bn_data(48)
    x[-1, 0] = 1e7  # the last sample of the third batch
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6,))
    h = keras.layers.BatchNormalization()(FailsOn()(inputs))
    outputs = keras.layers.Dense(3)(keras.layers.Dense(8, activation="tanh")(h))
    model = AccumModel(inputs, outputs, micro_batch_size=8, accum_steps=accum_steps)
    model.compile(OPTIMIZERS["adam"](), loss(), metrics=["accuracy"])

    def state():
        return [
            *model.weights,
            *model.optimizer.variables,
            *model.metrics_variables,
            *internals.window_variables(model),
        ]

    snapshot = Snapshot(state)
    with pytest.raises(tf.errors.InvalidArgumentError, match="poisoned sample"):
        model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0, callbacks=[snapshot])
    assert int(model.optimizer.iterations) == (2 if accum_steps == 1 else 1)
    assert len(snapshot.values) == len(state()) > 10
    for v, value in zip(state(), snapshot.values):
        np.testing.assert_array_equal(v.numpy(), value, err_msg=v.name)
    assert_no_open_window(model)


# -- bad input ------------------------------------------------------------------------

BAD = [
    (0, ValueError),
    (-8, ValueError),
    (True, TypeError),
    (8.0, TypeError),
    ("8", TypeError),
    ("AUTO", TypeError),
]


@pytest.mark.parametrize("value,error", BAD)
@pytest.mark.unit
def test_bad_micro_batch_size_in_constructor_and_wrap(value, error):
    message = rf"`micro_batch_size` must be.*Received: micro_batch_size={value!r}"
    with pytest.raises(error, match=message):
        functional(AccumModel, micro_batch_size=value)
    with pytest.raises(error, match=message):
        keras_accum.wrap(functional(), micro_batch_size=value)


@pytest.mark.parametrize("value,error", BAD[:3])
def test_bad_micro_batch_size_in_setter_and_fit_change_nothing(value, error):
    x, y = make_data(32)
    model = functional(AccumModel, micro_batch_size=8, accum_steps=2)
    model.compile(OPTIMIZERS["adam"](), loss())
    with pytest.raises(error, match=r"`micro_batch_size`"):
        model.micro_batch_size = value
    assert model.micro_batch_size == 8
    with pytest.raises(error, match=r"`micro_batch_size`"):
        model.fit(x, y, batch_size=16, verbose=0, micro_batch_size=value, accum_steps=4)
    assert (model.micro_batch_size, model.accum_steps) == (8, 2)
    assert not model.built or int(model.optimizer.iterations) == 0


@pytest.mark.unit
def test_auto_and_numpy_integers_are_accepted():
    assert functional(AccumModel, micro_batch_size="auto").micro_batch_size == "auto"
    size = functional(AccumModel, micro_batch_size=np.int64(8)).micro_batch_size
    assert size == 8 and type(size) is int


@pytest.mark.unit
@pytest.mark.parametrize("jit_compile", [False, True], ids=["graph", "xla"])
def test_a_micro_batch_waits_for_the_previous_one_without_a_changed_bit(jit_compile):
    # Under XLA a micro-batch waits by data (a zero it cannot fold, taken
    # away from each input): -0.0 stays -0.0, NaN and infinities in what it
    # waits for change nothing, integers and booleans pass as they are.
    from keras_accum.split import microbatch

    part = (
        tf.constant([-0.0, 0.0, 1.5, -np.inf, np.nan], tf.float32),
        tf.constant([-0.0, 2.0], tf.bfloat16),
        tf.constant([3, -4], tf.int32),
        tf.constant([True, False]),
        None,
    )
    previous = [tf.constant([np.nan, 1.0]), None, tf.constant([np.inf])]
    waited = tf.function(lambda p, x: microbatch.after(p, x), jit_compile=jit_compile)(
        previous, part
    )
    assert waited[4] is None
    for before, after in zip(part[:4], waited[:4]):
        assert after.dtype == before.dtype
        a = np.asarray(tf.cast(before, tf.float64) if before.dtype == tf.bfloat16 else before)
        b = np.asarray(tf.cast(after, tf.float64) if after.dtype == tf.bfloat16 else after)
        np.testing.assert_array_equal(a, b)
        if a.dtype.kind == "f":
            np.testing.assert_array_equal(np.signbit(a), np.signbit(b))
