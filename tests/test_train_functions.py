"""The train functions: one traced step per setting, kept and reused; and
whatever changes the train function composes with whatever else does.

The window length and the micro-batch split are constants of a traced
step, so each setting has its own, kept while what its trace captured (the
compiled state, the trainable variables) is unchanged: a schedule of k
distinct values traces k steps.

BackupAndRestore's batch skipping, AccumScheduler, `fit(accum_steps=)`,
`micro_batch_size` changes and "auto" each swap or retrace the function
`fit` calls; the model's `train_function` has one owner
(keras_accum/train_functions.py) where the skipping is a layer over
whichever step is current, so a retrace while skipping keeps skipping.

Every resumed run here restarts from a batch-level backup taken with a
window open, and must end as the uninterrupted run (and the plain big
batch) does.
"""

import time

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_accum
from helpers import internals, references
from helpers.assertions import assert_weights_close
from helpers.data import make_data
from helpers.models import OPTIMIZERS, functional, loss
from helpers.replicas import mirrored
from helpers.tiers import wide
from helpers.training import InterruptAt
from keras_accum import AccumModel, AccumScheduler
from keras_accum.engine.functions import EAGER_FLUSHES

# 92 samples at 8: 12 batches an epoch, the last one of 4.
X, Y = make_data(92)
MICRO = 8
FIT = dict(batch_size=MICRO, shuffle=False, verbose=0)


def compiled(**kwargs):
    # Never built before fit: fit builds it from the first batch.
    model = functional(AccumModel, **kwargs)
    model.compile(OPTIMIZERS["adam"](), loss())
    return model


def plain_with_batches(batches):
    """A plain model trained one epoch per entry of `batches` (batch sizes),
    once per process."""

    def train():
        model = functional()
        model.compile(OPTIMIZERS["adam"](), loss())
        for epoch, batch_size in enumerate(batches):
            model.fit(
                X,
                Y,
                batch_size=batch_size,
                epochs=epoch + 1,
                initial_epoch=epoch,
                shuffle=False,
                verbose=0,
            )
        return model

    return references.once(("train_functions", tuple(batches)), train)


# -- issue 23, item 4: a schedule and a batch-level backup ---------------------------


# backup_first (slow): the changer pairs below resume with the backup first.
@pytest.mark.parametrize("order", wide(["scheduler_first", "backup_first"], ["scheduler_first"]))
def test_schedule_and_batch_backup_resume_exactly(tmp_path, order):
    # Epoch 1 runs at accum_steps=4, the model's own is 1: the resumed
    # epoch's value differs from the model's, so the scheduler retraces
    # while the batches already seen are being skipped.
    schedule = {0: 1, 1: 4}

    def callbacks(*extra):
        backup = keras_accum.BackupAndRestore(tmp_path, save_freq=5)
        scheduler = AccumScheduler(schedule)
        pair = [scheduler, backup] if order == "scheduler_first" else [backup, scheduler]
        return [*pair, *extra]

    uninterrupted = compiled()
    uninterrupted.fit(X, Y, epochs=3, callbacks=[AccumScheduler(schedule)], **FIT)
    with pytest.raises(KeyboardInterrupt):
        # Backups at 5 and 10 batches of epoch 0, then 3 into epoch 1 (a
        # window 3/4 full); interrupted after 6.
        compiled().fit(X, Y, epochs=3, callbacks=callbacks(InterruptAt(1, 5)), **FIT)
    resumed = compiled()
    resumed.fit(X, Y, epochs=3, callbacks=callbacks(), **FIT)
    iterations = int(uninterrupted.optimizer.iterations.numpy())
    assert iterations == 12 + 3 + 3
    assert int(resumed.optimizer.iterations.numpy()) == iterations
    assert_weights_close(resumed, uninterrupted)
    assert_weights_close(resumed, plain_with_batches([8, 32, 32]))


# -- issue 23, item 5: resumed with another accum_steps ------------------------------


def test_batch_backup_resumed_with_another_accum_steps_names_both(tmp_path):
    def backup():
        return keras_accum.BackupAndRestore(tmp_path, save_freq=5)

    with pytest.raises(KeyboardInterrupt):
        # Backed up 3 batches into epoch 1, a window of 4 open.
        compiled(accum_steps=4).fit(X, Y, epochs=3, callbacks=[backup(), InterruptAt(1, 5)], **FIT)
    resumed = compiled(accum_steps=4)
    with pytest.raises(
        ValueError, match=r"accumulated with accum_steps=4, but the model now has accum_steps=2"
    ):
        resumed.fit(X, Y, epochs=3, accum_steps=2, callbacks=[backup()], **FIT)
    # Nothing was trained on top of the restored window.
    assert internals.pending(resumed) == 3
    # Resumed as it began, it ends as the uninterrupted run.
    resumed.fit(X, Y, epochs=3, callbacks=[backup()], **FIT)
    assert_weights_close(resumed, plain_with_batches([32, 32, 32]))


