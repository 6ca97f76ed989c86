"""`micro_batch_size="auto"`: a real out-of-memory error is survived by
retrying the same batch on smaller micro-batches, and the training is that
of the big batch.

The out-of-memory errors are real (tests/helpers/oom.py): `Limit` and
`LimitedLoss` ask TensorFlow for an impossible tensor whenever they see more
than `k` samples at once, so the allocator raises a genuine
`ResourceExhaustedError` on any machine, at once under the tests'
allocator (tests/conftest.py).
"""

import logging

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_accum
from helpers import internals, replicas
from helpers.assertions import assert_history_close, assert_trained, assert_weights_close
from helpers.data import CLASSES, FEATURES, make_data
from helpers.models import WAYS_IN, functional, initial_weights
from helpers.oom import Limit, LimitedLoss
from helpers.project import ROOT
from helpers.tiers import wide

B = 16  # the batch fit draws
K = 8  # the most samples the limited model holds at once


def plain_loss():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def adam():
    return keras.optimizers.Adam(0.01)


def fit_kwargs(**kwargs):
    return dict(epochs=2, shuffle=False, verbose=0, **kwargs)


def train_reference(make_plain, data, batch_size=B, **kwargs):
    plain = make_plain()
    plain.compile(adam(), plain_loss(), metrics=["accuracy"])
    history = plain.fit(*data, batch_size=batch_size, **fit_kwargs(**kwargs))
    return plain, history


def train_auto(make_accum, data, k=K, batch_size=B, **kwargs):
    model = make_accum()
    model.compile(adam(), LimitedLoss(k), metrics=["accuracy"])
    history = model.fit(*data, batch_size=batch_size, **fit_kwargs(**kwargs))
    return model, history


def assert_same_training(plain, h_plain, model, h_model):
    assert_weights_close(plain, model)
    assert_history_close(h_plain, h_model)
    assert int(model.optimizer.iterations) == int(plain.optimizer.iterations)


def test_limit_is_a_real_out_of_memory_error_for_plain_fit():
    x, y = make_data(2 * B)
    model = functional()
    model.compile(adam(), LimitedLoss(K))
    with pytest.raises(tf.errors.ResourceExhaustedError, match="OOM"):
        model.fit(x, y, batch_size=B, verbose=0)


# Every way in in the slow tier; the inner loop keeps the model fit builds.
@pytest.mark.parametrize("way", wide(sorted(WAYS_IN), ["subclass"]))
def test_auto_trains_as_the_big_batch_after_running_out_of_memory(way, caplog):
    make_accum, make_plain = WAYS_IN[way](micro_batch_size="auto")
    data = make_data(3 * B + K)  # 16, 16, 16, 8: a short last batch
    plain, h_plain = train_reference(make_plain, data)
    with caplog.at_level(logging.WARNING, logger="keras_accum"):
        model, h_model = train_auto(make_accum, data)
    assert_trained(plain, initial_weights(make_plain, data[0]))
    assert_same_training(plain, h_plain, model, h_model)
    assert model.micro_batch_size == "auto"
    # Halved once, at the first step, and kept for both epochs.
    assert model.chosen_micro_batch_size == K
    changes = [r for r in caplog.records if "ran out of memory" in r.getMessage()]
    assert len(changes) == 1
    assert f"micro_batch_size={K}" in changes[0].getMessage()


def test_auto_without_running_out_of_memory_keeps_whole_batches():
    make_accum, make_plain = WAYS_IN["functional"](micro_batch_size="auto")
    data = make_data(3 * B)
    plain, h_plain = train_reference(make_plain, data)
    model, h_model = train_auto(make_accum, data, k=B)
    assert_same_training(plain, h_plain, model, h_model)
    assert model.chosen_micro_batch_size is None


def _uneven_batches(x, y, sizes):
    """A dataset of batches of the given sizes, in order."""
    bounds = np.cumsum([0, *sizes])
    parts = [
        tf.data.Dataset.from_tensors((x[a:b], y[a:b])) for a, b in zip(bounds[:-1], bounds[1:])
    ]
    dataset = parts[0]
    for part in parts[1:]:
        dataset = dataset.concatenate(part)
    return dataset


@pytest.mark.slow  # each out-of-memory retry traces the step again: the slow tier
def test_out_of_memory_in_the_middle_of_an_epoch_is_recovered(caplog):
    # Whole batches fit until a bigger batch comes: its step runs out of
    # memory, is retried on micro-batches and nothing is lost or doubled.
    sizes = [K, K, B, K, B + K]
    x, y = make_data(sum(sizes))
    dataset = _uneven_batches(x, y, sizes)
    make_accum, make_plain = WAYS_IN["functional"](micro_batch_size="auto")
    plain = make_plain()
    plain.compile(adam(), plain_loss(), metrics=["accuracy"])
    h_plain = plain.fit(dataset, **fit_kwargs())
    model = make_accum()
    model.compile(adam(), LimitedLoss(K), metrics=["accuracy"])
    h_model = model.fit(dataset, **fit_kwargs())
    assert_same_training(plain, h_plain, model, h_model)
    assert int(plain.optimizer.iterations) == 2 * len(sizes)
    assert model.chosen_micro_batch_size == K
    # Kept for later fit calls, through a new compile (a new train function)
    # too: no step runs out of memory again.
    caplog.clear()
    model.compile(adam(), LimitedLoss(K))
    with caplog.at_level(logging.WARNING, logger="keras_accum"):
        model.fit(dataset, epochs=1, verbose=0)
    assert not [r for r in caplog.records if "ran out of memory" in r.getMessage()]
    assert model.chosen_micro_batch_size == K


