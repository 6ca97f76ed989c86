"""A split batch's sparse gradient, summed by row once it outgrows its table.

An embedding's gradient has a row per token of the batch: concatenated
micro-batch by micro-batch, it grows with the batch, and each micro-batch
copied it whole (the transformer's memory curve: 21 MB at 64 sequences, 25 at
256, where the window of `accum_steps` stays flat). Keras's sparse updates
read a row's occurrences only through their sum and the sum of their squares
(Adamax: absolute values; window/slices.py), so past two tables' worth of
occurrences, the size of those two sums, the batch keeps the sums instead, and
hands the optimizer `slices.synthesised` occurrences, as a window of row sums
is applied. Not where the optimizer reads each occurrence (`clipvalue`,
Adamax's clipping: `slices.exact_statistic` is None): there every occurrence
is kept, as before.

When the step is traced the count of occurrences is known, and the rule is
made there, or (a batch of unknown size) it is not, and the rule is made at
run time (`tf.cond`), except under XLA, which needs one shape per branch: it
keeps the occurrences.
"""

from typing import NamedTuple

import tensorflow as tf

from keras_accum import _internals as internals
from keras_accum.window import slices


class RowSums(NamedTuple):
    """A sparse gradient's occurrences over the micro-batches so far: per row
    of its table, the sum of their values, of their `statistic`, and their
    count, once they outgrew two tables; before that (decided at run time
    only), the occurrences themselves.

    Attributes:
        values, indices: the occurrences not summed by row: all of them
            until they outgrow two tables, none after.
        sums, stats: `[rows, ...]` once summed by row, `[0, ...]` before.
        counts: int32 `[rows]` once summed by row, `[0]` before.
        dense_shape: the table's shape, as the `IndexedSlices`'.
        statistic: `slices.SQUARE` or `slices.ABS`.
        rows: the table's rows (a Python int).
        occurrence_count: how many occurrences in all, if known when traced.
    """

    values: tf.Tensor
    indices: tf.Tensor
    sums: tf.Tensor
    stats: tf.Tensor
    counts: tf.Tensor
    dense_shape: tf.Tensor
    statistic: str
    rows: int
    occurrence_count: object


def add(a, b, statistic, rows):
    """`a + b` for a sparse gradient of a `rows`-row table: `a` the sum so
    far (`IndexedSlices` or `RowSums`), `b` a micro-batch's `IndexedSlices`.

    Example:
        total = add(total, micro_batch_grad, slices.SQUARE, 60)
        grad = as_gradient(total)  # for the optimizer
    """
    if isinstance(a, tf.IndexedSlices):
        a = _pending(a, statistic, rows)
    count = _static_count(a, b)
    if a.sums.shape[0] == rows or (count is not None and count > 2 * rows):
        if count is None and internals.in_xla_context():
            # Not reached (a step's micro-batches are all of known size or
            # none is): XLA's synthesised occurrences need a static count.
            raise ValueError("A sparse gradient of unknown size after one of known size under XLA.")
        return _by_row(a, b)
    if count is not None or internals.in_xla_context():
        joined = _joined(a, b)
        return tf.IndexedSlices(joined.values, joined.indices, joined.dense_shape)
    outgrown = tf.logical_or(tf.shape(a.sums)[0] > 0, _count(a) + _count(b) > 2 * rows)
    fields = tf.cond(
        outgrown, lambda: _tensors_of(_by_row(a, b)), lambda: _tensors_of(_joined(a, b))
    )
    return a._replace(**dict(zip(_TENSORS, fields)), occurrence_count=None)


def as_gradient(row_sums):
    """The sum as the optimizer takes it: an `IndexedSlices` of the
    occurrences, or of `slices.synthesised` ones (under XLA a static number:
    every row, plus room for every occurrence but one)."""
    if row_sums.sums.shape[0] == row_sums.rows:
        return _synthesised(row_sums)

    def synthesised():
        grad = _synthesised(row_sums)
        return grad.values, grad.indices

    values, indices = tf.cond(
        tf.shape(row_sums.sums)[0] > 0, synthesised, lambda: (row_sums.values, row_sums.indices)
    )
    return _as_slices(values, indices, row_sums)


