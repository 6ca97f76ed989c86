"""Micro-batches inside the step: each batch `fit` draws is split, its
gradients summed exactly, and one update made.

The step runs the forward and backward pass of every micro-batch of the batch
in turn (unrolled in the traced graph: no `tf.while_loop`, so XLA fuses it
like any other step) and sums their gradients, each micro-batch weighted by
what Keras normalises its loss by (normaliser.py), exactly as a window of
`accum_steps` micro-batches is summed across steps. Only one micro-batch's
activations and gradient are alive at a time (each micro-batch waits for
the sum of the gradients before it: `summed`, `after`), so memory is the
micro-batch's; the update, the logged loss and the metrics are the whole
batch's.

Everything is computed into tensors first; the step (step.py) makes every state
write of the step (BatchNormalization's pooled moments, the loss tracker,
the metrics, the window or the optimizer) wait for all micro-batches'
gradients, so a step that fails part-way (out of memory) writes nothing.

Example (inside a traced train step, as `AccumModel` does it):

```python
parts, total = [], None
for part, live in split(data, 32, 256):
    parts.append(gradients_of(*(part if total is None else after(total, part))))
    total = summed(total, parts[-1])
batch = combine(parts, total)
optimizer.apply([scaled(g, 1 / batch.weight) for g in batch.grads], variables)
```
"""

import math
from typing import NamedTuple

import tensorflow as tf
from keras import tree

from keras_accum import _internals as internals
from keras_accum.scaling import scaled

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


class Gradients(NamedTuple):
    """One forward and backward pass: what a micro-batch (or a batch) gives.

    Attributes:
        grads: gradients of the (scaled) loss, one per variable, None where
            the variable has none.
        grad_scale: multiplies `grads` into `weight * gradient` (the
            micro-batch's weight and the loss scale's undoing), or None when
            the weight was folded into the loss already.
        weight: what the loss was normalised by (normaliser.py).
        normalise: whether the update divides by the total weight (Python bool).
        loss: the loss as Keras computed it.
        num_samples: the number of samples.
        y_pred: the predictions.
    """

    grads: list
    grad_scale: object
    weight: object
    normalise: bool
    loss: object
    num_samples: object
    y_pred: object


def split(data, micro_batch_size, batch_size_seen):
    """Cuts a batch `(x, y, sample_weight)` into micro-batches, in order.

    Yields `(micro_batch, live)`: `live` is None for a real micro-batch, or a
    boolean tensor saying whether it is one.

    With a static batch size the cuts are static: `micro_batch_size` samples
    each, the last one shorter. Otherwise (fit's batch dimension is None)
    there are as many micro-batches as the first training batch needs, of
    `micro_batch_size` samples each. A shorter batch (an epoch's last) has
    fewer real ones: each one past its end is the batch's last sample alone,
    not live, which the step weighs 0 (an empty micro-batch would give NaN
    moments, and NaN * 0 gradients, in layers such as BatchNormalization).
    A longer batch is cut into as many longer micro-batches, never dropping
    a sample.
    """
    if micro_batch_size is None:
        # One micro-batch of the whole batch ("auto" before it has had to
        # split): the split step's all-or-nothing writes, no cut.
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


def summed(total, part):
    """`total` (the micro-batches' weighted gradients summed so far, or None
    before the first) plus `part`'s (a `Gradients`): `weight * gradient`,
    the first micro-batch's taken as they are, not added to zeros.

    Summed micro-batch by micro-batch, each waiting for the sum before it
    (`after`): one micro-batch's gradient alive at a time. A sum made after
    the last micro-batch would be one chain of adds, which TensorFlow's
    graph optimiser rewrites into one `AddN` of every micro-batch's
    gradient, all held at once (16 micro-batches of an MLP with 43M
    weights: 1.56 GB of tensors against the big batch's 0.70,
    benchmarks/contrastive.md).
    """
    weighted = [scaled(g, part.grad_scale) for g in part.grads]
    if total is None:
        return weighted
    return [add_gradients(a, b) for a, b in zip(total, weighted)]


