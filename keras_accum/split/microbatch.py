"""Micro-batches inside the step: each batch is split, its gradients summed
exactly (normaliser.py), and one update made. The micro-batches are in
sequence in the traced graph (no `tf.while_loop`): on one device each is a
call of one traced pass (engine/shared_pass.py), under XLA (which fuses them
as any step) and under a strategy an unrolled copy. Each waits for the sum
before it, so memory is one micro-batch's; the step (engine/step.py) makes
every write wait for all of them, so a failed step writes nothing.
"""

import math

import tensorflow as tf
from keras import tree

from keras_accum import _internals as internals
from keras_accum.scaling import scaled
from keras_accum.split import row_sums
from keras_accum.split.row_sums import RowSums
from keras_accum.window import MicroBatch


def static_batch_size(data):
    """The batch dimension of `data` as a Python int, or None if unknown."""
    x = data[0] if isinstance(data, tuple) else data
    for leaf in tree.flatten(x):
        if leaf is not None and getattr(leaf, "shape", None) is not None:
            if len(leaf.shape) == 0:
                return None
            dim = leaf.shape[0]
            return None if dim is None else int(dim)
    return None


def num_micro_batches(batch_size, micro_batch_size):
    """How many micro-batches a batch of `batch_size` samples is split into."""
    return max(1, math.ceil(batch_size / micro_batch_size))


