"""The gradient buffers of a window: each micro-batch adds `weight * gradient`
per variable; `window_gradients` gives back the big batch's gradient
(scaling.py). Binding: binding.py; files: file_format.py; closing: state.py."""

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

    The window's gradient is the sum over `window_weight`: the big batch's,
    however unevenly the samples were split (unscaled under loss scaling too).
    All are `tf.Variable`s, saved by `tf.train.Checkpoint` and Keras's files.

    Attributes:
        accum_steps: the length this window is accumulated for, so a restored
            window is never finished under another length by mistake.
        normalise: a mean or a plain sum (`sum` losses); written each
            micro-batch, so a restored window ends as it began.
        acc_grads: per variable: float32 (float64 for float64 variables)
            unless `dtype`; a sparse gradient's window as slices or row sums
            (slices.py: `slice_indices`, `slice_counts`, `acc_stats`).
    """

    def __init__(self, dtype=None, name="gradient_accumulator"):
        super().__init__(name=name)
        self.dtype = check_accum_dtype(dtype)
        # Remembered so that a build from loading a checkpoint is per replica too.
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
        self.slice_indices = []
        self.slice_counts = []
        self.acc_stats = {}
        self.binding = binding.Binding()
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
        """Creates zeroed buffers for `variables` (anything with `shape` and
        `dtype`: the window is bound later) and the counters."""
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
            # Appended to the list tracked since __init__, not a new list: a
            # checkpoint restored before the build fills each buffer as made.
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
                        tf.zeros([], tf.int64),
                        trainable=False,
                        name=f"slice_count_{i}",
                        **first,
                    )
                )
        if variables and all(isinstance(v, _VARIABLE_TYPES) for v in variables):
            self.binding.variables = variables
        self._built = True

    def add(
        self,
        grads,
        weight,
        grad_scale=None,
        normalise=True,
        variables=None,
        statistic=slices.SQUARE,
        window_occurrences=1,
    ):
        """Adds one micro-batch: `acc_grads += grad_scale * grads`, and `weight`.

        The buffers must end up holding `weight * gradient`: the caller folded
        `weight` into the loss, or passes `grad_scale`. `window_occurrences`:
        how many times this micro-batch's occurrences a window holds at most
        (or a function giving it), the static size of row sums under XLA.
        """
        self._record(grads, variables, statistic, window_occurrences)
        self._write(MicroBatch(grads, grad_scale, weight, normalise), statistic)

    def add_or_close(
        self,
        accum_steps,
        close,
        grads,
        weight,
        grad_scale=None,
        normalise=True,
        variables=None,
        statistic=slices.SQUARE,
        window_occurrences=1,
    ):
        """Adds one micro-batch as `add` does or, if it completes a window of
        `accum_steps`, calls `close(last)` with it unwritten, as Keras's built-in
        accumulation does: the update reads each buffer once, with the last
        gradient (benchmarks/design-notes.md, "The last micro-batch folded into the update"). One device
        only; a window of slices is added to, then closed."""
        self._record(grads, variables, statistic, window_occurrences)
        batch = MicroBatch(grads, grad_scale, weight, normalise)
        if self.layout.sparse:
            self._write(batch, statistic)
            self.when_full(accum_steps, lambda: close(None))
            return

        def add():
            # A window's first micro-batch is assigned, not added: an in-place
            # add onto `reset`'s constant zero copied the buffer first (its
            # zeros are made at run time now; the assign was kept, not
            # re-measured). Why: benchmarks/design-notes.md, "The last
            # micro-batch folded into the update".
            tf.cond(
                self.micro_step > 0,
                lambda: self._write(batch, statistic),
                lambda: self._write(batch, statistic, first=True),
            )

        tf.cond(self.micro_step + 1 >= accum_steps, lambda: close(batch), add)

    def _record(self, grads, variables, statistic, window_occurrences):
        # Recorded before any branch is traced: an update traced in one reads them.
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
        """The window's gradient per window variable, in each variable's dtype:
        times `loss_scale`, over `total_weight` (summed over replicas) or else
        `window_weight` unless a sum; None where a variable had no gradient.
        `last`: an unwritten `MicroBatch` completing the window (dense only);
        `compact` (XLA): `compact_sizes()`, for a window `within` them."""
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
                        self._slices(i),
                        self.acc_stats.get(str(i)),
                        self.layout.statistic,
                        padded,
                        self._trace.capacity(i) if padded else None,
                        inv,
                        v.dtype,
                    )
                )
            else:
                dense = _dense_sum(self._slices(i), self._trace.holds(i))
                if last is not None and last.grads[i] is not None:
                    dense = dense + _scaled(tf.cast(last.grads[i], buf.dtype), last.grad_scale)
                grads.append(tf.cast(_scaled(dense, inv), v.dtype))
        return grads

    def compact_sizes(self):
        """Under XLA, per sparse buffer, the occurrences a window of the traced
        step can hold (at most the table's rows), its slices' size; else None."""
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
        """Whether every sparse buffer holds slices (not row sums), no more than `sizes`."""
        fits = []
        for i, size in sizes.items():
            count = internals.replica_component(self.slice_counts[i])
            fits.append(tf.logical_and(count >= 0, count <= size))
        return tf.reduce_all(tf.stack(fits))

    def stats_of(self, i):
        """Buffer i's per-row statistic sums (slices.py), made when first needed."""
        if str(i) not in self.acc_stats:
            return replicas.in_cross_replica_context(lambda: _make_stats(self, i))
        return self.acc_stats[str(i)]

    def _slices(self, i):
        return [
            internals.replica_component(v)
            for v in (self.acc_grads[i], self.slice_indices[i], self.slice_counts[i])
        ]

    def when_full(self, accum_steps, apply):
        """Runs `apply()` once the window holds `accum_steps` (int or tensor) micro-batches."""
        tf.cond(self.micro_step >= accum_steps, apply, lambda: None)

    def when_open(self, apply):
        """Runs `apply()` if the window holds any micro-batch; graph-safe."""
        tf.cond(self.micro_step > 0, apply, lambda: None)

    def reset(self):
        """Zeroes the buffers and counters: a new window starts, or an open
        one is discarded. A window of slices is emptied by its count alone."""
        # Under XLA the new count is written from a sort, so the reset stays a
        # branch run once per window (`internals.branch_keeping_zero`).
        zero = internals.branch_keeping_zero(self.micro_step)
        zeros = tf.zeros_like if internals.in_xla_context() else _zeros_at_run_time(self.micro_step)
        for i, (buf, count) in enumerate(zip(self.acc_grads, self.slice_counts)):
            if i not in self.layout.sparse:
                buf.assign(zeros(buf))
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

    def save_own_variables(self, store):
        file_format.save_window(self, store)

    def load_own_variables(self, store):
        file_format.load_window(self, store)

    def snapshot(self):
        """This process's buffers and counters as numpy, for `restore` after a failed load."""
        return file_format.snapshot(self)

    def restore(self, snapshot):
        file_format.restore(self, snapshot)

    def state(self):
        """Every variable of the window, counters first."""
        return [
            self.micro_step,
            self.window_weight,
            self.accum_steps,
            self.normalise,
            *self.acc_grads,
            *self.slice_indices,
            *self.slice_counts,
            # Last: made later, so a snapshot taken before it existed leaves it unread.
            *(self.acc_stats[k] for k in sorted(self.acc_stats, key=int)),
        ]


def _zeros_at_run_time(probe):
    """A function giving zeros shaped as a buffer, filled from a zero computed at
    run time from the scalar `probe` (`internals.zero_at_run_time`): Grappler
    folds `zeros_like` of a static shape into a constant the step's function
    holds while it lives (one per buffer shape: 0.43 MB on the transformer
    benchmark). The buffer's static shape, not `tf.shape`: no read of it (a
    sum across replicas for a summed buffer, in cross-replica context).
    """
    zero = internals.zero_at_run_time(tf.cast(probe, tf.float32))
    return lambda buf: tf.fill(buf.shape, tf.cast(zero, buf.dtype))


def _sparse_window_gradient(parts, stats, statistic, padded, capacity, inv, dtype):
    # One IndexedSlices that Keras's sparse update makes the big batch's step of.
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
    # Made as the buffers are; tracked by the dict, so a checkpoint restores it.
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
    storage, indices, count = parts
    if not len(storage.shape):
        return storage
    if held_dense:
        # A dense sum, read as is: a conditional per variable would sit in the
        # step's graph at every micro-batch (benchmarks/step_mode_ops.md).
        return storage.read_value()
    # Slices in a buffer not known to be sparse: a window restored by
    # `tf.train.Checkpoint` (no `sparse` saved), flushed before any step.
    return tf.cond(
        count > 0,
        lambda: slices.dense_sum(storage, indices, count),
        storage.read_value,
    )


_VARIABLE_TYPES = (tf.Variable, keras.Variable)


class MicroBatch(NamedTuple):
    """One forward and backward pass: a micro-batch's (or a split batch's)
    part of a window.

    `grad_scale` multiplies `grads` into `weight * gradient` (None when the
    weight is in the loss already); `weight` is what the loss was normalised
    by; `normalise`: whether the window divides by its total weight. The
    step's own fields (`loss`, `num_samples`, `y_pred`) the buffers ignore.
    """

    grads: list
    grad_scale: object
    weight: object
    normalise: bool
    loss: object = None
    num_samples: object = None
    y_pred: object = None


def _scaled(grad, scale):
    return grad if scale is None else grad * tf.cast(scale, grad.dtype)
