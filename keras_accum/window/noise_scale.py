"""The gradient noise scale, measured from the window: how big a batch pays.

A window holds what McCandlish et al. (2018, "An Empirical Model of
Large-Batch Training", appendix A) need to estimate the *simple noise
scale* `B_simple = tr(Sigma) / |G|^2`, the batch size beyond which a bigger
batch stops buying fewer steps: the gradients of its micro-batches (batch
`b_j`) and of the window (batch `B`). For a micro-batch's mean gradient
`E|g_j|^2 = |G|^2 + tr(Sigma) / b_j`, and for the window's
`E|G_B|^2 = |G|^2 + tr(Sigma) / B`. With `S` the mean of `|g_j|^2` over the
window's micro-batches, `a` the mean of `1 / b_j`, `c = 1 / B` and
`L = |G_B|^2`:

    tr(Sigma) ~ (S - L) / (a - c)        |G|^2 ~ (L a - S c) / (a - c)

which, with equal micro-batches, is the paper's pair of estimators (its
`B_small = b`, `B_big = B`). Each window's ratio is far too noisy to read,
so an estimate over many windows (an epoch's, or the scheduler's since its
last decision) is the ratio of the sums of the windows' estimates (a ratio
of means, as the paper advises). The sums of their squares and product are
kept beside them, for the estimate's spread (keras_accum/growth.py).

What is measured, and where:

- per micro-batch, in the step: the squared norm of its mean gradient over
  every trainable variable, unscaled (loss scale, weight and Keras's
  division by the number of replicas taken out), one pass over the
  gradients it computed anyway; a sparse gradient's norm is of the dense
  rows it touches (its occurrences summed per row first);
- per window, when it is applied: the squared norm of the window's
  gradient (across replicas, the global one: one all-reduce of the
  gradient more per update, only when measuring);
- under a strategy, each replica's micro-batch is a micro-batch: `b_j` is
  the per-replica micro-batch and `B` the global window.

A window with fewer than two micro-batches (in all), a window skipped or
discarded, one whose gradient is not finite (a loss scale settling), or one
resumed from a file (its first micro-batches were not measured), adds
nothing. Measuring writes only its own variables: the
training is bit-identical with it on and off (tested).

Example:

```python
noise = NoiseScale()
noise.build(strategy)                    # eagerly, before the step is traced
noise.record(micro_batch_sums(parts))    # in the step, per micro-batch(es)
noise.close(closed)                      # when the window is applied
noise.end_epoch()                        # B_simple of the epoch, a float
noise.read()                             # the sums so far (NoiseEstimate.of)
```
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

    Not saved in files: it is a measurement, made again from the windows
    trained after a resume, not training state.

    Attributes:
        window_sums: float64 vector, per replica (summed across replicas):
            over the open window's micro-batches, the sum of their mean
            gradients' squared norms (`SQUARES`), of `1 / b_j`
            (`INVERSE_SIZES`), their number (`MICRO_BATCHES`) and samples
            (`SAMPLES`), and the train steps that recorded them (`STEPS`:
            a window whose steps were not all recorded is not estimated).
        estimate_sums: float64 vector, the same on every replica: since
            it was built, the sums over the windows estimated of their
            `tr(Sigma)` (`TRACE`) and `|G|^2` (`SIGNAL`) estimates, of 1
            (`WINDOWS`), and of the estimates' squares and product. Only
            ever added to: an estimate over some windows is the difference
            of two reads (`read`), so the epoch's and a scheduler's
            readers do not reset each other's.

    Example:

    ```python
    noise = NoiseScale()
    noise.build(None)
    noise.end_epoch()  # nan: no window measured
    ```
    """

    def __init__(self):
        self.window_sums = None
        self.estimate_sums = None
        # The strategy the variables were made under (None: none).
        self._strategy = None
        # `estimate_sums` at this epoch's start, read eagerly.
        self._epoch_start = None

    @property
    def built(self):
        return self.window_sums is not None

    def build(self, strategy):
        """Makes the variables, outside any `tf.function` (per replica under
        a strategy, as the window's); once."""
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
        """Adds one train step's `micro_batch_sums` to the open window (in
        the replica: no collective)."""
        self.window_sums.assign_add(sums)

    def close(self, closed):
        """The window is applied: its estimates are added to the epoch's and
        a new window starts. In each replica (`state.ClosedWindow` `closed`):
        the window's gradient and sums are summed across replicas, the one
        all-reduce of the gradient measuring adds."""
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
        # A window whose steps were not all recorded (resumed from a file)
        # says nothing.
        measured = tf.equal(sums[STEPS], tf.cast(closed.micro_steps, tf.float64))
        self.estimate_sums.assign_add(window_estimates(sums, norm, measured))
        if recorded:
            self.window_sums.assign(tf.zeros_like(sums))

    def discard(self):
        """The open window is dropped (skipped, discarded): so is its measure."""
        if self.built:
            self.window_sums.assign(tf.zeros_like(self.window_sums))

    def read(self):
        """Eagerly: `estimate_sums` now, a float64 numpy vector (zeros if not
        built). The difference of two reads is the windows between them."""
        if not self.built:
            return np.zeros([6])
        return self.estimate_sums.numpy()

    def open_window(self):
        """Eagerly: the open window's `window_sums` (a list), for a backup
        of a schedule that acts on the estimate; None under a strategy of
        several replicas (each holds its own share: the resumed window is
        then left out of the estimate, as a file's)."""
        # Eagerly, outside the strategy's scope: `get_strategy()` would be
        # the default one here; the variable's own strategy says how many
        # shares of it this worker holds.
        shares = (
            (self.window_sums,) if self._strategy is None
            else self._strategy.experimental_local_results(self.window_sums)
        )
        if not self.built or len(shares) > 1:
            return None
        return self.window_sums.numpy().tolist()

    def resume_window(self, sums):
        """Eagerly: the open window's sums back (`open_window`'s), so that a
        window resumed from a backup is measured whole."""
        if self.built and sums is not None:
            self.window_sums.assign(tf.constant(sums, tf.float64))

    def start_epoch(self):
        """Eagerly: the epoch's estimate starts from the windows after now."""
        self._epoch_start = self.read()

    def end_epoch(self):
        """Eagerly: the epoch's `B_simple` in samples (a float), and a new
        epoch begins.

        `nan` if no window of the epoch had two micro-batches; `inf` if the
        noise was measured but the signal's estimate is not positive (the
        noise dominates at every batch the windows resolve). A negative
        value means the noise is below what the windows resolve.
        """
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
    """`[tr(Sigma), |G|^2, 1, tr(Sigma)^2, |G|^2^2, tr(Sigma) |G|^2]` of
    one window from its `window_sums` and `|G_B|^2`, or zeros for a window
    that says nothing (fewer than two micro-batches, not `measured`, or not
    finite)."""
    squares = sums[SQUARES]
    count = sums[MICRO_BATCHES]
    known = tf.logical_and(count >= 2, measured)
    safe = tf.where(known, count, 2.0)
    mean_square = squares / safe
    a = sums[INVERSE_SIZES] / safe
    c = tf.math.divide_no_nan(tf.constant(1.0, tf.float64), sums[SAMPLES])
    gap = tf.where(known, a - c, 1.0)
    norm = tf.cast(squared_norm, tf.float64)
    estimates = tf.stack(
        [(mean_square - norm) / gap, (norm * a - mean_square * c) / gap, 1.0]
    )
    # A window with an overflowed gradient (a loss scale still settling, a
    # NaN sample) is left out: the optimizer skips it too, or it would make
    # the whole epoch's estimate NaN.
    known = tf.logical_and(known, tf.reduce_all(tf.math.is_finite(estimates)))
    trace, signal = estimates[0], estimates[1]
    estimates = tf.concat([estimates, [trace * trace, signal * signal, trace * signal]], 0)
    return tf.where(known, estimates, tf.zeros_like(estimates))


