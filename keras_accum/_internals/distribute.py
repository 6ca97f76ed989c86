"""Distribution strategies as Keras and TensorFlow see them: replicas,
workers, per-replica variables, metric variables and XLA compilation."""

import inspect
import weakref

import keras
import tensorflow as tf

from keras_accum._internals.versions import reach, required

_collective_all_reduce_multi_worker = reach(
    "keras.src.backend.tensorflow.trainer", "_collective_all_reduce_multi_worker"
)
# TensorFlow has no public test for "no strategy.scope()" (see `replicated`).
_default_strategy = reach(
    "tensorflow.python.distribute.distribute_lib", "_get_default_strategy"
)
# Nor for "traced for XLA" (see `in_xla_context`).
_in_xla = reach("tensorflow.python.ops.control_flow_util", "GraphOrParentsInXlaContext")
_FuncGraph = reach("tensorflow.python.framework.func_graph", "FuncGraph")


def metrics_summed_over_replicas():
    """Whether Keras's metric variables are read as their sum over replicas.

    Keras 3.8 makes them without `synchronization="on_read"`, so under a
    multi-replica strategy the loss and metrics Keras logs (plain models
    too) are not the one-device values; later releases sum them on read.
    """
    return "synchronization" in inspect.signature(keras.Variable).parameters


def replicated(strategy):
    """Whether steps under `strategy` run as replicas of a `tf.distribute`
    strategy, one replica included (a one-GPU or CPU-only MirroredStrategy,
    a MultiWorkerMirroredStrategy without TF_CONFIG).

    Such a step runs in a replica context whose optimizer update is a
    `merge_call`, which cannot sit inside a conditional traced in the
    replica, whatever the number of replicas: the window is then applied in
    cross-replica context, as for several replicas. False for None and the
    default strategy (no `strategy.scope()`).
    """
    if strategy is None:
        return False
    return strategy is not _default_strategy()


def multi_worker(strategy):
    """Whether `strategy` runs across several worker processes."""
    return _collective_all_reduce_multi_worker(strategy)


def in_xla_context():
    """Whether the code being traced is compiled by XLA (`jit_compile=True`).

    XLA needs static shapes: a window of sparse slices is then handed to the
    optimizer padded to its buffer (window/slices.py). TensorFlow exposes no public
    test for this.
    """
    if tf.executing_eagerly():
        return False
    return _in_xla(tf.compat.v1.get_default_graph())


def branch_keeping_zero(probe):
    """Under XLA, a float32 zero made from the scalar `probe` at run time
    through a sort: written by a conditional's branch, it keeps the
    conditional a branch. Elsewhere a constant zero.

    XLA's ConditionalSimplifier (its "simplify-conditional" pass) turns a
    two-way conditional whose branches hold only what it counts as cheap,
    elementwise work included whatever its size, into both branches run
    and a select: the window's update, all elementwise for Adam, SGD and
    most optimizers, then runs at every micro-batch and is thrown away at
    all but the last (benchmarks/xla.md: 1.33x a step's time on an MLP).
    A sort is not cheap to it; `where(p > inf, p, 0)` is zero for every
    float, NaN included, and cannot be folded.
    """
    if not in_xla_context():
        return tf.constant(0.0)
    probe = tf.cast(tf.reshape(probe, []), tf.float32)
    smallest = tf.sort(tf.stack([probe, probe]))[0]
    return tf.where(smallest > float("inf"), smallest, 0.0)


def whole_sum(t):
    """The sum of every element of `t` (float32), written for XLA.

    Public TensorFlow, kept here beside `branch_keeping_zero`: both work
    around how XLA compiles, not Keras. XLA's CPU reduction to a scalar
    runs on one thread, a float at a time (1.4 ms for an MLP's 1.6M
    weights); a product with ones of the tensor cut into up to 1024 rows
    runs on every core (0.3 ms) and reads `t` once, the elementwise work
    producing `t` fused into it (benchmarks/xla.md). Not measured on a GPU.
    """
    flat = tf.reshape(tf.cast(t, tf.float32), [-1])
    size = flat.shape[0]
    if size is None:
        return tf.reduce_sum(flat)
    rows = _rows_for(size)
    matrix = tf.reshape(flat, [rows, size // rows])
    return tf.reduce_sum(tf.linalg.matvec(matrix, tf.ones([size // rows], tf.float32)))


def _rows_for(size):
    # The most rows (up to 1024) that divide `size`, keeping at least 8
    # columns: enough rows for every core.
    for rows in (1024, 512, 256, 128, 64, 32, 16, 8, 4, 2):
        if size % rows == 0 and size // rows >= 8:
            return rows
    return 1


def replica_component(variable):
    """The current replica's own component of a per-replica variable.

    Sync-on-read variables refuse scatter updates (TensorFlow leaves them
    unimplemented, even in a replica context); a window kept as slices
    appends with scatter updates, on the replica's own component. A
    variable that is not distributed is its own component.
    """
    if not isinstance(variable, tf.distribute.DistributedValues):
        return variable
    return required(variable, "_get_on_device_or_primary", "TensorFlow")()


def current_graph():
    """The graph being traced (a weak reference to it), or None eagerly."""
    if tf.executing_eagerly():
        return None
    return weakref.ref(tf.compat.v1.get_default_graph())


def tracing_inside(graph):
    """Whether the graph being traced is `graph` (a `current_graph()`) or
    one nested in it (a conditional's branch, a loop's body)."""
    traced = None if graph is None else graph()
    if traced is None or tf.executing_eagerly():
        return False
    inner = tf.compat.v1.get_default_graph()
    while isinstance(inner, _FuncGraph):
        if inner is traced:
            return True
        # A FuncGraph keeps the graph it is traced in here (a plain Graph,
        # the outermost, keeps none).
        inner = required(inner, "outer_graph", "TensorFlow")
    return inner is traced
