"""Saving, exporting and resuming, pending window included."""

import os
import subprocess
import sys
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_accum
from helpers import internals
from helpers.assertions import assert_no_open_window, assert_weights_close
from helpers.data import FEATURES, bn_data, make_data
from helpers.models import bn_net, functional, loss, subclassed
from helpers.tiers import wide
from keras_accum import AccumModel

X, Y = make_data(64)
MICRO = 8


def micro_batch(i):
    return X[MICRO * i : MICRO * (i + 1)], Y[MICRO * i : MICRO * (i + 1)]


def compiled(model):
    model.compile(
        keras.optimizers.Adam(keras.optimizers.schedules.ExponentialDecay(0.02, 1, 0.7)),
        loss(),
        metrics=["accuracy"],
    )
    return model


def train(model, steps):
    for i in steps:
        model.train_on_batch(*micro_batch(i))
    return model


def uninterrupted(make=functional):
    """8 micro-batches at accum_steps=4: the run every resume must equal."""
    return train(compiled(make(AccumModel, accum_steps=4)), range(8))


def fresh(make=functional, accum_steps=4):
    model = compiled(make(AccumModel, accum_steps=accum_steps))
    model.optimizer.build(model.trainable_variables)  # as fit() would
    return model


def window_state(model):
    acc = internals.accumulator(model)
    return (
        acc.open_micro_batches(),
        float(acc.window_weight.numpy()),
        [b.numpy() for b in acc.acc_grads],
    )


def assert_same_window(a, b):
    (pa, wa, ga), (pb, wb, gb) = window_state(a), window_state(b)
    assert (pa, wa) == (pb, wb)
    for u, v in zip(ga, gb):
        np.testing.assert_array_equal(u, v)


MAKERS = {
    "functional": lambda cls=keras.Model, **kw: functional(cls, **kw),
    "subclassed": lambda cls=keras.Model, **kw: subclassed(cls, **kw),
    "wrap_functional": lambda cls=keras.Model, **kw: (
        keras_accum.wrap(functional(), **kw) if cls is AccumModel else functional()
    ),
    "wrap_subclassed": lambda cls=keras.Model, **kw: (
        keras_accum.wrap(subclassed(), **kw) if cls is AccumModel else subclassed()
    ),
}


# -- .keras files -------------------------------------------------------------------


# The subclassed model and its wrap in the inner loop; the
# functional ones, every other test's models, in the slow tier.
@pytest.mark.parametrize("kind", wide(sorted(MAKERS), ["subclassed", "wrap_subclassed"]))
def test_keras_file_round_trip_mid_window(kind, tmp_path):
    make = MAKERS[kind]
    model = train(compiled(make(AccumModel, accum_steps=4)), range(6))
    path = tmp_path / "m.keras"
    model.save(path)
    loaded = keras.models.load_model(path)  # no custom_objects
    assert isinstance(loaded, AccumModel) and loaded.accum_steps == 4
    assert loaded.compiled and int(loaded.optimizer.iterations) == 1
    assert [m.name for m in loaded.metrics] == [m.name for m in model.metrics]
    np.testing.assert_array_equal(loaded.predict(X, verbose=0), model.predict(X, verbose=0))
    assert_same_window(model, loaded)
    # Further training is the same training.
    for m in (model, loaded):
        train(m, range(6, 8))
        m.fit(X, Y, batch_size=MICRO, epochs=1, shuffle=False, verbose=0)
    assert_weights_close(model, loaded, rtol=0, atol=0)


# -- resuming a pending window ----------------------------------------------------


def test_tf_train_checkpoint_resumes_a_pending_window(tmp_path):
    model = train(compiled(functional(AccumModel, accum_steps=4)), range(6))
    prefix = tf.train.Checkpoint(model=model, optimizer=model.optimizer).save(
        str(tmp_path / "ckpt")
    )
    restored = fresh()
    tf.train.Checkpoint(model=restored, optimizer=restored.optimizer).restore(
        prefix
    ).assert_existing_objects_matched()
    train(restored, range(6, 8))
    assert int(restored.optimizer.iterations) == 2
    assert_weights_close(uninterrupted(), restored, rtol=0, atol=0)


