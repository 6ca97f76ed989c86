"""Features together: pairs and triples, each against the reference.

Each feature has its own tests; these train two or three at once, where
they meet in shared state (the window, the train function, BatchNorm's
moments, the backup): micro-batching, BatchNorm, sparse (Embedding)
gradients, schedules, skipping non-finite windows, backups, saving,
export and AccumOptimizer. Models are never built before `fit`. The
reference is a plain `keras.Model` on the big batch from the same seed
(BatchNorm: step mode over the same micro-batches for the weights, the
plain big batch for the first BN layer's moving statistics), compared with
rtol 1e-5. A representative set, chosen to run in about two minutes on two
cores: every feature is in at least two combinations.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_accum
from helpers import internals
from helpers.assertions import (
    assert_moved,
    assert_moving_close,
    assert_trained,
    assert_weights_close,
)
from helpers.data import bn_data, make_data, token_data
from helpers.models import OPTIMIZERS, bn_net, functional, initial_weights, loss, text_net
from helpers.training import InterruptAt, plain_on_batches
from keras_accum import AccumModel, AccumOptimizer, AccumScheduler

FIT = dict(shuffle=False, verbose=0)
# As in test_nonfinite.py: 92 samples, windows of 32, 32 and 28 at batch 8
# and accum_steps=4, one NaN sample in the second window.
X, Y = make_data(92)
X_NAN = X.copy()
X_NAN[40, 1] = np.nan
WINDOWS = [slice(0, 32), slice(32, 64), slice(64, 92)]


def _plain_epochs(make, x, y, batches, optimizer):
    """A plain model trained one epoch per entry of `batches` (batch sizes)."""
    model = make()
    model.compile(optimizer(), loss())
    for epoch, batch_size in enumerate(batches):
        model.fit(x, y, batch_size=batch_size, epochs=epoch + 1, initial_epoch=epoch, **FIT)
    return model


def _serve(model, path, x):
    """What `model.export(path)` serves for `x`, loaded back without Keras."""
    model.export(str(path), verbose=False)
    loaded = tf.saved_model.load(str(path))  # kept alive: it owns the variables
    return np.asarray(loaded.serve(tf.constant(x)))


# -- micro-batching x BatchNorm ------------------------------------------------------


def test_micro_batches_with_batchnorm_and_a_schedule():
    # micro + BN + schedule: micro_batch_size=8 splits batch 32 (one update a
    # batch, epoch 0), then the schedule makes epoch 1 windows of 2 batches.
    # Its weights are step mode's over the same micro-batches of 8, its first
    # BN layer's moving statistics the plain model's with the same batches.
    x, y = bn_data(92)
    sgd = lambda: keras.optimizers.SGD(0.1)  # noqa: E731
    schedule = AccumScheduler({1: 2})
    micro = bn_net(AccumModel, micro_batch_size=8)
    micro.compile(sgd(), loss())
    micro.fit(x, y, batch_size=32, epochs=2, callbacks=[schedule], **FIT)
    step = bn_net(AccumModel, accum_steps=4)
    step.compile(sgd(), loss())
    step.fit(x, y, batch_size=8, epochs=2, callbacks=[AccumScheduler({1: 8})], **FIT)
    plain = _plain_epochs(bn_net, x, y, [32, 64], sgd)
    assert_weights_close(micro, step)
    assert_moving_close(micro, plain)
    assert_moved(micro)
    assert (
        int(micro.optimizer.iterations.numpy()) == int(plain.optimizer.iterations.numpy()) == 3 + 2
    )


def test_micro_batches_with_batchnorm_resumed_from_a_batch_backup(tmp_path):
    # micro + BN + backup: windows of 4 batches of 8, each split in 4s; a
    # batch-level backup with a window (and its pooled BN moments) open.
    x, y = bn_data(92)

    def model():
        made = bn_net(AccumModel, accum_steps=4, micro_batch_size=4)
        made.compile(keras.optimizers.SGD(0.1), loss())
        return made

    def fit(made, *extra):
        backup = keras_accum.BackupAndRestore(tmp_path, save_freq=17)
        return made.fit(x, y, batch_size=8, epochs=2, callbacks=[backup, *extra], **FIT)

    uninterrupted = model()
    uninterrupted.fit(x, y, batch_size=8, epochs=2, **FIT)
    with pytest.raises(KeyboardInterrupt):
        fit(model(), InterruptAt(1, 6))  # backed up 5 batches into epoch 1
    resumed = model()
    fit(resumed)
    assert_weights_close(resumed, uninterrupted)
    assert_moving_close(resumed, uninterrupted)
    plain = _plain_epochs(bn_net, x, y, [32, 32], lambda: keras.optimizers.SGD(0.1))
    assert_moving_close(resumed, plain)


def test_batchnorm_model_exports_what_it_predicts(tmp_path):
    # BN + micro + export: the export serves the trained moving statistics.
    x, y = bn_data(40)
    model = bn_net(AccumModel, accum_steps=2, micro_batch_size=4)
    model.compile(keras.optimizers.SGD(0.1), loss())
    model.fit(x, y, batch_size=8, epochs=2, **FIT)
    assert_moved(model)
    np.testing.assert_allclose(
        _serve(model, tmp_path / "bn", x), model.predict(x, verbose=0), rtol=1e-5, atol=1e-6
    )


def test_auto_micro_batches_with_batchnorm_and_fit_accum_steps():
    # auto + BN + fit(accum_steps=): "auto"'s eager train function, on
    # whole batches (nothing runs out of memory), is step mode exactly.
    x, y = bn_data(92)
    auto = bn_net(AccumModel, micro_batch_size="auto")
    auto.compile(keras.optimizers.SGD(0.1), loss())
    auto.fit(x, y, batch_size=8, epochs=2, accum_steps=4, **FIT)
    step = bn_net(AccumModel, accum_steps=4)
    step.compile(keras.optimizers.SGD(0.1), loss())
    step.fit(x, y, batch_size=8, epochs=2, **FIT)
    plain = _plain_epochs(bn_net, x, y, [32, 32], lambda: keras.optimizers.SGD(0.1))
    assert auto.accum_steps == 1 and auto.chosen_micro_batch_size is None
    assert_weights_close(auto, step)
    assert_moving_close(auto, plain)


# -- sparse gradients ----------------------------------------------------------------


def test_sparse_with_micro_batches_and_a_schedule():
    # sparse + micro + schedule: Adam's sparse update, occurrence by
    # occurrence, on batches of 16 (epoch 0) then 32, split into 4s.
    x, y = token_data(76)
    adam = lambda: keras.optimizers.Adam(0.01)  # noqa: E731
    model = text_net(AccumModel, micro_batch_size=4)
    model.compile(adam(), loss())
    model.fit(x, y, batch_size=16, epochs=2, callbacks=[AccumScheduler({1: 2})], **FIT)
    plain = _plain_epochs(text_net, x, y, [16, 32], adam)
    assert_weights_close(model, plain)
    assert_trained(model, initial_weights(text_net, x))


def test_sparse_with_a_schedule_resumed_from_a_batch_backup(tmp_path):
    # sparse + schedule + backup: epoch 1 at accum_steps=4 (the model's own is
    # 1), resumed 5 batches into it, a window of slices open.
    x, y = token_data(76)  # 10 batches of 8 an epoch, the last of 4
    adam = lambda: keras.optimizers.Adam(0.01)  # noqa: E731

    def model():
        made = text_net(AccumModel)
        made.compile(adam(), loss())
        return made

    def fit(made, *extra):
        backup = keras_accum.BackupAndRestore(tmp_path, save_freq=15)
        return made.fit(
            x, y, batch_size=8, epochs=2, callbacks=[AccumScheduler({1: 4}), backup, *extra], **FIT
        )

    with pytest.raises(KeyboardInterrupt):
        fit(model(), InterruptAt(1, 6))
    assert sorted(p.name for p in tmp_path.iterdir())[0] == "epoch-1-batch-5.json"
    resumed = model()
    fit(resumed)
    plain = _plain_epochs(text_net, x, y, [8, 32], adam)
    assert int(resumed.optimizer.iterations.numpy()) == 10 + 3
    assert_weights_close(resumed, plain)


def test_sparse_accum_optimizer_saved_mid_window_and_exported(tmp_path):
    # AccumOptimizer + sparse + saving + export: a plain model compiled with
    # AccumOptimizer, saved as .keras with a window half done, loaded, and
    # trained to the end of the window; then exported.
    x, y = token_data(64)
    model = text_net()
    model.compile(AccumOptimizer(keras.optimizers.Adam(0.01), accum_steps=4), loss())
    model.fit(x[:48], y[:48], batch_size=8, **FIT)  # 1 update, 2 micro-batches open
    model.save(tmp_path / "half.keras")
    loaded = keras.models.load_model(tmp_path / "half.keras")
    loaded.fit(x[48:], y[48:], batch_size=8, **FIT)
    plain = text_net()
    plain.compile(keras.optimizers.Adam(0.01), loss())
    plain.fit(x, y, batch_size=32, **FIT)
    assert int(loaded.optimizer.iterations.numpy()) == 2
    assert_weights_close(loaded, plain)
    np.testing.assert_allclose(
        _serve(loaded, tmp_path / "text", x), plain.predict(x, verbose=0), rtol=1e-5, atol=1e-6
    )


def test_accum_optimizer_on_a_plain_model_resumed_from_a_batch_backup(tmp_path):
    # AccumOptimizer + backup: keras_accum.BackupAndRestore on a plain
    # keras.Model skips the restored batches with its own wrapper; the
    # optimizer's open window (2 of 4 micro-batches) comes back with it.
    x, y = make_data(64)  # 8 batches an epoch: 2 windows, none across epochs

    def model():
        made = functional()
        made.compile(AccumOptimizer(OPTIMIZERS["adam"](), accum_steps=4), loss())
        return made

    def fit(made, *extra):
        backup = keras_accum.BackupAndRestore(tmp_path, save_freq=14)
        return made.fit(x, y, batch_size=8, epochs=2, callbacks=[backup, *extra], **FIT)

    with pytest.raises(KeyboardInterrupt):
        fit(model(), InterruptAt(1, 6))  # backed up 6 batches into epoch 1
    resumed = model()
    fit(resumed)
    plain = functional()
    plain.compile(OPTIMIZERS["adam"](), loss())
    plain.fit(x, y, batch_size=32, epochs=2, **FIT)
    assert int(resumed.optimizer.iterations.numpy()) == 4
    assert_weights_close(resumed, plain)


# -- skipping non-finite windows -----------------------------------------------------


def test_skipping_with_micro_batches_and_a_backup(tmp_path):
    # skip + micro + backup: windows of 4 batches of 8 split into 4s; the
    # second window of each epoch holds a NaN and is skipped; resumed from a
    # backup taken inside it, the skip decision is the uninterrupted run's.
    def model():
        made = functional(AccumModel, accum_steps=4, micro_batch_size=4, skip_nonfinite=True)
        made.compile(OPTIMIZERS["adam"](), loss())
        return made

    def fit(made, *extra):
        backup = keras_accum.BackupAndRestore(tmp_path, save_freq=17)
        return made.fit(X_NAN, Y, batch_size=8, epochs=2, callbacks=[backup, *extra], **FIT)

    with pytest.raises(KeyboardInterrupt):
        fit(model(), InterruptAt(1, 6))  # backed up 5 batches in: the NaN window
    resumed = model()
    fit(resumed)
    plain = plain_on_batches(X, Y, [WINDOWS[0], WINDOWS[2]], epochs=2)
    assert int(resumed.optimizer.iterations.numpy()) == 4
    assert resumed.skipped_windows == 2  # epoch 0's, restored, and epoch 1's
    assert_weights_close(resumed, plain)


def test_skipping_with_a_schedule_and_saving(tmp_path):
    # skip + schedule + saving: epoch 0 at accum_steps=1 skips the NaN batch
    # alone; epoch 1 at 4 skips its window; saved and loaded between fits.
    x, y = X_NAN, Y
    model = functional(AccumModel, skip_nonfinite=True)
    model.compile(OPTIMIZERS["adam"](), loss())
    model.fit(x, y, batch_size=8, epochs=1, **FIT)
    model.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras")
    assert loaded.skip_nonfinite and loaded.skipped_windows == 1
    loaded.fit(
        x, y, batch_size=8, epochs=2, initial_epoch=1, callbacks=[AccumScheduler({1: 4})], **FIT
    )
    plain = functional()
    plain.compile(OPTIMIZERS["adam"](), loss())
    for start in range(0, 92, 8):
        if not start <= 40 < start + 8:
            plain.train_on_batch(x[start : start + 8], y[start : start + 8])
    for window in (WINDOWS[0], WINDOWS[2]):
        plain.train_on_batch(x[window], y[window])
    assert int(loaded.optimizer.iterations.numpy()) == 11 + 2
    assert loaded.skipped_windows == 2
    assert_weights_close(loaded, plain)


# -- saving and export with micro-batching --------------------------------------------


def test_micro_batches_saved_mid_window_then_flushed(tmp_path):
    # micro + saving + flush: a .keras file of a window interrupted half done,
    # flushed after loading, makes the original's update.
    x, y = make_data(92)
    model = functional(AccumModel, accum_steps=4, micro_batch_size=3)
    model.compile(OPTIMIZERS["adam"](), loss())
    with pytest.raises(KeyboardInterrupt):
        model.fit(x, y, batch_size=8, epochs=2, callbacks=[InterruptAt(0, 5)], **FIT)
    model.save(tmp_path / "open.keras")
    loaded = keras.models.load_model(tmp_path / "open.keras")
    assert loaded.micro_batch_size == 3 and internals.pending(loaded) == 2
    model.flush()
    loaded.flush()
    assert_weights_close(loaded, model)
    plain = functional()
    plain.compile(OPTIMIZERS["adam"](), loss())
    plain.train_on_batch(x[:32], y[:32])
    plain.train_on_batch(x[32:48], y[32:48])
    assert_weights_close(loaded, plain)


def test_wrapped_model_with_micro_batches_fit_accum_steps_and_export(tmp_path):
    # wrap + micro + fit(accum_steps=) + export: the export serves the model
    # the plain big batch trained.
    x, y = make_data(92)
    model = keras_accum.wrap(functional(), micro_batch_size=4)
    model.compile(OPTIMIZERS["sgd_momentum"](), loss())
    model.fit(x, y, batch_size=8, epochs=2, accum_steps=4, **FIT)
    assert model.accum_steps == 1
    plain = functional()
    plain.compile(OPTIMIZERS["sgd_momentum"](), loss())
    plain.fit(x, y, batch_size=32, epochs=2, **FIT)
    assert_weights_close(model, plain)
    np.testing.assert_allclose(
        _serve(model, tmp_path / "wrapped", x), plain.predict(x, verbose=0), rtol=1e-5, atol=1e-6
    )


def test_skipping_with_batchnorm_leaves_the_moving_statistics():
    # skip + BN + micro: a NaN sample weight makes the second window's
    # gradient NaN while its BN moments stay finite; the skipped window must
    # not reach the moving statistics, which are then those of the plain
    # model trained on the other two windows.
    x, y = bn_data(92)
    weights = np.ones(92, "float32")
    weights[40] = np.nan
    model = bn_net(AccumModel, accum_steps=4, micro_batch_size=4, skip_nonfinite=True)
    model.compile(keras.optimizers.SGD(0.1), loss())
    model.fit(x, y, sample_weight=weights, batch_size=8, epochs=1, **FIT)
    assert model.skipped_windows == 1
    plain = bn_net()
    plain.compile(keras.optimizers.SGD(0.1), loss())
    for window in (WINDOWS[0], WINDOWS[2]):
        plain.train_on_batch(x[window], y[window])
    assert_moving_close(model, plain)
