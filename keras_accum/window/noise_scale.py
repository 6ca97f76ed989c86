"""The gradient noise scale `B_simple = tr(Sigma) / |G|^2`, measured from windows.

McCandlish et al. (2018, "An Empirical Model of Large-Batch Training", app. A):
from micro-batch gradients `g_j` (batch `b_j`) and the window's `G_B` (batch
`B`), with `S` the mean of `|g_j|^2`, `a` the mean of `1 / b_j`, `c = 1 / B`
and `L = |G_B|^2`, a window estimates `tr(Sigma) ~ (S - L) / (a - c)` and
`|G|^2 ~ (L a - S c) / (a - c)`. One window is far too noisy: an estimate over
many is the ratio of their sums (spread: growth/estimate.py).
"""

import math

import numpy as np
import tensorflow as tf

from keras_accum import _internals as internals
from keras_accum.window import replicas

# `window_sums`, one vector so that a read across replicas is one reduction.
SQUARES, INVERSE_SIZES, MICRO_BATCHES, SAMPLES, STEPS = range(5)
# `estimate_sums`: per window estimated, its tr(Sigma) and |G|^2 estimates,
# 1, and their squares and product (for the spread of their ratio).
TRACE, SIGNAL, WINDOWS, TRACE_SQUARES, SIGNAL_SQUARES, PRODUCTS = range(6)


class NoiseScale:
    """The window's measurement of the gradient noise scale (module doc).

    Not saved: made again from the windows after a resume. Writes only its own
    variables, so training is bit-identical with it on and off. Under a
    strategy, `b_j` is the per-replica micro-batch and `B` the global window.
    `estimate_sums` is only ever added to: an estimate over some windows is the
    difference of two `read`s, so its readers do not reset each other's.
    """

    def __init__(self):
        self.window_sums = None
        self.estimate_sums = None
        self._strategy = None
        # `estimate_sums` at this epoch's start, read eagerly.
        self._epoch_start = None

    @property
    def built(self):
        return self.window_sums is not None

    def build(self, strategy):
        """Makes the variables once, eagerly (per replica under a strategy)."""
        if self.built:
            return
        self._strategy = strategy
        with tf.init_scope(), replicas.scope_of(strategy):
            self.window_sums = tf.Variable(
                tf.zeros([5], tf.float64),
                trainable=False,
                name="noise_scale_window",
                **replicas.variable_arguments(strategy, replicas.SUMMED),
            )
            self.estimate_sums = tf.Variable(
                tf.zeros([6], tf.float64),
                trainable=False,
                name="noise_scale_estimates",
                **replicas.variable_arguments(strategy, replicas.FIRST_REPLICAS),
            )

    @property
    def variables(self):
        return [self.window_sums, self.estimate_sums] if self.built else []

    def record(self, sums):
        """Adds one train step's `micro_batch_sums` to the open window (no collective)."""
        self.window_sums.assign_add(sums)

    def close(self, closed):
        """The window is applied: its estimates are added, a new window starts.
        In each replica; summing the gradient across replicas is the one
        all-reduce measuring adds."""
        grads = [g for g in closed.gradients if g is not None]
        sums = closed.noise_sums
        recorded = sums is None
        if recorded:
            sums = self.window_sums.read_value()
        context = tf.distribute.get_replica_context()
        if context.num_replicas_in_sync > 1:
            # Two reductions: one all-reduce packs tensors of one dtype.
            grads = context.all_reduce(tf.distribute.ReduceOp.SUM, grads)
            if recorded:
                sums = context.all_reduce(tf.distribute.ReduceOp.SUM, sums)
        norm = squared_norm(grads)
        if closed.loss_scale is not None:
            norm = norm / tf.square(tf.cast(closed.loss_scale, tf.float64))
        # A window whose steps were not all recorded (resumed from a file) says nothing.
        measured = tf.equal(sums[STEPS], tf.cast(closed.micro_steps, tf.float64))
        self.estimate_sums.assign_add(window_estimates(sums, norm, measured))
        if recorded:
            self.window_sums.assign(tf.zeros_like(sums))

    def discard(self):
        """The open window is dropped (skipped, discarded): so is its measure."""
        if self.built:
            self.window_sums.assign(tf.zeros_like(self.window_sums))

    def read(self):
        """Eagerly: `estimate_sums` as numpy (zeros if not built)."""
        if not self.built:
            return np.zeros([6])
        return self.estimate_sums.numpy()

    def open_window(self):
        """Eagerly: the open window's `window_sums` (a list), for a backup of a
        schedule acting on the estimate; None with several replicas, each
        holding its own share (the resumed window is then left out)."""
        # The variable's own strategy, not `get_strategy()` (the default one
        # here), says how many shares this worker holds.
        shares = (
            (self.window_sums,)
            if self._strategy is None
            else self._strategy.experimental_local_results(self.window_sums)
        )
        if not self.built or len(shares) > 1:
            return None
        return self.window_sums.numpy().tolist()

    def resume_window(self, sums):
        """Eagerly: `open_window`'s sums back, so a resumed window is measured whole."""
        if self.built and sums is not None:
            self.window_sums.assign(tf.constant(sums, tf.float64))

    def start_epoch(self):
        """Eagerly: the epoch's estimate starts from the windows after now."""
        self._epoch_start = self.read()

    def end_epoch(self):
        """Eagerly: the epoch's `B_simple` in samples; a new epoch begins.
        `nan` if no window had two micro-batches; `inf` if the signal's estimate
        is not positive (noise dominates at every batch the windows resolve);
        negative: the noise is below what the windows resolve."""
        if not self.built:
            return math.nan
        now = self.read()
        start = now * 0 if self._epoch_start is None else self._epoch_start
        trace, signal, windows = (float(v) for v in (now - start)[:3])
        self._epoch_start = now
        if windows == 0 or math.isnan(trace) or math.isnan(signal):
            return math.nan
        if signal <= 0:
            return math.inf if trace > 0 else math.nan
        return trace / signal


