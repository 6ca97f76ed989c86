"""KerasTuner searches `accum_steps` and `micro_batch_size`: each trial is the
big batch's training, a search resumes where it was interrupted, and the best
model saves and reloads.

The hyperparameters reach the model either through `HyperModel.build`
(arguments of `AccumModel`, kept in its config) or through `HyperModel.fit`
(arguments of `fit`, for that call only).
"""

import keras
import numpy as np
import pytest

import keras_accum
from helpers.assertions import ATOL, RTOL
from helpers.data import make_data
from helpers.models import OPTIMIZERS, functional, loss
from helpers.training import InterruptAt

kt = pytest.importorskip("keras_tuner")
# KerasTuner imports TensorBoard's hparams plugin in every trial on TensorFlow.
pytest.importorskip("tensorboard")

pytestmark = pytest.mark.slow  # a search trains a model per trial (about 30 s)

# 92 samples at micro-batch 8: windows of 4 batches end with 8 + 8 + 8 + 4.
MICRO = 8
FIT = dict(batch_size=MICRO, epochs=2, shuffle=False, verbose=0)


def data():
    x, y = make_data(92)
    x_val, y_val = make_data(20, seed=1)
    return x, y, (x_val, y_val)


def compiled(model):
    model.compile(OPTIMIZERS["adam"](), loss(), metrics=["accuracy"])
    return model


class InBuild(kt.HyperModel):
    """`accum_steps` and `micro_batch_size` as `AccumModel` arguments."""

    def __init__(self, accum_steps=(2, 4), micro_batch_sizes=(4, 8)):
        super().__init__()
        self.accum_steps, self.micro_batch_sizes = list(accum_steps), list(micro_batch_sizes)
        self.builds = 0

    def build(self, hp):
        self.builds += 1
        return compiled(
            functional(
                keras_accum.AccumModel,
                accum_steps=hp.Choice("accum_steps", self.accum_steps),
                micro_batch_size=hp.Choice("micro_batch_size", self.micro_batch_sizes),
            )
        )


class InFit(kt.HyperModel):
    """The same hyperparameters as `fit` arguments of a wrapped model."""

    def build(self, hp):
        return compiled(keras_accum.wrap(functional()))

    def fit(self, hp, model, *args, **kwargs):
        return model.fit(
            *args,
            accum_steps=hp.Choice("accum_steps", [2, 4]),
            micro_batch_size=hp.Choice("micro_batch_size", [4, 8]),
            **kwargs,
        )


def recorded(trial, name):
    """`{epoch: value}` of a metric as KerasTuner recorded it for the trial
    (the logs of the objective's best epoch)."""
    return {o.step: o.value[0] for o in trial.metrics.get_history(name)}


@pytest.mark.parametrize("hypermodel", [InBuild, InFit], ids=["build", "fit"])
def test_every_trial_trains_as_the_big_batch(hypermodel, tmp_path):
    x, y, validation = data()
    tuner = kt.GridSearch(
        hypermodel(),
        objective="val_loss",
        directory=tmp_path,
        project_name="search",
    )
    tuner.search(x, y, validation_data=validation, **FIT)
    trials = list(tuner.oracle.trials.values())
    grid = {
        (t.hyperparameters["accum_steps"], t.hyperparameters["micro_batch_size"]) for t in trials
    }
    assert grid == {(2, 4), (2, 8), (4, 4), (4, 8)}
    for trial in trials:
        plain = compiled(functional())
        plain_history = plain.fit(
            x,
            y,
            validation_data=validation,
            **dict(FIT, batch_size=MICRO * trial.hyperparameters["accum_steps"]),
        ).history
        # The best epoch is the big batch's, and so is every metric there.
        best = int(np.argmin(plain_history["val_loss"]))
        np.testing.assert_allclose(trial.score, plain_history["val_loss"][best], RTOL, ATOL)
        for name, values in plain_history.items():
            assert list(recorded(trial, name)) == [best], name
            np.testing.assert_allclose(
                recorded(trial, name)[best], values[best], RTOL, ATOL, err_msg=name
            )


def test_an_interrupted_search_resumes_and_the_best_model_reloads(tmp_path):
    x, y, validation = data()
    search = dict(x=x, y=y, validation_data=validation, **FIT)

    def tuner(hypermodel):
        # overwrite=False (KerasTuner's default, spelled out): the same
        # directory and project continue the search they hold.
        # RandomSearch: KerasTuner 1.4.8's GridSearch cannot resume a search
        # interrupted during a trial, whatever the model (a KeyError in its
        # grid's order, keras-team/keras-tuner#1055).
        return kt.RandomSearch(
            hypermodel,
            objective="val_loss",
            max_trials=3,
            directory=tmp_path,
            project_name="search",
            overwrite=False,
            seed=0,
        )

    hypermodel = InBuild(accum_steps=[1, 2, 4], micro_batch_sizes=[4])
    _Fits.start(interrupt=2)
    with pytest.raises(KeyboardInterrupt):  # Ctrl-C in the second trial
        tuner(hypermodel).search(**search, callbacks=[_Fits()])
    assert _Fits.fits == 2

    _Fits.start()
    tuned = tuner(hypermodel)
    tuned.search(**search, callbacks=[_Fits()])
    assert _Fits.fits == 2  # the interrupted trial again, and the third
    trials = tuned.oracle.trials.values()
    assert all(t.status == "COMPLETED" for t in trials)
    assert sorted(t.hyperparameters["accum_steps"] for t in trials) == [1, 2, 4]

    _Fits.start()
    tuner(hypermodel).search(**search, callbacks=[_Fits()])
    assert _Fits.fits == 0  # nothing left to try

    (best_hp,) = tuned.get_best_hyperparameters(1)
    (best,) = tuned.get_best_models(1)
    config = best.get_config()
    assert (config["accum_steps"], config["micro_batch_size"]) == (
        best_hp["accum_steps"],
        best_hp["micro_batch_size"],
    )
    best.save(tmp_path / "best.keras")
    reloaded = keras.saving.load_model(tmp_path / "best.keras")
    assert type(reloaded) is type(best)
    reloaded_config = reloaded.get_config()
    assert (reloaded_config["accum_steps"], reloaded_config["micro_batch_size"]) == (
        config["accum_steps"],
        config["micro_batch_size"],
    )
    np.testing.assert_array_equal(reloaded.predict(x, verbose=0), best.predict(x, verbose=0))


class _Fits(InterruptAt):
    """Counts the trials' fits; Ctrl-C after the first batch of fit number
    `interrupt`.

    KerasTuner deep-copies the callbacks for every trial, so the count lives
    in the class.
    """

    fits, interrupt = 0, None

    @classmethod
    def start(cls, interrupt=None):
        cls.fits, cls.interrupt = 0, interrupt

    def __init__(self):
        super().__init__(epoch=0, batch=0)

    def on_train_begin(self, logs=None):
        type(self).fits += 1

    def on_train_batch_end(self, batch, logs=None):
        if type(self).fits == type(self).interrupt:
            super().on_train_batch_end(batch, logs)
