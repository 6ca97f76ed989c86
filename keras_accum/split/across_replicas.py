"""`micro_batch_size="auto"` across replicas and workers: a step that runs
out of memory on any replica is retried, on every replica of every worker,
with the one smaller micro-batch size they agree on.

On one device a failed traced step simply raises (auto_micro_batch.py).
Across replicas it must not fail while another replica waits in a
collective: a worker that raised would leave its peers blocked in the
gradient all-reduce forever (and a NCCL kernel waiting for a GPU that gave
up can block its device). So each step is three calls:

1. the attempt: every local replica's forward and backward passes, its
   micro-batches' gradients summed into tensors, no state written but by the
   layers' forward passes (put back after a failure, as on one device), and
   no collective at all (checked on its traced graph);
2. the agreement (across workers only): one all-gather of one integer per
   replica, the size each worker needs: no limit if its attempt succeeded,
   half its size if it ran out of memory, 0 if even one sample did not fit,
   -1 if it failed otherwise. The smallest wins, on every worker alike;
3. the commit, only if nobody failed: the attempt's gradients, moments,
   loss and predictions written as the ordinary step writes them (window or
   optimizer, loss tracker, metrics), the window applied once full, the
   logs reduced: every collective of the step is here.

Under MirroredStrategy (one process) the attempt of all replicas fails or
succeeds as one call, so no agreement call is needed.

Example:

```python
function = train_function(auto, model, (compute, write), after_step, written)
function(iterator)  # what fit calls: up to steps_per_execution steps
```
"""

import tensorflow as tf
from keras import tree

from keras_accum import _internals as internals
from keras_accum.split.auto import NOTHING_FITS

# What a worker proposes in the agreement.
NO_LIMIT = 2**31 - 1  # its attempt succeeded
FAILED = -1  # its attempt raised something other than running out of memory

# Op types that wait for other replicas or workers: none may be in an attempt.
_COLLECTIVE_PREFIXES = ("Collective", "Nccl")


def train_function(auto, model, halves, after_step, written):
    """A train function for `fit` under a multi-replica strategy in auto mode.

    Args:
        auto: the model's `AutoMicroBatch` (the size, kept across calls).
        model: the model trained.
        halves: `(compute, write)`, the step's two halves in a replica:
            `compute(data)`, the batch's gradients in tensors, no state
            written (step.py's `SplitBatch`, any structure `tf.nest`
            flattens); `write(data, computed)`, what it computed written,
            the logs. Each reads the current size when traced.
        after_step: the cross-replica part of a step (the window applied once
            full), or None where the step updates by itself.
        written: a `StepState` for what an attempt may write (per replica).

    Returns:
        `function(iterator) -> logs`, as Keras's `train_function`.

    Example:

    ```python
    written = StepState(lambda: written_before_gradients(model, state), strategy)
    halves = (compute, write)  # step.compute_split, step.write_split
    function = train_function(model._auto_micro_batch, model, halves, after_step, written)
    model.chosen_micro_batch_size  # the same on every worker
    ```
    """
    strategy = model.distribute_strategy
    agree = _agreement(strategy) if internals.multi_worker(strategy) else None
    phases = _Phases(model, halves, after_step)

    def run(data):
        nonlocal phases
        data = internals.optionals_to_none(data)
        while True:
            before = written.snapshot()
            computed, error, proposal = None, None, NO_LIMIT
            try:
                computed = phases.attempt(data)
            except tf.errors.ResourceExhaustedError as raised:
                error = raised
                proposal = auto.needed(_local_batch_size(strategy, data))
            except Exception as raised:  # noqa: BLE001 - re-raised below
                if agree is None:
                    raise
                error, proposal = raised, FAILED
            agreed = proposal if agree is None else int(agree(proposal))
            if agreed == NO_LIMIT:
                return phases.commit(data, computed)
            del computed
            written.restore(before)
            _raise_if_final(agreed, error)
            auto.adopt(
                agreed,
                auto.size or _local_batch_size(strategy, data),
                " on at least one replica",
            )
            phases = _Phases(model, halves, after_step)

    def function(iterator):
        return internals.each_batch(model, iterator, run)

    return function


def _raise_if_final(agreed, error):
    """Raises the same error on every worker when the step cannot go on."""
    if agreed == FAILED:
        if error is not None and not isinstance(error, tf.errors.ResourceExhaustedError):
            raise error
        raise tf.errors.AbortedError(
            None,
            None,
            "Another worker's training step failed (micro_batch_size='auto' "
            "stops every worker together); its error is in its own log.",
        )
    if agreed < 1:
        message = NOTHING_FITS + " (On at least one replica.)"
        raise tf.errors.ResourceExhaustedError(None, None, message) from error


