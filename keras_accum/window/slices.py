"""Sparse (`tf.IndexedSlices`) gradients over a window, exact for Keras's optimizers.

Keras's sparse updates square (Adamax: take the absolute value of) each
occurrence before summing a row's: a token seen k times adds `sum(g_i**2)`, not
`(sum g_i)**2`. So a window keeps its occurrences while they fit in the buffer
(`count >= 0`), then per-row sums of values, statistic and occurrences
(`ROW_SUMS`), handed over as `synthesised` occurrences; `DENSE`: an older file's
dense sum. Not enough for `clipvalue`, or Adamax with clipping (README).
"""

import keras
import tensorflow as tf

from keras_accum import _internals as internals

# `count` values below zero: what the buffer holds instead of slices.
DENSE = -1
ROW_SUMS = -2

# The per-occurrence statistic a window of row sums keeps beside the sums.
SQUARE = "square"
ABS = "abs"


def statistic_of(optimizer):
    """The statistic of its occurrences `optimizer`'s sparse update reads: `ABS`
    for Adamax's infinity norm, else `SQUARE`; wrappers are looked through."""
    inner = internals.innermost(optimizer)
    return ABS if isinstance(inner, keras.optimizers.Adamax) else SQUARE


def exact_statistic(optimizer):
    """`statistic_of(optimizer)` if row sums make its update exact, else None:
    `clipvalue` clips each occurrence, and Adamax's clipping norms read the
    absolute values, not the squares the sums keep."""
    inner = internals.innermost(optimizer)
    if getattr(inner, "clipvalue", None) is not None:
        return None
    kind = statistic_of(optimizer)
    clipped = getattr(inner, "clipnorm", None) or getattr(inner, "global_clipnorm", None)
    return None if kind == ABS and clipped else kind


def statistic(values, kind):
    """Each occurrence's statistic, elementwise."""
    return tf.abs(values) if kind == ABS else tf.square(values)


def index_dtype(rows):
    """The dtype of a buffer's row indices: int32 unless the table is huge."""
    return tf.int32 if rows < 2**31 else tf.int64


def append(storage, indices, count, slices, values, stats, kind=SQUARE):
    """Adds one micro-batch's `slices` (with scaled `values`) to the window: as
    slices while they fit in `storage`, else as row sums (module doc)."""
    rows = storage.shape[0]
    idx = tf.cast(slices.indices, indices.dtype)
    n = tf.cast(tf.shape(idx)[0], count.dtype)

    def to_slices():
        # Scatters at count + range(n), no dynamic-size slice: runs under XLA.
        positions = count + tf.range(n, dtype=count.dtype)
        storage.scatter_update(tf.IndexedSlices(values, positions))
        indices.scatter_update(tf.IndexedSlices(idx, positions))
        count.assign_add(n)

    def to_row_sums():
        def from_slices():
            # Only the live slices: the rest of the buffer is stale.
            live_values, rows_of = _padded(storage, indices, count)
            live = tf.cast(tf.range(rows, dtype=count.dtype) < count, indices.dtype)
            storage.assign(tf.math.unsorted_segment_sum(live_values, rows_of, rows))
            stats.assign(tf.math.unsorted_segment_sum(statistic(live_values, kind), rows_of, rows))
            indices.assign(tf.math.unsorted_segment_sum(live, rows_of, rows))

        def from_dense():
            # A dense sum from an older file: one occurrence per row.
            stats.assign(statistic(storage, kind))
            indices.assign(tf.ones_like(indices))

        tf.cond(
            count >= 0,
            from_slices,
            lambda: tf.cond(count == DENSE, from_dense, lambda: None),
        )
        storage.scatter_add(tf.IndexedSlices(values, idx))
        stats.scatter_add(tf.IndexedSlices(statistic(values, kind), idx))
        indices.scatter_add(tf.IndexedSlices(tf.ones_like(idx), idx))
        count.assign(tf.constant(ROW_SUMS, count.dtype))

    fits = tf.logical_and(count >= 0, count + n <= rows)
    tf.cond(fits, to_slices, to_row_sums)