def test_tf_train_checkpoint_into_an_untrained_model_restores_on_build(tmp_path):
    model = train(compiled(functional(AccumModel, accum_steps=4)), range(6))
    prefix = tf.train.Checkpoint(model=model, optimizer=model.optimizer).save(
        str(tmp_path / "ckpt")
    )
    restored = compiled(functional(AccumModel, accum_steps=4))  # nothing built
    tf.train.Checkpoint(model=restored, optimizer=restored.optimizer).restore(prefix)
    train(restored, range(6, 8))
    assert_weights_close(uninterrupted(), restored, rtol=0, atol=0)


@pytest.mark.parametrize("then", ["flush", "reset_window"])
def test_a_window_a_tf_train_checkpoint_restored_is_there_to_flush_or_discard(then, tmp_path):
    # Restored before the buffers exist (TensorFlow's deferred restoration),
    # the window must not wait for the next step to come back: flush()
    # applies it now, reset_window() drops it for good.
    model = train(compiled(functional(AccumModel, accum_steps=4)), range(6))
    prefix = tf.train.Checkpoint(model=model, optimizer=model.optimizer).save(
        str(tmp_path / "ckpt")
    )
    restored = fresh()
    tf.train.Checkpoint(model=restored, optimizer=restored.optimizer).restore(prefix)
    getattr(restored, then)()
    assert int(restored.optimizer.iterations) == (2 if then == "flush" else 1)
    train(restored, range(6, 10))  # a window of 4: one update either way
    expected = compiled(functional(AccumModel, accum_steps=4))
    train(expected, range(6))
    getattr(expected, then)()
    train(expected, range(6, 10))
    assert_weights_close(expected, restored, rtol=0, atol=0)


@pytest.mark.parametrize("suffix", [".weights.h5", ".keras"])
def test_load_weights_resumes_a_pending_window(suffix, tmp_path):
    model = train(compiled(functional(AccumModel, accum_steps=4)), range(6))
    path = str(tmp_path / f"m{suffix}")
    model.save_weights(path) if suffix == ".weights.h5" else model.save(path)
    restored = fresh()
    restored.load_weights(path)
    assert_same_window(model, restored)
    assert internals.accumulator(restored).window_length() == 4
    train(restored, range(6, 8))
    assert_weights_close(uninterrupted(), restored, rtol=0, atol=0)


@pytest.mark.parametrize("make", [functional, subclassed], ids=["functional", "subclassed"])
def test_load_weights_mid_window_into_a_model_not_trained_yet(make, tmp_path):
    # Compiled, never trained: its optimizer is not built. The file's
    # optimizer state (iterations, moments) must load all the same, or the
    # resumed run goes on from a fresh optimizer.
    model = train(compiled(make(AccumModel, accum_steps=4)), range(6))
    model.save_weights(tmp_path / "m.weights.h5")
    restored = compiled(make(AccumModel, accum_steps=4))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        restored.load_weights(tmp_path / "m.weights.h5")
    assert not [w for w in caught if "Skipping variable loading" in str(w.message)]
    assert int(restored.optimizer.iterations) == 1
    train(restored, range(6, 8))
    assert_weights_close(uninterrupted(make), restored, rtol=0, atol=0)
    # ... which is the big batch's: two updates of 32 samples.
    plain = compiled(make())
    for i in range(2):
        plain.train_on_batch(X[32 * i : 32 * i + 32], Y[32 * i : 32 * i + 32])
    assert_weights_close(plain, restored)


