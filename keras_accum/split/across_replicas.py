"""`micro_batch_size="auto"` across replicas and workers: no replica may fail
while another waits in a collective (its peers would block forever). So a step
is an attempt (each replica's gradients in tensors, no collective, checked on
its graph), an agreement across workers (an all-gather of the size each needs,
the smallest wins) and, if nobody failed, a commit holding every write and
collective. Under MirroredStrategy the attempt fails or succeeds as one call.
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

    `halves`: `(compute, write)` in a replica, `compute(data)` giving the
    batch's gradients in tensors (engine/step.py's `ComputedBatch`), nothing
    written, and `write(data, computed)` writing them and giving the logs; each
    reads the current size when traced. `written`: a `StepState`.
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
        self._attempt = self._function(lambda data: strategy.run(self._compute, args=(data,)))

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
        # Traced per batch shape: the split is static and exact, the short last too.
        return tf.function(function, reduce_retracing=False, jit_compile=self._model.jit_compile)

    def attempt(self, data):
        if not self._model.run_eagerly:
            # Checked before its first run: a collective in it could block every
            # replica once one runs out of memory (and a NCCL kernel its GPU).
            self._check_no_collectives(data)
        return self._attempt(data)

    def commit(self, data, flat):
        return self._commit(data, flat)

    def _compute(self, data):
        computed = self._compute_split(data)
        # Only tensors leave the call; the rest (None gradients, pooled moments, flags) stays.
        leaves = tf.nest.flatten(computed)
        layout = [None if _is_tensor(leaf) else (leaf,) for leaf in leaves]
        structure = tf.nest.pack_sequence_as(computed, [0] * len(leaves))
        self._layouts[_shapes(data)] = (structure, layout)
        return [leaf for leaf in leaves if _is_tensor(leaf)]

    def _write(self, data, flat):
        structure, layout = self._layouts[_shapes(data)]
        # Remade on this replica's device: an argument's tensor has none to reduce to.
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
        None if leaf is None else tuple(leaf.shape.as_list()) for leaf in tf.nest.flatten(data)
    )


def _is_tensor(value):
    return isinstance(value, tf.IndexedSlices) or tf.is_tensor(value)
