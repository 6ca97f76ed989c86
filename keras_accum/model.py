"""`AccumModel`: a `keras.Model` whose `fit` trains as if on N-times bigger batches."""

import keras
import tensorflow as tf

from keras_accum import _keras_internals as internals
from keras_accum.accumulator import (
    GradientAccumulator,
    check_accum_steps,
    loss_scale_of,
)
from keras_accum.backup import check_callbacks
from keras_accum.normaliser import loss_normaliser, micro_batch_weight
from keras_accum.optimizer import check_not_accumulating


class _WindowFlush(keras.callbacks.Callback):
    """Applies a pending window when an epoch's data ends, inside `fit` only.

    `fit` runs validation through `evaluate(callbacks=<fit's callbacks>)`, so
    `on_test_begin` is the moment after the last training batch and before
    the first validation batch; `on_epoch_end` covers epochs without
    validation. It is put first in the list, so every other callback's
    `on_epoch_end` (checkpoints included) sees the updated weights.
    """

    def __init__(self, model):
        super().__init__()
        self._accum_model = model

    def on_test_begin(self, logs=None):
        self._accum_model.flush()

    def on_epoch_end(self, epoch, logs=None):
        self._accum_model.flush()


@keras.saving.register_keras_serializable(package="keras_accum")
class AccumModel(keras.Model):
    """A `keras.Model` that accumulates gradients over `accum_steps` batches.

    Training with micro-batch `b` and `accum_steps=N` is the same training as
    a plain `keras.Model` with batch `N * b`: each update uses the gradient of
    the loss over every sample of its window (each micro-batch weighted by
    what Keras normalises its loss by: samples, unmasked tokens or sample
    weights, so short windows and padded sequences are exact), a window still open
    when an epoch's data ends is applied then, before validation, and
    `optimizer.iterations` (hence learning-rate schedules and EMA) counts
    updates. The logged loss and metrics are those of the big-batch run.

    Between updates the weights do not move; gradients are summed into
    float32 buffers that are training state, not model weights: `weights`,
    `count_params()`, `summary()` and `get_weights()` are the plain model's.

    Under `tf.distribute.MirroredStrategy` or `MultiWorkerMirroredStrategy`
    (build and compile in `strategy.scope()`), `batch_size` is the global
    micro-batch: each replica sums its share into its own buffers and
    gradients cross devices once per update, so the effective batch is
    micro-batch per replica x `accum_steps` x replicas. Across workers,
    where plain Keras `fit` fails (tensorflow/tensorflow#72388), this model
    trains with any `accum_steps`, 1 included.

    Args:
        *args: `inputs, outputs` for a functional model, or nothing when
            subclassing.
        accum_steps: micro-batches per optimizer update, an integer >= 1.
            1 is ordinary Keras training.
        accum_dtype: dtype of the gradient buffers. Default None: float32
            (float64 for float64 weights), whatever the compute dtype, so
            mixed-precision gradients are summed in float32.
        **kwargs: passed to `keras.Model`.

    Example:

    ```python
    inputs = keras.Input((64,))
    outputs = keras.layers.Dense(10, activation="softmax")(inputs)
    model = keras_accum.AccumModel(inputs, outputs, accum_steps=4)
    model.compile("adam", "sparse_categorical_crossentropy")
    model.fit(x, y, batch_size=32)  # updates as with batch_size=128

    class Net(keras_accum.AccumModel):
        def __init__(self):
            super().__init__(accum_steps=8)
            self.dense = keras.layers.Dense(10)

        def call(self, x):
            return self.dense(x)
    ```
    """

    def __new__(cls, *args, **kwargs):
        if internals.functional_init_arguments(
            args, kwargs
        ) and not issubclass(cls, internals.Functional):
            cls = _functional_variant(cls)
        return super().__new__(cls, *args, **kwargs)

    def __init__(self, *args, accum_steps=1, accum_dtype=None, **kwargs):
        accum_steps = check_accum_steps(accum_steps)
        accumulator = GradientAccumulator(dtype=accum_dtype)
        if internals.functional_init_arguments(args, kwargs):
            # Calling Functional.__init__ ourselves, on a class that already
            # has Functional in its bases (see __new__), keeps Keras from
            # re-basing AccumModel onto Functional, which would break every
            # later `class Net(AccumModel)` in the process.
            internals.Functional.__init__(self, *args, **kwargs)
        else:
            super().__init__(*args, **kwargs)
        self._accum_steps = accum_steps
        self._accumulator = accumulator
        self._flush_function = None

    @property
    def accum_steps(self):
        """Micro-batches per optimizer update. Setting it applies a pending window."""
        return self._accum_steps

    @accum_steps.setter
    def accum_steps(self, value):
        value = check_accum_steps(value)
        if value == self._accum_steps:
            return
        acc = self._accumulator
        if acc.pending() and int(acc.accum_steps.numpy()) != value:
            self.flush()
        self._accum_steps = value
        self._retrace()

    def _retrace(self):
        # The window length is a Python constant in the traced step (cheaper
        # than a variable read every micro-batch), so a new one needs a new
        # trace. Rebuild rather than clear: fit() holds on to the function.
        if self.train_function is not None:
            self.make_train_function(force=True)

    # -- training -----------------------------------------------------------

    def fit(
        self,
        x=None,
        y=None,
        batch_size=None,
        epochs=1,
        verbose="auto",
        callbacks=None,
        *,
        accum_steps=None,
        **kwargs,
    ):
        """`keras.Model.fit`, plus `accum_steps` for this call only.

        Args:
            accum_steps: if given, overrides `self.accum_steps` for this call;
                validated before any training happens.
            (others): as `keras.Model.fit`. `batch_size` is the micro-batch.

        A window left open when an epoch's data ends is applied before
        validation and before other callbacks' `on_epoch_end`.
        """
        check_callbacks(
            getattr(callbacks, "callbacks", callbacks) or [], self.distribute_strategy
        )
        previous = self._accum_steps
        if accum_steps is not None:
            self.accum_steps = accum_steps
        flush = _WindowFlush(self)
        if isinstance(callbacks, keras.callbacks.CallbackList):
            callbacks.callbacks.insert(0, flush)
            flush.set_model(self)
        else:
            callbacks = [flush] + list(callbacks or [])
        try:
            return super().fit(
                x,
                y,
                batch_size=batch_size,
                epochs=epochs,
                verbose=verbose,
                callbacks=callbacks,
                **kwargs,
            )
        finally:
            if isinstance(callbacks, keras.callbacks.CallbackList):
                callbacks.callbacks.remove(flush)
            if self._accum_steps != previous:
                # Not through the setter: after an interrupted fit the open
                # window stays open (to be resumed), it is not applied early.
                # The next fit or train_on_batch traces a new step.
                self._accum_steps = previous
                self.train_function = None

    def make_train_function(self, force=False):
        if self.train_function is not None and not force:
            return self.train_function
        check_not_accumulating(self.optimizer, self._accum_steps)
        strategy = self.distribute_strategy
        if self._accum_steps > 1:
            self._build_window()
            if strategy.num_replicas_in_sync > 1:
                self.train_function = internals.make_replicated_function(
                    self, self._accumulate, self._apply_if_full_across_replicas
                )
                return self.train_function
        elif internals.multi_worker(strategy):
            # Keras's own train function fails across workers (its log
            # reduction, tensorflow/tensorflow#72388); same step, our function.
            self.train_function = internals.make_replicated_function(
                self, self.train_step
            )
            return self.train_function
        return super().make_train_function(force=force)

    def make_test_function(self, force=False):
        if self.test_function is not None and not force:
            return self.test_function
        if internals.multi_worker(self.distribute_strategy):
            # As for training: Keras's test function fails across workers.
            self.test_function = internals.make_replicated_function(
                self, self.test_step
            )
            return self.test_function
        return super().make_test_function(force=force)

    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        # Keras's version fails across workers (tensorflow/tensorflow#72388).
        internals.symbolic_build(self, iterator=iterator, data_batch=data_batch)

    def _build_window(self):
        variables = self.trainable_variables
        acc = self._accumulator
        shapes = [tuple(v.shape) for v in variables]
        if acc.built and acc.shapes() != shapes and acc.pending():
            raise ValueError(
                f"This model has a pending window of {acc.pending()} "
                "micro-batches whose gradient buffers (shapes "
                f"{acc.shapes()}) do not fit its trainable variables (shapes "
                f"{shapes}). It was restored from another model or the "
                "trainable set changed: restore a matching checkpoint, or "
                "load weights saved at a window boundary."
            )
        if not acc.built or acc.shapes() != shapes:
            acc.build(
                variables,
                accum_steps=self._accum_steps,
                strategy=self.distribute_strategy,
            )
        window_length = int(acc.accum_steps.numpy())
        if not acc.pending():
            acc.accum_steps.assign(self._accum_steps)
        elif window_length != self._accum_steps:
            raise ValueError(
                f"This model's pending window ({acc.pending()} micro-batches) "
                f"was accumulated with accum_steps={window_length}, but the "
                f"model now has accum_steps={self._accum_steps}. Set "
                f"`model.accum_steps = {window_length}` to finish the window "
                "as it began, or call `model.flush()` to apply it now."
            )
        if not self.optimizer.built:
            # Built here, eagerly: the optimizer first runs inside a
            # conditional branch, where it cannot create its variables.
            self.optimizer.build(variables)

    def train_step(self, data):
        if self._accum_steps == 1:
            return super().train_step(data)
        logs = self._accumulate(data)
        self._accumulator.apply_if_full(
            self.optimizer, self.trainable_variables, self._accum_steps
        )
        return logs

    def _accumulate(self, data):
        # TensorFlowTrainer.train_step with the update replaced by
        # accumulation; keep in step with it (see _keras_internals).
        internals.build_compiled_loss(self, data)
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        loss_scale = loss_scale_of(self.optimizer)
        # The micro-batch's weight is folded into the loss where that is safe:
        # one scalar multiply instead of one per gradient element. Not under
        # loss scaling or float16, where it could overflow float16 gradients;
        # there the (then needed anyway) per-element unscale carries it.
        fold = loss_scale is None and self.dtype_policy.compute_dtype != "float16"
        normalisers = []
        with tf.GradientTape() as tape:
            y_pred = internals.call_for_training(self, x)
            with internals.recording_loss_calls(
                self, lambda *call: normalisers.append(loss_normaliser(*call))
            ):
                loss = internals.compute_loss(self, x, y, y_pred, sample_weight)
            n = internals.batch_size(x)
            internals.track_loss(self, loss, n)
            weight, normalise = micro_batch_weight(normalisers, n)
            scaled = self.optimizer.scale_loss(loss)
            if fold:
                scaled = scaled * tf.cast(weight, loss.dtype)
        variables = self.trainable_variables
        grads = tape.gradient(scaled, variables)
        if fold:
            grad_scale = None
        elif loss_scale is None:
            grad_scale = weight
        else:
            grad_scale = weight / loss_scale
        self._accumulator.add(grads, weight, grad_scale, normalise=normalise)
        return self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    def _apply_window(self):
        if self.distribute_strategy.num_replicas_in_sync > 1:
            self._apply_across_replicas()
        else:
            self._accumulator.apply(self.optimizer, self.trainable_variables)

    def _apply_if_full_across_replicas(self):
        # Cross-replica context: replica 0's micro-step decides for all.
        self._accumulator.when_full(self._accum_steps, self._apply_across_replicas)

    def _apply_across_replicas(self):
        strategy = self.distribute_strategy
        acc = self._accumulator
        # Read here, across replicas: the window's weight over all replicas.
        # Keras divides each replica's loss by the number of replicas (so
        # that summing replica gradients gives a mean); the window's total
        # weight is divided likewise to undo it.
        total = acc.window_weight.read_value() / strategy.num_replicas_in_sync
        strategy.run(
            lambda: acc.apply(self.optimizer, self.trainable_variables, total)
        )

    def flush(self):
        """Applies the pending partial window now; a no-op if none is pending.

        `fit` calls it when an epoch's data ends. Call it yourself after
        `train_on_batch` loops, or before reading weights mid-window.
        """
        if not self._accumulator.pending():
            return
        if self.run_eagerly:
            self._apply_window()
            return
        if self._flush_function is None or self.train_function is None:
            # Traced again after compile() (which clears train_function), as
            # the optimizer may have changed. Held in a plain closure: a
            # tf.function attribute would be tracked and exported.
            function = tf.function(self._apply_window)
            self._flush_function = lambda: function()
        self._flush_function()

    # -- saving -----------------------------------------------------------------

    def load_weights(self, filepath, *args, **kwargs):
        """`keras.Model.load_weights`, all or nothing.

        Restores the weights, the optimizer state and a pending window. If
        loading fails (a corrupted or mismatched file), the model is left as it
        was before the call and the error is raised.
        """
        variables = list(self.weights)
        if self.optimizer is not None:
            variables += list(self.optimizer.variables)
        saved = [v.numpy() for v in variables]
        window = self._accumulator.snapshot()
        try:
            return super().load_weights(filepath, *args, **kwargs)
        except Exception:
            for v, value in zip(variables, saved):
                v.assign(value)
            self._accumulator.restore(window)
            raise

    # -- serialisation --------------------------------------------------------

    def get_config(self):
        config = super().get_config()
        config["accum_steps"] = self._accum_steps
        if self._accumulator.dtype is not None:
            config["accum_dtype"] = self._accumulator.dtype.name
        return config

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        accum_steps = config.pop("accum_steps", 1)
        accum_dtype = config.pop("accum_dtype", None)
        model = super().from_config(config, custom_objects=custom_objects)
        model.accum_steps = accum_steps
        if accum_dtype is not None:
            model._accumulator = GradientAccumulator(dtype=accum_dtype)
        return model


def _functional_variant(cls):
    """`cls` with `Functional` mixed in, made once per class.

    Keras makes a `Model` subclass functional by rewriting the class's
    `__bases__` in place, for every instance that follows. We give functional
    calls their own subclass instead and leave `cls` as it was.
    """
    variant = cls.__dict__.get("_accum_functional_variant")
    if variant is None:
        variant = type(
            cls.__name__,
            (cls, internals.Functional),
            {"__module__": cls.__module__, "__qualname__": cls.__qualname__,
             "__doc__": cls.__doc__},
        )
        registered = keras.saving.get_registered_name(cls)
        if ">" in registered:
            # Serialise the variant under cls's name, and keep that name
            # resolving to cls (whose __new__ brings the variant back).
            package, _, name = registered.partition(">")
            keras.saving.register_keras_serializable(package, name)(variant)
            keras.saving.register_keras_serializable(package, name)(cls)
        cls._accum_functional_variant = variant
    return variant