# -- the cache: one traced step per accum_steps value, reused ------------------------

X96, Y96 = make_data(96)  # equal batches only: one trace per function
QUIET = dict(shuffle=False, verbose=0)


class CountingTraces(AccumModel):
    """Logs the accum_steps of each trace of its step: the Python body runs
    once per trace, not per step."""

    traced = []

    def train_step(self, data):
        CountingTraces.traced.append(self.accum_steps)
        return super().train_step(data)


def traces():
    """The values traced, in order. A step that creates variables (Keras's
    own, at accum_steps=1, builds the optimizer) is traced twice by
    tf.function on its first call: consecutive repeats are one function."""
    log = CountingTraces.traced
    return [v for i, v in enumerate(log) if i == 0 or log[i - 1] != v]


@pytest.fixture
def counting():
    CountingTraces.traced = []
    model = functional(CountingTraces)
    model.compile(OPTIMIZERS["adam"](), loss())
    return model


def test_a_schedule_traces_each_distinct_value_once(counting):
    schedule = {0: 1, 1: 2, 2: 4, 3: 2, 4: 1, 5: 4}
    history = counting.fit(
        X96, Y96, batch_size=MICRO, epochs=6, callbacks=[AccumScheduler(schedule)], **QUIET
    )
    assert history.history["accum_steps"] == [1, 2, 4, 2, 1, 4]
    assert traces() == [1, 2, 4]


def test_repeated_fit_with_accum_steps_traces_once(counting):
    for _ in range(3):
        counting.fit(X96, Y96, batch_size=MICRO, accum_steps=4, **QUIET)
        assert counting.accum_steps == 1
    assert CountingTraces.traced == [4]
    counting.fit(X96, Y96, batch_size=MICRO, **QUIET)  # its own accum_steps=1
    counting.fit(X96, Y96, batch_size=MICRO, accum_steps=4, **QUIET)
    assert traces() == [4, 1]
    plain = functional()
    plain.compile(OPTIMIZERS["adam"](), loss())
    plain.fit(X96, Y96, batch_size=32, epochs=3, **QUIET)
    plain.fit(X96, Y96, batch_size=8, **QUIET)
    plain.fit(X96, Y96, batch_size=32, **QUIET)
    assert_weights_close(plain, counting)


def test_compile_makes_new_steps_for_the_new_optimizer(counting):
    counting.fit(X96, Y96, batch_size=MICRO, accum_steps=2, **QUIET)
    first = counting.optimizer
    counting.compile(keras.optimizers.SGD(0.1), loss())
    counting.fit(X96, Y96, batch_size=MICRO, accum_steps=2, **QUIET)
    assert CountingTraces.traced == [2, 2]
    # A stale step would have kept updating the first optimizer.
    assert int(first.iterations.numpy()) == 6
    assert int(counting.optimizer.iterations.numpy()) == 6


def test_a_change_of_trainable_variables_makes_new_steps(counting):
    counting.fit(X96, Y96, batch_size=MICRO, accum_steps=2, **QUIET)
    # Not recompiled (Keras warns): the new trainable set alone must tell.
    counting.get_layer("hidden").trainable = False
    frozen = counting.get_layer("hidden").get_weights()
    counting.fit(X96, Y96, batch_size=MICRO, accum_steps=2, **QUIET)
    assert CountingTraces.traced == [2, 2]
    for w, w0 in zip(counting.get_layer("hidden").get_weights(), frozen):
        np.testing.assert_array_equal(w, w0)


class RecordingAdam(keras.optimizers.Adam):
    """Adam (OPTIMIZERS["adam"], as the references') recording whether each
    update ran inside a traced function."""

    def __init__(self):
        super().__init__(0.01)
        self.inside = []

    def apply(self, grads, trainable_variables=None):
        self.inside.append(tf.inside_function())
        return super().apply(grads, trainable_variables)


def _placed(replicas, build):
    if not replicas:
        return build()
    with mirrored(replicas).scope():
        return build()


