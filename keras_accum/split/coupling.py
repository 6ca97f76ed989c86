"""Batch-coupled losses: the big batch's gradient with the micro-batch's memory.

A contrastive loss (CLIP's, SigLIP's, InfoNCE, a two-tower softmax) reads every
sample of the batch. `coupled_from` names the layers whose outputs are the
per-sample representations (or "methods": a subclassed model's `represent` and
`couple`): upstream runs per micro-batch, downstream once on the whole batch,
and `coupled_gradients` makes the big batch's gradient exactly, as GradCache
(Gao et al. 2021) does.
"""

import inspect

import keras
import numpy as np
import tensorflow as tf
from keras import tree

from keras_accum import _internals as internals
from keras_accum import scaling
from keras_accum.arguments import AUTO, METHODS, shown_coupled_from
from keras_accum.normaliser import loss_normaliser, micro_batch_weight
from keras_accum.split import microbatch
from keras_accum.window import MicroBatch


class Coupling:
    """Where a model's batch couples: `per_sample(inputs, training=True)` gives
    the representations, `coupled(representations, training=True)` the outputs.
    Not a layer: its parts share the model's layers; nothing of it is saved."""

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
        # A subclassed model has no graph to cut: its two methods say where.
        missing = [
            name for name in ("represent", "couple") if not callable(getattr(model, name, None))
        ]
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
    # Keras 3.8 makes a model whose outputs need more than its inputs and fails
    # only when run (KeyError): run it on made-up representations, writing nothing.
    try:
        with keras.StatelessScope():
            coupled([_made_up(r, rows=2) for r in representations], training=False)
    except Exception as error:  # noqa: BLE001 - only a missing input: see above
        if isinstance(error, KeyError):
            raise


def _layer_that_mixes_samples(per_sample):
    # The first layer whose output for a sample depends on the others of its
    # batch, in inference mode (no dropout; moving statistics). A made-up batch
    # the model cannot take leaves the check undone: it only names a mistake early.
    layers = [
        layer for layer in per_sample.layers if not isinstance(layer, keras.layers.InputLayer)
    ]
    probed = [(layer, internals.output_of_its_call(layer)) for layer in layers]
    probed = [
        (layer.name, output)
        for layer, output in probed
        if output is not None and len(tree.flatten(output)) == 1
    ]
    if not probed:
        return None
    try:
        probe = keras.Model(per_sample.input, [output for _, output in probed])
        batch = tree.map_structure(lambda spec: _made_up(spec, rows=2), per_sample.input)
        alone = tree.map_structure(lambda t: t[:1], batch)
        # Each call from the same seeds: a layer random even in inference
        # (Monte Carlo dropout) draws alike; one unlike itself is not judged.
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
    # Unknown sizes 3; integers 1 or 2, valid ids for any lookup but an empty one.
    shape = [rows] + [3 if size is None else size for size in spec.shape[1:]]
    rng = np.random.default_rng(0)
    if "int" in str(spec.dtype):
        return rng.integers(1, 3, size=shape).astype(spec.dtype)
    if "bool" in str(spec.dtype):
        return rng.integers(0, 2, size=shape).astype(bool)
    return rng.normal(size=shape).astype(spec.dtype)


class _Called(keras.layers.Layer):
    """A model's `represent` or `couple` method called as a layer is, so that
    layers it calls without `training` read it from the call, as inside `call`.
    Holds no weights; not tracked by the model."""

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


def coupled_gradients(
    model, coupling, state, parts, batch, variables, fold, loss_scale, statistic=None
):
    """The whole batch's `MicroBatch` from its micro-batches `parts`,
    and the BatchNormalization records of its coupled part and micro-batches.
    `statistic`: as `microbatch.summed`'s (a sparse gradient past two tables
    summed by row; None keeps every occurrence).

    Passes: each micro-batch without a tape; the coupled part and the loss once,
    under a tape (its weights' gradient and each representation's); each
    micro-batch again, backpropagating its rows of that gradient.
    """
    x, y, sample_weight = batch
    parts = list(parts)
    # 1. No tape. What it would write (seeds, moving statistics) stays in the
    # scope: pass 3 draws the same dropout masks, stateful layers update once.
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
    # 2. The coupled part and the loss, once, on the global batch (every replica).
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
    # Each part weighted (and cast to its sum's dtype) before it is summed,
    # as `microbatch.summed` sums: row sums of half-precision occurrences
    # would square them in half precision.
    grad_scale = None if fold else scaling.into_window(weight, loss_scale)
    grads = [scaling.scaled(g, grad_scale) for g in grads]
    # 3. Each micro-batch again, under a tape.
    start, previous = 0, upstream
    for ((x_k, _, _), live), kept in zip(parts, rows):
        x_k = microbatch.after(previous, x_k)
        first = len(records)
        with tf.GradientTape() as tape:
            with state.moments.micro_batch(records):
                reps = tree.flatten(coupling.per_sample(x_k, training=True))
            surrogate = tf.add_n(
                [
                    tf.reduce_sum(r * tf.cast(_rows_of(u, start, kept, r), r.dtype))
                    for r, u in zip(reps, upstream)
                ]
            )
        if live is not None:
            # A stand-in past a short batch's end adds no moments.
            records[first:] = [
                record._replace(count=record.count * tf.cast(live, record.count.dtype))
                for record in records[first:]
            ]
        part = [scaling.scaled(g, grad_scale) for g in tape.gradient(surrogate, variables)]
        # The next micro-batch waits for the sum so far (microbatch.summed).
        grads = previous = [_sum(g, p, statistic, v) for g, p, v in zip(grads, part, variables)]
        start = start + kept
    gradients = MicroBatch(
        microbatch.as_gradients(grads),
        None,
        weight,
        normalise,
        loss,
        internals.batch_size(x),
        replicas.own_rows(y_pred),
    )
    return gradients, records


class _Replicas:
    """This replica's rows of the global batch under several replicas: the
    coupled part sees every replica's representations (as CLIP's training
    gathers them), each replica its own rows of the gradient. One: identity."""

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
        # A copy made in the replica: MultiWorkerMirroredStrategy gathers to the
        # tensor's device, and one from outside the replica has none.
        return tree.map_structure(
            lambda t: None if t is None else self.context.all_gather(tf.identity(t), axis=0),
            values,
        )

    def own_rows(self, values):
        if self.count == 1:
            return values
        return microbatch.drop_rows(
            tree.map_structure(lambda t: None if t is None else t[self.start :], values),
            self.rows,
        )

    def own_rows_of_gradient(self, upstream):
        # Keras divides each replica's loss (the global batch's) by the replicas:
        # a representation's gradient comes from one replica only, so multiply back.
        if self.count == 1:
            return upstream
        return [u[self.start : self.start + self.rows] * self.count for u in upstream]


def _sum(a, b, statistic, variable):
    if a is None or b is None:
        return b if a is None else a
    return microbatch.add_gradients(a, b, statistic, microbatch.table_rows(variable))


def _rows_of(upstream, start, kept, reps):
    # A stand-in past a short batch's end (kept 0) gets zeros for its one row.
    mine = upstream[start : start + kept]
    padding = tf.zeros_like(upstream[:1])[: tf.shape(reps)[0] - kept]
    return tf.concat([mine, padding], 0)