def test_load_weights_saved_before_training_leaves_the_optimizer_unbuilt(tmp_path):
    # Nothing of the optimizer's to load: no build, and no warning.
    compiled(functional(AccumModel, accum_steps=4)).save_weights(tmp_path / "m.weights.h5")
    restored = compiled(functional(AccumModel, accum_steps=4))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        restored.load_weights(tmp_path / "m.weights.h5")
    assert not [w for w in caught if "Skipping variable loading" in str(w.message)]
    assert not restored.optimizer.built
    train(restored, range(8))
    assert_weights_close(uninterrupted(), restored, rtol=0, atol=0)


def test_weights_files_interchange_with_a_plain_model(tmp_path):
    acc = train(compiled(functional(AccumModel, accum_steps=4)), range(6))
    acc.save_weights(tmp_path / "acc.weights.h5")
    plain = compiled(functional())
    plain.optimizer.build(plain.trainable_variables)
    plain.load_weights(tmp_path / "acc.weights.h5")  # the window is not its business
    np.testing.assert_array_equal(plain.predict(X, verbose=0), acc.predict(X, verbose=0))
    plain.save_weights(tmp_path / "plain.weights.h5")
    acc.load_weights(tmp_path / "plain.weights.h5")  # a plain file: no open window
    assert_no_open_window(acc)


# -- a different accum_steps ----------------------------------------------------------


def test_resuming_with_a_different_accum_steps_is_refused_until_resolved(tmp_path):
    model = train(compiled(functional(AccumModel, accum_steps=4)), range(6))
    model.save_weights(tmp_path / "m.weights.h5")
    restored = fresh(accum_steps=2)
    restored.load_weights(tmp_path / "m.weights.h5")
    before = restored.get_weights()
    with pytest.raises(ValueError, match=r"accumulated with accum_steps=4.*now has accum_steps=2"):
        restored.train_on_batch(*micro_batch(6))
    for a, b in zip(before, restored.get_weights()):
        np.testing.assert_array_equal(a, b)
    assert internals.pending(restored) == 2
    restored.accum_steps = 4  # finish the window as it began: no early update
    assert internals.pending(restored) == 2
    train(restored, range(6, 8))
    assert_weights_close(uninterrupted(), restored, rtol=0, atol=0)


def test_flush_resolves_a_window_of_another_length(tmp_path):
    model = train(compiled(functional(AccumModel, accum_steps=4)), range(6))
    model.save_weights(tmp_path / "m.weights.h5")
    restored = fresh(accum_steps=2)
    restored.load_weights(tmp_path / "m.weights.h5")
    restored.flush()
    model.flush()
    assert_weights_close(model, restored, rtol=0, atol=0)
    restored.train_on_batch(*micro_batch(6))  # now trains at accum_steps=2


# -- bad files leave the model as it was --------------------------------------------------


def _state(model):
    return [v.numpy() for v in model.weights + model.optimizer.variables], window_state(model)


def _assert_unchanged(model, state):
    values, window = state
    now, now_window = _state(model)
    for a, b in zip(values, now):
        np.testing.assert_array_equal(a, b)
    assert now_window[:2] == window[:2]


def test_mismatched_weights_file_leaves_the_model_unchanged(tmp_path):
    keras.utils.set_random_seed(1)
    inputs = keras.Input((FEATURES,))
    other = keras.Model(
        inputs, keras.layers.Dense(3, name="logits")(keras.layers.Dense(7, name="hidden")(inputs))
    )  # hidden layer of 7, not 16
    other.save_weights(tmp_path / "other.weights.h5")
    model = train(compiled(functional(AccumModel, accum_steps=4)), range(6))
    state = _state(model)
    with pytest.raises(ValueError, match=r"shape|expected"):
        model.load_weights(tmp_path / "other.weights.h5")
    _assert_unchanged(model, state)


