"""`wrap`: accumulation for a model that already exists, sharing its weights."""

from __future__ import annotations

import sys
import types

import keras

from keras_accum import _internals as internals
from keras_accum.arguments import MODEL_ARGUMENTS, check_keywords
from keras_accum.engine.files import check_config_is_faithful
from keras_accum.model import AccumModel


class _CompiledAsItsModel:
    """`compile()` of a wrapper: as the wrapped model's own `compile`, where its
    class has one (a KerasHub task: its default optimizer, loss and metrics,
    its `sampler`). The model compiles itself (its defaults read from its own
    attributes), and the wrapper gets exactly the objects that handed to Keras.
    """

    def _model_compiled_as(self):
        raise NotImplementedError

    def compile(self, *args, **kwargs):
        model = self._model_compiled_as()
        if type(model).compile is keras.Model.compile:
            return super().compile(*args, **kwargs)
        model.compile(*args, **kwargs)
        arguments = internals.compile_arguments(model)
        if "auto_scale_loss" in kwargs:  # not among what Keras keeps
            arguments["auto_scale_loss"] = kwargs["auto_scale_loss"]
        return super().compile(**arguments)

    def compile_from_config(self, config):
        # What Keras's `compile` received, given to it again (Keras's own
        # skips a class with a `compile` of its own).
        config = keras.saving.deserialize_keras_object(config)
        super().compile(**config)
        if self.built:
            self.optimizer.build(self.trainable_variables)


@keras.saving.register_keras_serializable(package="keras_accum")
class WrappedModel(_CompiledAsItsModel, AccumModel):
    """An `AccumModel` around a subclassed model; made by `keras_accum.wrap`.

    Its only layer is the wrapped model, so its weights are that model's
    weights, in the same order.

    Args:
        model: the `keras.Model` to train.
        accum_steps: micro-batches per optimizer update.
        **kwargs: passed to `AccumModel` (e.g. `batchnorm`) and `keras.Model`.

    Example:

    ```python
    class Net(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(10, activation="softmax")

        def call(self, x):
            return self.dense(x)

    model = keras_accum.wrap(Net(), accum_steps=4)  # a WrappedModel
    model.compile("adam", "sparse_categorical_crossentropy")
    model.fit(x, y, batch_size=32, verbose=0)
    ```
    """

    def __init__(self, model, accum_steps=1, **kwargs):
        kwargs.setdefault("name", model.name)
        super().__init__(accum_steps=accum_steps, **kwargs)
        self.wrapped = model
        self.accumulation.model_to_split = model  # coupled_from names its parts
        internals.called_like(self, model)
        if model.built:
            # Nothing of its own to build. The input shapes the wrapped
            # model was built for are what `export()` serves.
            self.built = True
            internals.copy_build_shapes(model, self)

    def call(self, inputs, training=None):
        return self.wrapped(inputs, training=training)

    def _model_compiled_as(self):
        return self.wrapped

    def get_config(self):
        config = super().get_config()
        config["model"] = keras.saving.serialize_keras_object(self.wrapped)
        return config

    @classmethod
    def from_config(cls, config, custom_objects=None):
        return _from_config(cls, config, custom_objects)


