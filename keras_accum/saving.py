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

from keras_accum import _keras_internals as internals


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
