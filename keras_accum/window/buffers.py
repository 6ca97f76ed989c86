"""The gradient buffers of the accumulation window and their arithmetic.

Each micro-batch adds `weight * gradient` into one buffer per variable;
`window_gradients` turns the sum back into the big batch's gradient
(scaling.py); `reset` starts a new window. Which variables the buffers
belong to is binding.py's; how they are written to files, file_format.py's;
whether a window is applied or skipped, the window's (window/__init__.py).
"""

from typing import NamedTuple

import keras
import tensorflow as tf

from keras_accum import _internals as internals
from keras_accum import scaling
from keras_accum.arguments import check_accum_dtype
from keras_accum.window import binding, file_format, replicas, slices
from keras_accum.window.trace import StepTrace


class GradientAccumulator(tf.Module, internals.SavedState):
    """Sums weighted micro-batch gradients until a window is applied.

    Each micro-batch adds `weight * gradient` (`weight`: what its loss was
    normalised by); the window's gradient is the sum over `window_weight`,
    the big batch's gradient however unevenly the samples were split.
    Buffers hold true (unscaled) sums under loss scaling too (scaling.py).
    The state is `tf.Variable`s: it lives inside `tf.function`s and is saved
    by `tf.train.Checkpoint` and Keras's `save`/`save_weights`.

    Attributes:
        micro_step: int64 scalar; micro-batches added since the last update.
        window_weight: float32 scalar; the sum of the weights in this window.
        accum_steps: int64 scalar; the window length this window is being
            accumulated for, so a restored window is never finished under a
            different length by mistake.
        normalise: bool scalar; whether the window's gradient is the sum
            divided by `window_weight` (a mean) or the plain sum (`sum`
            losses). Written by every micro-batch, so a restored window is
            finished with the arithmetic it was started with.
        acc_grads: one buffer per variable of the window holding the sum of
            weighted gradients: float32 (float64 for float64 variables) unless
            `dtype` asks otherwise. For a variable whose gradient is
            `tf.IndexedSlices` (an `Embedding`'s): the window's slices while
            they fit, then the per-row sums of its occurrences (slices.py).
        slice_indices: per buffer, the table row of each slice it holds
            (one int per row of the variable); per row, its occurrences,
            once the window is kept as row sums.
        slice_counts: per buffer, how many slices it holds; below zero
            what it holds instead (`slices.ROW_SUMS`, `slices.DENSE`).
        acc_stats: per sparse buffer (by its index as a string), the
            per-row sums of its occurrences' statistic once the window is
            kept as row sums; made when the buffer is first given slices.
        window_variables: the variables the buffers belong to, one each, by
            identity; None for a window restored from a file until it is
            bound to a model's variables (binding.py). A window is only
            ever applied to these variables.
        layout: the `GradientLayout` of the gradients the traced step
            adds (which are None, which are sparse, the statistic): a fact
            of the step's graph, hence Python; saved with the window.

    Args:
        dtype: buffer dtype; None for the rule above.
        name: the module's name.

    Example:

    ```python
    acc = GradientAccumulator()
    acc.bind(model.trainable_variables, accum_steps=4)
    acc.add(grads, weight=batch_size)   # every micro-batch
    acc.when_full(4, lambda: window.close(AccumState(acc), optimizer))
    ```
    """

    def __init__(self, dtype=None, name="gradient_accumulator"):
        super().__init__(name=name)
        self.dtype = check_accum_dtype(dtype)
        # Made inside a strategy's scope (with its model): build per-replica
        # buffers even when the build comes from loading a checkpoint.
        self.strategy = tf.distribute.get_strategy() if tf.distribute.has_strategy() else None
        # The skip policy, held here for the file layout only (see AccumState).
        self.nonfinite = None
        self.unbuild()

    def unbuild(self):
        self.micro_step = None
        self.window_weight = None
        self.accum_steps = None
        self.normalise = None
        self.acc_grads = []
        # Per buffer: the table rows of its window's slices and how many
        # slices it holds (slices.py); -1 when it holds a dense sum.
        self.slice_indices = []
        self.slice_counts = []
        self.acc_stats = {}
        self.binding = binding.Binding()
        # What the step being traced adds: which buffers dense gradients.
        self._trace = StepTrace()
        self.layout = binding.GradientLayout()
        self._built = False

    @property
    def built(self):
        return self._built

    @property
    def window_variables(self):
        return self.binding.variables

    def open_micro_batches(self):
        """Micro-batches in the open window (a Python int; 0 when unbuilt)."""
        return int(self.micro_step.numpy()) if self._built else 0

    def window_length(self):
        """The length the open window is accumulated for (a Python int)."""
        return int(self.accum_steps.numpy())

    def shapes(self):
        return [tuple(b.shape) for b in self.acc_grads]

    def bind(self, variables, accum_steps, strategy=None):
        """`binding.bind(self, ...)`: True if buffers were replaced."""
        return binding.bind(self, variables, accum_steps, strategy)

    def build(self, variables, accum_steps, strategy=None):
        """Creates a zeroed buffer for each of `variables` and the counters.

        `variables` need only `shape` and `dtype` (numpy arrays will do: the
        window is bound later). Made outside any surrounding `tf.function`,
        per replica under a strategy (replicas.py).
        """
        variables = list(variables)
        self.layout = self.layout._replace(absent=frozenset(), sparse=frozenset())
        self.binding.variables = None
        strategy = strategy or self.strategy
        self.strategy = strategy
        summed = replicas.variable_arguments(strategy, replicas.SUMMED)
        first = replicas.variable_arguments(strategy, replicas.FIRST_REPLICAS)
        with tf.init_scope(), replicas.scope_of(strategy):
            self.micro_step = tf.Variable(
                0, dtype=tf.int64, trainable=False, name="micro_step", **first
            )
            self.window_weight = tf.Variable(
                0.0, dtype=tf.float32, trainable=False, name="window_weight", **summed
            )
            self.accum_steps = tf.Variable(
                accum_steps, dtype=tf.int64, trainable=False, name="accum_steps", **first
            )
            self.normalise = tf.Variable(
                True, dtype=tf.bool, trainable=False, name="normalise", **first
            )
            # Appended one by one to the list tracked since __init__ (not a
            # new list) so that a tf.train.Checkpoint restored before the
            # build fills each buffer as it is created.
            if self.acc_grads:
                self.acc_grads = []
                self.slice_indices = []
                self.slice_counts = []
            self.acc_stats.clear()
            for i, v in enumerate(variables):
                self.acc_grads.append(
                    tf.Variable(
                        tf.zeros(v.shape, dtype=scaling.buffer_dtype(v.dtype, self.dtype)),
                        trainable=False,
                        name=f"acc_grad_{i}",
                        **summed,
                    )
                )
                # Scalars cannot have sparse gradients: no slices for them.
                rows = v.shape[0] if len(v.shape) else 0
                self.slice_indices.append(
                    tf.Variable(
                        tf.zeros([rows], slices.index_dtype(rows)),
                        trainable=False,
                        name=f"slice_indices_{i}",
                        **first,
                    )
                )
                self.slice_counts.append(
                    tf.Variable(
                        tf.zeros([], tf.int64), trainable=False,
                        name=f"slice_count_{i}", **first,
                    )
                )
        if variables and all(isinstance(v, _VARIABLE_TYPES) for v in variables):
            self.binding.variables = variables
        self._built = True

    def add(self, grads, weight, grad_scale=None, normalise=True, variables=None,
            statistic=slices.SQUARE, window_occurrences=1):
        """Adds one micro-batch: `acc_grads += grad_scale * grads`, and `weight`.

        Args:
            grads: one per buffer; `tf.IndexedSlices` are appended to the
                window's slices (slices.py), never densified.
            weight: what this micro-batch's loss was normalised by. The
                buffers must end up holding `weight * gradient`: the caller
                folded `weight` into the loss, or passes `grad_scale`.
            grad_scale: optional scalar multiplying every gradient as it is
                added (`scaling.into_window`).
            normalise: whether the window's gradient is a mean (divided by
                the window's weight); False for a sum.
            variables: the variables `grads` belong to, checked when traced.
            statistic: what the optimizer reads of sparse occurrences
                (`slices.statistic_of(optimizer)`).
            window_occurrences: how many times this micro-batch's
                occurrences a window can hold at most (accum_steps, times
                full batch over this one's size), or a function giving it:
                the static size a window of row sums is handed over in
                under XLA.
        """
        self._record(grads, variables, statistic, window_occurrences)
        self._write(MicroBatch(grads, weight, grad_scale, normalise), statistic)

    def add_or_close(self, accum_steps, close, grads, weight, grad_scale=None,
                     normalise=True, variables=None, statistic=slices.SQUARE,
                     window_occurrences=1):
        """Adds one micro-batch as `add` does, or, if it completes a window of
        `accum_steps`, calls `close(last)` instead, `last` the `MicroBatch`
        (then never written: `window_gradients(last=last)` reads it with the
        buffers' sum, as Keras's built-in accumulation does).

        One device only (a window across replicas closes in cross-replica
        context, after every replica has added). Why: the last micro-batch's
        add and the update's read of the same buffers would otherwise run one
        after the other; folded, the update reads each buffer once and the
        executor overlaps the update's independent ops (benchmarks/
        redesign_before_after.md). A window holding slices (sparse
        gradients) is added to, then closed, as before: its slices are
        appended and read by slices.py.
        """
        self._record(grads, variables, statistic, window_occurrences)
        batch = MicroBatch(grads, weight, grad_scale, normalise)
        if self.layout.sparse:
            self._write(batch, statistic)
            self.when_full(accum_steps, lambda: close(None))
            return

        def add():
            # A window's first micro-batch is assigned, not added: `reset`
            # assigned the buffers a constant zero, which an in-place add
            # would first copy (TensorFlow copies a variable's tensor on
            # write while another holds it) and the first micro-batch of
            # each window took 1.06-1.09x the built-in's. 0 + g is g.
            tf.cond(
                self.micro_step > 0,
                lambda: self._write(batch, statistic),
                lambda: self._write(batch, statistic, first=True),
            )

        tf.cond(self.micro_step + 1 >= accum_steps, lambda: close(batch), add)

    def _record(self, grads, variables, statistic, window_occurrences):
        # Python facts of the step being traced, recorded before any branch
        # is traced: an update traced in a branch reads them.
        binding.check_gradients(self, grads, variables)
        self.layout = layout = binding.GradientLayout.of(grads, statistic)
        if layout.sparse and callable(window_occurrences):
            window_occurrences = window_occurrences()
        self._trace.record(
            (i for i, g in enumerate(grads) if g is not None and i not in layout.sparse),
            {
                i: tf.cast(window_occurrences, tf.int32) * tf.shape(grads[i].indices)[0]
                for i in layout.sparse
            },
        )

    def _write(self, batch, statistic, first=False):
        # `first`: the window is empty and its dense buffers zero.
        for i, (buf, g) in enumerate(zip(self.acc_grads, batch.grads)):
            if g is None:
                continue
            if i in self.layout.sparse:
                values = _scaled(tf.cast(g.values, buf.dtype), batch.grad_scale)
                stats = internals.replica_component(self.stats_of(i))
                slices.append(*self._slices(i), g, values, stats, statistic)
            else:
                value = _scaled(tf.cast(g, buf.dtype), batch.grad_scale)
                if first:
                    buf.assign(value)
                else:
                    buf.assign_add(value)
        self.window_weight.assign_add(tf.cast(batch.weight, tf.float32))
        self.normalise.assign(bool(batch.normalise))
        self.micro_step.assign_add(1)

    def micro_steps(self, last=None):
        """The window's micro-batches (a tensor), with `last` if given."""
        steps = self.micro_step.read_value()
        return steps if last is None else steps + 1

    def window_gradients(self, loss_scale=None, total_weight=None, last=None, compact=None):
        """The window's gradient per window variable, in each variable's dtype.

        Multiplied by `loss_scale` when given: what a loss-scaling optimizer
        expects. Divided by `total_weight` when given (the window's weight
        summed over replicas), else by this `window_weight`, unless the
        window is a sum. Variables that had no gradient give None, as they
        would for the big batch. `last`: a `MicroBatch` that completes the
        window without having been added (`add_or_close`; dense only).
        `compact` (XLA): `compact_sizes()`, for a window `within` them: each
        sparse buffer's slices handed over in that size.
        """
        normalise = self.normalise
        if last is not None:
            normalise = bool(last.normalise)
            if total_weight is None:
                total_weight = self.window_weight + tf.cast(last.weight, tf.float32)
        if total_weight is None:
            total_weight = self.window_weight
        inv = scaling.out_of_window(normalise, total_weight, loss_scale)
        grads = []
        for i, (buf, v) in enumerate(zip(self.acc_grads, self._bound())):
            if i in self.layout.absent:
                grads.append(None)
            elif i in self.layout.sparse and compact is not None:
                window = slices.compact_window(*self._slices(i), compact[i])
                grads.append(_scaled_slices(window, inv, v.dtype))
            elif i in self.layout.sparse:
                padded = internals.in_xla_context()
                grads.append(
                    _sparse_window_gradient(
                        self._slices(i), self.acc_stats.get(str(i)), self.layout.statistic,
                        padded, self._trace.capacity(i) if padded else None, inv, v.dtype,
                    )
                )
            else:
                dense = _dense_sum(self._slices(i), self._trace.holds(i))
                if last is not None and last.grads[i] is not None:
                    dense = dense + _scaled(tf.cast(last.grads[i], buf.dtype), last.grad_scale)
                grads.append(tf.cast(_scaled(dense, inv), v.dtype))
        return grads

    def compact_sizes(self):
        """Under XLA, in the graph of a step that adds sparse gradients: per
        sparse buffer, the occurrences a window of this step can hold (its
        recorded capacity, at most the table's rows), the static size its
        slices are handed over in when the window is `within` it; else None
        (eagerly and in graphs, slices are handed over as they are)."""
        if not self.layout.sparse or not internals.in_xla_context():
            return None
        sizes = {}
        for i in self.layout.sparse:
            capacity = self._trace.capacity(i)
            if capacity is None:
                return None
            rows = self.acc_grads[i].shape[0]
            sizes[i] = tf.minimum(tf.cast(capacity, tf.int64), rows)
        return sizes

    def within(self, sizes):
        """Whether every sparse buffer holds slices (not row sums) no more
        than its size in `sizes` (`compact_sizes`): a boolean scalar."""
        fits = []
        for i, size in sizes.items():
            count = internals.replica_component(self.slice_counts[i])
            fits.append(tf.logical_and(count >= 0, count <= size))
        return tf.reduce_all(tf.stack(fits))

    def stats_of(self, i):
        """Buffer i's per-row statistic sums (slices.py), made when first
        needed: only sparse buffers have one."""
        if str(i) not in self.acc_stats:
            return replicas.in_cross_replica_context(lambda: _make_stats(self, i))
        return self.acc_stats[str(i)]

    def _slices(self, i):
        # This replica's own buffers: each replica keeps its own slices.
        return [
            internals.replica_component(v)
            for v in (self.acc_grads[i], self.slice_indices[i], self.slice_counts[i])
        ]

    def when_full(self, accum_steps, apply):
        """Runs `apply()` once the window holds `accum_steps` micro-batches.

        `accum_steps` may be a Python int (traced as a constant) or a tensor.
        Works eagerly and inside `tf.function`/XLA.
        """
        tf.cond(self.micro_step >= accum_steps, apply, lambda: None)

    def when_open(self, apply):
        """Runs `apply()` if the window holds any micro-batch; graph-safe."""
        tf.cond(self.micro_step > 0, apply, lambda: None)

    def reset(self):
        """Zeroes the buffers and counters: a new window starts.

        Also how an open window is discarded: its gradients are dropped and
        no update is made. A window kept as slices is emptied by its count
        alone: no pass over the table.
        """
        # Under XLA a new window's count is written from a sort: the update
        # that resets it stays a branch, run once per window, not at every
        # micro-batch (`internals.branch_keeping_zero`).
        zero = internals.branch_keeping_zero(self.micro_step)
        for i, (buf, count) in enumerate(zip(self.acc_grads, self.slice_counts)):
            if i not in self.layout.sparse:
                buf.assign(tf.zeros_like(buf))
            count.assign(tf.zeros_like(count))
        self.window_weight.assign(0.0)
        self.micro_step.assign(tf.cast(zero, self.micro_step.dtype))

    def _bound(self):
        if self.window_variables is None:
            raise ValueError(
                "This window was restored from a file and is not yet bound to "
                "variables: train a step, or call `flush()` on the model."
            )
        return self.window_variables

    # -- Keras saving (`model.save`, `save_weights`, `load_weights`) ----------

    def save_own_variables(self, store):
        file_format.save_window(self, store)

    def load_own_variables(self, store):
        file_format.load_window(self, store)

    def snapshot(self):
        """This process's state as numpy, for `restore` after a failed load."""
        return file_format.snapshot(self)

    def restore(self, snapshot):
        file_format.restore(self, snapshot)

    def state(self):
        """Every variable of the window's state, counters first."""
        return [
            self.micro_step,
            self.window_weight,
            self.accum_steps,
            self.normalise,
            *self.acc_grads,
            *self.slice_indices,
            *self.slice_counts,
            # Last: made later than the rest (a snapshot taken before one
            # was made restores the others and leaves it unread).
            *(self.acc_stats[k] for k in sorted(self.acc_stats, key=int)),
        ]