def _padded(storage, indices, count):
    """The window's slices padded to the whole buffer, stale rows zeroed: exact
    (zero occurrences change nothing in Keras's updates) and static (XLA)."""
    rows = tf.shape(indices, out_type=count.dtype)[0]
    live = tf.range(rows, dtype=count.dtype) < count
    mask = tf.reshape(live, [-1] + [1] * (len(storage.shape) - 1))
    # A scalar zero, broadcast: `zeros_like` of a static shape is folded into
    # a constant of the buffer's size, held while the step's function lives.
    values = tf.where(mask, storage, tf.zeros([], storage.dtype))
    return values, tf.where(live, indices, tf.zeros([], indices.dtype))


def compact_window(storage, indices, count, size):
    """A window of slices (`0 <= count <= size`) as one `IndexedSlices` of the
    buffer's first `size` slots, those past `count` zero-valued at row 0: under
    XLA, the window's occurrences, not a table of padding (benchmarks/xla.md)."""
    values, idx = _padded(storage[:size], indices[:size], count)
    dense_shape = tf.constant(storage.shape.as_list(), tf.int64)
    return tf.IndexedSlices(values, idx, dense_shape)


def dense_sum(storage, indices, count):
    """The sum of the window's slices as a dense gradient."""
    values, idx = _padded(storage, indices, count)
    return tf.math.unsorted_segment_sum(values, idx, storage.shape[0])


def live_indices(indices, count):
    """The row indices of the window's slices (eager inspection, saving)."""
    return indices[: max(int(count), 0)]


def write_slices(storage, indices, count, values, rows):
    """Makes `values` at table rows `rows` the window's slices (loading)."""
    n = len(rows)
    positions = tf.range(n, dtype=count.dtype)
    storage.scatter_update(tf.IndexedSlices(values, positions))
    indices.scatter_update(tf.IndexedSlices(tf.cast(rows, indices.dtype), positions))
    count.assign(n)


def synthesised(sums, stats, counts, kind=SQUARE, capacity=None):
    """Occurrences `(values, rows)` whose per-row sums of values and of
    `statistic(values, kind)` are `sums` and `stats`, at most `counts` a row:
    Keras's sparse update makes the same step of them as of the real ones
    (checked per optimizer in tests/test_small_tables.py).

    Squares: m - 1 copies of `a = (S - d) / m` and one `S - (m - 1) a`, with
    `d = sqrt((m Q - S**2) / (m - 1))`, sum S and squares Q; real for
    `m >= S**2 / Q` (Cauchy-Schwarz). Absolute values: `(A + S) / 2`, `(S - A) / 2`.
    `capacity` (XLA): every row once plus `capacity` extra slots, zero-valued if
    unused; a row whose extras do not fit keeps its sum exact, its statistic
    the nearest reachable. None: the touched rows only.
    """
    rows = sums.shape[0]
    dtype = sums.dtype
    counts = tf.cast(counts, tf.int32)
    axes = list(range(1, len(sums.shape)))
    if capacity is None:
        # Only the touched rows: no more occurrences than the big batch's gradient.
        touched = tf.cast(tf.where(counts > 0)[:, 0], tf.int32)
        sums, stats, counts = (tf.gather(t, touched) for t in (sums, stats, counts))
    else:
        touched = tf.range(rows, dtype=tf.int32)
    if kind == ABS:
        needed = tf.minimum(counts, 2)
    else:
        ratio = tf.math.divide_no_nan(tf.square(sums), stats)
        # The tolerance: a ratio a rounding above an integer needs no more.
        needed = tf.cast(tf.math.ceil(tf.reduce_max(ratio, axis=axes) * (1 - 1e-6)), tf.int32)
        # At least two (one has no freedom), unless the row had just one.
        needed = tf.minimum(tf.maximum(needed, 2), tf.maximum(counts, 1))
    extra = tf.maximum(needed - 1, 0)
    ends = tf.cumsum(extra)
    if capacity is None:
        slots = tf.reduce_sum(extra)
    else:
        slots = capacity
        # Rows past the capacity get what is left (possibly nothing).
        extra = tf.clip_by_value(slots - (ends - extra), 0, extra)
        ends = tf.cumsum(extra)
    total = tf.reduce_sum(extra)
    m = tf.cast(extra + 1, dtype)
    shape = [-1] + [1] * len(axes)
    m = tf.reshape(m, shape)
    if kind == ABS:
        repeated = (stats + sums) / 2
        first = tf.where(m > 1, (sums - stats) / 2, sums)
    else:
        spread = tf.sqrt(tf.math.divide_no_nan(tf.maximum(m * stats - tf.square(sums), 0), m - 1))
        repeated = (sums - spread) / m
        first = sums - (m - 1) * repeated
    # Extra occurrence j belongs to the row whose range of ends holds it.
    j = tf.range(slots, dtype=tf.int32)
    owner = _owners(ends, slots)
    used = j < total
    owner = tf.where(used, owner, tf.zeros_like(owner))
    extra_values = tf.gather(repeated, owner)
    extra_values = tf.where(tf.reshape(used, shape), extra_values, tf.zeros_like(extra_values))
    values = tf.concat([first, extra_values], 0)
    idx = tf.concat([touched, tf.gather(touched, owner)], 0)
    return values, idx


