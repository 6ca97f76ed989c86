"""Model files: configs that rebuild the model faithfully, loads that are
all or nothing.

Keras's functional config rebuilds every top-level layer from its own
config, so a layer a nested model also holds (KerasHub's tied embedding)
comes back twice: such a file does not load, or loads with the tie broken.
A plain `keras.Model` writes it anyway; an `AccumModel` refuses before
writing (`wrap` of a class with its own config saves that config instead).
"""

from keras_accum import _internals as internals
from keras_accum.window import binding


def check_config_is_faithful(model):
    """Raises ValueError, naming the shared layer and what to do, if
    `model`'s functional config cannot rebuild it."""
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
    """Runs `load()` (a `load_weights`); if it raises, puts the model's
    weights, its optimizer's state and its window (`state`) back as they
    were, and raises."""
    variables = list(model.weights)
    optimizer = model.optimizer
    if optimizer is not None:
        variables += list(optimizer.variables)
    saved = [v.numpy() for v in variables]
    snapshot = state.snapshot()

    def build_optimizer():
        # The file holds the optimizer's state: built as fit would build
        # it (and unbuilt again if the load fails).
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
    """Whether a traced step can go on with `state`'s window as loaded: none
    open, or one opened for `variables` and `accum_steps`."""
    buffers = state.buffers
    return not buffers.open_micro_batches() or binding.fits(buffers, variables, accum_steps)
