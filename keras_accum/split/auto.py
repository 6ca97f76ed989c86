"""`micro_batch_size="auto"`: a step that runs out of memory is retried on
smaller micro-batches, and the training does not change.

Micro-batches are summed exactly, so their size changes memory, not the update:
on `tf.errors.ResourceExhaustedError` the same batch is trained again on
micro-batches half the size, kept from then on. Each batch is taken from the
iterator eagerly (Keras takes it inside the traced function, where a failed
step would lose it), and what a failed attempt wrote is put back first.
"""

import logging

import keras
import tensorflow as tf
from keras import tree

from keras_accum import _internals as internals

_log = logging.getLogger("keras_accum")


class AutoMicroBatch:
    """The micro-batch size chosen by `micro_batch_size="auto"`: from the whole
    batch (`size` None) or a remembered size, halved (rounding up) each time a
    step runs out of memory, and kept."""

    def __init__(self, size=None):
        self.size = size

    def train_function(self, model, make_step, state):
        """A train function for `fit` that retries out-of-memory steps, as
        Keras's `function(iterator) -> logs`; `make_step()` traces a step for
        the current `self.size`; a `StepState` puts back what a failure wrote."""
        step = make_step()

        def run(data):
            nonlocal step
            data = internals.optionals_to_none(data)
            while True:
                before = state.snapshot()
                try:
                    return step(data)
                except tf.errors.ResourceExhaustedError as error:
                    state.restore(before)
                    self._halve(data, error)
                    step = make_step()

        def function(iterator):
            return internals.each_batch(model, iterator, run)

        return function

    def _halve(self, data, error):
        needed = self.needed(_batch_size(data))
        if needed < 1:
            raise tf.errors.ResourceExhaustedError(
                error.node_def, error.op, NOTHING_FITS + " The error was: " + error.message
            ) from error
        self.adopt(needed, self.size or _batch_size(data))

    def needed(self, batch_size):
        """The size a step needs after running out of memory: half the current
        one (or of `batch_size`, per replica, while none is chosen), rounding
        up; 0 if it was 1 already (or unknown)."""
        current = self.size or batch_size
        if current is None or current <= 1:
            return 0
        return (current + 1) // 2

    def adopt(self, size, current, where=""):
        """Trains on with micro-batches of `size`, warning that `current` ran
        out of memory (`where`: e.g. " on at least one replica")."""
        self.size = size
        _log.warning(
            "A training step ran out of memory with micro-batches of %s "
            "samples%s; training on with micro_batch_size=%d (the same batch "
            "is trained again, the training is unchanged).",
            current,
            where,
            size,
        )


# The error when not even micro-batches of one sample fit.
NOTHING_FITS = (
    "A training step ran out of memory with micro-batches of 1 sample "
    "(micro_batch_size='auto' halved them down to 1), so no micro-batch "
    "size fits: make the model or its inputs smaller, or free memory."
)


class StepState:
    """Snapshot and restore of what a step may write before it fails: not what
    depends on the gradients (the update, the buffers' sums; tested), but
    forward-pass writes (BatchNormalization's moving statistics, metrics), small
    enough to copy before every attempt, each replica's own. `variables` is a
    callable: the model builds some of them in its first step."""

    def __init__(self, variables, strategy=None):
        self._guarded = variables
        self._strategy = strategy
        self._copy = None
        self._copied_for = None

    def _components(self):
        for variable in self._guarded():
            # A Keras variable holds its backend variable as `value`.
            inner = variable.value if isinstance(variable, keras.Variable) else variable
            if self._strategy is None:
                yield inner
            else:
                yield from self._strategy.experimental_local_results(inner)

    def snapshot(self):
        variables = tuple(self._components())
        if self._copied_for != tuple(map(id, variables)):
            # Traced once per set of variables: one call per step, not one per variable.
            self._copy = tf.function(
                tf.autograph.experimental.do_not_convert(
                    lambda: [tf.identity(v) for v in variables]
                )
            )
            self._copied_for = tuple(map(id, variables))
        return variables, self._copy()

    @staticmethod
    def restore(snapshot):
        variables, values = snapshot
        for variable, value in zip(variables, values):
            variable.assign(value)


def written_before_gradients(model, state):
    """The variables a step of `model` may write before its gradients exist:
    non-trainable ones, metrics, and the moments and counters of `state`."""
    buffers = state.buffers
    scalars = [buffers.micro_step, buffers.window_weight] if buffers.built else []
    return [
        *model.non_trainable_variables,
        *model.metrics_variables,
        *state.moments.variables,
        *scalars,
    ]


def _batch_size(data):
    leaves = [t for t in tree.flatten(data) if t is not None and len(t.shape)]
    if not leaves:
        return None
    return int(tf.shape(leaves[0])[0])
