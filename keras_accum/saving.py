"""What a `.keras` file of an accumulating model can hold faithfully.

A `.keras` file is a config to rebuild the model from, plus its weights by
path. Keras's functional config rebuilds every top-level layer from its own
config, so a layer that a nested model also holds (KerasHub's tied
`ReversibleEmbedding`: the backbone embeds with it, the LM head projects with
it) comes back twice: the file does not load ("Layer 'token_embedding'
expected 1 variables, but received 0"), or loads with the tie broken. A plain
functional `keras.Model` of such a graph writes that file too; an
`AccumModel` refuses instead, before anything is written.

`wrap` of a model whose class has a config of its own (a KerasHub task)
saves that model's config instead of the graph (`wrap.RebuiltModel`), so
those files load as the unwrapped model's do.
"""

from keras_accum import _internals as internals
from keras_accum import arguments
from keras_accum.window import binding


def check_config_is_faithful(model):
    """Raises ValueError if `model`'s functional config cannot rebuild it.

    Args:
        model: a functional model (an `AccumModel` built from inputs and
            outputs, or a model `wrap` rebuilt over).

    Raises:
        ValueError: naming the shared layer, the two places that hold it and
            what to do instead.

    Example:

    ```python
    check_config_is_faithful(model)  # before writing model.keras
    ```
    """
    if not isinstance(model, internals.Functional):
        return
    shared = internals.layers_shared_across_nesting(model)
    if not shared:
        return
    layer, first, second = shared[0]
    raise ValueError(
        f"Cannot save {model.name!r} as a .keras file: layer {layer.name!r} "
        f"is used both by {first.name!r} and by {second.name!r}, a layer "
        "shared across a nested model, which Keras's functional config "
        "records twice, so the file would load with the tie broken or not at "
        "all (a plain keras.Model of this graph writes such a file). Nothing "
        "was written. Save the weights with `model.save_weights("
        "'m.weights.h5')` and rebuild the model in code, give the nested "
        "model a class with its own `get_config` (as KerasHub tasks have) and "
        "`keras_accum.wrap` it, or `model.export(path)` to serve it."
    )


def all_or_nothing(model, load):
    """Runs `load()` (a `load_weights`); if it raises, puts back the
    model's weights, its optimizer's state and its window as they were
    before, and raises.

    Example:

    ```python
    all_or_nothing(model, lambda: keras.Model.load_weights(model, path))
    ```
    """
    variables = list(model.weights)
    optimizer = model.optimizer
    if optimizer is not None:
        variables += list(optimizer.variables)
    saved = [v.numpy() for v in variables]
    window = model._window.snapshot()

    def build_optimizer():
        # The file holds the optimizer's state (see
        # building_optimizer_on_load): built as fit would build it, and
        # put back as built if the load fails.
        known = {id(v) for v in variables}
        with model.distribute_strategy.scope():
            optimizer.build(model.trainable_variables)
        for v in optimizer.variables:
            if id(v) not in known:
                variables.append(v)
                saved.append(v.numpy())

    try:
        if model.built:
            with internals.building_optimizer_on_load(optimizer, build_optimizer):
                return load()
        return load()
    except Exception:
        for v, value in zip(variables, saved):
            v.assign(value)
        model._window.restore(window)
        raise


class SavedWithWindow:
    """How an `AccumModel` saves and loads: its settings in its config, its
    window with its weights, and loading all or nothing.

    Example:

    ```python
    class AccumModel(SavedWithWindow, keras.Model): ...
    ```
    """

    def load_weights(self, filepath, *args, **kwargs):
        """`keras.Model.load_weights`, all or nothing.

        Restores the weights, the optimizer state and a pending window. An
        optimizer not built yet (a model compiled and not trained) is built
        when the file holds its state, so that the state loads (Keras alone
        skips it with a warning, and training would go on from a fresh
        optimizer). If loading fails (a corrupted or mismatched file), the
        model is left as it was before the call and the error is raised.

        Args:
            filepath: as `keras.Model.load_weights`.
            *args: as `keras.Model.load_weights`.
            **kwargs: as `keras.Model.load_weights`.

        Example:

        ```python
        model = keras_accum.AccumModel(inputs, outputs, accum_steps=4)
        model.compile("adam", "sparse_categorical_crossentropy")
        model.train_on_batch(x[:32], y[:32])  # a window left open
        model.save_weights("mid-window.weights.h5")
        model.load_weights("mid-window.weights.h5")  # the window comes back too
        ```
        """
        result = all_or_nothing(
            self, lambda: super(SavedWithWindow, self).load_weights(filepath, *args, **kwargs)
        )
        buffers = self._window.buffers
        if buffers.open_micro_batches() and not binding.fits(
            buffers, self.trainable_variables, self._settings.accum_steps
        ):
            # The traced step would continue the restored window with
            # another length or other variables: the next one is made anew
            # and refuses it, naming what differs.
            self._train_functions.invalidate()
        return result

    def save(self, filepath, *args, **kwargs):
        """`keras.Model.save`; refuses, before writing, a model whose `.keras`
        file would not load (a layer shared across a nested model, see
        `keras_accum.saving`)."""
        if str(filepath).endswith(".keras"):
            self._check_config_is_faithful()
        return super().save(filepath, *args, **kwargs)

    def _check_config_is_faithful(self):
        check_config_is_faithful(self)

    def get_config(self):
        self._check_config_is_faithful()
        return {**super().get_config(), **self._accum_config()}

    def _accum_config(self):
        # What AccumModel adds to a Keras model's config (its own arguments).
        return self._settings.config()

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        settings = arguments.settings_from_config(config)
        # Keras makes functional models with only their graph's arguments:
        # the settings are given to the model it made, before any training.
        model = super().from_config(config, custom_objects=custom_objects)
        model._configure(settings)
        return model
