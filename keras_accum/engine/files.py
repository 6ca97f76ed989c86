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


def all_or_nothing(model, state, load):
    """Runs `load()` (a `load_weights`); if it raises, puts back the
    model's weights, its optimizer's state and its window (`state`, its
    `AccumState`) as
    they were before, and raises.

    Example:

    ```python
    all_or_nothing(model, state, lambda: keras.Model.load_weights(model, path))
    ```
    """
    variables = list(model.weights)
    optimizer = model.optimizer
    if optimizer is not None:
        variables += list(optimizer.variables)
    saved = [v.numpy() for v in variables]
    snapshot = state.snapshot()

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
        state.restore(snapshot)
        raise


def step_continues(state, variables, accum_steps):
    """Whether a traced step can go on with `state`'s window as loaded: no window
    open, or one opened for `variables` and `accum_steps`. If not, the next
    step is made anew, and refuses it naming what differs.

    Example:

    ```python
    if not step_continues(window, model.trainable_variables, accum_steps):
        functions.invalidate()
    ```
    """
    buffers = state.buffers
    return not buffers.open_micro_batches() or binding.fits(buffers, variables, accum_steps)
