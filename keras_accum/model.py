"""`AccumModel`: a `keras.Model` whose `fit` trains as if on N-times bigger batches.

The model is Keras's face of its accumulation: each member forwards to the
model's `Engine` (engine/), which owns the settings, the window, the train
functions and the running fit (`model.accumulation`, for reading).

Training with micro-batch `b` and `accum_steps=N` is the same training as
a plain `keras.Model` with batch `N * b` (docs/concepts.md): each update
uses the gradient of the loss over every sample of its window (each
micro-batch weighted by what Keras normalises its loss by), a window still
open when an epoch's data ends is applied then, and `optimizer.iterations`
counts updates. Between updates the weights do not move; the gradients are
summed into float32 buffers that are training state, not model weights.
"""

import inspect

import keras

from keras_accum import _internals as internals
from keras_accum import arguments
from keras_accum.engine import Engine, files, held_functions


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
        # Not a Keras object: saving passes it by; the window's parts are
        # saved at the paths below.
        self._engine = Engine(self, settings, internals.holder_of(self, "train_function"))
        self._expose_window()

    def _configure(self, settings):
        # The settings and the window they make, for a model not yet trained
        # (from_config).
        self._engine.configure(settings)
        self._expose_window()

    def _expose_window(self):
        # The window's parts as the model's attributes: Keras saves an
        # object at the first attribute path that reaches it, and these are
        # the files' paths (the skip count: `_accumulator/nonfinite`).
        state = self._engine.state
        self._accumulator = state.buffers
        self._nonfinite = state.buffers.nonfinite
        self._batchnorm = state.moments

    @property
    def accumulation(self):
        """The model's `Engine`: its settings, window and train functions.

        For reading what training does (`accumulation.settings`,
        `accumulation.plan()`, `accumulation.batch_size_seen`); change the
        model through its own members.

        Example:

        ```python
        model = keras_accum.AccumModel(inputs, outputs, accum_steps=4)
        model.accumulation.settings.accum_steps  # 4
        ```
        """
        return self._engine

    # -- the train function: held by the engine's TrainFunctions --------------

    # What fit calls next: the step for the current settings, or a resumed
    # epoch's fast-forward over its first batches. Keras assigns it too
    # (compile: None).
    train_function = internals.HeldAttribute(
        held_functions,
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
        return self._engine.make_train_function(force=force)

    def train_step(self, data):
        return self._engine.train_step(data)

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
        return self._engine.settings.accum_steps

    @accum_steps.setter
    def accum_steps(self, value):
        self._engine.set_accum_steps(value, by_user=True)

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
        return self._engine.settings.micro_batch_size

    @micro_batch_size.setter
    def micro_batch_size(self, value):
        self._engine.set_micro_batch_size(value, by_user=True)

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
        return self._engine.auto.size

    @property
    def skip_nonfinite(self):
        """Whether windows with a non-finite gradient are skipped.

        Example:

        ```python
        model = keras_accum.AccumModel(inputs, outputs, skip_nonfinite=True)
        assert model.skip_nonfinite
        ```
        """
        return self._engine.settings.skip_nonfinite

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
        return self._engine.state.skipped_windows

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
        return self._engine.noise_scale

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
        with self._engine.fit(callbacks, accum_steps, micro_batch_size, kwargs) as callbacks:
            return super().fit(
                x,
                y,
                batch_size=batch_size,
                epochs=epochs,
                verbose=verbose,
                callbacks=callbacks,
                **kwargs,
            )

    def _see_batch(self, data_batch, size=None):
        # The first training batch of a fit or train_on_batch, or the spec
        # of fit's batches (internals.BuildFromFirstBatch).
        self._engine.see_batch(data_batch, size)

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
        self._engine.flush()

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
        self._engine.reset_window()

    # -- saving and loading (engine/files.py) ------------------------------------

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
        return self._engine.load_weights(lambda: load(filepath, *args, **kwargs))

    def save(self, filepath, *args, **kwargs):
        """`keras.Model.save`; refuses, before writing, a model whose `.keras`
        file would not load (a layer shared across a nested model, see
        `keras_accum.saving`)."""
        if str(filepath).endswith(".keras"):
            self._check_config_is_faithful()
        return super().save(filepath, *args, **kwargs)

    def _check_config_is_faithful(self):
        files.check_config_is_faithful(self)

    def get_config(self):
        self._check_config_is_faithful()
        return {**self._model_config(), **self._engine.settings.config()}

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
        `fit` of the model loaded from it (`engine.fit.FitScope`). An
        asset, not config: a subclass's own `from_config` never sees it."""
        self._engine.fits.save(dir_path)

    def load_assets(self, dir_path):
        """Keras's loading hook: takes back what `save_assets` wrote."""
        self._engine.fits.read(dir_path)
