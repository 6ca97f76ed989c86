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

The first pass runs in a `keras.StatelessScope`, so what it would write
(random seeds, moving statistics) is dropped: the second pass starts from
the same state, dropout draws the same masks in both passes and the
gradient is exactly the big batch's with those masks; stateful layers
update once, in the second pass, as in an ordinary split.

A subclassed model has no layer graph to split: it defines `represent`
(inputs to representations) and `couple` (representations to outputs),
and `coupled_from="methods"` splits it there.

Example:

```python
model = keras_accum.AccumModel(
    [queries, items], logits, micro_batch_size=32,
    coupled_from=["query_repr", "item_repr"],
)
```
"""

import inspect

import keras
import numpy as np
import tensorflow as tf
from keras import tree

from keras_accum import _internals as internals
from keras_accum import scaling
from keras_accum.split import microbatch
from keras_accum.arguments import AUTO, METHODS, shown_coupled_from
from keras_accum.normaliser import loss_normaliser, micro_batch_weight


class Coupling:
    """Where a model's batch couples: its two parts.

    Made once per model and `coupled_from` (`Coupling.of`), eagerly; read
    by the traced step. Not a layer: its parts share the model's layers and
    weights, and nothing of it is saved (`coupled_from` is, in the config).

    Attributes:
        coupled_from: the setting it was made for: the layer names (a tuple),
            or "methods".
        per_sample: called as `per_sample(inputs, training=True)`: the
            representations (a tensor, or a list, tuple or dict of them).
        coupled: called as `coupled(representations, training=True)`: the
            model's outputs.

    Example:

    ```python
    coupling = Coupling.of(model, ("query_repr", "item_repr"))
    representations = coupling.per_sample(x, training=True)
    y_pred = coupling.coupled(representations, training=True)
    ```
    """

    def __init__(self, coupled_from, per_sample, coupled):
        self.coupled_from = coupled_from
        self.per_sample = per_sample
        self.coupled = coupled

    @classmethod
    def of(cls, model, coupled_from):
        """The `Coupling` of `model` at `coupled_from` (checked by
        `arguments.check_coupled_from`); raises a ValueError, naming what is
        wrong, if it does not split the model."""
        if coupled_from == METHODS:
            return cls._of_methods(model)
        return cls._of_layers(model, coupled_from)

    @classmethod
    def _of_methods(cls, model):
        # A subclassed model has no graph to cut: it says where its batch
        # couples itself, in the two methods its `call` is made of.
        missing = [name for name in ("represent", "couple")
                   if not callable(getattr(model, name, None))]
        if missing:
            raise ValueError(
                "`coupled_from='methods'` splits the model at its `represent` "
                f"and `couple` methods, and {type(model).__name__} has no "
                f"{' or '.join(f'`{name}`' for name in missing)}. Define "
                "`represent(self, inputs, training=None)`, returning the "
                "per-sample representations, and `couple(self, "
                "representations, training=None)`, returning the model's "
                "outputs from them, so that `call` is "
                "`self.couple(self.represent(inputs, training), training)`. "
                "(For a layer named 'methods', pass `coupled_from=['methods']`.)"
            )
        return cls(METHODS, _Called(model.represent), _Called(model.couple))

    @classmethod
    def _of_layers(cls, model, names):
        if not isinstance(model, internals.Functional):
            raise ValueError(
                f"`coupled_from={list(names)}` needs a functional model (made "
                "from `keras.Input`s, or a `Sequential` or functional model "
                f"given to `wrap`), to split it at those layers. Received a "
                f"{type(model).__name__}. Build the model functionally, or "
                "give it `represent` and `couple` methods and pass "
                "`coupled_from='methods'`."
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
            _runs_on_its_inputs(coupled, outputs)
        except (ValueError, KeyError) as error:
            raise ValueError(
                f"The layers `coupled_from={list(names)}` do not split the "
                "model: an input reaches its output without passing through "
                "them, so part of the model would see one micro-batch where "
                "the big batch sees the whole batch. Name every layer whose "
                "output carries a sample's representation to the coupled "
                f"part. (Keras: {error})"
            ) from error
        mixing = _layer_that_mixes_samples(per_sample)
        if mixing is not None:
            raise ValueError(
                f"The layer {mixing!r}, upstream of `coupled_from="
                f"{list(names)}`, mixes the samples of a batch: a sample's "
                "output from it changed when another sample was in the batch "
                "(tried on made-up samples, in inference mode). Upstream of "
                "the coupling layers, each micro-batch sees its own samples "
                "only, so this layer would see a micro-batch where the big "
                "batch sees the whole batch. Move it downstream of the "
                "coupling layers (name the layers before it in "
                "`coupled_from`), or make it per sample."
            )
        return cls(names, per_sample, coupled)


def _runs_on_its_inputs(coupled, representations):
    # Keras 3.8 makes a model whose outputs need more than its inputs, and
    # fails only when it runs, with a KeyError for the tensor it lacks (later
    # releases raise a ValueError when it is made): run it once, on made-up
    # representations, writing nothing. Any other failure of made-up inputs
    # is not this one, and is left for training to show.
    try:
        with keras.StatelessScope():
            coupled([_made_up(r, rows=2) for r in representations], training=False)
    except Exception as error:  # noqa: BLE001 - only a missing input: see above
        if isinstance(error, KeyError):
            raise


def _layer_that_mixes_samples(per_sample):
    # The first layer (in the graph's order) whose output for one sample
    # depends on the others of its batch: a batch of two made-up samples
    # against the first alone. Inference mode, so that dropout draws
    # nothing and BatchNormalization uses its moving statistics (in
    # training it normalises each micro-batch by its own, as any split
    # does: docs/contrastive.md). A made-up batch the model cannot take (a
    # lookup's vocabulary, a fixed length) leaves the check undone: it only
    # names a mistake earlier than training would show it.
    layers = [layer for layer in per_sample.layers
              if not isinstance(layer, keras.layers.InputLayer)]
    probed = [(layer, internals.output_of_its_call(layer)) for layer in layers]
    probed = [(layer.name, output) for layer, output in probed
              if output is not None and len(tree.flatten(output)) == 1]
    if not probed:
        return None
    try:
        probe = keras.Model(per_sample.input, [output for _, output in probed])
        batch = tree.map_structure(lambda spec: _made_up(spec, rows=2), per_sample.input)
        alone = tree.map_structure(lambda t: t[:1], batch)
        # Each call from the same state: a layer random even in inference
        # (Monte Carlo dropout) draws the same numbers in each, and one
        # that still disagrees with itself is not judged.
        outputs = []
        for inputs in (batch, alone, alone):
            with keras.StatelessScope():
                outputs.append([np.asarray(o, np.float64) for o in probe(inputs, training=False)])
    except Exception:  # noqa: BLE001 - see above: the check is left undone
        return None
    for (name, _), together, alone, again in zip(probed, *outputs):
        together = together[:1]
        if together.shape != alone.shape or not np.array_equal(alone, again, equal_nan=True):
            continue
        # Relative to the output's scale: a batch of two and a batch of one
        # may run different kernels (float noise); mixing moves it by O(1).
        scale = max(np.max(np.abs(alone), initial=0), 1e-6)
        if np.max(np.abs(together - alone), initial=0) > 1e-2 * scale:
            return name
    return None


def _made_up(spec, rows):
    # Samples for an input of `spec`'s shape and dtype: unknown sizes 3,
    # integers 1 or 2 (valid ids for any lookup but an empty one).
    shape = [rows] + [3 if size is None else size for size in spec.shape[1:]]
    rng = np.random.default_rng(0)
    if "int" in str(spec.dtype):
        return rng.integers(1, 3, size=shape).astype(spec.dtype)
    if "bool" in str(spec.dtype):
        return rng.integers(0, 2, size=shape).astype(bool)
    return rng.normal(size=shape).astype(spec.dtype)


class _Called(keras.layers.Layer):
    """A model's `represent` or `couple` method, called as a layer is: the
    layers it calls without a `training` argument then read it from the
    call, as they do inside the model's `call` (Dropout drops, BatchNorm
    uses the batch's statistics). Holds no weights; not tracked by the
    model (made by `Coupling`, which nothing saves)."""

    def __init__(self, method):
        # No casting of the inputs: the method's layers cast their own.
        super().__init__(name=f"{method.__name__}_call", autocast=False)
        self.method = method
        self.passes_training = "training" in inspect.signature(method).parameters
        self.built = True

    def call(self, inputs, training=None):
        if self.passes_training:
            return self.method(inputs, training=training)
        return self.method(inputs)


def check_strategy(settings, strategy):
    """Raises if `coupled_from` cannot train under `strategy` as set."""
    several = strategy.num_replicas_in_sync > 1 or internals.multi_worker(strategy)
    if several and settings.micro_batch_size == AUTO:
        raise ValueError(
            f"`coupled_from={shown_coupled_from(settings.coupled_from)!r}` with "
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
    # 1. Representations, micro-batch by micro-batch, no tape kept. What
    # the pass would write (random seeds, moving statistics) stays in the
    # scope, so pass 3 starts from the same state and draws the same masks.
    representations, rows = [], []
    with keras.StatelessScope():
        for (x_k, _, _), live in parts:
            if representations:
                x_k = microbatch.after(representations[-1], x_k)
            output = coupling.per_sample(x_k, training=True)
            reps = [tf.stop_gradient(r) for r in tree.flatten(output)]
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
            y_pred = coupling.coupled(tree.pack_sequence_as(output, whole), training=True)
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
    # 3. Each micro-batch again, under a tape.
    start, previous = 0, upstream
    for ((x_k, _, _), live), kept in zip(parts, rows):
        x_k = microbatch.after(previous, x_k)
        first = len(records)
        with tf.GradientTape() as tape:
            with state.moments.micro_batch(records):
                reps = tree.flatten(coupling.per_sample(x_k, training=True))
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
        # Gathered from a copy made in the replica: a tensor from outside
        # it (the batch's `y` from the dataset) has no device, and
        # MultiWorkerMirroredStrategy gathers to the tensor's device.
        return tree.map_structure(
            lambda t: None if t is None else self.context.all_gather(tf.identity(t), axis=0),
            values,
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
