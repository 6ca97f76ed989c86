"""Sparse (`tf.IndexedSlices`) gradients kept as slices over a window.

Keras's optimizers apply an `IndexedSlices` gradient occurrence by
occurrence: Adam, RMSprop and Adagrad square each occurrence's values
before summing the occurrences of a row, so a token seen k times in a batch
adds `sum(g_i**2)` to its second moment, not `(sum g_i)**2`. Summing a
window's slices into a dense buffer loses the occurrences. Here a window
keeps them: each micro-batch's slices are appended to a fixed-capacity
buffer, and the window is handed to the optimizer as ONE `IndexedSlices` of
all its occurrences, which is exactly what the big batch's gradient is.

The slices' values live in the variable's gradient buffer itself
(`storage`, the shape of the variable: slice `k`'s values in row `k`), their
row indices in an int vector with one entry per row (`indices`), and a
`count`:

- `count >= 0`: the window holds `count` slices in `storage[:count]` and
  `indices[:count]`; rows beyond are stale and never read. Starting a new
  window is `count = 0`: no dense pass over the table.
- `count == -1`: `storage` is the dense sum of the window's gradient
  (the representation rule below spilled the slices into it).

The representation rule: slices while the window's occurrences fit in the
buffer, `window tokens <= table rows` (values `tokens x width` within the
table's `rows x width`). A micro-batch that would overflow it spills the
window into the dense sum (a scatter-add, as before slices existed) and the
window is applied as that sum, one occurrence per row: the one case where
Keras's occurrence-wise update is not reproduced. Nothing is dropped: the
decision is made per micro-batch at run time, so a micro-batch bigger than
any seen before is caught too.

Why a table-sized buffer and not one sized to the window: the tokens per
micro-batch are usually unknown when the buffers are made (Keras traces
the step with a `None` batch dimension, and the last batch is shorter or
a later one bigger), and a window that outgrows its slices must still be
summed somewhere without dropping anything: in place, here. The indices
are a vector of their own, not bits in the float buffer: copies of floats
are not bit-exact everywhere (NaN patterns are canonicalised).
"""

import tensorflow as tf


def index_dtype(rows):
    """The dtype of a buffer's row indices: int32 unless the table is huge."""
    return tf.int32 if rows < 2**31 else tf.int64


def append(storage, indices, count, slices, values):
    """Adds one micro-batch's `slices` (with scaled `values`) to the window.

    Appended as slices while they fit in `storage`; otherwise the window
    becomes (or stays) the dense sum in `storage`.
    """
    rows = storage.shape[0]
    idx = tf.cast(slices.indices, indices.dtype)
    n = tf.cast(tf.shape(idx)[0], count.dtype)

    def to_slices():
        # Scatter updates at count + range(n): no dynamic-size slice, so the
        # same code runs under XLA.
        positions = count + tf.range(n, dtype=count.dtype)
        storage.scatter_update(tf.IndexedSlices(values, positions))
        indices.scatter_update(tf.IndexedSlices(idx, positions))
        count.assign_add(n)

    def to_dense():
        def densify():
            # Only the live slices: the rest of the buffer is stale.
            storage.assign(dense_sum(storage, indices, count))

        tf.cond(count >= 0, densify, lambda: None)
        storage.scatter_add(tf.IndexedSlices(values, idx))
        count.assign(-1)

    fits = tf.logical_and(count >= 0, count + n <= rows)
    tf.cond(fits, to_slices, to_dense)


def _padded(storage, indices, count):
    """The window's slices padded to the whole buffer: stale rows zeroed.

    Zero-valued occurrences change nothing in Keras's updates (each sums
    the occurrences of a row, after squaring them where it squares), so
    this is exact and has static shapes (for XLA).
    """
    rows = storage.shape[0]
    live = tf.range(rows, dtype=count.dtype) < count
    mask = tf.reshape(live, [rows] + [1] * (len(storage.shape) - 1))
    values = tf.where(mask, storage, tf.zeros_like(storage))
    return values, tf.where(live, indices, tf.zeros_like(indices))


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
    indices.scatter_update(
        tf.IndexedSlices(tf.cast(rows, indices.dtype), positions)
    )
    count.assign(n)


def window_slices(storage, indices, count, padded=False):
    """The window's gradient as one `IndexedSlices` (unscaled sums).

    Slices: the window's occurrences in order. Dense: every row once, which
    Keras's sparse update applies as it would the dense sum. `padded`
    hands the whole buffer (stale rows zero-valued), for XLA, which needs
    static shapes.
    """
    rows = storage.shape[0]
    dense = count < 0
    every_row = tf.range(rows, dtype=indices.dtype)
    if padded:
        values, idx = _padded(
            storage, indices, tf.where(dense, tf.constant(rows, count.dtype), count)
        )
        idx = tf.where(dense, every_row, idx)
    else:
        n = tf.maximum(count, 0)
        live = tf.range(n)
        # sparse_read: only the window's rows are read, not the table.
        values = tf.cond(dense, storage.read_value, lambda: storage.sparse_read(live))
        idx = tf.cond(dense, lambda: every_row, lambda: indices.sparse_read(live))
    return tf.IndexedSlices(values, idx, tf.constant(storage.shape.as_list(), tf.int64))


def values_of(grad):
    """The tensor holding `grad`'s numbers (its values for IndexedSlices)."""
    return grad.values if isinstance(grad, tf.IndexedSlices) else grad
