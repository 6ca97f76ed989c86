"""Sparse (`tf.IndexedSlices`) gradients kept as slices over a window.

Keras's optimizers apply an `IndexedSlices` gradient occurrence by
occurrence: Adam, RMSprop and Adagrad square each occurrence's values
before summing the occurrences of a row, so a token seen k times in a batch
adds `sum(g_i**2)` to its second moment, not `(sum g_i)**2`. Summing a
window's slices into a dense buffer loses the occurrences. Here a window
keeps them: each micro-batch's slices are appended to a fixed-capacity
buffer, and the window is handed to the optimizer as ONE `IndexedSlices` of
all its occurrences, which is exactly what the big batch's gradient is.

The slices live in the variable's gradient buffer itself (`storage`, the
shape of the variable), so a window takes no more memory than a dense one:
slice `k`'s values in row `k`, its row index (an int, bit-cast to the
buffer's float dtype: copied, never computed with) in the buffer's last
elements, and a `count`:

- `count >= 0`: the window holds `count` slices; rows and indices beyond
  are stale and never read. Starting a new window is `count = 0`: no
  dense pass over the table.
- `count == -1`: `storage` is the dense sum of the window's gradient
  (the representation rule below spilled the slices into it).

The representation rule: slices while the window's occurrences fit in the
buffer, values and indices together: `tokens x (width + 1) <= rows x
width` (`width + 2` for 16-bit buffers, whose floats hold half an int32;
`capacity` tokens: 196,923 for a 200,000 x 64 float32 table). A
micro-batch that would overflow it spills the window into the dense sum (a
scatter-add, as before slices existed) and the window is applied as that
sum, one occurrence per row: the one case where Keras's occurrence-wise
update is not reproduced. Nothing is dropped: the decision is made per
micro-batch at run time, so a micro-batch bigger than any seen before is
caught too.

Why a table-sized buffer and not one sized to the window: the tokens per
micro-batch are usually unknown when the buffers are made (Keras traces
the step with a `None` batch dimension, and the last batch is shorter or
a later one bigger), and a window that outgrows its slices must still be
summed somewhere without dropping anything: in place, here.
"""

import math

import tensorflow as tf


class Layout:
    """Where a buffer keeps its slices: values in rows `[0, capacity)`, each
    slice's row index in `slots` elements from flat offset `start`."""

    def __init__(self, storage):
        self.shape = storage.shape.as_list()
        self.rows = self.shape[0]
        self.width = math.prod(self.shape[1:])
        self.dtype = storage.dtype
        # An index as wide as the buffer's floats (int64 in float64), or
        # int32 spread over two 16-bit floats.
        self.index_dtype = tf.int64 if storage.dtype.size == 8 else tf.int32
        self.slots = self.index_dtype.size // storage.dtype.size
        size = self.rows * self.width
        self.capacity = size // (self.width + self.slots)
        self.start = size - self.capacity * self.slots

    def _coordinates(self, first, n):
        """Buffer coordinates of the index slots of slices first..first+n."""
        flat = self.start + tf.cast(first, tf.int64) * self.slots
        flat = flat + tf.range(tf.cast(n, tf.int64) * self.slots)
        coordinates = []
        for dim in reversed(self.shape):
            coordinates.append(flat % dim)
            flat = flat // dim
        return tf.stack(coordinates[::-1], axis=1)

    def write_indices(self, storage, first, indices):
        bits = tf.bitcast(tf.cast(indices, self.index_dtype), self.dtype)
        storage.scatter_nd_update(
            self._coordinates(first, tf.shape(indices)[0]), tf.reshape(bits, [-1])
        )

    def read_indices(self, storage, n):
        """The first `n` indices, reading only their elements."""
        return self._from_bits(storage.gather_nd(self._coordinates(0, n)))

    def all_indices(self, storage):
        """All `capacity` index slots, live or stale: static shapes for XLA
        (which has no kernel for a variable's gather_nd)."""
        return self._from_bits(tf.reshape(storage.read_value(), [-1])[self.start :])

    def _from_bits(self, bits):
        if self.slots > 1:
            bits = tf.reshape(bits, [-1, self.slots])
        return tf.bitcast(bits, self.index_dtype)