def _owners(ends, slots):
    """For each slot j < `slots`, how many `ends` (sorted) are at most j,
    counted through a histogram of the ends: not `searchsorted`, which XLA
    compiles into a comparison of every slot with every row, allocated whether
    its branch runs or not (benchmarks/design-notes.md, "A histogram, not searchsorted")."""
    # Ends past the last slot count for none: one bucket past the end.
    buckets = tf.minimum(ends, slots)
    marks = tf.math.unsorted_segment_sum(tf.ones_like(buckets), buckets, slots + 1)
    return tf.cumsum(marks)[:slots]


def window_slices(storage, indices, count, padded=False, stats=None, kind=SQUARE, capacity=None):
    """The window's gradient as one `IndexedSlices` (unscaled sums): occurrences,
    `synthesised` ones, or every row once for a dense sum. `padded` (XLA): the
    whole buffer for slices, every row plus `capacity` for row sums."""
    rows = storage.shape[0]
    dense_shape = tf.constant(storage.shape.as_list(), tf.int64)
    every_row = tf.range(rows, dtype=indices.dtype)
    if padded:
        # No recorded size (no step traced here): room for as many more.
        capacity = rows if capacity is None else capacity
        return _padded_window(
            storage, indices, count, stats, kind, capacity, every_row, dense_shape
        )
    n = tf.maximum(count, 0)
    live = tf.range(n)

    def row_sums():
        values, idx = synthesised(storage.read_value(), stats.read_value(), indices, kind)
        return values, tf.cast(idx, indices.dtype)

    def slices_only():
        # sparse_read: only the window's rows are read, not the table.
        dense = count < 0
        values = tf.cond(dense, storage.read_value, lambda: storage.sparse_read(live))
        idx = tf.cond(dense, lambda: every_row, lambda: indices.sparse_read(live))
        return values, idx

    if stats is None:
        values, idx = slices_only()
    else:
        values, idx = tf.cond(count == ROW_SUMS, row_sums, slices_only)
    return tf.IndexedSlices(values, idx, dense_shape)


def _padded_window(storage, indices, count, stats, kind, capacity, every_row, dense_shape):
    rows = storage.shape[0]

    def slices_padded():
        values, idx = _padded(
            storage, indices, tf.where(count < 0, tf.constant(rows, count.dtype), count)
        )
        return values, tf.where(count < 0, every_row, idx)

    if stats is None:
        values, idx = slices_padded()
        return tf.IndexedSlices(values, idx, dense_shape)

    def slices_padded_to_row_sums():
        # Both branches of the conditional have one static shape.
        values, idx = slices_padded()
        zeros = tf.zeros(tf.concat([[capacity], tf.shape(values)[1:]], 0), values.dtype)
        return tf.concat([values, zeros], 0), tf.concat([idx, tf.zeros([capacity], idx.dtype)], 0)

    def row_sums():
        values, idx = synthesised(storage.read_value(), stats.read_value(), indices, kind, capacity)
        return values, tf.cast(idx, indices.dtype)

    values, idx = tf.cond(count == ROW_SUMS, row_sums, slices_padded_to_row_sums)
    return tf.IndexedSlices(values, idx, dense_shape)


def values_of(grad):
    """The tensor holding `grad`'s numbers (its values for IndexedSlices)."""
    return grad.values if isinstance(grad, tf.IndexedSlices) else grad
