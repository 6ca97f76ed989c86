"""Which variables a window belongs to, and whether an open window may go on.

A window is only ever applied to the variables it was computed for: bound by
identity when the step is made or, restored from a file, by position (as Keras
pairs weights). Other variables or another window length are refused, naming
what differs and what to do.
"""

from typing import NamedTuple

import tensorflow as tf

from keras_accum.window import slices


class GradientLayout(NamedTuple):
    """Which of a window's gradients are None (`absent`) and which sparse: known
    once the step is traced, saved with the window. The optimizer must see None
    for an absent gradient, as for a big batch: a zero would still move Adam."""

    absent: frozenset = frozenset()
    sparse: frozenset = frozenset()
    statistic: str = slices.SQUARE

    @classmethod
    def of(cls, grads, statistic):
        """The layout of `grads` (one per variable; None where absent)."""
        return cls(
            frozenset(i for i, g in enumerate(grads) if g is None),
            frozenset(i for i, g in enumerate(grads) if isinstance(g, tf.IndexedSlices)),
            statistic,
        )


class Binding:
    """Holds the window's variables out of sight of `tf.Module` tracking, so
    they are neither saved with the buffers nor listed in their `variables`."""

    __slots__ = ("variables",)

    def __init__(self, variables=None):
        self.variables = variables


def bind(buffers, variables, accum_steps, strategy=None):
    """Makes `buffers` the window of `variables`, `accum_steps` micro-batches long;
    eager. An open window must be of these variables (or, restored from a file,
    of the same shapes in order) and length. True if buffers were replaced."""
    variables = list(variables)
    if buffers.open_micro_batches():
        check_fits(buffers, variables, accum_steps)
        buffers.binding.variables = variables
        return False
    bound = buffers.window_variables
    if buffers.built and (
        same(bound, variables) or (bound is None and buffers.shapes() == shapes(variables))
    ):
        buffers.binding.variables = variables
        buffers.accum_steps.assign(accum_steps)
        return False
    replaced = buffers.built
    buffers.build(variables, accum_steps, strategy)
    return replaced


def fits(buffers, variables, accum_steps):
    """Whether the open window may go on with `variables` and `accum_steps`."""
    try:
        check_fits(buffers, list(variables), accum_steps)
    except ValueError:
        return False
    return True


def check_fits(buffers, variables, accum_steps):
    """Raises, naming what differs, if the open window cannot go on."""
    bound = buffers.window_variables
    pending = buffers.open_micro_batches()
    if bound is None:
        if buffers.shapes() != shapes(variables):
            raise ValueError(
                f"This model has a pending window of {pending} "
                "micro-batches whose gradient buffers (shapes "
                f"{buffers.shapes()}) do not fit its trainable variables "
                f"(shapes {shapes(variables)}). It was restored from "
                "another model or the trainable set changed: restore a "
                "matching checkpoint, load weights saved at a window "
                "boundary, or call `reset_window()` to discard it."
            )
    elif not same(bound, variables):
        raise ValueError(
            f"The open window ({pending} micro-batches) holds "
            f"gradients for the variables {names(bound)}, but training "
            f"now updates {names(variables)} (the trainable set or the "
            "model changed with a window open). Call `flush()` before "
            "changing what is trainable to apply the window to the "
            "variables it was computed for, or `reset_window()` to "
            "discard it."
        )
    window_length = buffers.window_length()
    if window_length != accum_steps:
        raise ValueError(
            f"This model's pending window ({pending} micro-batches) "
            f"was accumulated with accum_steps={window_length}, but the "
            f"model now has accum_steps={accum_steps}. Set "
            f"`model.accum_steps = {window_length}` to finish the window "
            "as it began, call `model.flush()` to apply it now, or "
            "`model.reset_window()` to discard it."
        )


def check_gradients(buffers, grads, variables=None):
    """Raises unless `grads` (for `variables`, if known) are for the buffers'
    variables; checked when a step is traced."""
    if not buffers.built:
        raise ValueError(
            "The accumulator has no buffers yet: `bind` it to the "
            "variables before adding gradients."
        )
    if len(grads) != len(buffers.acc_grads) or (
        variables is not None and not same(buffers.window_variables, variables)
    ):
        raise ValueError(
            "These gradients are not for this window's variables: "
            f"{len(grads)} gradients for "
            f"{names(variables) if variables is not None else '?'}, "
            f"the window holds {len(buffers.acc_grads)} for "
            f"{names(buffers.window_variables)}."
        )


def same(a, b):
    """Whether `a` and `b` are the same variables, one by one, by identity."""
    return a is not None and len(a) == len(b) and all(x is y for x, y in zip(a, b))


def shapes(variables):
    return [tuple(v.shape) for v in variables]


def names(variables):
    if variables is None:
        return "(not yet bound)"
    return [getattr(v, "path", None) or getattr(v, "name", "?") for v in variables]