@keras.saving.register_keras_serializable(package="keras_accum")
class RebuiltModel(_CompiledAsItsModel, AccumModel):
    """A functional `AccumModel` over the layers of a model whose class has a
    config of its own (a KerasHub task, a registered functional subclass);
    made by `keras_accum.wrap`.

    It trains the model's layers in place and saves the model's own config
    with the accumulation settings, not the layer graph (which cannot record a
    layer a nested model also holds, as KerasHub's tied embedding): loading
    rebuilds the model from its config and wraps it again.

    Args:
        model: the functional `keras.Model` to train.
        **kwargs: passed to `AccumModel` (`accum_steps`, `batchnorm`, ...).

    Example:

    ```python
    class Classifier(keras.Model):  # functional, of a class of its own
        def __init__(self, **kwargs):
            inputs = keras.Input((4,))
            super().__init__(inputs, keras.layers.Dense(2)(inputs), **kwargs)

    model = keras_accum.wrap(Classifier(), accum_steps=4)
    assert type(model).__name__ == "RebuiltModel"  # as for a KerasHub task
    ```
    """

    def __new__(cls, model, **kwargs):
        return super().__new__(cls, *_graph(model), **kwargs)

    def __init__(self, model, **kwargs):
        kwargs.setdefault("name", model.name)
        super().__init__(*_graph(model), **kwargs)
        # Untracked: its layers are this model's already (saved once).
        self._source = types.SimpleNamespace(model=model)

    def _model_compiled_as(self):
        return self._source.model

    def _check_config_is_faithful(self):
        source = self._source.model
        if type(source).get_config is internals.Functional.get_config:
            # The model's own config is the layer graph after all.
            check_config_is_faithful(source)

    def _model_config(self):
        config = {"name": self.name, "trainable": self.trainable}
        model = keras.saving.serialize_keras_object(self._source.model)
        # The wrapper is what is compiled (a task's own compile config
        # would only make loading warn).
        model.pop("compile_config", None)
        config["model"] = model
        return config

    @classmethod
    def from_config(cls, config, custom_objects=None):
        return _from_config(cls, config, custom_objects)


def _from_config(cls, config, custom_objects):
    """A wrapper class's model from `config["model"]`, wrapped as saved."""
    config = dict(config)
    model = keras.saving.deserialize_keras_object(
        config.pop("model"), custom_objects=custom_objects
    )
    return cls(model, **config)


def wrap(
    model: keras.Model,
    accum_steps: int = 1,
    skip_nonfinite: bool = False,
    batchnorm: str = "window",
    micro_batch_size: int | str | None = None,
    noise_scale: bool = False,
    accum_dtype: str | None = None,
    coupled_from: str | list[str] | None = None,
    **kwargs,
) -> AccumModel:
    """Returns an `AccumModel` that trains `model`'s own layers and weights.

    Training the result trains `model`: no weights are copied. A functional or
    built `Sequential` model is rebuilt as a functional `AccumModel` over the
    same layers (a `RebuiltModel` where its class has its own config); any
    other model is the single layer of a `WrappedModel`. The wrapper compiles
    as the model's own `compile` would.

    Args:
        model: a `keras.Model` (Sequential, functional or subclassed).
        accum_steps: as `AccumModel`'s.
        skip_nonfinite: as `AccumModel`'s.
        batchnorm: as `AccumModel`'s.
        micro_batch_size: as `AccumModel`'s.
        noise_scale: as `AccumModel`'s.
        accum_dtype: as `AccumModel`'s.
        coupled_from: as `AccumModel`'s.
        **kwargs: none are taken: a misspelt argument raises a TypeError naming
            the argument it is close to.

    Returns:
        An `AccumModel`, not yet compiled.

    Example:

    ```python
    base = keras.applications.MobileNetV3Small(weights=None)
    model = keras_accum.wrap(base, accum_steps=8)
    model.compile("adam", "sparse_categorical_crossentropy")
    ```
    """
    check_keywords(kwargs, "wrap()", MODEL_ARGUMENTS)
    # Checked once, by the AccumModel made below, before it changes anything.
    settings = dict(
        accum_steps=accum_steps,
        accum_dtype=accum_dtype,
        skip_nonfinite=skip_nonfinite,
        batchnorm=batchnorm,
        micro_batch_size=micro_batch_size,
        noise_scale=noise_scale,
        coupled_from=coupled_from,
    )
    if not isinstance(model, keras.Model):
        raise TypeError(
            "`model` must be a keras.Model. "
            f"Received: model={model!r} (of type {type(model).__name__})."
            + internals.legacy_keras_hint(model)
        )
    if isinstance(model, AccumModel):
        raise ValueError(
            f"`model` is already an AccumModel (accum_steps="
            f"{model.accum_steps}). Set `model.accum_steps = {accum_steps}` "
            "instead of wrapping it again."
        )
    # Every kind of model: a functional subclass is rebuilt from its graph,
    # which would drop its overrides as silently.
    _check_no_step_overrides(model)
    graph = _graph(model)
    if graph is not None and _has_own_class(model):
        # Its own config is what saving needs (RebuiltModel).
        return RebuiltModel(model, **settings)
    if graph is not None:
        return AccumModel(*graph, name=model.name, **settings)
    return WrappedModel(model, **settings)


