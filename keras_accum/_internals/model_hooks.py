"""Keras's private `Model` hooks that `AccumModel` overrides: `__new__` for a
functional subclass (`FunctionalVariants`), `_maybe_symbolic_build`
(`BuildFromFirstBatch`), `make_test_function` across workers, and the
`train_function` attribute Keras assigns (`HeldAttribute`).
"""

import contextlib

import keras

from keras_accum._internals import distribute, layers, optimizer, saving, trainer
from keras_accum._internals.versions import require, required

# What a fit of an AccumModel reads of the model (`check_fit`).
_MODEL_READS = (
    "_call_has_training_arg",
    "_compute_loss",
    "_loss_tracker",
    "_compile_loss",
    "_symbolic_build",
    "_distribute_strategy",
    "_flatten_layers",
)


def check_fit(model):
    """Raises `KerasInternalsChanged` before a step is made if this Keras moved
    anything a fit of `model` reaches for: the model's private attributes,
    its compiled loss's terms, its optimizer's bookkeeping, the hook
    `BuildFromFirstBatch` overrides, and saving's `_obj_type`."""
    require(model, *_MODEL_READS)
    compile_loss = model._compile_loss
    if compile_loss is not None:
        required(compile_loss, "_flat_losses")
    if model.optimizer is not None:
        optimizer.check_optimizer(model.optimizer)
    required(trainer.TensorFlowTrainer, "_maybe_symbolic_build")
    saving.check_saving()


class FunctionalVariants:
    """A functional call of a subclass gets a `Functional` variant of its own,
    where Keras would rewrite the class's `__bases__` for every later
    instance (`init_model` runs the variant's constructor)."""

    def __new__(cls, *args, **kwargs):
        if layers.functional_init_arguments(args, kwargs) and not issubclass(
            cls, layers.Functional
        ):
            cls = _functional_variant(cls)
        return super().__new__(cls, *args, **kwargs)


class BuildFromFirstBatch:
    """Builds the model before any step is traced, and hands the first training
    batch (or its spec) to `_see_batch`: `_training_build` is set while `fit`
    or `train_on_batch` builds, not `evaluate` (never split)."""

    _training_build = False

    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        # Keras builds without a strategy in its first traced step; a window
        # needs the variables before. From the data's spec, drawing nothing.
        # Keras's own fails across workers (tensorflow/tensorflow#72388).
        data_batch = trainer.symbolic_build(
            self, iterator=iterator, data_batch=data_batch, without_strategy=True
        )
        if self._training_build:
            self._training_build = False
            # Under a strategy the batch built from is one replica's, drawn;
            # the array adapter's size is the global batch.
            local = required(self, "_distribute_strategy") is not None
            size = None if iterator is None or local else trainer.array_batch_size(iterator)
            self._see_batch(data_batch, size)

    def train_on_batch(self, *args, **kwargs):
        with training_build(self):
            return super().train_on_batch(*args, **kwargs)

    def make_test_function(self, force=False):
        if self.test_function is not None and not force:
            return self.test_function
        if distribute.multi_worker(self.distribute_strategy):
            # As for training: Keras's test function fails across workers.
            self.test_function = trainer.make_replicated_function(self, self.test_step)
            return self.test_function
        return super().make_test_function(force=force)


def init_model(model, model_init, args, kwargs):
    """`model_init(*args, **kwargs)`, or for a functional call
    `Functional.__init__` on the variant (`FunctionalVariants`), which keeps
    Keras from re-basing the class (breaking every later subclass)."""
    if layers.functional_init_arguments(args, kwargs):
        layers.Functional.__init__(model, *args, **kwargs)
    else:
        model_init(*args, **kwargs)


class HeldAttribute:
    """A model attribute Keras reads and assigns (`train_function`: `compile()`
    sets None, `make_train_function` the function, `fit` reads it each step),
    held by an object of the model's own: a data descriptor, shadowing
    Keras's attribute. Reads give `holder.current()`, assignments call
    `holder.assign(value)`; the holder (`make_holder()`) is made at first
    need, as Keras's constructor may assign before the model's `__init__`.
    `doc` is the attribute's docstring, as the API reference shows it.
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
            # Not through Keras's tracking: nothing the model saves.
            object.__setattr__(model, self._key, holder)
        return holder


def holder_of(model, name):
    """The holder of `model`'s attribute `name` if its class holds it with a
    `HeldAttribute`, else None (a plain Keras model)."""
    held = getattr(type(model), name, None)
    return held.holder(model) if isinstance(held, HeldAttribute) else None


@contextlib.contextmanager
def training_build(model):
    """Inside, `model`'s build from its first batch is a training one: its
    `_see_batch` gets that batch (`fit` and `train_on_batch`)."""
    model._training_build = True
    try:
        yield
    finally:
        model._training_build = False


def _functional_variant(cls):
    """`cls` with `Functional` mixed in, made once per class; `cls` is left as
    it was."""
    variant = cls.__dict__.get("_accum_functional_variant")
    if variant is None:
        variant = type(
            cls.__name__,
            (cls, layers.Functional),
            {
                "__module__": cls.__module__,
                "__qualname__": cls.__qualname__,
                "__doc__": cls.__doc__,
            },
        )
        registered = keras.saving.get_registered_name(cls)
        if ">" in registered:
            # The variant saves under cls's name, which keeps resolving to
            # cls (whose __new__ brings the variant back).
            package, _, name = registered.partition(">")
            keras.saving.register_keras_serializable(package, name)(variant)
            keras.saving.register_keras_serializable(package, name)(cls)
        cls._accum_functional_variant = variant
    return variant
