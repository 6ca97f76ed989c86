"""`AccumModel`: a `keras.Model` whose `fit` trains as if on N-times bigger batches.

The model is the public surface; the work is done by what it composes:
its settings (arguments.py) make a step plan (plan.py); the step
(step.py) adds into the window (window/) and applies it; the train
functions (train_functions.py) are made, cached and swapped by one owner;
`fit`'s per-call settings and epoch-end flush are fitting.py's, and
faithful configs and all-or-nothing loads saving.py's.

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
"""

import inspect

import keras

from keras_accum import _internals as internals
from keras_accum import arguments, fitting, plan, saving, step, window
from keras_accum.split import coupling
from keras_accum.split.auto import AutoMicroBatch
from keras_accum.split.microbatch import static_batch_size
from keras_accum.optimizer import check_not_accumulating
from keras_accum.train_functions import TrainFunctions
from keras_accum.window import AccumState, slices
from keras_accum.window.batchnorm import BatchNormMoments
from keras_accum.window.noise_scale import NoiseScale


# The keyword arguments Keras's Model takes (a Layer's, and a functional
# model's graph): a misspelling of ours is refused, these go to Keras.
_KERAS_MODEL_ARGUMENTS = frozenset(
    name
    for name, parameter in inspect.signature(keras.layers.Layer.__init__).parameters.items()
    if parameter.kind is inspect.Parameter.KEYWORD_ONLY
) | {"inputs", "outputs", "input_shape", "input_dim"}


