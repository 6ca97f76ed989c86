"""Keras's private hooks that `AccumModel` overrides, boxed in one place.

- `FunctionalVariants.__new__`: Keras makes a `Model` subclass functional by
  rewriting the class's `__bases__` in place, for every instance that
  follows; a functional call gets a subclass of its own instead.
- `BuildFromFirstBatch._maybe_symbolic_build`: the model is built before
  any step is traced (as Keras does under a strategy): from the data's
  element spec without a strategy, so nothing is drawn that a plain model
  would not draw; the first training batch, or its spec, is handed to
  `_see_batch`.
- `make_test_function` across workers, where Keras's own fails.
- `train_function`, which Keras assigns and `fit` reads, held by an object
  of the model's own (`HeldAttribute`, `holder_of`).

Example:

```python
class AccumModel(FunctionalVariants, BuildFromFirstBatch, keras.Model):
    def _see_batch(self, data_batch): ...
```
"""

import contextlib

import keras

from keras_accum._internals import distribute, layers, optimizer, saving, trainer
from keras_accum._internals.versions import require, required

# What a fit of an AccumModel reads of the model: checked, with the rest of
# `check_fit`, before its first step.
_MODEL_READS = (
    "_call_has_training_arg", "_compute_loss", "_loss_tracker", "_compile_loss",
    "_symbolic_build", "_distribute_strategy", "_flatten_layers",
)


def check_fit(model):
    """Raises `KerasInternalsChanged`, before a step is made, if this Keras
    moved anything a fit of `model` reaches for: the model's private
    attributes, its compiled loss's terms, its optimizer's bookkeeping, the
    Keras hook `BuildFromFirstBatch` overrides (a renamed one would never
    be called) and saving's kind hook (a checkpoint mid-fit).

    Example:

    ```python
    check_fit(model)  # TrainFunctions.make, before tracing a step
    ```
    """
    require(model, *_MODEL_READS)
    compile_loss = model._compile_loss
    if compile_loss is not None:
        required(compile_loss, "_flat_losses")
    if model.optimizer is not None:
        optimizer.check_optimizer(model.optimizer)
    required(trainer.TensorFlowTrainer, "_maybe_symbolic_build")
    saving.check_saving()


class FunctionalVariants:
    """Functional calls of a subclass get a `Functional` variant of their own
    (`init_model` runs the constructor that variant needs)."""

    def __new__(cls, *args, **kwargs):
        if layers.functional_init_arguments(
            args, kwargs
        ) and not issubclass(cls, layers.Functional):
            cls = _functional_variant(cls)
        return super().__new__(cls, *args, **kwargs)


class BuildFromFirstBatch:
    """Builds the model from the first batch, and sees the first training batch.

    `_training_build` is set while `fit` or `train_on_batch` builds from its
    first batch (not `evaluate`'s, whose batches the step never splits).
    """

    _training_build = False

    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        # Keras builds a model without a strategy in its first traced step;
        # a window needs the variables before that (and a cached train
        # function the variables it was traced with): built here from the
        # data's spec, drawing nothing. Keras's own version also fails
        # across workers (tensorflow/tensorflow#72388).
        data_batch = trainer.symbolic_build(
            self, iterator=iterator, data_batch=data_batch, without_strategy=True
        )
        if self._training_build:
            self._training_build = False
            size = None if iterator is None else trainer.array_batch_size(iterator)
            self._see_batch(data_batch, size)

    def train_on_batch(self, *args, **kwargs):
        with training_build(self):
            return super().train_on_batch(*args, **kwargs)

    def make_test_function(self, force=False):
        if self.test_function is not None and not force:
            return self.test_function
        if distribute.multi_worker(self.distribute_strategy):
            # As for training: Keras's test function fails across workers.
            self.test_function = trainer.make_replicated_function(
                self, self.test_step
            )
            return self.test_function
        return super().make_test_function(force=force)