def to_wait_on(row_sums):
    """What a control dependency on the sum waits for."""
    return [row_sums.values, row_sums.sums, row_sums.stats, row_sums.counts]


_TENSORS = ("values", "indices", "sums", "stats", "counts")


def _tensors_of(row_sums):
    return tuple(getattr(row_sums, name) for name in _TENSORS)


def _pending(g, statistic, rows):
    # Every occurrence pending, no row summed yet.
    no_rows = _no_rows(g.values)
    return RowSums(
        g.values,
        g.indices,
        no_rows,
        no_rows,
        tf.zeros([0], tf.int32),
        g.dense_shape,
        statistic,
        rows,
        g.values.shape[0],
    )


def _static_count(a, b):
    counts = (a.occurrence_count, b.values.shape[0])
    return None if None in counts else sum(counts)


def _count(g):
    # int64: a table may have 2**31 rows or more (slices.index_dtype).
    return tf.shape(g.values, out_type=tf.int64)[0]


def _joined(a, b):
    # Rows of the batch, concatenated: as the big batch's gradient is.
    return a._replace(
        values=tf.concat([a.values, b.values], 0),
        indices=tf.concat([a.indices, tf.cast(b.indices, a.indices.dtype)], 0),
        occurrence_count=_static_count(a, b),
    )


def _by_row(a, b):
    """`a`'s row sums (made of its occurrences if it still holds them) with
    `b`'s occurrences added, scattered into the sums so far, which TensorFlow
    updates in place when nothing else reads them: no table-sized
    temporaries, and no table of zeros, which Grappler would fold into a
    constant held as long as the step's function."""
    if a.sums.shape[0] == a.rows:
        sums, stats, counts = a.sums, a.stats, a.counts
    elif a.sums.shape[0] == 0:
        sums, stats, counts = _summed_by_row(a)
    else:
        sums, stats, counts = tf.cond(
            tf.shape(a.sums)[0] > 0,
            lambda: (a.sums, a.stats, a.counts),
            lambda: _summed_by_row(a),
        )
    at = tf.expand_dims(tf.cast(b.indices, a.indices.dtype), -1)
    shape = [a.rows] + a.values.shape[1:].as_list()
    return a._replace(
        values=_no_rows(a.values),
        indices=tf.zeros([0], a.indices.dtype),
        sums=tf.ensure_shape(tf.tensor_scatter_nd_add(sums, at, b.values), shape),
        stats=tf.ensure_shape(
            tf.tensor_scatter_nd_add(stats, at, slices.statistic(b.values, a.statistic)), shape
        ),
        counts=tf.ensure_shape(
            tf.tensor_scatter_nd_add(counts, at, tf.ones_like(at[:, 0], tf.int32)), [a.rows]
        ),
        occurrence_count=_static_count(a, b),
    )


def _summed_by_row(a):
    # The tables of `a`'s pending occurrences (all of them: it has no rows yet).
    return (
        tf.math.unsorted_segment_sum(a.values, a.indices, a.rows),
        tf.math.unsorted_segment_sum(slices.statistic(a.values, a.statistic), a.indices, a.rows),
        tf.math.unsorted_segment_sum(tf.ones_like(a.indices, tf.int32), a.indices, a.rows),
    )


def _no_rows(values):
    # `values` with no rows: `[0, ...]`, its width kept (static where it is).
    empty = tf.zeros(tf.concat([[0], tf.shape(values)[1:]], 0), values.dtype)
    return tf.ensure_shape(empty, [0] + values.shape[1:].as_list())


def _synthesised(row_sums):
    # Under XLA a static number: no row needs more extra occurrences than
    # it had, less one. Unknown counts under XLA keep the occurrences (`add`).
    capacity = row_sums.occurrence_count - 1 if internals.in_xla_context() else None
    values, at = slices.synthesised(
        row_sums.sums, row_sums.stats, row_sums.counts, row_sums.statistic, capacity
    )
    return _as_slices(values, at, row_sums)


def _as_slices(values, indices, row_sums):
    return tf.IndexedSlices(values, tf.cast(indices, row_sums.indices.dtype), row_sums.dense_shape)