# A flush traced cost a trace and an instantiation per compile: a fifth of
# this model's fit on one device, about half under two replicas. One rule
# for both: two replicas in the slow tier, one device in the inner loop.
@pytest.mark.parametrize("replicas", wide([0, 2], [0]), ids=["one_device", "two_replicas"])
def test_the_window_open_at_an_epochs_end_is_applied_without_a_trace_of_its_own(replicas):
    def build():
        model = functional(AccumModel, accum_steps=5)  # windows of 40, 40 and 12
        model.compile(RecordingAdam(), loss())
        return model

    model = _placed(replicas, build)
    model.fit(X, Y, epochs=2, validation_data=(X[:16], Y[:16]), **FIT)
    inside = model.optimizer.inside
    # The one traced update is the train step's (one trace, once per
    # replica); the window of 12, at each epoch's end, is applied op by op.
    assert inside.count(True) == max(replicas, 1)
    assert inside.count(False) == 2 * max(replicas, 1)
    assert_weights_close(plain_with_batches((40, 40)), model)


@pytest.mark.parametrize("replicas", wide([0, 2], [0]), ids=["one_device", "two_replicas"])
def test_flushes_run_op_by_op_until_a_trace_costs_less_then_traced_exactly(replicas):
    # A flush after every micro-batch: each applies a window of one batch of
    # 8, as a plain model's step on it. The first EAGER_FLUSHES run op by
    # op, then one trace serves the rest.
    flushes = EAGER_FLUSHES + 3

    def build():
        model = functional(AccumModel, accum_steps=4)
        model.compile(RecordingAdam(), loss())
        return model

    model = _placed(replicas, build)
    plain = functional()
    plain.compile(OPTIMIZERS["adam"](), loss())
    for i in range(flushes):
        batch = slice(MICRO * (i % 11), MICRO * (i % 11 + 1))
        model.train_on_batch(X[batch], Y[batch])
        model.flush()
        plain.train_on_batch(X[batch], Y[batch])
    inside = model.optimizer.inside
    per_flush = max(replicas, 1)
    # The step's trace (its update traced once per replica), then the
    # flushes: op by op, then traced once.
    assert inside[: per_flush * (EAGER_FLUSHES + 1)].count(False) == per_flush * EAGER_FLUSHES
    assert inside[per_flush * (EAGER_FLUSHES + 1) :] == [True] * per_flush
    assert int(model.optimizer.iterations.numpy()) == flushes
    assert_weights_close(plain, model)


# -- no retracing warnings from keras_accum's own functions --------------------------


class CountingSteps(AccumModel):
    """Counts traces of its train step (its Python body runs once a trace)."""

    traced = 0

    def train_step(self, data):
        CountingSteps.traced += 1
        return super().train_step(data)


class CountingPlainSteps(keras.Model):
    """The same count for a plain model: what Keras itself traces."""

    traced = 0

    def train_step(self, data):
        CountingPlainSteps.traced += 1
        return super().train_step(data)


def _recipe(cls, x, y, **kwargs):
    # As in a notebook: the recipe, for a few models in one process.
    for _ in range(2):
        model = functional(cls, **kwargs)
        hidden = model.get_layer("hidden")
        for trainable in (True, False, True):  # fit / freeze / fit / unfreeze / fit
            hidden.trainable = trainable
            model.compile(OPTIMIZERS["adam"](), loss(), metrics=["accuracy"])
            model.fit(x, y, batch_size=MICRO, shuffle=False, verbose=0)


def test_fine_tuning_recipe_raises_no_retracing_warning(monkeypatch):
    import logging

    from tensorflow.python.eager.polymorphic_function import polymorphic_function

    # TensorFlow counts traces per code object for the whole process and
    # warns at most twice per code: a fresh count, so that earlier tests'
    # models neither trip nor use up the warning here.
    monkeypatch.setattr(
        polymorphic_function,
        "_frequent_tracing_detector_manager",
        internals.fresh_tracing_detector(),
    )
    warnings = []

    class Record(logging.Handler):
        def emit(self, record):
            if "retracing" in record.getMessage():
                warnings.append(record.getMessage()[:160])

    handler = Record()
    logging.getLogger("tensorflow").addHandler(handler)
    x, y = make_data(76)  # windows 4, 4 and 2: an open window at each epoch's end
    CountingSteps.traced = CountingPlainSteps.traced = 0
    try:
        _recipe(CountingSteps, x, y, accum_steps=4)
    finally:
        logging.getLogger("tensorflow").removeHandler(handler)
    assert warnings == []
    # Nothing is traced that Keras itself would not trace: the same recipe on
    # plain models. Ours is one step per compile up to Keras 3.15 (plain
    # Keras two); Keras 3.16 takes a one-step batch outside its traced loop,
    # so both trace again, relaxed, at the epoch's short last batch.
    _recipe(CountingPlainSteps, x, y)
    assert CountingSteps.traced <= CountingPlainSteps.traced
    assert CountingSteps.traced <= 2 * 3 * 2  # at most twice per compile