@pytest.mark.slow  # each out-of-memory retry traces the step again: the slow tier
def test_auto_with_accum_steps():
    # Windows of 2 batches of 16, the last epoch's window a single batch
    # of 8: the reference is the plain model with batches of 32.
    make_accum, make_plain = WAYS_IN["functional"](micro_batch_size="auto", accum_steps=2)
    data = make_data(2 * 2 * B + K)
    plain, h_plain = train_reference(make_plain, data, batch_size=2 * B)
    model, h_model = train_auto(make_accum, data)
    assert_same_training(plain, h_plain, model, h_model)
    assert model.chosen_micro_batch_size == K


@pytest.mark.slow  # each out-of-memory retry traces the step again: the slow tier
def test_auto_halves_an_odd_batch_rounding_up():
    # 3 samples over a limit of 2: halved to 2 (micro-batches of 2 and 1),
    # not to 1, which would also fit but take a step per sample.
    make_accum, make_plain = WAYS_IN["functional"](micro_batch_size="auto")
    data = make_data(9)  # batches of 3, 3, 3
    plain, h_plain = train_reference(make_plain, data, batch_size=3)
    model, h_model = train_auto(make_accum, data, k=2, batch_size=3)
    assert_same_training(plain, h_plain, model, h_model)
    assert model.chosen_micro_batch_size == 2


# Both in the slow tier (13 s), with test_auto_replicas' strategies.
@pytest.mark.slow
@pytest.mark.parametrize("accum_steps", [1, 2])
def test_auto_under_a_one_replica_strategy(accum_steps):
    # MirroredStrategy() on a one-GPU or CPU-only machine: one replica,
    # where 'auto' trains as on one device, out-of-memory retry included.
    strategy = replicas.mirrored(1)
    make_accum, make_plain = WAYS_IN["functional"](micro_batch_size="auto", accum_steps=accum_steps)
    data = make_data(2 * 2 * B + K)
    plain, h_plain = train_reference(make_plain, data, batch_size=accum_steps * B)
    with strategy.scope():
        model = make_accum()
        model.compile(adam(), LimitedLoss(K), metrics=["accuracy"])
    h_model = model.fit(*data, batch_size=B, **fit_kwargs())
    assert_weights_close(plain, model)
    assert_history_close(h_plain, h_model)
    iterations = [int(m.optimizer.iterations.numpy()) for m in (plain, model)]
    assert iterations[0] == iterations[1]
    assert model.chosen_micro_batch_size == K


@pytest.mark.slow  # each out-of-memory retry traces the step again: the slow tier
def test_auto_with_steps_per_execution():
    # The out-of-memory step is the first of an execution of 3 batches.
    make_accum, make_plain = WAYS_IN["functional"](micro_batch_size="auto")
    data = make_data(4 * B + K)
    plain = make_plain()
    plain.compile(adam(), plain_loss(), metrics=["accuracy"], steps_per_execution=3)
    h_plain = plain.fit(*data, batch_size=B, **fit_kwargs())
    model = make_accum()
    model.compile(adam(), LimitedLoss(K), metrics=["accuracy"], steps_per_execution=3)
    h_model = model.fit(*data, batch_size=B, **fit_kwargs())
    assert_same_training(plain, h_plain, model, h_model)


@pytest.mark.slow  # each out-of-memory retry traces the step again: the slow tier
def test_micro_batch_of_one_still_out_of_memory_raises_the_error_saying_so():
    x, y = make_data(4)
    model = functional(keras_accum.AccumModel, micro_batch_size="auto")
    model.compile(adam(), LimitedLoss(0))
    with pytest.raises(tf.errors.ResourceExhaustedError) as raised:
        model.fit(x, y, batch_size=2, verbose=0)
    message = str(raised.value)
    assert "micro-batches of 1 sample" in message
    assert "OOM when allocating" in message  # the original error's text
    assert model.chosen_micro_batch_size == 1


def _state(model):
    """Every value training can change: weights, optimizer, metrics, the open
    window, the BatchNormalization windows."""
    variables = [
        *model.variables,
        *model.optimizer.variables,
        *model.metrics_variables,
        *internals.window_variables(model),
    ]
    return [v.numpy() for v in variables]


