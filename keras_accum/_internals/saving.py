"""Keras's saving and object tracking: keras_accum's training state in a
model's files, build shapes for `export()`, and tf_keras objects."""

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


def check_saving():
    """Raises `KerasInternalsChanged` unless Keras's saving still asks a
    saveable object its kind through `_obj_type` (which `SavedState`
    answers): before training, rather than at a checkpoint."""
    required(KerasSaveable, "_obj_type")


class SavedState(KerasSaveable):
    """Base of keras_accum's training state held by a model (the pending
    window, BatchNorm windows, the count of skipped windows).

    Keras's saving (`save`, `save_weights`, `load_weights`) visits every
    `KerasSaveable` attribute of a model under its own path and calls its
    `save_own_variables` / `load_own_variables`; a plain model loading the
    same file never looks there. Subclasses define those two methods.
    """

    def _obj_type(self):
        # Saving walks an object's attributes except those a fresh object of
        # the kind named here has (`get_attr_skipset`), and refuses kinds it
        # does not know. Every supported Keras knows "Loss" (3.8 and 3.10 do
        # not know "Operation"), and a Loss has none of the attribute names
        # of our state objects, so all of them are visited; the same kind on
        # every version keeps files loadable across versions.
        return "Loss"


def legacy_keras_hint(obj):
    """A sentence for errors about `obj` if it is a tf_keras (Keras 2) object.

    With TF_USE_LEGACY_KERAS=1 `tf.keras` is tf_keras while `import keras`
    is still Keras 3: keras_accum works with the latter only.
    """
    if type(obj).__module__.split(".")[0] != "tf_keras":
        return ""
    return (
        " This is a tf_keras (Keras 2) object, from `tf.keras` under "
        "TF_USE_LEGACY_KERAS=1; keras_accum works with Keras 3 only: build "
        "it with `import keras`, not `tf.keras`."
    )


def copy_build_shapes(source, target):
    """Records `source`'s build input shapes as `target`'s.

    `Layer.build` records them when it runs; Keras's `export()` reads them
    to serve a subclassed model. A wrapper made around a built model is
    built without running `build`.
    """
    target._build_shapes_dict = required(source, "_build_shapes_dict")


@contextlib.contextmanager
def building_optimizer_on_load(optimizer, build):
    """While Keras loads a file: an `optimizer` not yet built is built by
    `build()` when the file holds more variables for it than it has.

    Keras's `Optimizer.load_own_variables` skips the saved state of an
    optimizer that is not built, with only a warning ("Skipping variable
    loading for optimizer"), and training goes on from a fresh state: the
    iterations, the moments and the learning-rate schedule's step lost. The
    file's store tells how many variables it holds for the optimizer, so
    the optimizer is built only when there is state to load (a file saved
    before any training holds `iterations` and the learning rate only,
    which load as they are). Keras finds `load_own_variables` on the
    object, so an instance attribute shadows the method for this load.

    If a Keras found the method on the class instead, the state would be
    skipped as before this, with Keras's own warning: loud, not silent; and
    tests/test_saving.py's loads of an unbuilt optimizer's state fail.

    Example:

    ```python
    with building_optimizer_on_load(model.optimizer, build):
        keras.Model.load_weights(model, path)
    ```
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