def split(data, micro_batch_size, batch_size_seen):
    """Cuts a batch `(x, y, sample_weight)` into micro-batches, yielding
    `(micro_batch, live)`, `live` None or a boolean tensor. Without a static
    batch size, as many as the first batch needs: past a shorter batch's end
    each is its last sample alone, not live, weighed 0 (an empty one gives NaN
    moments, and NaN * 0 gradients); a longer batch is cut into longer ones."""
    if micro_batch_size is None:
        # One micro-batch of the whole batch ("auto" before it has had to split).
        yield data, None
        return
    static = static_batch_size(data)
    if static is not None:
        size = micro_batch_size
        for start in range(0, max(static, 1), size):
            stop = min(start + size, static)
            yield _rows(data, start, stop), None
        return
    if batch_size_seen is None:
        raise ValueError(
            "`micro_batch_size` needs the batch size when the train step "
            "is traced, but neither the batch's shape nor a first batch "
            "seen by `fit` or `train_on_batch` gives it. Train with `fit` "
            "or `train_on_batch`, or give batches a static size."
        )
    count = num_micro_batches(batch_size_seen, micro_batch_size)
    total = internals.batch_size(data[0])
    size = tf.maximum(micro_batch_size, -(-total // count))
    for i in range(count):
        if i == 0:
            yield _rows(data, 0, tf.minimum(size, total)), None
            continue
        live = i * size < total
        start = tf.minimum(i * size, total - 1)
        stop = tf.maximum(tf.minimum((i + 1) * size, total), start + 1)
        yield _rows(data, start, stop), live


def _rows(data, start, stop):
    return tree.map_structure(lambda t: None if t is None else t[start:stop], data)


def drop_rows(y_pred, rows):
    """The first `rows` rows of every prediction, masks included."""

    def cut(t):
        if t is None:
            return None
        kept = t[:rows]
        mask = internals.get_keras_mask(t)
        if mask is not None:
            internals.set_keras_mask(kept, mask[:rows])
        return kept

    return tree.map_structure(cut, y_pred)


def summed(total, part, variables=None, statistic=None):
    """`total` (the weighted gradients summed so far, or None) plus `part`'s
    `weight * gradient`. Summed as they come (`after`): a sum after the last
    would be a chain of adds that TensorFlow's graph optimiser rewrites into one
    `AddN` holding every micro-batch's gradient (benchmarks/design-notes.md,
    "One AddN of every micro-batch"). `statistic` (`slices.exact_statistic`
    of the optimizer): a sparse gradient that outgrows two tables (of
    `variables`, the gradients' own) goes on as `RowSums` (row_sums.py);
    None: every occurrence is kept (the optimizer reads each)."""
    weighted = [scaled(g, part.grad_scale) for g in part.grads]
    if total is None:
        return weighted
    if statistic is None:
        return [add_gradients(a, b) for a, b in zip(total, weighted)]
    return [
        add_gradients(a, b, statistic, table_rows(v)) for a, b, v in zip(total, weighted, variables)
    ]


def table_rows(variable):
    """The rows of `variable` a sparse gradient's row sums are shaped by (its
    first dimension); None for a scalar, which has no sparse gradient."""
    return variable.shape[0] if len(variable.shape) else None


def as_gradients(total):
    """The summed gradients as the optimizer takes them (`RowSums` as
    occurrences: row_sums.py)."""
    return [row_sums.as_gradient(g) if isinstance(g, RowSums) else g for g in total]


def combine(parts, grads):
    """The batch's `MicroBatch` from its micro-batches' and their `summed`
    `grads`: `loss` as Keras logs it for the whole batch, `y_pred` with masks."""
    weights = [tf.cast(p.weight, tf.float32) for p in parts]
    weight = tf.add_n(weights)
    losses = [tf.cast(p.loss, tf.float32) for p in parts]
    normalise = parts[0].normalise
    if normalise:
        # The weighted mean is the big batch's loss.
        loss = tf.math.divide_no_nan(
            tf.add_n([w * value for w, value in zip(weights, losses)]), weight
        )
    else:
        loss = tf.add_n(losses)
    num_samples = tf.add_n([p.num_samples for p in parts])
    y_pred = tree.map_structure(_concat, *[p.y_pred for p in parts])
    return MicroBatch(grads, None, weight, normalise, loss, num_samples, y_pred)


def control_after(batch):
    """Tensors ready only once every micro-batch has run; the loss too: what it
    alone needs may run, and fail, after the gradients."""
    return _tensors(batch.grads) + [batch.weight, batch.loss]


def _tensors(grads):
    # What a control dependency can wait on: a sparse gradient's values.
    return [t for g in grads if g is not None for t in _parts(g)]


def _parts(g):
    if isinstance(g, tf.IndexedSlices):
        return (g.values,)
    if isinstance(g, RowSums):
        return row_sums.to_wait_on(g)
    return (g,)


def after(previous, part):
    """`part`, readable only once `previous` (the gradients `summed` so far) is,
    lest the graph run micro-batches at once, holding several's activations.
    Under XLA (no control dependencies; equal computations merged, as a coupled
    micro-batch's two passes) it waits by data: minus a zero made from `previous`."""
    if not internals.in_xla_context():
        with tf.control_dependencies(_tensors(previous)):
            return tree.map_structure(lambda t: None if t is None else tf.identity(t), part)
    zero = _zero_after(previous)
    return tree.map_structure(lambda t: None if t is None else _waiting(t, zero), part)


def _zero_after(previous):
    # 0.0 from the whole of each tensor of `previous` (`zero_at_run_time`):
    # XLA folds what it can prove (a zero, integer `x * 0`; an optimization
    # barrier is expanded before CSE on CPU), not this. The whole, read as a product with ones, not one element: XLA
    # copies an elementwise sum into each reader of a part of it, and put every
    # add off to the end. Why: benchmarks/design-notes.md, "Waiting on the whole sum".
    reads = [_read_for_waiting(g) for g in previous if g is not None]
    if not reads:
        return tf.constant(0.0)
    return internals.zero_at_run_time(tf.add_n(reads))


def _read_for_waiting(t):
    # A sparse gradient's rows are joined, not added: nothing to put off, and the
    # whole would be read again at every micro-batch. Its newest row ends the values.
    if isinstance(t, tf.IndexedSlices):
        return tf.cast(tf.reduce_sum(tf.reshape(t.values, [-1])[-1:]), tf.float32)
    if isinstance(t, RowSums):
        # Summed by row when traced (XLA has no other): added as a dense
        # gradient is, in three tables each written by its own scatters.
        return (
            internals.whole_sum(t.sums)
            + internals.whole_sum(t.stats)
            + tf.cast(tf.reduce_sum(t.counts), tf.float32)
        )
    return internals.whole_sum(t)


def _waiting(t, zero):
    # `t` itself, by data after `zero`. Minus, not plus: x - 0.0 is x for
    # every float, -0.0 included (-0.0 + 0.0 is +0.0).
    if not isinstance(t, tf.Tensor):
        return t  # a SparseTensor, a RaggedTensor: waits by nothing
    if t.dtype.is_bool:
        return tf.logical_or(t, zero > 0)
    if t.dtype.is_floating or t.dtype.is_integer:
        return t - tf.cast(zero, t.dtype)
    return t  # strings, complex: waits by nothing


def add_gradients(a, b, statistic=None, rows=None):
    """`a + b` for one variable's gradients; sparse ones stay sparse, as
    `RowSums` once they outgrow two tables of `rows` if `statistic` is given
    (`summed`)."""
    if a is None:
        return None
    if isinstance(a, RowSums):
        return row_sums.add(a, b, a.statistic, a.rows)
    if isinstance(a, tf.IndexedSlices) and isinstance(b, tf.IndexedSlices):
        if statistic is not None:
            return row_sums.add(a, b, statistic, rows)
        # Rows of the batch, concatenated: as the big batch's gradient is.
        return tf.IndexedSlices(
            tf.concat([a.values, b.values], 0),
            tf.concat([a.indices, b.indices], 0),
            a.dense_shape,
        )
    return tf.convert_to_tensor(a) + tf.convert_to_tensor(b)


def _concat(*tensors):
    if any(t is None for t in tensors):
        return None
    joined = tf.concat(tensors, 0)
    masks = [internals.get_keras_mask(t) for t in tensors]
    if all(m is not None for m in masks):
        internals.set_keras_mask(joined, tf.concat(masks, 0))
    return joined
