"""Keras's optimizer bookkeeping, private attributes of `BaseOptimizer`: the
variables a built optimizer was built for and their order, those it made
itself, and the schedule object it was given.
"""

import keras

from keras_accum._internals.versions import require, required

# What the functions below read, set by `BaseOptimizer.__init__` in every
# reviewed Keras: checked before training (`check_optimizer`), so a Keras
# that moved one fails before the first step, not at a flush or a save.
_BOOKKEEPING = (
    "_trainable_variables",
    "_trainable_variables_indices",
    "_var_key",
    "_get_variable_index",
    "_variables",
    "_learning_rate",
)


def wrapped(optimizer):
    """`optimizer` and every optimizer it wraps (as `inner_optimizer`:
    `LossScaleOptimizer`, `AccumOptimizer`), outermost first. Public Keras."""
    while optimizer is not None:
        yield optimizer
        optimizer = getattr(optimizer, "inner_optimizer", None)


def innermost(optimizer):
    """The optimizer that does the updates: the last of `wrapped(optimizer)`."""
    *_, inner = wrapped(optimizer)
    return inner


def check_optimizer(optimizer):
    """Raises `KerasInternalsChanged` if `optimizer` (or the one it wraps)
    lacks the bookkeeping read here."""
    require(optimizer, *_BOOKKEEPING)
    inner = innermost(optimizer)
    if inner is not optimizer:
        require(inner, *_BOOKKEEPING)


def unknown_variables(optimizer, variables):
    """Those of `variables` a built `optimizer` was not built for."""
    # Before Keras 3.13 a LossScaleOptimizer records none of its inner
    # optimizer's variables itself.
    optimizer = innermost(optimizer)
    known = required(optimizer, "_trainable_variables_indices")
    key = required(optimizer, "_var_key")
    return [v for v in variables if key(v) not in known]


def built_variables(optimizer):
    """The variables a built `optimizer` was built for, in build order."""
    return required(optimizer, "_trainable_variables")


def build_position(optimizer, variable):
    """Where `variable` stands in a built `optimizer`'s build order: also its
    slot variables' position, and its gradient's in what Keras's `apply`
    passes to `update_step`."""
    return required(optimizer, "_get_variable_index")(variable)


def own_variables(optimizer):
    """The variables `optimizer` made itself (`iterations`, its slots), not a
    wrapped one's: what `BaseOptimizer.variables` lists."""
    return required(optimizer, "_variables")


def learning_rate_schedule(optimizer):
    """The `LearningRateSchedule` object `optimizer` (or its inner optimizer)
    was given as its rate, or None. Public Keras gives its value, not the
    object, whose count a `SampleSchedule` keeps."""
    rate = required(innermost(optimizer), "_learning_rate")
    if isinstance(rate, keras.optimizers.schedules.LearningRateSchedule):
        return rate
    return None
