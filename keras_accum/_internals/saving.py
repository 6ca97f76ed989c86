"""Keras's saving and object tracking: keras_accum's variables in a model's
files, build shapes for `export()`, and tf_keras objects."""

import contextlib

from keras_accum._internals.versions import is_missing, reach, required

KerasSaveable = reach("keras.src.saving.keras_saveable", "KerasSaveable")
_no_tracking = reach("keras.src.utils.tracking", "no_automatic_dependency_tracking")


def no_automatic_dependency_tracking(method):
    """Keras's decorator; used at import, so a missing one fails on call."""
    if not is_missing(_no_tracking):
        return _no_tracking(method)

    def moved(*_args, **_kwargs):
        _no_tracking()  # raises KerasInternalsChanged, naming the change

    return moved


def written_otherwise(model):
    """The variables of `model` that Keras's weights files leave out or write
    as other values, which a backup keeps beside them.

    A layer with LoRA enabled is written with its adapters merged into its
    kernel, and loads with them zero (the same predictions, another
    training); a seed generator's state is not written at all (Dropout would
    draw other masks). Both are read here by public names: `lora_enabled`,
    and the seed state's variable name.
    """
    found, seen = [], set()
    for layer in required(model, "_flatten_layers")(include_self=False, recursive=True):
        if getattr(layer, "lora_enabled", False):
            found += [v for v in layer.variables if id(v) not in seen]
            seen |= {id(v) for v in layer.variables}
    for variable in model.variables:
        if variable.name == "seed_generator_state" and id(variable) not in seen:
            found.append(variable)
            seen.add(id(variable))
    return found


def check_saving():
    """Raises `KerasInternalsChanged` unless Keras's saving still asks a
    saveable object its kind through `_obj_type` (which `SavedState`
    answers): before training, rather than at a checkpoint."""
    required(KerasSaveable, "_obj_type")


class SavedState(KerasSaveable):
    """Base of the parts of the state (`AccumState`) a model's files hold (the
    window, its BatchNorm moments, the skipped windows' count): Keras's
    saving calls every `KerasSaveable` attribute's `save_own_variables` /
    `load_own_variables` (subclasses define them) under its own path, where
    a plain model loading the file never looks.
    """

    def _obj_type(self):
        # Saving skips the attributes a fresh object of this kind has
        # (`get_attr_skipset`) and refuses unknown kinds. Every supported
        # Keras knows "Loss" (3.8 and 3.10 not "Operation"), which has none of
        # our attribute names; one kind everywhere keeps files portable.
        return "Loss"


def legacy_keras_hint(obj):
    """A sentence for errors about `obj` if it is a tf_keras (Keras 2) object:
    with TF_USE_LEGACY_KERAS=1 `tf.keras` is tf_keras, `import keras` Keras 3.
    """
    if type(obj).__module__.split(".")[0] != "tf_keras":
        return ""
    return (
        " This is a tf_keras (Keras 2) object, from `tf.keras` under "
        "TF_USE_LEGACY_KERAS=1; keras_accum works with Keras 3 only: build "
        "it with `import keras`, not `tf.keras`."
    )


def copy_build_shapes(source, target):
    """Records `source`'s build input shapes as `target`'s: Keras's `export()`
    reads them to serve a subclassed model, and a wrapper around a built
    model is built without running `Layer.build`, which records them.
    """
    target._build_shapes_dict = required(source, "_build_shapes_dict")


@contextlib.contextmanager
def building_optimizer_on_load(optimizer, build):
    """While Keras loads a file, an unbuilt `optimizer` is built by `build()`
    when the file holds more variables for it than it has.

    Keras's `Optimizer.load_own_variables` skips an unbuilt optimizer's variables
    with only a warning (iterations, moments, schedule step lost). Keras
    finds the method on the object, which an instance attribute shadows for
    this load (tests/test_saving.py fails if it looks on the class).
    """
    if optimizer is None or optimizer.built:
        yield
        return
    load = optimizer.load_own_variables

    def load_own_variables(store):
        if not optimizer.built and len(store.keys()) > len(optimizer.variables):
            build()
        return load(store)

    optimizer.load_own_variables = load_own_variables
    try:
        yield
    finally:
        del optimizer.load_own_variables
