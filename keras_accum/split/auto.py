"""`micro_batch_size="auto"`: a step that runs out of memory is retried on
smaller micro-batches, and the training does not change.

Because the micro-batches of a batch are summed exactly (microbatch.py), the
micro-batch size is a memory setting, not a training one: any size gives the
same update. So when a step raises `tf.errors.ResourceExhaustedError`, the
same batch is trained again with micro-batches half the size, and the size
that worked is kept for the rest of training.

Keras's `fit` hands the train function an iterator and the batch is taken
from it inside the traced function, so a failed step would lose its batch.
In auto mode the train function takes each step's batch from the iterator
eagerly, in Python, and calls a traced step on it: a failed attempt leaves
the batch in hand to retry. Whatever the failed attempt may have written
before the error (statistics a layer updates in its forward pass, metrics)
is put back first, so the retry starts from exactly the state before it.
"""

import logging

import keras
import tensorflow as tf
from keras import tree

from keras_accum import _internals as internals

_log = logging.getLogger("keras_accum")

class AutoMicroBatch:
    """The micro-batch size chosen by `micro_batch_size="auto"`.

    Starts from the whole batch (`size` None) or a remembered size; halves it
    (rounding up) each time a step runs out of memory, and keeps it.

    Args:
        size: the size to start from, an integer >= 1, or None for the whole
            batch.

    Example:

    ```python
    auto = AutoMicroBatch()
    function = auto.train_function(model, make_step)  # fit's train_function
    auto.size  # None until a step ran out of memory, then e.g. 16
    ```
    """

    def __init__(self, size=None):
        self.size = size

    def train_function(self, model, make_step, state):
        """A train function for `fit` that retries out-of-memory steps.

        Args:
            model: the model trained (for `steps_per_execution`).
            make_step: returns a new step `step(data) -> logs`, traced for
                the current `self.size`; called again after each halving.
            state: a `StepState` for the variables a failed attempt may have
                written.

        Returns:
            `function(iterator) -> logs`, as Keras's `train_function`: runs
            up to `steps_per_execution` steps on batches taken from
            `iterator`, and raises StopIteration if it holds none.
        """
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
        """The size a step needs after running out of memory at the current
        one: half of it (rounding up); 0 if it was 1 already (nothing fits).

        Args:
            batch_size: the batch (per replica) the step trained on, used
                while no size is chosen; None if unknown.
        """
        current = self.size or batch_size
        if current is None or current <= 1:
            return 0
        return (current + 1) // 2

    def adopt(self, size, current, where=""):
        """Trains on with micro-batches of `size` (>= 1), and says so.

        Args:
            size: the new size, smaller than the one that ran out of memory.
            current: the size that ran out of memory (for the warning).
            where: how the warning says where memory ran out (under a
                strategy: " on at least one replica").
        """
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
    """Snapshot and restore of what a step may write before it fails.

    A traced step's writes that depend on its gradients (the optimizer's
    update and the accumulator's sums) cannot run before the gradients exist,
    so a step that fails while computing them leaves them untouched (tested).
    Writes made in the forward pass can: a `BatchNormalization` layer's
    moving statistics, or metrics updated before a failing backward pass.
    Those variables are small (statistics, counters, totals), so they are
    copied before every attempt and put back after a failed one.

    Under a strategy each replica's own copy is guarded: replicas may hold
    different values (a BatchNormalization's moving statistics, updated by
    each replica from its own share), and a failed attempt must change none.

    Args:
        variables: a callable returning the variables to guard (read at every
            snapshot: the model builds some of them in its first step).
        strategy: the strategy the variables were made under, or None.
    """

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
            # Traced once per set of variables: one call per step, not one
            # read per variable.
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
    """The variables a step of `model` may write before its gradients
    exist (see `StepState`): layers' state, metrics, the moments and
    counters of `state` (the model's `AccumState`)."""
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