def append(storage, count, slices, values):
    """Adds one micro-batch's `slices` (with scaled `values`) to the window.

    Appended as slices while they fit in `storage`; otherwise the window
    becomes (or stays) the dense sum in `storage`.
    """
    layout = Layout(storage)
    idx = tf.cast(slices.indices, layout.index_dtype)
    n = tf.cast(tf.shape(idx)[0], count.dtype)

    def to_slices():
        # scatter updates at count + range(n): no dynamic-size slice, so the
        # same code runs under XLA.
        positions = count + tf.range(n, dtype=count.dtype)
        storage.scatter_update(tf.IndexedSlices(values, positions))
        layout.write_indices(storage, count, idx)
        count.assign_add(n)

    def to_dense():
        def densify():
            # Only the live slices: the rest of the buffer is stale.
            storage.assign(dense_sum(storage, count))

        tf.cond(count >= 0, densify, lambda: None)
        storage.scatter_add(tf.IndexedSlices(values, idx))
        count.assign(-1)

    fits = tf.logical_and(count >= 0, count + n <= layout.capacity)
    tf.cond(fits, to_slices, to_dense)


def _padded(storage, count):
    """The window's slices padded to the whole buffer: stale rows zeroed.

    Zero-valued occurrences change nothing in Keras's updates (each sums
    the occurrences of a row, after squaring them where it squares), so
    this is exact and has static shapes (for XLA).
    """
    layout = Layout(storage)
    rows = layout.rows
    live = tf.range(rows, dtype=count.dtype) < count
    mask = tf.reshape(live, [rows] + [1] * (len(layout.shape) - 1))
    values = tf.where(mask, storage, tf.zeros_like(storage))
    idx = tf.concat(
        [
            layout.all_indices(storage),
            tf.zeros([rows - layout.capacity], layout.index_dtype),
        ],
        0,
    )
    return values, tf.where(live, idx, tf.zeros_like(idx))


def dense_sum(storage, count):
    """The sum of the window's slices as a dense gradient."""
    values, idx = _padded(storage, count)
    return tf.math.unsorted_segment_sum(values, idx, storage.shape[0])


def live_indices(storage, count):
    """The row indices of the window's slices (eager inspection, saving)."""
    return Layout(storage).read_indices(storage, tf.maximum(count, 0))


def write_slices(storage, count, values, indices):
    """Makes `values` at rows `indices` the window's slices (loading)."""
    n = len(indices)
    storage.scatter_update(tf.IndexedSlices(values, tf.range(n)))
    Layout(storage).write_indices(storage, 0, indices)
    count.assign(n)


def window_slices(storage, count, padded=False):
    """The window's gradient as one `IndexedSlices` (unscaled sums).

    Slices: the window's occurrences in order. Dense: every row once, which
    Keras's sparse update applies as it would the dense sum. `padded`
    hands the whole buffer (stale rows zero-valued), for XLA, which needs
    static shapes.
    """
    layout = Layout(storage)
    dense = count < 0
    every_row = tf.range(layout.rows, dtype=layout.index_dtype)
    if padded:
        values, idx = _padded(
            storage, tf.where(dense, tf.constant(layout.rows, count.dtype), count)
        )
        idx = tf.where(dense, every_row, idx)
    else:
        n = tf.maximum(count, 0)
        # sparse_read and gather_nd: only the window's elements are read.
        values = tf.cond(
            dense, storage.read_value, lambda: storage.sparse_read(tf.range(n))
        )
        idx = tf.cond(
            dense, lambda: every_row, lambda: layout.read_indices(storage, n)
        )
    return tf.IndexedSlices(values, idx, tf.constant(layout.shape, tf.int64))


def values_of(grad):
    """The tensor holding `grad`'s numbers (its values for IndexedSlices)."""
    return grad.values if isinstance(grad, tf.IndexedSlices) else grad
