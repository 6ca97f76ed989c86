"""`AccumModel`: a `keras.Model` whose `fit` trains as if on N-times bigger batches.

Keras's face of the accumulation: each member forwards to the model's
`Engine` (engine/), which owns the settings, the window, the train
functions and the running fit (docs/concepts.md says what is exact).
"""

from __future__ import annotations

import inspect
from typing import Any

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
    a plain `keras.Model` with batch `N * b`: the same updates, logged loss and
    metrics, and schedule steps (docs/concepts.md).

    Args:
        *args: `inputs, outputs` for a functional model; nothing when subclassing.
        accum_steps: micro-batches per optimizer update, an integer >= 1 (1 is
            ordinary Keras training).
        accum_dtype: dtype of the gradient buffers. None (default): float32, or
            float64 for float64 weights, whatever the compute dtype.
        skip_nonfinite: if True, a window whose gradient holds a NaN or an Inf
            makes no update and is discarded (`skipped_windows` counts them).
        batchnorm: 'window' (default): `BatchNormalization` moving statistics
            updated once per update from the window's pooled moments, as the
            big batch would; 'micro_batch': Keras's update at every micro-batch.
        micro_batch_size: split each batch `fit` draws into micro-batches of this
            many samples inside the compiled step, summed exactly (the whole
            batch's training with the micro-batch's memory): an integer >= 1,
            "auto" (whole batches until a step runs out of memory, then halved
            until one fits; `chosen_micro_batch_size`), or None (default).
            Per replica under a strategy (docs/micro-batching.md).
        noise_scale: if True, the gradient noise scale `B_simple` is estimated
            from the windows and logged by `fit` every epoch (docs/noise-scale.md).
        coupled_from: for a loss coupling the samples of a batch (contrastive),
            the names of the layers whose outputs are the per-sample
            representations, or "methods" (a subclass's `represent` and
            `couple`): with `micro_batch_size`, the loss runs on the whole batch
            (docs/contrastive.md). Needs `accum_steps=1`.
        **kwargs: passed to `keras.Model`; a misspelling of an argument above
            raises a TypeError naming it.

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
        accum_steps: int = 1,
        accum_dtype: str | None = None,
        skip_nonfinite: bool = False,
        batchnorm: str = "window",
        micro_batch_size: int | str | None = None,
        noise_scale: bool = False,
        coupled_from: str | list[str] | None = None,
        **kwargs,
    ) -> None:
        arguments.check_keywords(
            kwargs, type(self).__name__, arguments.MODEL_ARGUMENTS, passed_on=_KERAS_MODEL_ARGUMENTS
        )
        settings = arguments.accum_settings(
            accum_steps,
            accum_dtype,
            skip_nonfinite,
            batchnorm,
            micro_batch_size,
            noise_scale,
            coupled_from,
        )
        internals.init_model(self, super().__init__, args, kwargs)
        # Not a Keras object: saving passes it by; the window's parts are
        # saved at the paths below.
        self._engine = Engine(self, settings, internals.holder_of(self, "train_function"))
        self._expose_window()

    def _configure(self, settings):
        # from_config: the settings, for a model not yet trained.
        self._engine.configure(settings)
        self._expose_window()

    def _expose_window(self):
        # The window's parts as the model's attributes: Keras saves an
        # object at the first attribute path that reaches it, and these are
        # the files' paths (the skip count: `_accumulator/nonfinite`).
        state = self._engine.state
        self._accumulator = state.buffers
        self._batchnorm = state.moments

    @property
    def accumulation(self) -> Engine:
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
    def accum_steps(self) -> int:
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
    def accum_steps(self, value: int) -> None:
        self._engine.set_accum_steps(value, by_user=True)

    @property
    def micro_batch_size(self) -> int | str | None:
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
    def micro_batch_size(self, value: int | str | None) -> None:
        self._engine.set_micro_batch_size(value, by_user=True)

    @property
    def chosen_micro_batch_size(self) -> int | None:
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
    def skip_nonfinite(self) -> bool:
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
    def skipped_windows(self) -> int:
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
    def noise_scale(self) -> float | None:
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
        x: Any = None,
        y: Any = None,
        batch_size: int | None = None,
        epochs: int = 1,
        verbose: str | int = "auto",
        callbacks: list[keras.callbacks.Callback] | None = None,
        *,
        accum_steps: int | None = None,
        micro_batch_size: int | str | None = None,
        **kwargs,
    ) -> keras.callbacks.History:
        """`keras.Model.fit`, plus `accum_steps` and `micro_batch_size` for this call only.

        Args:
            x: as `keras.Model.fit`.
            y: as `keras.Model.fit`.
            batch_size: as `keras.Model.fit`: the micro-batch of an `accum_steps`
                window, or the batch split by `micro_batch_size`.
            epochs: as `keras.Model.fit`.
            verbose: as `keras.Model.fit`.
            callbacks: as `keras.Model.fit`; one callback without a list too.
            accum_steps: overrides `self.accum_steps` for this call (checked
                before training; refused if an `AccumScheduler` sets another value
                for the first epoch).
            micro_batch_size: overrides `self.micro_batch_size` for this call.
            **kwargs: the other arguments of `keras.Model.fit`.

        Returns:
            The `History` object.

        A window open when an epoch's data ends is applied before validation and
        before other callbacks' `on_epoch_end`.

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
        # internals.BuildFromFirstBatch's hook.
        self._engine.see_batch(data_batch, size)

    # -- the open window -------------------------------------------------------

    def flush(self) -> None:
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

    def reset_window(self) -> None:
        """Discards the open window: no update is made; a no-op if none is open.

        For a window that must not be applied, e.g. after `TerminateOnNaN` stopped
        `fit` with a NaN gradient in it.

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
        """`keras.Model.load_weights`, all or nothing: weights, optimizer state
        and an open window. An optimizer not built yet is built when the file
        holds its state (Keras alone would skip it). If loading fails, the model
        is left as it was and the error raised.

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
        """`keras.Model.save`; refuses, before writing, a `.keras` file that would
        not load (a layer shared across a nested model: engine/files.py).
        """
        if str(filepath).endswith(".keras"):
            self._check_config_is_faithful()
        return super().save(filepath, *args, **kwargs)

    def _check_config_is_faithful(self):
        files.check_config_is_faithful(self)

    def get_config(self):
        self._check_config_is_faithful()
        return {**self._model_config(), **self._engine.settings.config()}

    def _model_config(self):
        # `wrap`'s models give the model they wrap instead.
        return super().get_config()

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        settings = arguments.settings_from_config(config)
        # Keras makes functional models from their graph's arguments only.
        model = super().from_config(config, custom_objects=custom_objects)
        cls._configure(model, settings)
        return model

    # -- a .keras file's assets: the settings callbacks' states mid-fit --------

    def save_assets(self, dir_path: str) -> None:
        """Keras's saving hook: a `.keras` file written mid-`fit` holds the settings
        callbacks' states (an `AccumScheduler`'s) for the loaded model's next fit.

        Example:

        ```python
        inputs = keras.Input((4,))
        model = keras_accum.AccumModel(inputs, keras.layers.Dense(2)(inputs), accum_steps=4)
        model.save("model.keras")  # Keras calls model.save_assets
        loaded = keras.saving.load_model("model.keras")  # and loaded.load_assets
        ```
        """
        self._engine.fits.save(dir_path)

    def load_assets(self, dir_path: str) -> None:
        """Keras's loading hook: takes back what `save_assets` wrote.

        Example:

        ```python
        inputs = keras.Input((4,))
        model = keras_accum.AccumModel(inputs, keras.layers.Dense(2)(inputs), accum_steps=4)
        model.save("model.keras")  # Keras calls model.save_assets
        loaded = keras.saving.load_model("model.keras")  # and loaded.load_assets
        ```
        """
        self._engine.fits.read(dir_path)