@keras.saving.register_keras_serializable(package="keras_accum")
class AccumModel(
    internals.FunctionalVariants,
    internals.BuildFromFirstBatch,
    keras.Model,
):
    """A `keras.Model` that accumulates gradients over `accum_steps` batches.

    Training with micro-batch `b` and `accum_steps=N` is the same training as
    a plain `keras.Model` with batch `N * b` (see the module's description
    for what that covers: windows, weights, schedules, strategies).

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
            so the training is unchanged. Under a multi-replica strategy
            the size is per replica, one size agreed by every replica and
            worker (docs/micro-batching.md).
        noise_scale: if True, the gradient noise scale `B_simple`
            (McCandlish et al. 2018) is estimated from the windows and
            logged by `fit` as `noise_scale` every epoch (`noise_scale`
            property); training is unchanged. Default False.
        coupled_from: for a loss that couples the samples of a batch (a
            contrastive loss: CLIP's, in-batch negatives), the names of the
            layers whose outputs are the per-sample representations, in a
            functional model; or "methods", for a subclassed model that
            defines `represent(inputs, training)` (the representations) and
            `couple(representations, training)` (the outputs from them).
            With `micro_batch_size`, everything upstream of them runs per
            micro-batch and everything downstream, the loss included, once
            on the whole batch: the big batch's gradient with the
            micro-batch's memory, for a second forward pass
            (docs/contrastive.md). Needs `accum_steps=1`. Default None.
        **kwargs: passed to `keras.Model`; a misspelling of an argument
            above (`accum_step`) raises a TypeError naming the argument.

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

    def __init__(
        self,
        *args,
        accum_steps=1,
        accum_dtype=None,
        skip_nonfinite=False,
        batchnorm="window",
        micro_batch_size=None,
        noise_scale=False,
        coupled_from=None,
        **kwargs,
    ):
        arguments.check_keywords(kwargs, type(self).__name__, arguments.MODEL_ARGUMENTS,
                                 passed_on=_KERAS_MODEL_ARGUMENTS)
        settings = arguments.accum_settings(
            accum_steps, accum_dtype, skip_nonfinite, batchnorm, micro_batch_size,
            noise_scale, coupled_from,
        )
        internals.init_model(self, super().__init__, args, kwargs)
        # The batch size the step splits into micro-batches, learnt from the
        # first training batch (see _maybe_symbolic_build).
        self._batch_size_seen = None
        self._auto_micro_batch = AutoMicroBatch()
        # The `Coupling` last made (coupling.py): not tracked, so not saved;
        # its two models share this model's layers.
        self._made_coupling = None
        # Settings assigned during a fit, which outlive it (fitting.py).
        self._fit_changes = fitting.FitChanges()
        # The settings callbacks' states in .keras files (fitting.py).
        self._setting_states = fitting.SettingStates()
        internals.holder_of(self, "train_function")
        self._configure(settings)

    def _configure(self, settings):
        # The settings and the window they make, for a model not yet trained
        # (__init__, from_config). The attribute names are the files' paths.
        self._settings = settings
        state = AccumState.new(
            settings.accum_dtype,
            settings.skip_nonfinite,
            BatchNormMoments(self, settings.batchnorm),
            # Held by the state only (not an attribute of the model): a
            # measurement, not saved in files.
            NoiseScale() if settings.noise_scale else None,
        )
        # The files' paths: Keras saves an object at the first attribute
        # path that reaches it (the skip count: `_accumulator/nonfinite`).
        self._accumulator = state.buffers
        self._nonfinite = state.buffers.nonfinite
        self._batchnorm = state.moments
        self._accum_state = state

    # -- the train function: one owner (train_functions.py) --------------------

    # What fit calls next: the step for the current settings, or a resumed
    # epoch's fast-forward over its first batches. Keras assigns it too
    # (compile: None).
    train_function = internals.HeldAttribute(
        lambda: TrainFunctions(check_not_accumulating),
        doc="""What `fit` calls for each step (Keras's attribute, kept by the
        model's train functions): the step for the current settings, made
        by `make_train_function()`; None until then and after `compile()`.

        Example:

        ```python
        model = keras_accum.AccumModel(inputs, outputs, accum_steps=4)
        model.compile("adam", "sparse_categorical_crossentropy")
        assert model.train_function is None  # until fit or make_train_function()
        model.make_train_function()
        assert model.train_function is not None
        ```
        """,
    )

    def make_train_function(self, force=False):
        return self._functions().make(
            self, self._accum_state, self._auto_micro_batch, self._step_plan,
            force=force,
        )

    def _step_plan(self):
        # The plan of the next traced step, from the current settings.
        return plan.make_plan(
            self._settings,
            self._batch_size_seen,
            self._auto_micro_batch.size,
            slices.statistic_of(self.optimizer),
            self._coupling(),
        )

    def _coupling(self):
        # The model's two parts at `coupled_from`, made once per setting
        # (their models add nodes to the layers: made again, they would add
        # more).
        coupled_from = self._settings.coupled_from
        if coupled_from is None:
            return None
        made = self._made_coupling
        if made is None or made.coupled_from != coupled_from:
            self._made_coupling = coupling.Coupling.of(self._model_to_split(), coupled_from)
        coupling.check_strategy(self._settings, self.distribute_strategy)
        return self._made_coupling

    def _model_to_split(self):
        # The model `coupled_from` names the layers or methods of.
        return self

    def _functions(self):
        # The model's TrainFunctions, made at first need and held by
        # `train_function` above.
        return internals.holder_of(self, "train_function")

    def train_step(self, data):
        return step.train_step(self, self._step_plan(), self._accum_state, data)

    # -- settings ------------------------------------------------------------

    @property
    def accum_steps(self):
        """Micro-batches per optimizer update. Setting it applies a pending window.

        Each value is traced once per compile: switching back and forth
        reuses the traced step. Set during `fit` (from a callback), it stays
        after `fit`, as a learning rate does.

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
        return self._settings.accum_steps

    @accum_steps.setter
    def accum_steps(self, value):
        value = arguments.check_accum_steps(value)
        self._fit_changes.set_by_user(accum_steps=value)
        self._set_accum_steps(value)

    def _set_accum_steps(self, value):
        # Not the user's: fit's per-call value, AccumScheduler (fitting.py).
        if value == self._settings.accum_steps:
            return
        arguments.check_coupled_settings(self._settings._replace(accum_steps=value))
        buffers = self._accum_state.buffers
        if buffers.open_micro_batches() and buffers.window_length() != value:
            self.flush()
        self._change(accum_steps=value)

    def _change(self, **settings):
        # A setting the traced step reads: the step for the new plan now.
        settings = self._settings._replace(**settings)
        if settings != self._settings:
            self._settings = settings
            self._functions().retrace(self)

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
        return self._settings.micro_batch_size

    @micro_batch_size.setter
    def micro_batch_size(self, value):
        value = arguments.check_micro_batch_size(value)
        self._fit_changes.set_by_user(micro_batch_size=value)
        self._change(micro_batch_size=value)

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

    @property
    def skip_nonfinite(self):
        """Whether windows with a non-finite gradient are skipped.

        Example:

        ```python
        model = keras_accum.AccumModel(inputs, outputs, skip_nonfinite=True)
        assert model.skip_nonfinite
        ```
        """
        return self._settings.skip_nonfinite

    # -- what training measured ---------------------------------------------

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
        return self._accum_state.skipped_windows

    # The last epoch's estimate, set at its end (fitting.py); not saved.
    _noise_scale = None

    def _measured(self, noise_scale):
        self._noise_scale = noise_scale

    @property
    def noise_scale(self):
        """The last epoch's gradient noise scale `B_simple`, in samples.

        None until an epoch of `fit` trained with `noise_scale=True`; NaN
        if that epoch had no window of two micro-batches or more. The
        estimate of each epoch is also logged as `noise_scale`. Batches up
        to about this size train in proportionally fewer steps; beyond it,
        a bigger batch mostly costs more samples (docs: noise scale).

        Example:

        ```python
        model = keras_accum.AccumModel(inputs, outputs, accum_steps=4, noise_scale=True)
        model.compile("adam", "sparse_categorical_crossentropy")
        history = model.fit(x, y, batch_size=32, epochs=3, verbose=0)
        print(model.noise_scale, history.history["noise_scale"])
        ```
        """
        return self._noise_scale

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
                validated before any training happens, and refused if an
                `AccumScheduler` sets another value for the first epoch.
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
        control = self._fit_control()
        with fitting.one_fit(
            self, control, callbacks, accum_steps, micro_batch_size, kwargs
        ) as callbacks:
            return super().fit(
                x,
                y,
                batch_size=batch_size,
                epochs=epochs,
                verbose=verbose,
                callbacks=callbacks,
                **kwargs,
            )

    def _fit_control(self):
        # What a fit and its callbacks may read and change of this model
        # (fitting.py), without reaching into it.
        return fitting.FitControl(
            settings=lambda: self._settings,
            set_accum_steps=self._set_accum_steps,
            set_micro_batch_size=lambda value: self._change(micro_batch_size=value),
            restore=self._restore_settings,
            end_fit=self._functions().end_fit,
            changes=self._fit_changes,
            setting_states=self._setting_states,
            batch_size_seen=lambda: self._batch_size_seen,
            window_open=lambda: bool(self._accum_state.open_micro_batches()),
            noise=self._accum_state.noise,
            measured=self._measured,
        )

    def _restore_settings(self, settings):
        # A fit's end: the model's own settings back, not through the
        # setters, so the open window stays open; the next step is made
        # for them.
        if settings != self._settings:
            self._settings = settings
            self._functions().invalidate()

    def _see_batch(self, data_batch, size=None):
        # The first training batch of a fit or train_on_batch, in Python,
        # or the spec of fit's batches (internals.BuildFromFirstBatch);
        # `size`: the first batch's size where Keras knows it from arrays.
        # The step splits a batch whose size the trace may not know (fit's
        # batch dimension is None): the size is taken from here, or, where
        # neither a batch nor the spec tells it, from the batch the first
        # step trains (TrainFunctions.see_first).
        if data_batch is None:
            return  # no data: nothing will train
        size = size or static_batch_size(data_batch)
        if size is None:
            self._functions().see_first(self, self._seen_batch_size)
            return
        self._seen_batch_size(size)

    def _seen_batch_size(self, size):
        # A new size gets its own train function where the step splits.
        if size is None or size == self._batch_size_seen:
            return
        self._batch_size_seen = size
        if self._settings.micro_batch_size is not None:
            self._functions().invalidate()

    # -- the open window -------------------------------------------------------

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
        state = self._accum_state
        if not state.open_micro_batches():
            return
        self._restore_batchnorm_window()
        state.prepare_flush(self.trainable_variables, self.optimizer, self.distribute_strategy)
        if self.run_eagerly:
            window.close(state, self.optimizer, self.distribute_strategy)
        else:
            self._functions().flush_function(self, state)()

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
        if self._accum_state.open_micro_batches():
            self._restore_batchnorm_window()
            self._accum_state.discard()

    def _restore_batchnorm_window(self):
        # BatchNormalization moments loaded from a file wait for their
        # layers' variables, made with the next train function; flush() and
        # reset_window() before that make them now, so that the restored
        # moments are applied or discarded with the gradients they came
        # with, and do not leak into the next window.
        if self.built:
            self._accum_state.moments.build(self.distribute_strategy)

    # -- saving and loading (saving.py) -----------------------------------------

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
        load = super().load_weights
        result = saving.all_or_nothing(
            self, self._accum_state, lambda: load(filepath, *args, **kwargs)
        )
        if not saving.step_continues(
            self._accum_state, self.trainable_variables, self._settings.accum_steps
        ):
            # The traced step would continue the restored window with
            # another length or other variables: the next one is made anew
            # and refuses it, naming what differs.
            self._functions().invalidate()
        return result

    def save(self, filepath, *args, **kwargs):
        """`keras.Model.save`; refuses, before writing, a model whose `.keras`
        file would not load (a layer shared across a nested model, see
        `keras_accum.saving`)."""
        if str(filepath).endswith(".keras"):
            self._check_config_is_faithful()
        return super().save(filepath, *args, **kwargs)

    def _check_config_is_faithful(self):
        saving.check_config_is_faithful(self)

    def get_config(self):
        self._check_config_is_faithful()
        return {**self._model_config(), **self._settings.config()}

    def _model_config(self):
        # The Keras model's own config, to which the settings are added;
        # `wrap`'s model gives the model it wraps instead.
        return super().get_config()

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        settings = arguments.settings_from_config(config)
        # Keras makes functional models with only their graph's arguments:
        # the settings are given to the model it made, before any training
        # (this class's _configure, on the instance it made).
        model = super().from_config(config, custom_objects=custom_objects)
        cls._configure(model, settings)
        return model

    # -- a .keras file's assets: the settings callbacks' states mid-fit --------

    def save_assets(self, dir_path):
        """Keras's saving hook (`.keras` files): written mid-`fit` (by
        `ModelCheckpoint`), the file holds the running settings callbacks'
        states (an `AccumScheduler`'s), beside the weights, for the first
        `fit` of the model loaded from it (`fitting.SettingStates`). An
        asset, not config: a subclass's own `from_config` never sees it."""
        self._setting_states.save(dir_path)

    def load_assets(self, dir_path):
        """Keras's loading hook: takes back what `save_assets` wrote."""
        self._setting_states.read(dir_path)