@pytest.mark.parametrize(
    "batchnorm, accum_steps",
    [
        ("window", 2),
        pytest.param("micro_batch", 2, marks=pytest.mark.slow),
        pytest.param("window", 1, marks=pytest.mark.slow),
    ],
)
def test_a_failed_attempt_changes_no_state(batchnorm, accum_steps):
    # BatchNormalization and Dropout before the point that runs out of memory
    # update their statistics and seed state in the forward pass, which a
    # failed step may already have run; every value must be as before the
    # attempt.
    keras.utils.set_random_seed(0)
    inputs = keras.Input((FEATURES,))
    h = keras.layers.Dense(8, name="hidden")(inputs)
    h = keras.layers.BatchNormalization(name="bn")(h)
    h = keras.layers.Dropout(0.5, name="dropout")(h)
    limit = Limit(K, name="limit")
    outputs = keras.layers.Dense(CLASSES)(limit(h))
    model = keras_accum.AccumModel(
        inputs,
        outputs,
        accum_steps=accum_steps,
        micro_batch_size="auto",
        batchnorm=batchnorm,
    )
    model.compile(adam(), plain_loss(), metrics=["accuracy"])
    x, y = make_data(2)
    model.train_on_batch(x[:1], y[:1])  # an update, or opens a window
    assert int(model.optimizer.iterations) == (accum_steps == 1)
    model.reset_metrics()  # as train_on_batch does before its step
    limit.k = 0  # now even one sample is too many
    model.make_train_function(force=True)  # traced again, with the new limit
    before = _state(model)
    with pytest.raises(tf.errors.ResourceExhaustedError):
        # Would update (or complete the window): the update is part of the
        # attempt.
        model.train_on_batch(x[1:], y[1:])
    after = _state(model)
    assert len(before) == len(after)
    for a, b in zip(before, after):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow  # each out-of-memory retry traces the step again: the slow tier
def test_save_resume_and_flush_in_auto_mode(tmp_path):
    # A window of 2 steps of 16 opened in one model (which runs out of
    # memory first), saved mid-window, resumed in a fresh model (which runs
    # out of memory again), completed; then a window of one step applied by
    # flush(). The reference: plain updates with 32 samples, then 16.
    x, y = make_data(3 * B)
    plain = functional()
    plain.compile(adam(), plain_loss())
    plain.train_on_batch(x[: 2 * B], y[: 2 * B])
    plain.train_on_batch(x[2 * B :], y[2 * B :])

    def auto_model():
        model = functional(keras_accum.AccumModel, accum_steps=2, micro_batch_size="auto")
        model.compile(adam(), LimitedLoss(K))
        return model

    first = auto_model()
    first.train_on_batch(x[:B], y[:B])
    assert first.chosen_micro_batch_size == K
    path = str(tmp_path / "mid_window.keras")
    first.save(path)
    resumed = keras.models.load_model(path, custom_objects={"LimitedLoss": LimitedLoss})
    assert resumed.micro_batch_size == "auto"
    assert internals.pending(resumed) == 1
    resumed.train_on_batch(x[B : 2 * B], y[B : 2 * B])
    assert int(resumed.optimizer.iterations) == 1
    resumed.train_on_batch(x[2 * B :], y[2 * B :])
    assert internals.pending(resumed) == 1
    resumed.flush()
    assert int(resumed.optimizer.iterations) == 2
    assert_weights_close(plain, resumed)


@pytest.mark.unit
def test_auto_config_round_trip():
    model = functional(keras_accum.AccumModel, micro_batch_size="auto")
    config = model.get_config()
    assert config["micro_batch_size"] == "auto"
    clone = keras_accum.AccumModel.from_config(config)
    assert clone.micro_batch_size == "auto"
    assert clone.chosen_micro_batch_size is None


def test_readme_auto_snippet_runs():
    import re

    readme = (ROOT / "README.md").read_text()
    block = next(
        b
        for b in re.findall(r"```python\n(.*?)```", readme, flags=re.S)
        if 'micro_batch_size="auto")' in b and "chosen_micro_batch_size" in b
    )
    x, y = make_data(2 * 256)
    keras.utils.set_random_seed(0)
    inputs = keras.Input((FEATURES,))
    outputs = keras.layers.Dense(CLASSES, activation="softmax")(inputs)
    namespace = {
        "keras_accum": keras_accum,
        "inputs": inputs,
        "outputs": outputs,
        "x_train": x,
        "y_train": y,
    }
    exec(block, namespace)
    model = namespace["model"]
    assert int(model.optimizer.iterations) == 2
    assert model.chosen_micro_batch_size is None


@pytest.mark.slow  # each out-of-memory retry traces the step again: the slow tier
def test_fit_argument_auto_for_one_call():
    make_accum, make_plain = WAYS_IN["functional"]()
    data = make_data(2 * B)
    plain, h_plain = train_reference(make_plain, data)
    model, h_model = train_auto(make_accum, data, micro_batch_size="auto")
    assert_same_training(plain, h_plain, model, h_model)
    assert model.chosen_micro_batch_size == K
    assert model.micro_batch_size is None  # for that call only
