"""`AccumModel`: a `keras.Model` whose `fit` trains as if on N-times bigger batches."""

import keras
import tensorflow as tf

from keras_accum import _keras_internals as internals
from keras_accum import microbatch
from keras_accum.auto_micro_batch import WHOLE_BATCH, AutoMicroBatch, StepState
from keras_accum.accumulator import (
    GradientAccumulator,
    check_accum_steps,
    loss_scale_of,
)
from keras_accum.backup import check_callbacks
from keras_accum.batchnorm import BatchNormWindow, check_batchnorm
from keras_accum.microbatch import check_micro_batch_size, static_batch_size
from keras_accum.nonfinite import NonFiniteWindows
from keras_accum.normaliser import loss_normaliser, micro_batch_weight
from keras_accum.optimizer import check_not_accumulating
from keras_accum.saving import check_config_is_faithful
from keras_accum.train_functions import TrainFunctions


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
        self._trained = False

    def on_train_batch_end(self, batch, logs=None):
        self._trained = True

    def on_test_begin(self, logs=None):
        self._flush()

    def on_epoch_end(self, epoch, logs=None):
        self._flush()
        if logs is not None and self._accum_model.skip_nonfinite:
            logs["skipped_windows"] = self._accum_model.skipped_windows

    def _flush(self):
        # An epoch that trained on no data (Keras warns that the input ran
        # out) leaves an open window from before the fit as it was.
        if self._trained:
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
    Each window belongs to the variables it was computed for: a trainable
    change takes effect at the next `compile()`, as in Keras, and `flush()`
    applies an open window to its own variables; `reset_window()` discards
    it. The model need not be built before `fit`: an accumulating model is
    built from the first batch's shapes.

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
        skip_nonfinite: if True, a window whose gradient holds a NaN or an
            Inf makes no update (weights, optimizer state and `iterations`
            untouched) and is discarded; `skipped_windows` counts them and
            `fit` logs the count. Default False: applied, as the big batch.
        batchnorm: how `BatchNormalization` layers in training mode update
            their moving statistics. 'window' (default): once per optimizer
            update, from the moments of the whole window pooled over its
            micro-batches, as the big batch would. 'micro_batch': Keras's own
            update at every micro-batch (momentum applied `accum_steps`
            times per update). The forward pass normalises each micro-batch
            with its own moments either way.
        micro_batch_size: if set, each batch `fit` draws is split into
            micro-batches of this many samples inside the compiled step;
            their gradients are summed exactly and make one update (or, with
            `accum_steps > 1`, one micro-step of the window): the training
            of the whole batch with the memory of the micro-batch. An
            integer >= 1, "auto", or None (default: whole batches). "auto":
            whole batches until a step runs out of memory
            (`tf.errors.ResourceExhaustedError`), then the same batch is
            trained again on micro-batches half the size, as often as
            needed, and the size that fitted is kept
            (`chosen_micro_batch_size`); the failed attempt leaves no trace,
            so the training is unchanged. One device (or a strategy with one
            replica, e.g. `MirroredStrategy()` on one GPU) only.
        **kwargs: passed to `keras.Model`.

    Example:

    ```python
    inputs = keras.Input((784,))
    outputs = keras.layers.Dense(10, activation="softmax")(inputs)
    model = keras_accum.AccumModel(inputs, outputs, accum_steps=4)
    model.compile("adam", "sparse_categorical_crossentropy")
    model.fit(x, y, batch_size=32)  # updates as with batch_size=128

    # The batch you want, split inside the step.
    model = keras_accum.AccumModel(inputs, outputs, micro_batch_size=32)
    model.compile("adam", "sparse_categorical_crossentropy")
    model.fit(x, y, batch_size=256)  # one update per 256, 32 at a time

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

    def __init__(
        self,
        *args,
        accum_steps=1,
        accum_dtype=None,
        skip_nonfinite=False,
        batchnorm="window",
        micro_batch_size=None,
        **kwargs,
    ):
        accum_steps = check_accum_steps(accum_steps)
        batchnorm = check_batchnorm(batchnorm)
        micro_batch_size = check_micro_batch_size(micro_batch_size)
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
        self._micro_batch_size = micro_batch_size
        # The batch size the step splits into micro-batches, learnt from the
        # first batch (see _maybe_symbolic_build).
        self._batch_size_seen = None
        self._auto_micro_batch = AutoMicroBatch()
        # Set while fit or train_on_batch builds from its first batch (not
        # evaluate's, whose batches the step never splits).
        self._training_build = False
        self._accumulator = accumulator
        self._flush_function = None
        self._flush_key = None
        self._train_function_owner()
        self._set_skip_nonfinite(skip_nonfinite)
        self._batchnorm = BatchNormWindow(self, batchnorm)

    # -- the train function: one owner (train_functions.py) --------------------

    def _train_function_owner(self):
        # Keras's constructor assigns `train_function` before ours runs.
        owner = self.__dict__.get("_train_functions")
        if owner is None:
            owner = TrainFunctions()
            self._train_functions = owner
        return owner

    @property
    def train_function(self):
        """What `fit` calls next: the step for the current settings, or a
        resumed epoch's batch skipping over it (train_functions.py)."""
        owner = self.__dict__.get("_train_functions")
        return None if owner is None else owner.current()

    @train_function.setter
    def train_function(self, value):
        # Replaces the step (None: made again when next needed); batches
        # being skipped stay skipped.
        self._train_function_owner().assign(value)

    def _set_skip_nonfinite(self, skip_nonfinite):
        if not isinstance(skip_nonfinite, bool):
            raise TypeError(
                "`skip_nonfinite` must be True or False. "
                f"Received: skip_nonfinite={skip_nonfinite!r}."
            )
        self._nonfinite = NonFiniteWindows() if skip_nonfinite else None
        self._accumulator.nonfinite = self._nonfinite

    @property
    def skip_nonfinite(self):
        """Whether windows with a non-finite gradient are skipped.

        Example:

        ```python
        model = keras_accum.AccumModel(inputs, outputs, skip_nonfinite=True)
        assert model.skip_nonfinite
        ```
        """
        return self._nonfinite is not None

    @property
    def skipped_windows(self):
        """Windows skipped for a non-finite gradient (0 unless `skip_nonfinite`).

        `fit` also logs the count as `skipped_windows` after each epoch.

        Example:

        ```python
        model = keras_accum.AccumModel(inputs, outputs, accum_steps=4, skip_nonfinite=True)
        model.compile("adam", "sparse_categorical_crossentropy")
        history = model.fit(x, y, batch_size=32, verbose=0)
        assert model.skipped_windows == history.history["skipped_windows"][-1] == 0
        ```
        """
        return 0 if self._nonfinite is None else int(self._nonfinite.skipped.numpy())

    @property
    def accum_steps(self):
        """Micro-batches per optimizer update. Setting it applies a pending window.

        Each value is traced once per compile: switching back and forth
        reuses the traced step.

        Example:

        ```python
        model = keras_accum.AccumModel(inputs, outputs, accum_steps=4)
        model.compile("adam", "sparse_categorical_crossentropy")
        model.fit(x, y, batch_size=32, verbose=0)  # 2 updates of 128 samples
        model.accum_steps = 8
        model.fit(x, y, batch_size=32, verbose=0)  # 1 update of 256 samples
        assert int(model.optimizer.iterations) == 3
        ```
        """
        return self._accum_steps

    @accum_steps.setter
    def accum_steps(self, value):
        value = check_accum_steps(value)
        if value == self._accum_steps:
            return
        acc = self._accumulator
        if acc.pending() and acc.window_length() != value:
            self.flush()
        self._accum_steps = value
        self._retrace()

    @property
    def micro_batch_size(self):
        """Samples per micro-batch inside each step, "auto", or None (whole batches).

        Setting it makes the next train step split batches with the new size
        (a train function per size is traced once and kept).

        Example:

        ```python
        model = keras_accum.AccumModel(inputs, outputs, micro_batch_size=32)
        model.compile("adam", "sparse_categorical_crossentropy")
        model.fit(x, y, batch_size=128, verbose=0)  # 2 updates, 32 samples at a time
        model.micro_batch_size = 64
        ```
        """
        return self._micro_batch_size

    @micro_batch_size.setter
    def micro_batch_size(self, value):
        value = check_micro_batch_size(value)
        if value == self._micro_batch_size:
            return
        self._micro_batch_size = value
        self._retrace()

    def _step_micro_batch_size(self):
        """The micro-batch size the step being traced splits batches into: a
        Python int, or None for whole batches.

        "auto" starts from the whole batch, as one micro-batch: the split
        step writes no state before its loss and gradients exist, so a step
        that runs out of memory can be retried (auto_micro_batch.py).
        """
        size = self._micro_batch_size
        if size == "auto":
            return self._auto_micro_batch.size or WHOLE_BATCH
        return size

    @property
    def chosen_micro_batch_size(self):
        """The micro-batch size `micro_batch_size="auto"` trains with.

        None (whole batches) until a step runs out of memory; then the
        halved size that fitted, kept for the rest of training (and later
        `fit` calls of this model).

        Example:

        ```python
        model = keras_accum.AccumModel(inputs, outputs, micro_batch_size="auto")
        model.compile("adam", "sparse_categorical_crossentropy")
        model.fit(x, y, batch_size=256, verbose=0)
        print(model.chosen_micro_batch_size)  # None: whole batches fitted
        ```
        """
        return self._auto_micro_batch.size

    def _step_settings(self):
        # What the traced step reads as Python constants: a train function
        # is kept per value (train_functions.py).
        if self._micro_batch_size is None:
            return self._accum_steps
        return (self._accum_steps, self._micro_batch_size, self._batch_size_seen)

    def _retrace(self):
        # The window length is a Python constant in the traced step (cheaper
        # than a variable read every micro-batch), so a new one needs its own
        # function: the cached one, else a new trace. Replaced now rather
        # than cleared: fit() reads the attribute before every step.
        if self._train_functions.function is not None:
            self.train_function = None
            self.make_train_function()

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
        micro_batch_size=None,
        **kwargs,
    ):
        """`keras.Model.fit`, plus `accum_steps` and `micro_batch_size` for this
        call only.

        Args:
            accum_steps: if given, overrides `self.accum_steps` for this call;
                validated before any training happens.
            micro_batch_size: if given, overrides `self.micro_batch_size`
                for this call: each batch of `batch_size` is split into
                micro-batches of this many samples inside the step (one
                update per batch when `accum_steps=1`), or "auto" (see
                `AccumModel`). Validated before any training happens.
            x: as `keras.Model.fit`: the input data.
            y: as `keras.Model.fit`: the targets.
            batch_size: as `keras.Model.fit`: the batch each step trains on
                (the micro-batch of an `accum_steps` window).
            epochs: as `keras.Model.fit`.
            verbose: as `keras.Model.fit`.
            callbacks: as `keras.Model.fit`; one callback without a list is
                accepted too.
            **kwargs: the other arguments of `keras.Model.fit`.

        Returns:
            The `History` object, as `keras.Model.fit` returns.

        A window left open when an epoch's data ends is applied before
        validation and before other callbacks' `on_epoch_end`.

        Example:

        ```python
        model = keras_accum.AccumModel(inputs, outputs)
        model.compile("adam", "sparse_categorical_crossentropy")
        model.fit(x, y, batch_size=32, accum_steps=8, verbose=0)  # this call only
        assert model.accum_steps == 1 and int(model.optimizer.iterations) == 1
        ```
        """
        if isinstance(callbacks, keras.callbacks.Callback):
            callbacks = [callbacks]  # Keras accepts one callback too
        check_callbacks(
            getattr(callbacks, "callbacks", callbacks) or [], self.distribute_strategy
        )
        if micro_batch_size is not None:
            micro_batch_size = check_micro_batch_size(micro_batch_size)
        previous = self._accum_steps
        previous_micro = self._micro_batch_size
        if accum_steps is not None:
            self.accum_steps = accum_steps
        if micro_batch_size is not None:
            self.micro_batch_size = micro_batch_size
        flush = _WindowFlush(self)
        if isinstance(callbacks, keras.callbacks.CallbackList):
            callbacks.callbacks.insert(0, flush)
            flush.set_model(self)
        else:
            callbacks = [flush] + list(callbacks or [])
        self._training_build = True
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
            self._training_build = False
            if isinstance(callbacks, keras.callbacks.CallbackList):
                callbacks.callbacks.remove(flush)
            if self._accum_steps != previous:
                # Not through the setter: after an interrupted fit the open
                # window stays open (to be resumed), it is not applied early.
                # The next fit or train_on_batch traces a new step.
                self._accum_steps = previous
                self.train_function = None
            if self._micro_batch_size != previous_micro:
                self._micro_batch_size = previous_micro
                self.train_function = None
            # Skipping belongs to the fit that restored a backup.
            self._train_functions.stop_skipping()

    def make_train_function(self, force=False):
        # The step for the current settings (the skipping, if any, stays
        # over it: train_functions.py).
        owner = self._train_functions
        if owner.function is not None and not force:
            return owner.function
        check_not_accumulating(self.optimizer, self._accum_steps)
        if self._windowed() and self.built:
            self._bind_window()
        elif self._step_micro_batch_size() is not None and self.built:
            # The batch's pooled moments are applied in the step: windows
            # made now, outside any replica.
            self._batchnorm.build(self.distribute_strategy)
        function = None if force else owner.cache.get(self)
        if function is None:
            function = self._new_train_function()
            owner.cache.put(self, function)
        self.train_function = function
        return function

    def _new_train_function(self):
        strategy = self.distribute_strategy
        if self._micro_batch_size == "auto":
            if strategy.num_replicas_in_sync > 1 or internals.multi_worker(strategy):
                raise ValueError(
                    "`micro_batch_size='auto'` trains on one device; under "
                    f"{type(strategy).__name__} set an integer "
                    "`micro_batch_size` (the micro-batch per replica). "
                    "Received: micro_batch_size='auto'."
                )
            return self._auto_micro_batch.train_function(
                self, self._make_step, StepState(self._forward_state)
            )
        if self._windowed():
            if internals.replicated(strategy):
                return internals.make_replicated_function(
                    self, self._accumulate, self._apply_if_full_across_replicas
                )
        elif internals.multi_worker(strategy):
            # Keras's own train function fails across workers (its log
            # reduction, tensorflow/tensorflow#72388); same step, our function.
            return internals.make_replicated_function(self, self.train_step)
        # Keras's own, made as Keras makes it (it assigns train_function).
        super().make_train_function(force=True)
        return self._train_functions.function

    def _make_step(self):
        # One step on a batch in hand, traced per batch shape: the split is
        # static and exact for every batch, the epoch's short last one too.
        if self._windowed() and internals.replicated(self.distribute_strategy):
            # Under a strategy (one replica: two or more are refused), the
            # window is applied in cross-replica context, as by the
            # replicated train function.
            return internals.make_step_on_data(
                self,
                self._accumulate,
                self._apply_if_full_across_replicas,
                reduce_retracing=False,
            )
        return internals.make_step_on_data(self, self.train_step, reduce_retracing=False)

    def _forward_state(self):
        # Variables a step may write before its gradients exist (see
        # auto_micro_batch.StepState).
        acc = self._accumulator
        scalars = [acc.micro_step, acc.window_weight] if acc.built else []
        return [
            *self.non_trainable_variables,
            *self.metrics_variables,
            *self._batchnorm.variables,
            *scalars,
        ]

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
        # Keras builds a model without a strategy in its first traced step;
        # a window needs the variables before that (and a cached train
        # function the variables it was traced with), so the model is built
        # from the first batch's shapes, as Keras does under a strategy.
        # Keras's own version also fails across workers
        # (tensorflow/tensorflow#72388).
        data_batch = internals.symbolic_build(
            self, iterator=iterator, data_batch=data_batch, without_strategy=True
        )
        if self._training_build:
            self._training_build = False
            self._see_batch(data_batch)

    def _see_batch(self, data_batch):
        # The step splits a batch whose size the trace may not know (fit's
        # batch dimension is None): it is taken from the first training
        # batch, here, in Python, and a new size gets its own train function.
        size = None if data_batch is None else static_batch_size(data_batch)
        if size is None or size == self._batch_size_seen:
            return
        self._batch_size_seen = size
        if self._micro_batch_size is not None:
            self.train_function = None

    def train_on_batch(self, *args, **kwargs):
        self._training_build = True
        try:
            return super().train_on_batch(*args, **kwargs)
        finally:
            self._training_build = False

    def _bind_window(self):
        """Makes the window the trainable variables' and builds the optimizer.

        Eager, before a step is traced: the step trains the window's
        variables (a trainable change takes effect at the next `compile()`,
        as in Keras), and an open window computed for other variables is
        refused with an error naming them.
        """
        acc = self._accumulator
        if acc.bind(
            self.trainable_variables,
            accum_steps=self._accum_steps,
            strategy=self.distribute_strategy,
        ):
            self._train_functions.clear()  # they hold the old buffers
        self._batchnorm.build(self.distribute_strategy)
        if not self.optimizer.built:
            # Built here, eagerly: the optimizer first runs inside a
            # conditional branch, where it cannot create its variables.
            self.optimizer.build(acc.window_variables)

    def _windowed(self):
        # accum_steps=1 is Keras's own step, unless windows may be skipped.
        return self._accum_steps > 1 or self._nonfinite is not None

    def train_step(self, data):
        if not self._windowed():
            size = self._step_micro_batch_size()
            if size is None:
                return super().train_step(data)
            return self._train_on_micro_batches(data, size)
        logs = self._accumulate(data)
        self._accumulator.when_full(self._accum_steps, self._apply_window)
        return logs

    def _accumulate(self, data):
        # TensorFlowTrainer.train_step with the update replaced by
        # accumulation; keep in step with it (see _keras_internals).
        internals.build_compiled_loss(self, data)
        variables = self._accumulator.window_variables
        if variables is None:
            raise ValueError(
                "This model was not built before its train function was "
                "made, so it has no variables to accumulate gradients for. "
                "Build it (call it on a batch, or `model.build(input_shape)`) "
                "before training it outside `fit`, `train_on_batch` and "
                "`evaluate`."
            )
        size = self._step_micro_batch_size()
        if size is not None:
            x, y, sample_weight, batch, moments = self._split_gradients(
                data, size, variables
            )
            # Nothing is written until every micro-batch has run: a step that
            # fails part-way (out of memory) leaves all state as it was.
            with tf.control_dependencies(microbatch.control_after(batch)):
                self._batchnorm.record(moments)
                internals.track_loss(self, batch.loss, batch.num_samples)
                self._accumulator.add(
                    batch.grads,
                    batch.weight,
                    normalise=batch.normalise,
                    variables=variables,
                )
                return self.compute_metrics(x, y, batch.y_pred, sample_weight=sample_weight)
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        step = self._gradients(x, y, sample_weight, variables)
        internals.track_loss(self, step.loss, step.num_samples)
        self._accumulator.add(
            step.grads,
            step.weight,
            step.grad_scale,
            normalise=step.normalise,
            variables=variables,
        )
        return self.compute_metrics(x, y, step.y_pred, sample_weight=sample_weight)

    def _gradients(self, x, y, sample_weight, variables, moments=None, live=None):
        """One forward and backward pass, as Keras's train_step makes it.

        Returns `microbatch.Gradients`: the gradients and the weight (what
        Keras normalised the loss by) that make them exact to sum.
        BatchNormalization moments go to the window, or to the list
        `moments` to be recorded later. `live` (a 0/1 float tensor)
        multiplies the weight: 0 makes the gradient exactly zero.
        """
        loss_scale = loss_scale_of(self.optimizer)
        # The micro-batch's weight is folded into the loss where that is safe:
        # one scalar multiply instead of one per gradient element. Not under
        # loss scaling or float16, where it could overflow float16 gradients;
        # there the (then needed anyway) per-element unscale carries it.
        fold = loss_scale is None and self.dtype_policy.compute_dtype != "float16"
        normalisers = []
        with tf.GradientTape() as tape:
            with self._batchnorm.micro_batch(moments):
                y_pred = internals.call_for_training(self, x)
            with internals.recording_loss_calls(
                self, lambda *call: normalisers.append(loss_normaliser(*call))
            ):
                loss = internals.compute_loss(self, x, y, y_pred, sample_weight)
            n = internals.batch_size(x)
            weight, normalise = micro_batch_weight(normalisers, n)
            if live is not None:
                weight = weight * live
            scaled = self.optimizer.scale_loss(loss)
            if fold:
                scaled = scaled * tf.cast(weight, loss.dtype)
        grads = tape.gradient(scaled, variables)
        if fold:
            grad_scale = None
        elif loss_scale is None:
            grad_scale = weight
        else:
            grad_scale = weight / loss_scale
        return microbatch.Gradients(
            grads, grad_scale, weight, normalise, loss, n, y_pred
        )

    def _split_gradients(self, data, size, variables):
        """The batch's summed gradients from micro-batches of `size` samples,
        in tensors; no state is written but by the layers' forward passes."""
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        moments = []
        parts = []
        for part, live in microbatch.split(
            (x, y, sample_weight), size, self._batch_size_seen
        ):
            if parts:
                part = microbatch.after(parts[-1], part)
            if live is None:
                parts.append(self._gradients(*part, variables, moments))
                continue
            # A stand-in past a short batch's end: weighs nothing, counts no
            # sample, predicts no row, adds no BatchNormalization moments.
            live = tf.cast(live, tf.float32)
            first = len(moments)
            step = self._gradients(*part, variables, moments, live=live)
            rows = step.num_samples * tf.cast(live, step.num_samples.dtype)
            moments[first:] = [
                (window, count * tf.cast(live, count.dtype), mean, variance)
                for window, count, mean, variance in moments[first:]
            ]
            parts.append(
                step._replace(
                    loss=step.loss * tf.cast(live, step.loss.dtype),
                    num_samples=rows,
                    y_pred=microbatch.drop_rows(step.y_pred, rows),
                )
            )
        return x, y, sample_weight, microbatch.combine(parts), moments

    def _train_on_micro_batches(self, data, size):
        # accum_steps=1: the batch's gradient goes straight to the optimizer,
        # no buffers.
        internals.build_compiled_loss(self, data)
        variables = self.trainable_variables
        x, y, sample_weight, batch, moments = self._split_gradients(
            data, size, variables
        )
        total = batch.weight
        context = tf.distribute.get_replica_context()
        if context is not None and context.num_replicas_in_sync > 1:
            # As for a window across replicas (_apply_across_replicas): the
            # optimizer sums replicas' gradients of losses Keras divided by
            # the number of replicas.
            total = context.all_reduce(tf.distribute.ReduceOp.SUM, total)
            total = total / context.num_replicas_in_sync
        with tf.control_dependencies(microbatch.control_after(batch)):
            self._batchnorm.record(moments)
            self._batchnorm.apply()
            internals.track_loss(self, batch.loss, batch.num_samples)
            grads = microbatch.batch_gradients(
                batch, loss_scale_of(self.optimizer), total
            )
            self.optimizer.apply(
                [None if g is None else tf.cast(g, v.dtype) for g, v in zip(grads, variables)],
                variables,
            )
            return self.compute_metrics(x, y, batch.y_pred, sample_weight=sample_weight)

    def _apply_window(self):
        if internals.replicated(self.distribute_strategy):
            # One replica included: its update is a merge_call, which
            # cannot run in a conditional traced inside the replica.
            self._apply_across_replicas()
            return
        acc = self._accumulator
        if self._nonfinite is None:
            acc.apply(self.optimizer)
            self._apply_batchnorm()
            return
        # One decision for all the window's state, as across replicas: a
        # skipped window moves neither the weights nor BatchNormalization's
        # moving statistics.
        grads = acc.window_gradients(loss_scale_of(self.optimizer))

        def apply():
            acc.apply(self.optimizer, check_finite=False, grads=grads)
            self._apply_batchnorm()

        self._nonfinite.one_device(grads, self.optimizer, apply, self._discard_window)

    def _apply_batchnorm(self):
        # With skip_nonfinite, non-finite statistics (a NaN sample's) are
        # kept out of the moving averages, as the window's update is.
        self._batchnorm.apply(finite_only=self._nonfinite is not None)

    def _discard_window(self):
        self._accumulator.reset()
        self._batchnorm.reset()

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

        def apply():
            strategy.run(lambda: acc.apply(self.optimizer, total, check_finite=False))
            strategy.run(self._apply_batchnorm)

        if self._nonfinite is None:
            apply()
        else:
            self._nonfinite.across_replicas(
                strategy,
                lambda: acc.window_gradients(total_weight=total),
                self.optimizer,
                apply,
                lambda: strategy.run(self._discard_window),
            )

    def flush(self):
        """Applies the pending partial window now; a no-op if none is pending.

        `fit` calls it when an epoch's data ends. Call it yourself after
        `train_on_batch` loops, or before reading weights mid-window.

        Example:

        ```python
        model = keras_accum.AccumModel(inputs, outputs, accum_steps=4)
        model.compile("adam", "sparse_categorical_crossentropy")
        for start in range(0, 96, 32):  # 3 micro-batches: no update yet
            model.train_on_batch(x[start:start + 32], y[start:start + 32])
        model.flush()                   # one update of the 96 samples
        assert int(model.optimizer.iterations) == 1
        ```
        """
        acc = self._accumulator
        if not acc.pending():
            return
        self._restore_batchnorm_window()
        if acc.window_variables is None:
            # Restored from a file and no step since: pair it with the
            # trainable variables by position, as Keras pairs weights.
            acc.bind(self.trainable_variables, accum_steps=acc.window_length())
        if not self.optimizer.built:
            # In the model's strategy scope: under a strategy, the optimizer's
            # variables must be made there (flush is called outside it).
            with self.distribute_strategy.scope():
                self.optimizer.build(acc.window_variables)
        unknown = internals.unknown_variables(self.optimizer, acc.window_variables)
        if unknown:
            raise ValueError(
                f"The open window ({acc.pending()} micro-batches) holds "
                f"gradients for {[v.path for v in unknown]}, which the "
                "optimizer was not built for (the model was compiled again "
                "after what is trainable changed). Call `flush()` before "
                "changing what is trainable, or `reset_window()` to discard "
                "the window."
            )
        if self.run_eagerly:
            self._apply_window()
            return
        # Traced for this optimizer and these buffers; again when either
        # changes (compile() with another optimizer, a rebuilt window).
        key = (id(self.optimizer), acc.generation, len(self._batchnorm.variables))
        if self._flush_key != key:
            # One trace per compile (or rebuilt window), each called about
            # once an epoch: TensorFlow's frequent-retracing warning, which
            # counts traces of the same code over every model in the
            # process, would call that excessive.
            function = internals.without_retracing_warning(
                tf.function(self._apply_window)
            )
            # Held in a plain closure: a tf.function attribute would be
            # tracked and exported.
            self._flush_function = lambda: function()
            self._flush_key = key
        self._flush_function()

    def reset_window(self):
        """Discards the open window: its gradients are dropped, no update is made.

        For a window that must not be applied, e.g. after
        `keras.callbacks.TerminateOnNaN(raise_error=True)` stopped `fit` with a
        NaN gradient in it (`flush()` or the next `fit` would apply it). A
        no-op if no window is open.

        Example:

        ```python
        model = keras_accum.AccumModel(inputs, outputs, accum_steps=4)
        model.compile("adam", "sparse_categorical_crossentropy")
        model.train_on_batch(x[:32], y[:32])  # a window of 1 micro-batch
        model.reset_window()                  # dropped: no update
        model.flush()                         # nothing left to apply
        assert int(model.optimizer.iterations) == 0
        ```
        """
        if self._accumulator.pending():
            self._restore_batchnorm_window()
            self._discard_window()

    def _restore_batchnorm_window(self):
        # BatchNormalization moments loaded from a file wait for their
        # layers' windows, made with the next train function; flush() and
        # reset_window() before that make them now, so that the restored
        # moments are applied or discarded with the gradients they came
        # with, and do not leak into the next window.
        if self.built:
            self._batchnorm.build(self.distribute_strategy)

    # -- saving -----------------------------------------------------------------

    def load_weights(self, filepath, *args, **kwargs):
        """`keras.Model.load_weights`, all or nothing.

        Restores the weights, the optimizer state and a pending window. If
        loading fails (a corrupted or mismatched file), the model is left as it
        was before the call and the error is raised.

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
        variables = list(self.weights)
        if self.optimizer is not None:
            variables += list(self.optimizer.variables)
        saved = [v.numpy() for v in variables]
        window = self._accumulator.snapshot()
        batchnorm = self._batchnorm.snapshot()
        try:
            result = super().load_weights(filepath, *args, **kwargs)
        except Exception:
            for v, value in zip(variables, saved):
                v.assign(value)
            self._accumulator.restore(window)
            self._batchnorm.restore(batchnorm)
            raise
        acc = self._accumulator
        if (
            self._train_functions.function is not None
            and acc.pending()
            and not acc.fits(self.trainable_variables, self._accum_steps)
        ):
            # The traced step would continue the restored window with
            # another length or other variables: the next one is made anew
            # and refuses it, naming what differs.
            self.train_function = None
        return result

    # -- serialisation --------------------------------------------------------

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
        config = {"accum_steps": self._accum_steps}
        if self._accumulator.dtype is not None:
            config["accum_dtype"] = self._accumulator.dtype.name
        if self._nonfinite is not None:
            config["skip_nonfinite"] = True
        config["batchnorm"] = self._batchnorm.mode
        if self._micro_batch_size is not None:
            config["micro_batch_size"] = self._micro_batch_size
        return config

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        accum_steps = config.pop("accum_steps", 1)
        accum_dtype = config.pop("accum_dtype", None)
        skip_nonfinite = config.pop("skip_nonfinite", False)
        batchnorm = config.pop("batchnorm", "window")
        micro_batch_size = check_micro_batch_size(config.pop("micro_batch_size", None))
        model = super().from_config(config, custom_objects=custom_objects)
        model._batchnorm = BatchNormWindow(model, batchnorm)
        model.accum_steps = accum_steps
        model.micro_batch_size = micro_batch_size
        if accum_dtype is not None:
            model._accumulator = GradientAccumulator(dtype=accum_dtype)
        model._set_skip_nonfinite(skip_nonfinite)
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
