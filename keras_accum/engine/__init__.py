"""The engine: everything a model's accumulation is, in one object.

An `AccumModel` holds an `Engine` (`model.accumulation`) and forwards to
it. Its parts: plan.py (what a traced step reads), step.py (the train
step), functions.py (the train functions `fit` calls), fit.py (one `fit`'s
settings and callbacks), files.py (faithful configs, all-or-nothing loads).
The engine hands each part what it needs and reads the Keras model only
through Keras's API: nothing calls back into the model.
"""

from keras_accum import arguments
from keras_accum.engine import files, fit, plan, step
from keras_accum.engine.functions import TrainFunctions
from keras_accum.split import coupling
from keras_accum.split.auto import AutoMicroBatch
from keras_accum.split.microbatch import static_batch_size
from keras_accum.window import AccumState, slices
from keras_accum.window.batchnorm import BatchNormMoments
from keras_accum.window.noise_scale import NoiseScale


class Engine:
    """A model's accumulation: its settings, its window and how `fit` trains it.

    Reached as `model.accumulation`, for reading what training does; change
    the model through its own members (`accum_steps`, `flush()`, ...).

    Args:
        model: the `keras.Model` it drives.
        settings: the model's `AccumSettings`, checked.
        functions: the `TrainFunctions` holding the model's `train_function`.

    Attributes:
        settings: the `AccumSettings` in force.
        state: the `AccumState`: the window's buffers, skip policy, observers.
        auto: the `AutoMicroBatch` of `micro_batch_size="auto"`.
        batch_size_seen: the first training batch's size per replica, or None.
        model_to_split: the model `coupled_from` names the parts of.
        noise_scale: the last epoch's noise scale estimate, or None.
        fits: the running fit's bookkeeping (`fit.FitScope`).
    """

    def __init__(self, model, settings, functions):
        self.model = model
        self.functions = functions
        self.auto = AutoMicroBatch()
        self.batch_size_seen = None
        self.model_to_split = model
        self.noise_scale = None
        self.fits = fit.FitScope()
        self._coupling = None
        self.configure(settings)

    def configure(self, settings):
        """A new window for `settings`, for a model not yet trained."""
        self.settings = settings
        self.state = AccumState.new(
            settings.accum_dtype,
            settings.skip_nonfinite,
            BatchNormMoments(self.model, settings.batchnorm),
            NoiseScale() if settings.noise_scale else None,
        )

    # -- the step ----------------------------------------------------------

    def plan(self):
        """The `StepPlan` of the next traced step."""
        return plan.StepPlan(
            self.settings,
            self.batch_size_seen,
            self.auto.size,
            slices.statistic_of(self.model.optimizer),
            self.coupling(),
        )

    def coupling(self):
        """The model's two parts at `coupled_from` (None without), made once per setting."""
        coupled_from = self.settings.coupled_from
        if coupled_from is None:
            return None
        if self._coupling is None or self._coupling.coupled_from != coupled_from:
            self._coupling = coupling.Coupling.of(self.model_to_split, coupled_from)
        coupling.check_strategy(self.settings, self.model.distribute_strategy)
        return self._coupling

    def train_step(self, data):
        """`model.train_step(data)`."""
        return step.train_step(self.model, self.plan(), self.state, data)

    def make_train_function(self, force=False):
        """`model.make_train_function(force)`."""
        return self.functions.make(self, force=force)

    # -- settings ----------------------------------------------------------

    def set_accum_steps(self, value, by_user=False):
        """`accum_steps` from now on: the user's (`by_user`, kept after the fit) or a
        fit's or schedule's (this fit only); an open window of another length is
        applied first.
        """
        value = arguments.check_accum_steps(value)
        if by_user:
            self.fits.set_by_user(accum_steps=value)
        if value == self.settings.accum_steps:
            return
        arguments.check_coupled_settings(self.settings._replace(accum_steps=value))
        buffers = self.state.buffers
        if buffers.open_micro_batches() and buffers.window_length() != value:
            self.flush()
        self._change(accum_steps=value)

    def set_micro_batch_size(self, value, by_user=False):
        """`micro_batch_size` from now on (as `set_accum_steps`)."""
        value = arguments.check_micro_batch_size(value)
        if by_user:
            self.fits.set_by_user(micro_batch_size=value)
        self._change(micro_batch_size=value)

    def _change(self, **changes):
        settings = self.settings._replace(**changes)
        if settings != self.settings:
            self.settings = settings
            self.functions.retrace(self)

    def restore_settings(self, settings):
        """A fit's end: the model's own settings back; the open window stays open."""
        if settings != self.settings:
            self.settings = settings
            self.functions.invalidate()

    def see_batch(self, data_batch, size=None):
        """The first training batch (or the spec of `fit`'s batches; `size`: Keras's,
        for arrays): its size, else the first step's batch gives it.
        """
        if data_batch is None:
            return  # no data: nothing will train
        size = size or static_batch_size(data_batch)
        if size is None:
            self.functions.see_first(self, self.seen_batch_size)
            return
        self.seen_batch_size(size)

    def seen_batch_size(self, size):
        """The size the step splits by (a new one retraces a splitting step)."""
        if size is None or size == self.batch_size_seen:
            return
        self.batch_size_seen = size
        if self.settings.micro_batch_size is not None:
            self.functions.invalidate()

    def batch_drawn(self):
        """The batch `fit` draws per step over all replicas, or None before one."""
        size = self.batch_size_seen
        return size and size * self.model.distribute_strategy.num_replicas_in_sync

    # -- the open window -----------------------------------------------------

    def window_open(self):
        """Whether micro-batches were trained and not yet applied."""
        return bool(self.state.open_micro_batches())

    def flush(self):
        """Applies the open window now (a no-op if none is)."""
        state, model = self.state, self.model
        self._restored_window()
        if not state.open_micro_batches():
            return
        self._restore_batchnorm_window()
        state.prepare_flush(model.trainable_variables, model.optimizer, model.distribute_strategy)
        self.functions.flush_function(model, state)()

    def reset_window(self):
        """Discards the open window (a no-op if none is)."""
        self._restored_window()
        if self.state.open_micro_batches():
            self._restore_batchnorm_window()
            self.state.discard()

    def _restored_window(self):
        # A window a `tf.train.Checkpoint` restored before the buffers were
        # made waits for them (TensorFlow's deferred restoration): made now,
        # it is applied or discarded, not brought back by the next step.
        settings, model = self.settings, self.model
        uses_buffers = settings.accum_steps > 1 or settings.skip_nonfinite
        if uses_buffers and model.built and not self.state.buffers.built:
            self.state.buffers.bind(
                model.trainable_variables, settings.accum_steps, model.distribute_strategy
            )

    def _restore_batchnorm_window(self):
        # Moments loaded from a file wait for their layers' variables: made
        # now, they go with the gradients they came with.
        if self.model.built:
            self.state.moments.build(self.model.distribute_strategy)

    # -- fit and files -----------------------------------------------------

    def fit(self, callbacks, accum_steps=None, micro_batch_size=None, fit_kwargs=None):
        """The context of one `fit` (fit.py); yields its callbacks."""
        return fit.one_fit(self, callbacks, accum_steps, micro_batch_size, fit_kwargs)

    def load_weights(self, load):
        """`load()`, all or nothing; the step is made anew if it cannot continue the
        loaded window.
        """
        model = self.model
        result = files.all_or_nothing(model, self.state, load)
        if not files.step_continues(
            self.state, model.trainable_variables, self.settings.accum_steps
        ):
            # Made anew, the step refuses the window, naming what differs.
            self.functions.invalidate()
        return result


def engine_of(model):
    """The `Engine` of a keras_accum model, or None for a plain Keras model."""
    engine = getattr(model, "accumulation", None)
    return engine if isinstance(engine, Engine) else None


def held_functions():
    """What holds a model's `train_function` (`internals.HeldAttribute`)."""
    return TrainFunctions()


__all__ = ["Engine", "engine_of", "held_functions"]
