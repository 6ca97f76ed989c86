"""Keras's optimizer bookkeeping: which variables a built optimizer was
built for, in which order, and which variables it made itself.

Keras keeps these in private attributes of `BaseOptimizer`, set by `build`
(`_trainable_variables`, `_trainable_variables_indices`, `_var_key`,
`_get_variable_index`) and by `add_variable` (`_variables`); the schedule
object it was given, in `_learning_rate` (the public `learning_rate`
evaluates it).
"""

import keras

from keras_accum._internals.versions import require, required


# What the functions below read of an optimizer, every one set by
# `BaseOptimizer.__init__` in every reviewed Keras: checked before training
# (`check_optimizer`), so that a Keras that moved one fails before the
# first step, not at an epoch's end (a flush) or a checkpoint (a save).
_BOOKKEEPING = (
    "_trainable_variables", "_trainable_variables_indices", "_var_key",
    "_get_variable_index", "_variables", "_learning_rate",
)


def wrapped(optimizer):
    """`optimizer` and every optimizer it wraps (`LossScaleOptimizer`,
    `AccumOptimizer` hold theirs as `inner_optimizer`), outermost first.
    Public Keras: a plain optimizer has no `inner_optimizer` by design."""
    while optimizer is not None:
        yield optimizer
        optimizer = getattr(optimizer, "inner_optimizer", None)


def innermost(optimizer):
    """The optimizer that does the updates: the last of `wrapped(optimizer)`."""
    *_, inner = wrapped(optimizer)
    return inner


def check_optimizer(optimizer):
    """Raises `KerasInternalsChanged` if `optimizer` (and the one it wraps)
    lacks any bookkeeping attribute the functions here read."""
    require(optimizer, *_BOOKKEEPING)
    inner = innermost(optimizer)
    if inner is not optimizer:
        require(inner, *_BOOKKEEPING)


def unknown_variables(optimizer, variables):
    """Those of `variables` a built `optimizer` was not built for."""
    # A wrapper (LossScaleOptimizer) builds its inner optimizer for the same
    # variables; before Keras 3.13 it records none of them itself.
    optimizer = innermost(optimizer)
    known = required(optimizer, "_trainable_variables_indices")
    key = required(optimizer, "_var_key")
    return [v for v in variables if key(v) not in known]


def built_variables(optimizer):
    """The variables a built `optimizer` was built for, in build order."""
    return required(optimizer, "_trainable_variables")


def build_position(optimizer, variable):
    """Where `variable` stands in a built `optimizer`'s build order.

    The position of its slot variables too, and of its gradient in the
    lists Keras's `apply` passes to `update_step`.
    """
    return required(optimizer, "_get_variable_index")(variable)


def own_variables(optimizer):
    """The variables `optimizer` made itself (`iterations`, its slots), not
    those of an optimizer it wraps: what `BaseOptimizer.variables` lists."""
    return required(optimizer, "_variables")


def learning_rate_schedule(optimizer):
    """The `LearningRateSchedule` object `optimizer` was given as its rate
    (a `LossScaleOptimizer`'s inner optimizer's), or None for a number.

    Public Keras gives the schedule's value (`optimizer.learning_rate`)
    and its config, not the object, whose state a `SampleSchedule` keeps.
    """
    rate = required(innermost(optimizer), "_learning_rate")
    if isinstance(rate, keras.optimizers.schedules.LearningRateSchedule):
        return rate
    return None