def micro_batch_sums(parts, steps=1.0):
    """`window_sums` of micro-batches `parts` (`microbatch.Gradients`).

    Each part's mean gradient is `grads * grad_scale * replicas / weight`:
    the window holds `weight * gradient` of a loss Keras divided by the
    number of replicas. A stand-in past a short batch's end (no samples)
    counts for nothing. The parts' scalars are stacked into vectors, so the
    graph is the same few ops whatever the number of parts.
    """
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
    """The squared norm over all of `grads` (float64; None skipped); an
    `IndexedSlices`' of the dense gradient it stands for."""
    return squared_norms([grads])[0]


def squared_norms(grads_lists):
    """`squared_norm` of each list in `grads_lists` (lists of gradients of
    the same variables), as one float64 vector."""
    halves = [
        [_half_square(g) for g in grads if g is not None] for grads in grads_lists
    ]
    if not halves[0]:
        return tf.zeros([len(grads_lists)], tf.float64)
    # One fused pass per gradient (L2Loss: no squared temporary), in float32
    # (a float16 square overflows), then summed in float64: the estimator
    # subtracts close sums.
    table = tf.cast(tf.stack([tf.stack(row) for row in halves]), tf.float64)
    return 2.0 * tf.reduce_sum(table, axis=1)


def _half_square(g):
    if isinstance(g, tf.IndexedSlices):
        return _sparse_half_square(g)
    return _half_square_dense(tf.cast(g, tf.float32))