# -- every pair of train-function changers, resumed mid-window ------------------------
#
# The model's own accum_steps is 2. Changers of the train function:
#   schedule: AccumScheduler({1: 3})          (a callback; epoch 1 at 3)
#   fit:      fit(accum_steps=4)              (both epochs at 4, unless scheduled)
#   micro:    a callback setting micro_batch_size=4 at epoch 1
#   auto:     fit(micro_batch_size="auto")    (its eager train function)
# With a backup every 17 batches (12 an epoch), the one restored is 5 batches
# into epoch 1, whatever the window length (2, 3 or 4), a window open; the
# first run is interrupted 7 batches into epoch 1. A resumed model starts
# fresh (accum_steps=2, micro_batch_size None), so each changer retraces
# while the restored batches are being skipped, or after a load that
# dropped the step.

SAVE_FREQ = 17
CHANGERS = ("schedule", "fit", "micro", "auto")
PAIRS = [(a,) for a in CHANGERS] + [
    (a, b) for i, a in enumerate(CHANGERS) for b in CHANGERS[i + 1 :]
]


class MicroBatchFrom(keras.callbacks.Callback):
    """Sets `micro_batch_size` at the start of each epoch from `epoch`."""

    def __init__(self, epoch, size):
        super().__init__()
        self.epoch, self.size = epoch, size

    def on_epoch_begin(self, epoch, logs=None):
        if epoch >= self.epoch:
            self.model.micro_batch_size = self.size


def _setup(changers):
    """(callbacks, fit kwargs, the accum_steps of epochs 0 and 1)."""
    callbacks, kwargs, steps = [], {}, [2, 2]
    if "fit" in changers:
        kwargs["accum_steps"] = 4
        steps = [4, 4]
    if "schedule" in changers:
        callbacks.append(AccumScheduler({1: 3}))
        steps[1] = 3
    if "micro" in changers:
        callbacks.append(MicroBatchFrom(1, 4))
    if "auto" in changers:
        kwargs["micro_batch_size"] = "auto"
    return callbacks, kwargs, steps


_UNINTERRUPTED = {}


def _uninterrupted(changers):
    if changers not in _UNINTERRUPTED:
        callbacks, kwargs, _ = _setup(changers)
        model = compiled(accum_steps=2)
        model.fit(X, Y, epochs=2, callbacks=callbacks, **kwargs, **FIT)
        _UNINTERRUPTED[changers] = (model.get_weights(), int(model.optimizer.iterations.numpy()))
    return _UNINTERRUPTED[changers]


# The inner loop's pairs: every changer in one of them (a schedule and
# micro-batches, then the batch size from fit and "auto").
INNER_PAIRS = {"schedule+micro", "fit+auto"}


def _cases():
    for changers in PAIRS:
        orders = ["backup_first", "backup_last"]
        if not {"schedule", "micro"} & set(changers):
            orders = ["backup_only"]  # no other callback to order it against
        for order in orders:
            # The other order of each pair, each changer alone (every pair
            # holds it) and the pairs not in INNER_PAIRS, in the slow tier.
            slow = order == "backup_last" or "+".join(changers) not in INNER_PAIRS
            marks = [pytest.mark.slow] if slow else []
            yield pytest.param(changers, order, id="+".join(changers) + "-" + order, marks=marks)


@pytest.mark.parametrize("changers, order", list(_cases()))
def test_changers_compose_when_resumed_from_a_batch_backup(tmp_path, changers, order):
    start = time.monotonic()

    def fit(model, *extra):
        callbacks, kwargs, _ = _setup(changers)
        backup = keras_accum.BackupAndRestore(tmp_path, save_freq=SAVE_FREQ)
        # backup_last also reverses the other callbacks' order.
        callbacks = [backup, *callbacks] if order != "backup_last" else [*callbacks[::-1], backup]
        return model.fit(X, Y, epochs=2, callbacks=[*callbacks, *extra], **kwargs, **FIT)

    with pytest.raises(KeyboardInterrupt):
        fit(compiled(accum_steps=2), InterruptAt(1, 6))
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "epoch-1-batch-5.json",
        "epoch-1-batch-5.weights.h5",
    ]
    resumed = compiled(accum_steps=2)
    history = fit(resumed)
    assert len(history.history["loss"]) == 1  # epoch 1 only
    weights, iterations = _uninterrupted(changers)
    assert int(resumed.optimizer.iterations.numpy()) == iterations
    for w, v in zip(resumed.get_weights(), weights, strict=True):
        np.testing.assert_allclose(w, v, rtol=1e-5, atol=1e-6)
    _, _, steps = _setup(changers)
    assert_weights_close(resumed, plain_with_batches(tuple(MICRO * s for s in steps)))
    print(f"\n{changers} {order}: {time.monotonic() - start:.1f} s")