def window_estimates(sums, squared_norm, measured=True):
    """`[tr(Sigma), |G|^2, 1, tr(Sigma)^2, |G|^2^2, tr(Sigma) |G|^2]` of one
    window, or zeros for one that says nothing (fewer than two micro-batches,
    not `measured`, or not finite)."""
    squares = sums[SQUARES]
    count = sums[MICRO_BATCHES]
    known = tf.logical_and(count >= 2, measured)
    safe = tf.where(known, count, 2.0)
    mean_square = squares / safe
    a = sums[INVERSE_SIZES] / safe
    c = tf.math.divide_no_nan(tf.constant(1.0, tf.float64), sums[SAMPLES])
    gap = tf.where(known, a - c, 1.0)
    norm = tf.cast(squared_norm, tf.float64)
    estimates = tf.stack([(mean_square - norm) / gap, (norm * a - mean_square * c) / gap, 1.0])
    # A window with an overflowed gradient (a loss scale settling, a NaN sample)
    # is left out, as the optimizer skips it: else the epoch's estimate is NaN.
    known = tf.logical_and(known, tf.reduce_all(tf.math.is_finite(estimates)))
    trace, signal = estimates[0], estimates[1]
    estimates = tf.concat([estimates, [trace * trace, signal * signal, trace * signal]], 0)
    return tf.where(known, estimates, tf.zeros_like(estimates))


def micro_batch_sums(parts, steps=1.0):
    """`window_sums` of micro-batches `parts` (`MicroBatch`): a part's
    mean gradient is `grads * grad_scale * replicas / weight`, as the window
    holds `weight * gradient` of a loss Keras divided by the replicas. Scalars
    are stacked: the same few ops for any number of parts."""
    replicas_in_sync = tf.distribute.get_strategy().num_replicas_in_sync
    sizes = _stacked([p.num_samples for p in parts])
    scales = tf.math.divide_no_nan(
        tf.constant(float(replicas_in_sync), tf.float64),
        _stacked([p.weight for p in parts]),
    )
    if parts[0].grad_scale is not None:  # one model: all parts or none
        scales = scales * _stacked([p.grad_scale for p in parts])
    live = sizes > 0
    # A stand-in's gradient is zeroed by its weight, but `where`, not a
    # product: it may be NaN (padding through the loss), and NaN * 0 is NaN.
    squares = tf.where(live, squared_norms([p.grads for p in parts]) * scales * scales, 0.0)
    columns = tf.stack(
        [squares, tf.math.divide_no_nan(1.0, sizes), tf.cast(live, tf.float64), sizes], axis=1
    )
    return tf.concat([tf.reduce_sum(columns, axis=0), [float(steps)]], axis=0)


