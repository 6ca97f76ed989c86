"""Batch-coupled losses: the big batch's gradient with the micro-batch's memory.

A contrastive loss (CLIP's, SigLIP's, a two-tower model's softmax over the
batch's items, InfoNCE) is not a sum over samples: each sample's loss reads
every other sample of the batch. Micro-batches summed as for any other loss
would give each sample the negatives of its micro-batch only, a different
and weaker training. `coupled_from` names the layers whose outputs are the
per-sample representations; the model splits there:

- the per-sample part (everything upstream of those layers: the encoders)
  runs per micro-batch;
- the coupled part (everything downstream: a similarity matrix, a logit
  scale, the loss) runs once on the whole batch's representations.

The step (Gao et al. 2021, "GradCache") then makes the big batch's gradient
exactly, in three stages, one compiled step:

1. every micro-batch forward through the per-sample part, no tape kept:
   its representations only;
2. the coupled part and the loss on the whole batch, under a tape: the
   gradient of its own weights and of the loss with respect to each
   representation;
3. every micro-batch forward again, under a tape, backpropagating its rows
   of that gradient: the per-sample part's gradient, summed.

The second forward pass starts from the state the first one did (the
per-sample part's non-trainable variables are put back: random seeds,
moving statistics), so dropout draws the same masks in both passes and
the gradient is exactly the big batch's with those masks; stateful layers
update once, as in an ordinary split.

Example:

```python
model = keras_accum.AccumModel(
    [queries, items], logits, micro_batch_size=32,
    coupled_from=["query_repr", "item_repr"],
)
```
"""

import keras
import tensorflow as tf
from keras import tree

from keras_accum import _internals as internals
from keras_accum import microbatch, scaling
from keras_accum.arguments import AUTO
from keras_accum.normaliser import loss_normaliser, micro_batch_weight


class Coupling:
    """Where a functional model's batch couples: its two parts.

    Made once per model and names (`Coupling.of`), eagerly; read by the
    traced step. Not a layer: its two models share the model's layers and
    weights, and nothing of it is saved (the names are, in the config).

    Attributes:
        names: the `coupled_from` layer names, in order.
        per_sample: a `keras.Model` from the model's inputs to the
            representations (a list, one per name).
        coupled: a `keras.Model` from the representations to the model's
            outputs.

    Example:

    ```python
    coupling = Coupling.of(model, ["query_repr", "item_repr"])
    representations = coupling.per_sample(x, training=True)
    y_pred = coupling.coupled(representations, training=True)
    ```
    """

    def __init__(self, names, per_sample, coupled):
        self.names = names
        self.per_sample = per_sample
        self.coupled = coupled

    @classmethod
    def of(cls, model, names):
        """The `Coupling` of `model` at the layers `names`; raises a
        ValueError, naming what is wrong, if they do not split it."""
        names = tuple(names)
        if not isinstance(model, internals.Functional):
            raise ValueError(
                f"`coupled_from={list(names)}` needs a functional model (made "
                "from `keras.Input`s, or a `Sequential` or functional model "
                f"given to `wrap`), to split it at those layers. Received a "
                f"{type(model).__name__}. Build the model functionally."
            )
        available = [layer.name for layer in model.layers]
        outputs = []
        for name in names:
            if name not in available:
                raise ValueError(
                    f"`coupled_from` names a layer the model does not have: "
                    f"{name!r}. Its layers are: {available}."
                )
            output = internals.output_of_its_call(model.get_layer(name))
            if output is None:
                raise ValueError(
                    f"The layer {name!r} in `coupled_from` is called more than "
                    "once in the model, so its output is not one tensor: name "
                    "a layer called once per representation."
                )
            outputs.append(output)
        per_sample = keras.Model(model.input, outputs, name=f"{model.name}_per_sample")
        try:
            coupled = keras.Model(outputs, model.output, name=f"{model.name}_coupled")
        except ValueError as error:
            raise ValueError(
                f"The layers `coupled_from={list(names)}` do not split the "
                "model: an input reaches its output without passing through "
                "them, so part of the model would see one micro-batch where "
                "the big batch sees the whole batch. Name every layer whose "
                "output carries a sample's representation to the coupled "
                f"part. (Keras: {error})"
            ) from error
        return cls(names, per_sample, coupled)


def check_strategy(settings, strategy):
    """Raises if `coupled_from` cannot train under `strategy` as set."""
    several = strategy.num_replicas_in_sync > 1 or internals.multi_worker(strategy)
    if several and settings.micro_batch_size == AUTO:
        raise ValueError(
            f"`coupled_from={list(settings.coupled_from)}` with "
            "micro_batch_size='auto' under a strategy of several replicas "
            "or workers is not supported yet: 'auto' computes each replica's "
            "gradients apart from every collective (so that running out of "
            "memory on one blocks no other), and a coupled loss gathers the "
            "representations across replicas. Give an integer "
            "`micro_batch_size`."
        )


