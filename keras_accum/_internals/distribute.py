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
_default_strategy = reach("tensorflow.python.distribute.distribute_lib", "_get_default_strategy")
# Nor for "traced for XLA" (see `in_xla_context`).
_in_xla = reach("tensorflow.python.ops.control_flow_util", "GraphOrParentsInXlaContext")
_FuncGraph = reach("tensorflow.python.framework.func_graph", "FuncGraph")


def metrics_summed_over_replicas():
    """Whether Keras sums its metric variables over replicas on read: 3.8 does
    not, so its logs under several replicas are not the one-device values."""
    return "synchronization" in inspect.signature(keras.Variable).parameters


def replicated(strategy):
    """Whether steps under `strategy` run as `tf.distribute` replicas, even one;
    False for None and the default strategy. A replica's optimizer update is
    a `merge_call`, which cannot sit in a conditional traced in the replica:
    the window is then applied in cross-replica context."""
    if strategy is None:
        return False
    return strategy is not _default_strategy()


def multi_worker(strategy):
    """Whether `strategy` runs across several worker processes."""
    return _collective_all_reduce_multi_worker(strategy)


def in_xla_context():
    """Whether the code being traced is compiled by XLA (`jit_compile=True`);
    TensorFlow has no public test. XLA needs static shapes: a window of
    sparse slices reaches the optimizer padded to its buffer (window/slices.py).
    """
    if tf.executing_eagerly():
        return False
    return _in_xla(tf.compat.v1.get_default_graph())


def branch_keeping_zero(probe):
    """Under XLA, a float32 zero made at run time from the scalar given, through
    a sort (elsewhere a constant zero): written by a conditional's branch, it
    keeps the conditional a branch, where XLA's ConditionalSimplifier would
    run both branches of cheap (elementwise) work, the window's update
    included, and select. `where(p > inf, p, 0)` is zero for every float,
    NaN too. Measured: benchmarks/design-notes.md, "A conditional kept a branch".
    """
    if not in_xla_context():
        return tf.constant(0.0)
    probe = tf.cast(tf.reshape(probe, []), tf.float32)
    return zero_at_run_time(tf.sort(tf.stack([probe, probe]))[0])


def zero_at_run_time(probe):
    """Zeros shaped as the float tensor `probe`, computed from it at run time:
    Grappler and XLA fold a constant (or integer `x * 0`), not this, so what
    reads it waits for `probe` and no constant is held. `where(p > inf, p, 0)`
    is zero for every float, NaN and inf too. Public TensorFlow, beside
    `branch_keeping_zero`.
    """
    return tf.where(probe > float("inf"), probe, tf.zeros_like(probe))


def whole_sum(t):
    """The sum of every element of `t` (float32), written for XLA: its CPU
    reduction to a scalar runs on one thread, a product with ones of `t` cut
    into up to 1024 rows on every core. Public TensorFlow, beside
    `branch_keeping_zero`. Measured: benchmarks/design-notes.md, "A sum to a scalar".
    """
    flat = tf.reshape(tf.cast(t, tf.float32), [-1])
    size = flat.shape[0]
    if size is None:
        return tf.reduce_sum(flat)
    rows = _rows_for(size)
    matrix = tf.reshape(flat, [rows, size // rows])
    return tf.reduce_sum(tf.linalg.matvec(matrix, tf.ones([size // rows], tf.float32)))


def _rows_for(size):
    # Enough rows for every core: the most (up to 1024) dividing `size`,
    # with at least 8 columns.
    for rows in (1024, 512, 256, 128, 64, 32, 16, 8, 4, 2):
        if size % rows == 0 and size // rows >= 8:
            return rows
    return 1


def replica_component(variable):
    """The current replica's own component of a per-replica variable (itself if
    not distributed): sync-on-read variables refuse the scatter updates a
    window of slices appends with, even in a replica context.
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
        # The graph it is traced in (the outermost plain Graph has none).
        inner = required(inner, "outer_graph", "TensorFlow")
    return inner is traced