def init_model(model, model_init, args, kwargs):
    """`model_init(*args, **kwargs)` (the class's `super().__init__`), or,
    for a functional call, `Functional.__init__`: called ourselves, on a
    class that already has Functional in its bases (see
    `FunctionalVariants`), it keeps Keras from re-basing the class onto
    Functional, which would break every later `class Net(AccumModel)` in
    the process.

    Example:

    ```python
    init_model(self, super().__init__, args, kwargs)  # in AccumModel.__init__
    ```
    """
    if layers.functional_init_arguments(args, kwargs):
        layers.Functional.__init__(model, *args, **kwargs)
    else:
        model_init(*args, **kwargs)


class HeldAttribute:
    """A model attribute that Keras reads and assigns, held by an object of
    the model's own (a data descriptor: it shadows Keras's attribute).

    Keras assigns `train_function` (`compile()` sets None, its
    `make_train_function` the function it made) and `fit` reads it before
    every step; `AccumModel` keeps its train functions in a `TrainFunctions`
    that decides what a read gives. The holder is made at first need, since
    Keras's constructor may assign the attribute before the model's own
    `__init__` runs; reading gives `holder.current()`, assigning calls
    `holder.assign(value)`.

    Args:
        make_holder: makes a model's holder (no arguments).
        doc: the attribute's docstring, as the API reference shows it.

    Example:

    ```python
    class AccumModel(keras.Model):
        train_function = HeldAttribute(lambda: TrainFunctions(check))
    holder_of(model, "train_function")  # the model's TrainFunctions
    ```
    """

    def __init__(self, make_holder, doc=None):
        self._make_holder = make_holder
        self._key = None
        self.__doc__ = doc

    def __set_name__(self, owner, name):
        self._key = f"_{name}_holder"

    def __get__(self, model, owner=None):
        if model is None:
            return self
        holder = model.__dict__.get(self._key)
        return None if holder is None else holder.current()

    def __set__(self, model, value):
        self.holder(model).assign(value)

    def holder(self, model):
        """`model`'s holder, made at first need."""
        holder = model.__dict__.get(self._key)
        if holder is None:
            holder = self._make_holder()
            # Not through Keras's tracking: the holder is not the model's state.
            object.__setattr__(model, self._key, holder)
        return holder


def holder_of(model, name):
    """The holder of `model`'s attribute `name` if its class holds it with a
    `HeldAttribute` (made at first need), else None (a plain Keras model)."""
    held = getattr(type(model), name, None)
    return held.holder(model) if isinstance(held, HeldAttribute) else None


@contextlib.contextmanager
def training_build(model):
    """Inside, `model`'s build from its first batch is a training one: its
    `_see_batch` gets that batch (`fit` and `train_on_batch`).

    Example:

    ```python
    with training_build(model):
        keras.Model.fit(model, x, y)
    ```
    """
    model._training_build = True
    try:
        yield
    finally:
        model._training_build = False


def _functional_variant(cls):
    """`cls` with `Functional` mixed in, made once per class.

    Keras makes a `Model` subclass functional by rewriting the class's
    `__bases__` in place, for every instance that follows. We give functional
    calls their own subclass instead and leave `cls` as it was.
    """
    variant = cls.__dict__.get("_accum_functional_variant")
    if variant is None:
        variant = type(
            cls.__name__,
            (cls, layers.Functional),
            {"__module__": cls.__module__, "__qualname__": cls.__qualname__,
             "__doc__": cls.__doc__},
        )
        registered = keras.saving.get_registered_name(cls)
        if ">" in registered:
            # Serialise the variant under cls's name, and keep that name
            # resolving to cls (whose __new__ brings the variant back).
            package, _, name = registered.partition(">")
            keras.saving.register_keras_serializable(package, name)(variant)
            keras.saving.register_keras_serializable(package, name)(cls)
        cls._accum_functional_variant = variant
    return variant
