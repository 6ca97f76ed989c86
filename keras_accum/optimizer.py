"""`AccumOptimizer`: the same accumulation as an optimizer wrapper, for custom loops."""

from __future__ import annotations

import numbers
from collections.abc import Iterable

import keras
import numpy as np
import tensorflow as tf

from keras_accum import _internals as internals
from keras_accum import scaling, window
from keras_accum.arguments import (
    OPTIMIZER_ARGUMENTS,
    check_accum_dtype,
    check_accum_steps,
    check_keywords,
    check_skip_nonfinite,
)
from keras_accum.window import AccumState, slices


def check_not_accumulating(optimizer, accum_steps):
    """Refuses an optimizer that already accumulates: one or the other."""
    for opt in internals.wrapped(optimizer):
        steps = getattr(opt, "gradient_accumulation_steps", None)
        if steps or isinstance(opt, AccumOptimizer):
            what = (
                f"is an AccumOptimizer (accum_steps={opt.accum_steps})"
                if isinstance(opt, AccumOptimizer)
                else f"has `gradient_accumulation_steps={steps}`"
            )
            raise ValueError(
                f"The optimizer {what}, and accumulation is also asked for "
                f"here (`accum_steps={accum_steps}`). Use one or the other: "
                "an AccumModel with a plain optimizer, or an AccumOptimizer "
                "(or Keras's `gradient_accumulation_steps`) on a plain model."
            )


def _check_weight(weight):
    """Refuses a micro-batch weight that is not a number >= 0, before anything
    is added: a string would reach TensorFlow's arithmetic, a negative weight
    would subtract a micro-batch."""
    if weight is None:
        return
    if isinstance(weight, keras.Variable):
        weight = weight.value
    if isinstance(weight, (bool, np.bool_)) or not (
        isinstance(weight, numbers.Real)
        or (isinstance(weight, np.ndarray) and weight.dtype.kind in "iuf")
        or (tf.is_tensor(weight) and (weight.dtype.is_floating or weight.dtype.is_integer))
    ):
        raise TypeError(
            "`weight` must be a number >= 0 (the micro-batch's number of "
            "samples, say), or a numeric scalar tensor. Received: "
            f"weight={weight!r} (of type {type(weight).__name__})."
        )
    shape = getattr(weight, "shape", ())
    if shape is not None and len(shape) > 0:
        raise ValueError(f"`weight` must be a scalar. Received: weight of shape {tuple(shape)}.")
    # A traced tensor's value is known only at run time: not checked.
    if isinstance(weight, tf.Variable):
        value = weight.numpy() if tf.executing_eagerly() else None
    elif tf.is_tensor(weight):
        value = tf.get_static_value(weight)
    else:
        value = weight
    if value is not None and not np.asarray(value) >= 0:
        raise ValueError(
            "`weight` must be >= 0: it weights the micro-batch's gradient in "
            f"the window's mean. Received: weight={np.asarray(value).item()!r}."
        )