def coupled_gradients(model, coupling, state, parts, batch, variables, fold, loss_scale):
    """The whole batch's `microbatch.Gradients` from its micro-batches `parts`.

    Args:
        model: the model (compiled loss, optimizer).
        coupling: its `Coupling`.
        state: the model's `AccumState` (BatchNormalization records).
        parts: the micro-batches, `((x, y, sample_weight), live)` as
            `microbatch.split` gives them.
        batch: the whole batch, `(x, y, sample_weight)`.
        variables: the variables to differentiate.
        fold: whether the batch's weight is folded into the loss (see
            `step.micro_batch_gradients`); else it scales the gradients.
        loss_scale: the optimizer's loss scale, or None.

    Returns:
        `(gradients, records)`: the `Gradients` of the whole batch (its
        gradient times its weight, `grad_scale` None) and the
        BatchNormalization records of its coupled part and micro-batches.
    """
    x, y, sample_weight = batch
    parts = list(parts)
    replayed = _replayed_state(coupling.per_sample)
    # 1. Representations, micro-batch by micro-batch, no tape kept.
    representations, rows = [], []
    for (x_k, _, _), live in parts:
        if representations:
            x_k = microbatch.after(representations[-1], x_k)
        reps = [tf.stop_gradient(r) for r in _as_list(_forward(coupling.per_sample, x_k))]
        n = internals.batch_size(x_k)
        kept = n if live is None else n * tf.cast(live, n.dtype)
        representations.append([r[:kept] for r in reps])
        rows.append(kept)
    local = [tf.concat(r, 0) for r in zip(*representations)]
    replicas = _Replicas(internals.batch_size(x))
    whole = replicas.gather(local)
    # 2. The coupled part and the loss, once, on the whole batch (the
    # global batch: every replica computes it).
    records, normalisers = [], []
    with tf.GradientTape() as tape:
        tape.watch(whole)
        with state.moments.micro_batch(records):
            y_pred = _forward(coupling.coupled, whole)
        y_all, weights_all = replicas.gather(y), replicas.gather(sample_weight)
        with internals.recording_loss_calls(
            model, lambda *call: normalisers.append(loss_normaliser(*call))
        ):
            loss = internals.compute_loss(model, x, y_all, y_pred, weights_all)
        weight, normalise = micro_batch_weight(normalisers, replicas.total)
        scaled = model.optimizer.scale_loss(loss)
        if fold:
            scaled = scaled * tf.cast(weight, loss.dtype)
    upstream, grads = tape.gradient(scaled, [whole, list(variables)])
    upstream = replicas.own_rows_of_gradient(upstream)
    # 3. Each micro-batch again, under a tape, from the first pass's state.
    _restore(replayed)
    start, previous = 0, upstream
    for ((x_k, _, _), live), kept in zip(parts, rows):
        x_k = microbatch.after(previous, x_k)
        first = len(records)
        with tf.GradientTape() as tape:
            with state.moments.micro_batch(records):
                reps = _as_list(_forward(coupling.per_sample, x_k))
            surrogate = tf.add_n([
                tf.reduce_sum(r * tf.cast(_rows_of(u, start, kept, r), r.dtype))
                for r, u in zip(reps, upstream)
            ])
        if live is not None:
            # A stand-in past a short batch's end adds no moments.
            records[first:] = [
                record._replace(count=record.count * tf.cast(live, record.count.dtype))
                for record in records[first:]
            ]
        part = tape.gradient(surrogate, variables)
        # The next micro-batch waits for the sum so far (microbatch.summed).
        grads = previous = [_sum(g, p) for g, p in zip(grads, part)]
        start = start + kept
    grad_scale = None if fold else scaling.into_window(weight, loss_scale)
    grads = [None if g is None else scaling.scaled(g, grad_scale) for g in grads]
    gradients = microbatch.Gradients(
        grads, None, weight, normalise, loss, internals.batch_size(x),
        replicas.own_rows(y_pred),
    )
    return gradients, records


class _Replicas:
    """This replica's rows of the global batch, under a strategy of several
    replicas: the coupled part sees every replica's representations (as
    CLIP's training on many GPUs gathers them), each replica its own rows
    of the gradient. One replica: every method is the identity."""

    def __init__(self, rows):
        context = tf.distribute.get_replica_context()
        self.count = 1 if context is None else context.num_replicas_in_sync
        self.rows = rows
        if self.count == 1:
            self.start, self.total = 0, rows
            return
        self.context = context
        sizes = context.all_gather(tf.reshape(rows, [1]), axis=0)
        replica = context.replica_id_in_sync_group
        self.start = tf.reduce_sum(sizes[:replica])
        self.total = tf.reduce_sum(sizes)

    def gather(self, values):
        if self.count == 1 or values is None:
            return values
        return tree.map_structure(
            lambda t: None if t is None else self.context.all_gather(t, axis=0), values
        )

    def own_rows(self, values):
        if self.count == 1:
            return values
        return microbatch.drop_rows(
            tree.map_structure(lambda t: None if t is None else t[self.start:], values),
            self.rows,
        )

    def own_rows_of_gradient(self, upstream):
        # The loss each replica computed is the global batch's, divided by
        # the replicas (Keras, so that summing replicas' gradients gives a
        # mean): the coupled part's own weights get a share from each
        # replica; a representation's gradient comes from one replica only,
        # so it is multiplied back.
        if self.count == 1:
            return upstream
        return [u[self.start:self.start + self.rows] * self.count for u in upstream]


def _forward(part, inputs):
    return part(inputs, training=True)


def _as_list(outputs):
    return list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]


def _sum(a, b):
    if a is None or b is None:
        return b if a is None else a
    return microbatch.add_gradients(a, b)


def _rows_of(upstream, start, kept, reps):
    # This micro-batch's rows of the whole batch's gradient; a stand-in past
    # a short batch's end (kept 0) gets zeros for its one row.
    mine = upstream[start:start + kept]
    padding = tf.zeros_like(upstream[:1])[: tf.shape(reps)[0] - kept]
    return tf.concat([mine, padding], 0)


def _replayed_state(per_sample):
    # What the per-sample part's forward pass writes (random seeds, moving
    # statistics), read before the first pass. Reading a variable no pass
    # writes (a frozen weight) copies nothing.
    return [(v, tf.identity(v.value)) for v in per_sample.non_trainable_variables]


def _restore(replayed):
    for variable, value in replayed:
        variable.assign(value)
