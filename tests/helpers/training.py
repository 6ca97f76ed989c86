"""Plain big-batch references, and a callback that interrupts training."""

from typing import NamedTuple

import keras

from helpers.models import OPTIMIZERS, built_before_fit, functional, loss


def plain_on_batches(x, y, batches, epochs=1, optimizer="adam", make=functional):
    """A plain model after one `train_on_batch` per slice of `batches`, the
    whole list once per epoch: the big batches an accumulating run's applied
    windows must reproduce."""
    plain = make()
    plain.compile(OPTIMIZERS[optimizer](), loss())
    for _ in range(epochs):
        for batch in batches:
            plain.train_on_batch(x[batch], y[batch])
    return plain


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


class Trained(NamedTuple):
    """A plain model trained on the big batch, an accumulating one on its
    micro-batches, and their histories."""

    plain: keras.Model
    accum: keras.Model
    plain_history: dict
    accum_history: dict


def fit_pair(
    make_accum,
    make_plain,
    x,
    y,
    make_optimizer,
    *,
    big_batch,
    accum_batch,
    epochs=2,
    fit_kwargs=None,
    **compile_kwargs,
):
    """The plain model on `big_batch` and the accumulating one on
    `accum_batch`, each compiled with its own `make_optimizer()` (and the
    tests' loss unless `compile_kwargs` gives one), trained alike: `Trained`."""
    plain, plain_history = fit_alone(
        make_plain, x, y, make_optimizer, big_batch, epochs, fit_kwargs, **compile_kwargs
    )
    accum, accum_history = fit_alone(
        make_accum, x, y, make_optimizer, accum_batch, epochs, fit_kwargs, **compile_kwargs
    )
    return Trained(plain, accum, plain_history, accum_history)


def fit_alone(
    make_model, x, y, make_optimizer, batch_size, epochs=2, fit_kwargs=None, **compile_kwargs
):
    """One model of `fit_pair`, trained as `fit_pair` trains it: `(model, history)`."""
    model = make_model()
    model.compile(make_optimizer(), **{"loss": loss(), **compile_kwargs})
    build_plain_optimizer(model, x)
    fit = {"epochs": epochs, "shuffle": False, "verbose": 0, **(fit_kwargs or {})}
    history = model.fit(x, y, batch_size=batch_size, **fit)
    return model, history.history


def build_plain_optimizer(model, x):
    """A plain reference's optimizer built before `fit`, where Keras's own
    lazy build would lose its state (`models.built_before_fit`)."""
    import keras_accum

    if not isinstance(model, keras_accum.AccumModel) and built_before_fit(model.optimizer):
        model(x[:1])
        model.optimizer.build(model.trainable_variables)