def _sparse_window_gradient(parts, stats, statistic, padded, capacity, inv, dtype):
    # One IndexedSlices that Keras's own sparse update makes the big batch's
    # step of: the window's occurrences (`parts`: storage, rows, count), or
    # their row sums (slices.py); `padded` to static shapes under XLA, to
    # `capacity` where the step being traced recorded it.
    window = slices.window_slices(
        *parts,
        padded=padded,
        stats=None if stats is None else internals.replica_component(stats),
        kind=statistic,
        capacity=capacity,
    )
    return _scaled_slices(window, inv, dtype)


def _scaled_slices(window, inv, dtype):
    values = window.values * tf.cast(inv, window.values.dtype)
    return tf.IndexedSlices(tf.cast(values, dtype), window.indices, window.dense_shape)


def _make_stats(acc, i):
    # In cross-replica context and outside any tf.function, as the buffers
    # are made (replicas.py); tracked by the dict, so a checkpoint restores it.
    key = str(i)
    if key not in acc.acc_stats:
        buf = acc.acc_grads[i]
        with tf.init_scope(), replicas.scope_of(acc.strategy):
            acc.acc_stats[key] = tf.Variable(
                tf.zeros(buf.shape, buf.dtype),
                trainable=False,
                name=f"acc_stats_{i}",
                **replicas.variable_arguments(acc.strategy, replicas.SUMMED),
            )
    return acc.acc_stats[key]