class _Phases:
    """The traced attempt and commit for the current size (read at trace)."""

    def __init__(self, model, halves, after_step):
        self._model = model
        self._compute_split, self._write_split = halves
        strategy = model.distribute_strategy
        # Per traced batch shape: where the attempt's tensors go back in.
        self._layouts = {}
        self._checked = set()
        self._attempt = self._function(
            lambda data: strategy.run(self._compute, args=(data,))
        )

        def commit(data, flat):
            outputs = strategy.run(self._write, args=(data, flat))
            if after_step is not None:
                after_step()
            return internals.reduce_outputs(outputs, strategy)

        self._commit = self._function(commit)

    def _function(self, function):
        function = tf.autograph.experimental.do_not_convert(function)
        if self._model.run_eagerly:
            return function
        # Traced per batch shape: the split is static and exact for every
        # batch, the short last one too.
        return tf.function(
            function, reduce_retracing=False, jit_compile=self._model.jit_compile
        )

    def attempt(self, data):
        if not self._model.run_eagerly:
            # Traced, not run, before its first run: a collective in it could
            # block every replica as soon as one runs out of memory (across
            # workers; and a NCCL kernel on a GPU whose peer gave up).
            self._check_no_collectives(data)
        return self._attempt(data)

    def commit(self, data, flat):
        return self._commit(data, flat)

    def _compute(self, data):
        computed = self._compute_split(data)
        # The tensors leave the call; everything else (None gradients, the
        # layers' moment windows, flags) stays here for the commit.
        leaves = tf.nest.flatten(computed)
        layout = [None if _is_tensor(leaf) else (leaf,) for leaf in leaves]
        structure = tf.nest.pack_sequence_as(computed, [0] * len(leaves))
        self._layouts[_shapes(data)] = (structure, layout)
        return [leaf for leaf in leaves if _is_tensor(leaf)]

    def _write(self, data, flat):
        structure, layout = self._layouts[_shapes(data)]
        # Made again on this replica's device: a reduction of a tensor that
        # came in as an argument has no device to reduce to.
        flat = tf.nest.map_structure(tf.identity, flat, expand_composites=True)
        tensors = iter(flat)
        leaves = [next(tensors) if kept is None else kept[0] for kept in layout]
        computed = tf.nest.pack_sequence_as(structure, leaves)
        return self._write_split(data, computed)

    def _check_no_collectives(self, data):
        concrete = self._attempt.get_concrete_function(data)
        if id(concrete) in self._checked:
            return
        self._checked.add(id(concrete))
        found = sorted(_collective_ops(concrete.graph))
        if found:
            raise ValueError(
                "micro_batch_size='auto' across replicas needs a forward and "
                "backward pass that waits for no other replica, so that one "
                "running out of memory cannot leave the others blocked; this "
                f"model's waits in {found} (a "
                "BatchNormalization(synchronized=True) does). Set an integer "
                "micro_batch_size (per replica). Received: "
                "micro_batch_size='auto'."
            )


def _collective_ops(graph):
    """The collective op types in `graph` and the functions it calls."""
    graph_def = graph.as_graph_def()
    nodes = list(graph_def.node)
    for function in graph_def.library.function:
        nodes.extend(function.node_def)
    return {n.op for n in nodes if n.op.startswith(_COLLECTIVE_PREFIXES)}


def _agreement(strategy):
    """The traced agreement: the smallest proposal of every replica."""

    def gather(proposal):
        context = tf.distribute.get_replica_context()
        return context.all_gather(tf.reshape(proposal, [1]), axis=0)

    @tf.function
    @tf.autograph.experimental.do_not_convert
    def agree(proposal):
        gathered = strategy.run(gather, args=(proposal,))
        return tf.reduce_min(strategy.experimental_local_results(gathered)[0])

    return lambda proposal: agree(tf.constant(proposal, tf.int64))


def _local_batch_size(strategy, data):
    """The largest batch any local replica trained on (None if unknown)."""
    sizes = [
        int(tf.shape(t)[0])
        for leaf in tree.flatten(data)
        if leaf is not None
        for t in strategy.experimental_local_results(leaf)
        if len(t.shape)
    ]
    return max(sizes) if sizes else None


def _shapes(data):
    """The static shapes of a replica's batch: which trace it belongs to."""
    return tuple(
        None if leaf is None else tuple(leaf.shape.as_list())
        for leaf in tf.nest.flatten(data)
    )


def _is_tensor(value):
    return isinstance(value, tf.IndexedSlices) or tf.is_tensor(value)
