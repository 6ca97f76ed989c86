"""Whatever changes the train function composes with whatever else does.

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
from reference import (
    OPTIMIZERS,
    assert_weights_close,
    functional,
    loss,
    make_data,
)

import keras_accum
from keras_accum import AccumModel, AccumScheduler

# 92 samples at 8: 12 batches an epoch, the last one of 4.
X, Y = make_data(92)
MICRO = 8
FIT = dict(batch_size=MICRO, shuffle=False, verbose=0)


class InterruptAt(keras.callbacks.Callback):
    """Ctrl-C after batch `batch` of epoch `epoch` (0-based) ends."""

    def __init__(self, epoch, batch):
        super().__init__()
        self.at = (epoch, batch)

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if (self._epoch, batch) == self.at:
            raise KeyboardInterrupt


def compiled(**kwargs):
    # Never built before fit: fit builds it from the first batch.
    model = functional(AccumModel, **kwargs)
    model.compile(OPTIMIZERS["adam"](), loss())
    return model


def plain_with_batches(batches):
    """A plain model trained one epoch per entry of `batches` (batch sizes)."""
    model = functional()
    model.compile(OPTIMIZERS["adam"](), loss())
    for epoch, batch_size in enumerate(batches):
        model.fit(X, Y, batch_size=batch_size, epochs=epoch + 1, initial_epoch=epoch,
                  shuffle=False, verbose=0)
    return model


# -- issue 23, item 4: a schedule and a batch-level backup ---------------------------


@pytest.mark.parametrize("order", ["scheduler_first", "backup_first"])
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
        compiled(accum_steps=4).fit(
            X, Y, epochs=3, callbacks=[backup(), InterruptAt(1, 5)], **FIT
        )
    resumed = compiled(accum_steps=4)
    with pytest.raises(
        ValueError, match=r"accumulated with accum_steps=4, but the model now has accum_steps=2"
    ):
        resumed.fit(X, Y, epochs=3, accum_steps=2, callbacks=[backup()], **FIT)
    # Nothing was trained on top of the restored window.
    assert resumed._accumulator.pending() == 3
    # Resumed as it began, it ends as the uninterrupted run.
    resumed.fit(X, Y, epochs=3, callbacks=[backup()], **FIT)
    assert_weights_close(resumed, plain_with_batches([32, 32, 32]))


# -- no retracing warnings from keras_accum's own functions --------------------------


class CountingSteps(AccumModel):
    """Counts traces of its train step (its Python body runs once a trace)."""

    traced = 0

    def train_step(self, data):
        CountingSteps.traced += 1
        return super().train_step(data)


def test_fine_tuning_recipe_raises_no_retracing_warning(monkeypatch):
    import logging

    from tensorflow.python.eager.polymorphic_function import polymorphic_function

    # TensorFlow counts traces per code object for the whole process and
    # warns at most twice per code: a fresh count, so that earlier tests'
    # models neither trip nor use up the warning here.
    monkeypatch.setattr(
        polymorphic_function,
        "_frequent_tracing_detector_manager",
        polymorphic_function._FrequentTracingDetectorManager(),
    )
    warnings = []

    class Record(logging.Handler):
        def emit(self, record):
            if "retracing" in record.getMessage():
                warnings.append(record.getMessage()[:160])

    handler = Record()
    logging.getLogger("tensorflow").addHandler(handler)
    x, y = make_data(76)  # windows 4, 4 and 2: an open window at each epoch's end
    CountingSteps.traced = 0
    try:
        # As in a notebook: the recipe, for a few models in one process.
        for _ in range(2):
            model = functional(CountingSteps, accum_steps=4)
            hidden = model.get_layer("hidden")
            for trainable in (True, False, True):  # fit / freeze / fit / unfreeze / fit
                hidden.trainable = trainable
                model.compile(OPTIMIZERS["adam"](), loss(), metrics=["accuracy"])
                model.fit(x, y, batch_size=MICRO, shuffle=False, verbose=0)
    finally:
        logging.getLogger("tensorflow").removeHandler(handler)
    assert warnings == []
    # One step traced per compile: nothing is traced again that need not be.
    assert CountingSteps.traced == 2 * 3