def _dense_sum(parts, held_dense):
    # `parts`: the buffer's storage, rows and count; `held_dense`: whether
    # the step being traced adds this buffer a dense gradient.
    storage, indices, count = parts
    if not len(storage.shape):
        return storage
    if held_dense:
        # In the trace that adds this buffer a dense gradient it holds a
        # dense sum: read as it is. A conditional per variable would sit
        # in the step's graph at every micro-batch, taken or not
        # (benchmarks/step_mode_ops.md).
        return storage.read_value()
    # Slices in a buffer not known to be sparse: a window restored by
    # `tf.train.Checkpoint` (which does not save `sparse`) and flushed
    # before a step is traced. Summed, as their dense gradient.
    return tf.cond(
        count > 0,
        lambda: slices.dense_sum(storage, indices, count),
        storage.read_value,
    )


_VARIABLE_TYPES = (tf.Variable, keras.Variable)


class MicroBatch(NamedTuple):
    """One micro-batch's part of a window, as `add` writes it.

    Attributes:
        grads: one gradient per buffer (None, dense or `tf.IndexedSlices`).
        weight: what its loss was normalised by.
        grad_scale: a scalar multiplying every gradient, or None.
        normalise: whether the window's gradient is a mean (a Python bool).
    """

    grads: list
    weight: object
    grad_scale: object
    normalise: bool


def _scaled(grad, scale):
    return grad if scale is None else grad * tf.cast(scale, grad.dtype)