def combine(parts, grads):
    """The batch's `Gradients` from its micro-batches' and their `summed`
    gradients `grads`.

    `grads` are `weight * gradient` summed over micro-batches, in float32
    for half-precision variables; `grad_scale` is None; `loss` is the
    batch's loss as Keras logs it for the whole batch; `y_pred` the batch's
    predictions, masks included.
    """
    weights = [tf.cast(p.weight, tf.float32) for p in parts]
    weight = tf.add_n(weights)
    losses = [tf.cast(p.loss, tf.float32) for p in parts]
    normalise = parts[0].normalise
    if normalise:
        # The weighted mean is the big batch's loss: its normaliser is the
        # sum of the micro-batches'.
        loss = tf.math.divide_no_nan(
            tf.add_n([w * l for w, l in zip(weights, losses)]), weight
        )
    else:
        loss = tf.add_n(losses)
    num_samples = tf.add_n([p.num_samples for p in parts])
    y_pred = tree.map_structure(_concat, *[p.y_pred for p in parts])
    return Gradients(grads, None, weight, normalise, loss, num_samples, y_pred)


def control_after(batch):
    """Tensors that are ready only once every micro-batch has run.

    The loss too: what it alone needs (a loss term's extra work, say) may
    run, and fail, after the gradients are ready.
    """
    return _tensors(batch.grads) + [batch.weight, batch.loss]


def _tensors(grads):
    # What a control dependency can wait on: a sparse gradient's values.
    return [
        t
        for g in grads
        if g is not None
        for t in ((g.values,) if isinstance(g, tf.IndexedSlices) else (g,))
    ]


def after(previous, part):
    """`part`, readable only once `previous` (the gradients summed so far, a
    list as `summed` gives them) is computed.

    The micro-batches of a step do not depend on each other, so the graph
    could run several at once, holding several micro-batches' activations:
    each waits for the sum of those before it, and memory stays the
    micro-batch's.

    Under XLA, which schedules without control dependencies and merges
    equal computations (a coupled micro-batch's second forward pass with
    its first, coupling.py: the first pass's activations would then be kept
    for the second), `part` waits by data instead: it is subtracted a zero
    that XLA cannot tell is one, made from `previous`.
    """
    if not internals.in_xla_context():
        with tf.control_dependencies(_tensors(previous)):
            return tree.map_structure(lambda t: None if t is None else tf.identity(t), part)
    zero = _zero_after(previous)
    return tree.map_structure(
        lambda t: None if t is None else _waiting(t, zero), part
    )


def _zero_after(previous):
    # 0.0, computed from the whole of each tensor of `previous`: a
    # comparison no float can pass (not even NaN or an overflow to inf)
    # selects it. XLA folds what it can prove (a constant zero, `x * 0` of
    # integers, an optimization barrier is expanded before CSE on CPU), not
    # this. The whole, not an element: XLA copies an elementwise sum into
    # each reader of a part of it, so waiting on one element of the sum
    # let it put off every add to the end, holding every micro-batch's
    # gradient (benchmarks/xla.md's MLP, 1.6M weights, 4 micro-batches of
    # 32: 34 MB of tensors, now 11, the big batch 13; tests/test_step_graph.py:
    # as much at 16 micro-batches as at 4). Read as a product with ones.
    reads = [_read_for_waiting(g) for g in previous if g is not None]
    if not reads:
        return tf.constant(0.0)
    probe = tf.add_n(reads)
    return tf.where(probe > float("inf"), probe, tf.zeros_like(probe))


def _read_for_waiting(t):
    # A sparse gradient's rows are joined, not added (`add_gradients`):
    # nothing to put off, and the whole would be read again at every
    # micro-batch (N^2 / 2 micro-batches' rows a step). Its newest row ends
    # the values: waiting on it waits on the newest micro-batch.
    if isinstance(t, tf.IndexedSlices):
        return tf.cast(tf.reduce_sum(tf.reshape(t.values, [-1])[-1:]), tf.float32)
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


def add_gradients(a, b):
    """`a + b` for one variable's gradients; sparse ones stay sparse."""
    if a is None:
        return None
    if isinstance(a, tf.IndexedSlices) and isinstance(b, tf.IndexedSlices):
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