def test_mismatched_window_leaves_the_model_unchanged(tmp_path):
    bigger = train(compiled(functional(AccumModel, accum_steps=4)), range(6))
    bigger.save_weights(tmp_path / "m.weights.h5")
    # Same layers, but only the output layer trainable: 2 buffers, not 4.
    model = functional(AccumModel, accum_steps=4)
    model.get_layer("hidden").trainable = False
    model = train(compiled(model), range(3))
    state = _state(model)
    with pytest.raises(ValueError, match=r"pending window does not fit|expected entries"):
        model.load_weights(tmp_path / "m.weights.h5")
    _assert_unchanged(model, state)


def test_a_failed_load_leaves_the_skipped_count_as_it_was(tmp_path):
    x, y = bn_data(48)
    x[8, 0] = np.nan  # the first window is skipped; 2 micro-batches pending
    model = bn_net(AccumModel, accum_steps=4, skip_nonfinite=True)
    model.compile(keras.optimizers.SGD(0.1), loss())
    model.fit(x, y, batch_size=MICRO, shuffle=False, verbose=0)
    assert model.skipped_windows == 1
    path = tmp_path / "m.weights.h5"
    model.save_weights(path)
    internals.break_after_the_skip_count(path, skipped=3)
    state = _state(model)
    with pytest.raises(ValueError, match=r"BatchNormalization|entries|expected"):
        model.load_weights(path)
    _assert_unchanged(model, state)
    assert model.skipped_windows == 1


def test_corrupted_weights_file_raises_and_leaves_the_model_unchanged(tmp_path):
    model = train(compiled(functional(AccumModel, accum_steps=4)), range(6))
    path = tmp_path / "m.weights.h5"
    model.save_weights(path)
    data = bytearray(path.read_bytes())
    data[len(data) // 2 :] = b"\0" * (len(data) - len(data) // 2)
    path.write_bytes(bytes(data))
    state = _state(model)
    with pytest.raises(Exception):
        model.load_weights(path)
    _assert_unchanged(model, state)


# -- callbacks -------------------------------------------------------------------


class Interrupt(keras.callbacks.Callback):
    def __init__(self, at_epoch, at_batch):
        super().__init__()
        self.at = (at_epoch, at_batch)
        self.epoch = 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if (self.epoch, batch) == self.at:
            raise RuntimeError("interrupted")


def test_backup_and_restore_after_an_interruption(tmp_path):
    x, y = make_data(100)
    fit = dict(batch_size=MICRO, epochs=3, shuffle=False, verbose=0)
    reference = compiled(functional(AccumModel, accum_steps=4))
    reference.fit(x, y, **fit)

    backup = keras.callbacks.BackupAndRestore(str(tmp_path / "backup"))
    checkpoint = keras.callbacks.ModelCheckpoint(str(tmp_path / "ckpt-{epoch}.keras"))
    model = compiled(functional(AccumModel, accum_steps=4))
    with pytest.raises(RuntimeError, match="interrupted"):
        # Interrupted mid-window: 6 micro-batches into the third epoch.
        model.fit(x, y, callbacks=[backup, checkpoint, Interrupt(2, 5)], **fit)
    model = compiled(functional(AccumModel, accum_steps=4))
    model.fit(x, y, callbacks=[backup, checkpoint], **fit)
    assert_weights_close(reference, model, rtol=0, atol=0)
    # ModelCheckpoint's files load as AccumModels with the epoch's weights.
    last = keras.models.load_model(tmp_path / "ckpt-3.keras")
    assert isinstance(last, AccumModel)
    assert_weights_close(reference, last, rtol=0, atol=0)


# -- SavedModel ----------------------------------------------------------------------

SERVE = """
import sys, numpy as np, tensorflow as tf
loaded = tf.saved_model.load(sys.argv[1])
x = np.load(sys.argv[2])
fn = getattr(loaded, "serve", None) or loaded.signatures["serving_default"]
out = fn(tf.constant(x))
out = list(out.values())[0] if isinstance(out, dict) else out
np.save(sys.argv[3], out.numpy())
assert not any(m.startswith("keras_accum") for m in sys.modules), "imported keras_accum"
"""


def serve_in_fresh_process(path, tmp_path):
    np.save(tmp_path / "x.npy", X)
    subprocess.run(
        [sys.executable, "-c", SERVE, str(path), str(tmp_path / "x.npy"), str(tmp_path / "y.npy")],
        check=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": ""},
    )
    return np.load(tmp_path / "y.npy")


def directory_size(path):
    return sum(
        os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path) for f in files
    )