@keras.saving.register_keras_serializable(package="keras_accum")
class AccumOptimizer(keras.optimizers.Optimizer):
    """Wraps an optimizer so that every `accum_steps` calls make one update.

    Each `apply` (or `apply_gradients`) adds one micro-batch's gradients to
    the window; every `accum_steps`-th applies its mean gradient through
    `optimizer`, and `iterations` (so learning-rate schedules too) counts
    updates. `weight=` makes an uneven window exactly the big batch's mean.
    Sparse gradients reach `optimizer` as the big batch's `IndexedSlices`
    (docs/sparse.md). For `model.fit`, prefer `AccumModel`, which weights by
    samples and applies the window open at an epoch's end (docs/ways-in.md).

    Args:
        optimizer: the `keras.optimizers.Optimizer` that makes the updates.
        accum_steps: micro-batches per update, an integer >= 1.
        accum_dtype: dtype of the window's gradient sums; default float32
            (float64 for float64 variables).
        skip_nonfinite: if True, a window whose gradient holds a NaN or an
            Inf makes no update and is discarded; `skipped_windows` counts
            them. Default False.
        name: optional name.

    Example:

    ```python
    model = existing_model
    opt = keras_accum.AccumOptimizer(keras.optimizers.Adam(1e-3), accum_steps=4)
    for x, y in dataset:  # micro-batches
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply(grads, model.trainable_variables, weight=len(x))
    opt.flush()  # a partial last window
    ```
    """

    def __init__(
        self,
        optimizer: keras.optimizers.Optimizer,
        accum_steps: int = 1,
        accum_dtype: str | tf.dtypes.DType | None = None,
        skip_nonfinite: bool = False,
        name: str | None = None,
        **kwargs,
    ) -> None:
        accum_steps = check_accum_steps(accum_steps)
        if not isinstance(optimizer, keras.optimizers.Optimizer):
            raise TypeError(
                "`optimizer` must be a keras.optimizers.Optimizer. "
                f"Received: optimizer={optimizer!r} "
                f"(of type {type(optimizer).__name__})." + internals.legacy_keras_hint(optimizer)
            )
        check_not_accumulating(optimizer, accum_steps)
        check_skip_nonfinite(skip_nonfinite)
        accum_dtype = check_accum_dtype(accum_dtype)
        # A misspelt argument of ours is named as such; any other belongs to
        # the inner optimizer.
        check_keywords(kwargs, "AccumOptimizer", OPTIMIZER_ARGUMENTS, passed_on=())
        if kwargs:
            raise ValueError(
                "AccumOptimizer takes no optimizer arguments of its own; set "
                "them on the inner optimizer. Received: "
                f"{', '.join(f'{k}={v!r}' for k, v in kwargs.items())}."
            )
        super().__init__(learning_rate=0.0, name=name)
        self.inner_optimizer = optimizer
        self._accum_steps = accum_steps
        self._accum_state = AccumState.new(accum_dtype, skip_nonfinite)
        # The files' path (the skip count: `_accumulator/nonfinite`).
        self._accumulator = self._accum_state.buffers

    @property
    def skipped_windows(self) -> int:
        """Windows skipped for a non-finite gradient (0 unless `skip_nonfinite`).

        Example:

        ```python
        opt = keras_accum.AccumOptimizer(keras.optimizers.SGD(), skip_nonfinite=True)
        assert opt.skipped_windows == 0
        ```
        """
        return self._accum_state.skipped_windows

    @property
    def accum_steps(self) -> int:
        """Micro-batches per update (fixed at construction).

        Example:

        ```python
        opt = keras_accum.AccumOptimizer(keras.optimizers.SGD(), accum_steps=4)
        assert opt.accum_steps == 4
        ```
        """
        return self._accum_steps

    @internals.no_automatic_dependency_tracking
    def build(self, var_list):
        # Before any update: fails now if this Keras moved the optimizer
        # bookkeeping apply and flush read.
        internals.check_optimizer(self)
        self.inner_optimizer.build(var_list)
        self._accumulator.bind(var_list, accum_steps=self._accum_steps)
        super().build(var_list)

    @property
    def variables(self) -> list[keras.Variable]:
        return internals.own_variables(self) + self.inner_optimizer.variables

    def apply(
        self,
        grads: Iterable[tf.Tensor | tf.IndexedSlices | None],
        trainable_variables: Iterable[keras.Variable] | None = None,
        weight: float | tf.Tensor | None = None,
    ) -> None:
        """Adds one micro-batch to the window; applies the window when it is full.

        Args:
            grads: gradients, one per variable (None for no gradient).
            trainable_variables: any subset of the variables the optimizer
                was built with, in any order; all of them if None.
            weight: this micro-batch's weight (its number of samples, say),
                >= 0: a number or a numeric scalar tensor. The update uses the
                window's weighted mean gradient. Default: 1 for each.

        Raises:
            ValueError: a variable the optimizer was not built with, a
                negative weight, or unequal numbers of gradients and
                variables; nothing is added.
            TypeError: a weight that is not a number.

        Example:

        ```python
        variable = keras.Variable([1.0, 2.0])
        opt = keras_accum.AccumOptimizer(keras.optimizers.SGD(0.1), accum_steps=2)
        opt.apply([tf.constant([1.0, 1.0])], [variable], weight=3)
        opt.apply([tf.constant([5.0, 5.0])], [variable], weight=1)  # updates
        # the weighted mean gradient, (3 * 1 + 1 * 5) / 4 = 2: 1 - 0.1 * 2
        np.testing.assert_allclose(variable.numpy(), [0.8, 1.8], rtol=1e-6)
        ```
        """
        if trainable_variables is None:
            trainable_variables = internals.built_variables(self)
        trainable_variables = list(trainable_variables)
        grads = list(grads)
        _check_weight(weight)
        if len(grads) != len(trainable_variables):
            raise ValueError(
                "`grads` and `trainable_variables` must have the same length, "
                f"one gradient per variable. Received: {len(grads)} gradients "
                f"for {len(trainable_variables)} variables."
            )
        if not self.built:
            with keras.name_scope(self.name, caller=self):
                self.build(trainable_variables)
        unknown = internals.unknown_variables(self, trainable_variables)
        if unknown:
            raise ValueError(
                "AccumOptimizer.apply received gradients for variables it was "
                f"not built with: {[v.path for v in unknown]}. Its window "
                "holds one buffer per variable of its first `apply` (or "
                "`build`): "
                f"{[v.path for v in internals.built_variables(self)]}. Pass "
                "those variables (any subset, in any order), or make a new "
                "AccumOptimizer for the new variables, after `flush()`ing "
                "this one."
            )
        # Buffers follow the build order; put each gradient in its place.
        ordered = [None] * len(internals.built_variables(self))
        for g, v in zip(grads, trainable_variables):
            ordered[internals.build_position(self, v)] = g
        factor = scaling.into_window(weight, scaling.loss_scale_of(self.inner_optimizer))
        self._accumulator.add(
            ordered,
            1.0 if weight is None else weight,
            grad_scale=factor,
            statistic=slices.statistic_of(self.inner_optimizer),
            window_occurrences=self._accum_steps,
        )
        self._accum_state.when_full(self._accum_steps, self._apply_window)

    def _apply_window(self):
        window.close(self._accum_state, self.inner_optimizer)

    def apply_gradients(
        self, grads_and_vars: Iterable[tuple], weight: float | tf.Tensor | None = None
    ) -> tf.Variable:
        grads, variables = zip(*grads_and_vars)
        self.apply(grads, variables, weight=weight)
        return self.iterations

    def flush(self) -> None:
        """Applies the open window now, if any; eagerly or inside `tf.function`.

        Example:

        ```python
        variable = keras.Variable([1.0])
        opt = keras_accum.AccumOptimizer(keras.optimizers.SGD(0.1), accum_steps=4)
        opt.apply([tf.constant([1.0])], [variable])  # 1 of 4 micro-batches
        opt.flush()                                   # applied now
        assert int(opt.iterations) == 1
        ```
        """
        if self.built:
            self._accumulator.when_open(self._apply_window)

    def reset_window(self) -> None:
        """Discards the open window without an update, e.g. one holding a NaN
        gradient; eagerly or inside `tf.function`.

        Example:

        ```python
        variable = keras.Variable([1.0])
        opt = keras_accum.AccumOptimizer(keras.optimizers.SGD(0.1), accum_steps=4)
        opt.apply([tf.constant([float("nan")])], [variable])
        opt.reset_window()                            # dropped, no update
        assert int(opt.iterations) == 0 and float(variable.numpy()[0]) == 1.0
        ```
        """
        if self.built:
            self._accumulator.reset()

    @property
    def iterations(self) -> keras.Variable:
        return self.inner_optimizer.iterations

    @property
    def learning_rate(self) -> keras.Variable | tf.Tensor:
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(
        self, learning_rate: float | keras.optimizers.schedules.LearningRateSchedule
    ) -> None:
        self.inner_optimizer.learning_rate = learning_rate

    def scale_loss(self, loss):
        return self.inner_optimizer.scale_loss(loss)

    def finalize_variable_values(self, var_list):
        self.inner_optimizer.finalize_variable_values(var_list)

    def get_config(self):
        return {
            "name": self.name,
            "optimizer": keras.saving.serialize_keras_object(self.inner_optimizer),
            "accum_steps": self._accum_steps,
            "accum_dtype": None
            if self._accumulator.dtype is None
            else self._accumulator.dtype.name,
            "skip_nonfinite": self._accum_state.skipping,
        }

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        optimizer = keras.saving.deserialize_keras_object(
            config.pop("optimizer"), custom_objects=custom_objects
        )
        return cls(optimizer, **config)