def _stacked(scalars):
    return tf.cast(tf.stack(scalars), tf.float64)


def squared_norm(grads):
    """The squared norm over all of `grads` (float64), an `IndexedSlices`' of
    the dense gradient it stands for."""
    return squared_norms([grads])[0]


def squared_norms(grads_lists):
    """`squared_norm` of each list of gradients (of the same variables), as a vector."""
    halves = [[_half_square(g) for g in grads if g is not None] for grads in grads_lists]
    if not halves[0]:
        return tf.zeros([len(grads_lists)], tf.float64)
    # One fused pass per gradient (L2Loss: no squared temporary), in float32 (a
    # float16 square overflows), summed in float64: the estimator subtracts close sums.
    table = tf.cast(tf.stack([tf.stack(row) for row in halves]), tf.float64)
    return 2.0 * tf.reduce_sum(table, axis=1)


def _half_square(g):
    if isinstance(g, tf.IndexedSlices):
        return _sparse_half_square(g)
    return _half_square_dense(tf.cast(g, tf.float32))


def _half_square_dense(g):
    if not internals.in_xla_context():
        return tf.nn.l2_loss(g)
    # XLA on a CPU reduces to a scalar on one thread: a product with ones instead.
    return 0.5 * internals.whole_sum(g * g)


def _sparse_half_square(slices):
    # Occurrences summed per row first, in float32 (a float16 sum overflows).
    values = tf.cast(slices.values, tf.float32)
    indices = tf.reshape(slices.indices, [-1])
    if internals.in_xla_context():
        return _half_square_dense(_rows_summed_under_xla(values, indices, slices.dense_shape))
    # Only the occurrences in repeated rows are summed when `k > 3n / 4` (k rows,
    # n occurrences): a row seen once is its own sum. Why:
    # benchmarks/design-notes.md, "Sparse gradients: a hash, not a sort".
    rows, segments, counts = tf.unique_with_counts(indices, out_idx=tf.int32)

    def every_row():
        return tf.nn.l2_loss(tf.math.unsorted_segment_sum(values, segments, tf.size(rows)))

    def repeated_rows():
        repeated = tf.gather(counts, segments) > 1
        once = values * tf.expand_dims(tf.cast(tf.logical_not(repeated), values.dtype), 1)
        positions = tf.where(repeated)[:, 0]
        _, compact = tf.unique(tf.gather(segments, positions), out_idx=tf.int32)
        summed = tf.math.unsorted_segment_sum(
            tf.gather(values, positions), compact, tf.size(positions)
        )
        return tf.nn.l2_loss(once) + tf.nn.l2_loss(summed)

    return tf.cond(4 * tf.size(rows) > 3 * tf.size(segments), repeated_rows, every_row)


def _rows_summed_under_xla(values, indices, dense_shape):
    # A map of the table's rows while it has at most 256 rows an occurrence, else
    # a sort (XLA has no `Unique`); decided on shapes, a constant under XLA.
    # Why: benchmarks/design-notes.md, "Summing sparse rows under XLA".
    rows = tf.cast(dense_shape[0], tf.int64)
    count = tf.shape(indices, out_type=tf.int64)[0]
    return tf.cond(
        rows <= 256 * count,
        lambda: _rows_summed_mapped(values, indices, rows),
        lambda: _rows_summed_sorted(values, indices),
    )


def _rows_summed_mapped(values, indices, rows):
    # Each occurrence's segment is its row's first occurrence; unused ones zero.
    indices = tf.cast(indices, tf.int64)
    count = tf.shape(indices, out_type=tf.int64)[0]
    first = tf.tensor_scatter_nd_min(
        tf.fill(tf.reshape(rows, [1]), count), indices[:, None], tf.range(count)
    )
    return tf.math.unsorted_segment_sum(values, tf.gather(first, indices), count)


def _rows_summed_sorted(values, indices):
    # With static shapes: sorted by row, each run of one row one segment.
    indices = tf.cast(indices, tf.int64)
    count = tf.shape(indices)[0]
    order = tf.argsort(indices)
    rows = tf.gather(indices, order)
    starts = tf.logical_or(tf.equal(tf.range(count), 0), tf.not_equal(rows, tf.roll(rows, 1, 0)))
    segments = tf.cumsum(tf.cast(starts, tf.int32)) - 1
    return tf.math.unsorted_segment_sum(tf.gather(values, order), segments, count)