@pytest.mark.parametrize("kind", ["functional", "subclassed"])
@pytest.mark.slow  # serves in a fresh process, without keras_accum
def test_export_serves_without_keras_accum_and_holds_no_window(kind, tmp_path):
    make = MAKERS[kind]
    model = train(compiled(make(AccumModel, accum_steps=4)), range(6))
    assert internals.pending(model) == 2
    model.export(tmp_path / "acc", verbose=False)
    served = serve_in_fresh_process(tmp_path / "acc", tmp_path)
    np.testing.assert_allclose(served, model.predict(X, verbose=0), rtol=1e-6, atol=1e-6)

    plain = compiled(make())
    plain.set_weights(model.get_weights())
    plain.export(tmp_path / "plain", verbose=False)
    ratio = directory_size(tmp_path / "acc") / directory_size(tmp_path / "plain")
    assert 0.95 < ratio < 1.05, ratio
    variables = tf.train.list_variables(str(tmp_path / "acc" / "variables" / "variables"))
    assert not any("acc_grad" in name or "micro_step" in name for name, _ in variables)


@pytest.mark.slow  # serves in a fresh process, without keras_accum
def test_tf_saved_model_save(tmp_path):
    model = train(compiled(functional(AccumModel, accum_steps=4)), range(6))
    tf.saved_model.save(model, str(tmp_path / "sm"))
    served = serve_in_fresh_process(tmp_path / "sm", tmp_path)
    np.testing.assert_allclose(served, model.predict(X, verbose=0), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("way", ["functional", "wrap_functional", "wrap_subclassed"])
def test_a_files_setting_states_go_to_the_next_fit_once_by_every_way_in(way, tmp_path):
    # A .keras file written mid-fit holds the settings callbacks' states (an
    # asset: the schedule's, tests/test_noise_scale.py resumes from one);
    # the first fit of the model loaded from it hands each to the callback
    # of its class, once, and warns about one no callback takes.
    from keras_accum.engine.fit import FitSetting

    class Recorder(FitSetting):
        def __init__(self, state=None):
            super().__init__()
            self.restored, self._state = [], state

        def state(self):
            return self._state

        def restore_state(self, state):
            self.restored.append(state)

    class Other(Recorder):
        pass

    model = {
        "functional": lambda: functional(AccumModel),
        "wrap_functional": lambda: keras_accum.wrap(functional()),
        "wrap_subclassed": lambda: keras_accum.wrap(subclassed()),
    }[way]()
    model.compile("sgd", loss())
    x, y = make_data(16)
    path = str(tmp_path / "mid_fit.keras")
    save = keras.callbacks.LambdaCallback(on_epoch_end=lambda *_: model.save(path))
    model.fit(
        x,
        y,
        batch_size=8,
        verbose=0,
        callbacks=[Recorder({"accum_steps": 4}), Other({"n": 1}), save],
    )
    model.save(tmp_path / "after_fit.keras")  # between fits: no state
    loaded = keras.saving.load_model(path)
    first, second = Recorder(), Recorder()
    with pytest.warns(UserWarning, match=r"state of Other, and this fit has no such callback"):
        loaded.fit(x, y, batch_size=8, verbose=0, callbacks=[first])
    loaded.fit(x, y, batch_size=8, verbose=0, callbacks=[second])
    assert first.restored == [{"accum_steps": 4}] and second.restored == []
    after = keras.saving.load_model(tmp_path / "after_fit.keras")
    third = Recorder()
    after.fit(x, y, batch_size=8, verbose=0, callbacks=[third])
    assert third.restored == []