def _half_square_dense(g):
    if not internals.in_xla_context():
        return tf.nn.l2_loss(g)
    # XLA on a CPU reduces to a scalar on one thread: summed as a product
    # with ones instead, the squares fused into it.
    return 0.5 * internals.whole_sum(g * g)


def _sparse_half_square(slices):
    # Half the squared norm of the dense gradient: occurrences summed per
    # row first, in float32 (a float16 sum overflows). XLA has no `Unique`:
    # there each row's first occurrence is found through a table-sized map,
    # or the rows are sorted where the table is too large for one.
    values = tf.cast(slices.values, tf.float32)
    indices = tf.reshape(slices.indices, [-1])
    if internals.in_xla_context():
        return _half_square_dense(_rows_summed_under_xla(values, indices, slices.dense_shape))
    # A hash of the rows (`Unique`): about half the time of sorting them.
    # Summing rows (a segment sum, ~70 ns a row on a CPU) costs more than
    # the rest together, and a row seen once is its own sum. With `k` rows
    # for `n` occurrences, at most `2 (n - k)` occurrences are in repeated
    # rows: when `k > 3n / 4` (a large table) only those are summed, about
    # twice as fast; otherwise all are, as before
    # (benchmarks/noise_scale_cost.md, "Sparse gradients").
    rows, segments, counts = tf.unique_with_counts(indices, out_idx=tf.int32)

    def every_row():
        return tf.nn.l2_loss(
            tf.math.unsorted_segment_sum(values, segments, tf.size(rows))
        )

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
    # XLA's sort on a CPU compares one pair at a time: 1.2 ms for a window
    # of 4096 occurrences, against 0.5 ms through a map of the table's rows
    # (each row's first occurrence, by a scatter of positions), whose cost
    # is a fill of the table's rows: the map while the table has at most
    # 256 rows an occurrence (both measured on a 200,000-row table at 1024
    # and 4096 occurrences; benchmarks/xla.md). Decided on shapes: a
    # constant when XLA compiles.
    rows = tf.cast(dense_shape[0], tf.int64)
    count = tf.shape(indices, out_type=tf.int64)[0]
    return tf.cond(
        rows <= 256 * count,
        lambda: _rows_summed_mapped(values, indices, rows),
        lambda: _rows_summed_sorted(values, indices),
    )


def _rows_summed_mapped(values, indices, rows):
    # Each occurrence's segment is its row's first occurrence: a row seen
    # once is its own sum, unused segments zero.
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
    starts = tf.logical_or(
        tf.equal(tf.range(count), 0), tf.not_equal(rows, tf.roll(rows, 1, 0))
    )
    segments = tf.cumsum(tf.cast(starts, tf.int32)) - 1
    return tf.math.unsorted_segment_sum(tf.gather(values, order), segments, count)