# What fit, evaluate and predict call on the model they run. A wrapper runs
# its own, so the wrapped model's versions would be silently ignored.
# A `fit` of its own (KerasHub's text-to-image tasks raise there: not
# trainable by `fit`) would be bypassed alike; a KerasHub task's, which
# only preprocesses, is refused only with a preprocessor to apply.
_STEP_METHODS = (
    "fit",
    "train_step",
    "test_step",
    "predict_step",
    "compute_loss",
    "compute_metrics",
)


def _check_no_step_overrides(model):
    overridden = [
        name
        for name in _STEP_METHODS
        if getattr(type(model), name) is not getattr(keras.Model, name)
    ]
    if "fit" in overridden and _is_kerashub_task_fit(model):
        # A KerasHub task's `fit` (and `evaluate`, `predict`) only maps its
        # preprocessor over the data: without one, it is Keras's.
        _check_no_preprocessor(model)
        overridden.remove("fit")
    if not overridden:
        return
    cls = type(model).__name__
    names = ", ".join(f"`{name}`" for name in overridden)
    if isinstance(model, (internals.Functional, keras.Sequential)):
        how = "wrap() rebuilds a functional model from its layer graph, with the accumulating step"
        build = (
            f" (built the same way, `{cls}(inputs, outputs)`)"
            if isinstance(model, internals.Functional)
            else ""
        )
    else:
        how = "the wrapper runs its own training step around the model's `call`"
        build = ""
    raise ValueError(
        f"`model` is a {cls}, which overrides {names}; wrap() cannot honour "
        f"that: {how}, so the override would be silently ignored. Received: "
        f"model={model!r}. Make the class subclass `keras_accum.AccumModel` "
        f"instead of `keras.Model`{build} (its `compute_loss`, "
        "`compute_metrics`, `test_step` and `predict_step` overrides are "
        "honoured), or keep a custom `train_step` and compile the plain "
        "model with `optimizer=keras_accum.AccumOptimizer(...)`."
    )


def _is_kerashub_task_fit(model):
    """Whether `model`'s `fit` is `keras_hub.models.Task`'s (a preprocessing one)."""
    hub_models = getattr(sys.modules.get("keras_hub"), "models", None)  # imported if a task
    task = getattr(hub_models, "Task", None)
    return task is not None and type(model).fit is task.fit


def _check_no_preprocessor(task):
    preprocessor = task.preprocessor
    if preprocessor is None:
        return
    raise ValueError(
        f"`model` is a {type(task).__name__} with a preprocessor: its `fit`, "
        "`evaluate` and `predict` preprocess the data they are given, the "
        "wrapper's do not, so its layers would be fed unprocessed data. "
        f"Received: model.preprocessor={preprocessor!r}. Map the preprocessor "
        "over your data and wrap the task without it: "
        "`dataset = dataset.map(task.preprocessor)`, then "
        "`task.preprocessor = None` before `keras_accum.wrap(task, ...)` (set "
        "it back after training for `generate`), or build the task with "
        "`preprocessor=None`."
    )


def _has_own_class(model):
    """Whether `model`'s class is its own, not Keras's `Functional` or `Sequential`."""
    return type(model) not in (internals.Functional, keras.Sequential)


def _graph(model):
    """`(inputs, outputs)` of a model defined by a layer graph, else None."""
    try:
        if isinstance(model, internals.Functional):
            return model.input, model.output  # keeps dict/nested structure
        if isinstance(model, keras.Sequential):
            (inputs,), (outputs,) = model.inputs, model.outputs
            return inputs, outputs
    except (AttributeError, ValueError):
        pass  # a Sequential without an Input: no graph to share yet
    return None
