"""The train step: functions of (model, plan, state), traced once per plan.

Three paths: no buffers and no split (`accum_steps=1`): Keras's own
`train_step`; a split without buffers: the batch is its own window, closed
by `window.close_batch`; buffers (`accum_steps > 1` or `skip_nonfinite`):
the gradient is added to the window, applied once full. Each path computes
everything into tensors first, then writes state in one place (`_write`),
so a split step that fails part-way (out of memory) writes nothing. What
each op per micro-batch costs and why it is there:
benchmarks/step_mode_ops.md.
"""

from typing import NamedTuple

import keras
import tensorflow as tf

from keras_accum import _internals as internals
from keras_accum import scaling, window
from keras_accum.engine import shared_pass
from keras_accum.normaliser import loss_normaliser, micro_batch_weight
from keras_accum.split import coupling, metrics, microbatch
from keras_accum.window import noise_scale, slices


class ComputedBatch(NamedTuple):
    """A batch with its gradients computed into tensors, nothing written yet.

    `tf.nest` flattens it in field order (split/across_replicas.py passes
    its tensors between calls).

    Attributes:
        gradients: `window.MicroBatch`, summed over the micro-batches.
        batchnorm_records: the micro-batches' moments to add to the window;
            None when they were added during the forward pass (no split).
        noise_sums: the noise scale's sums, or None when not measured.
        metric_values: the metrics' values after the batch, to write
            (split/metrics.py); None: `compute_metrics` on the batch.
    """

    x: object
    y: object
    sample_weight: object
    gradients: object
    batchnorm_records: object
    noise_sums: object
    metric_values: object = None


def train_step(model, plan, state, data):
    """One train step of `model` on `data`, as `plan` says, on `state`."""
    # Every op waits for the batch: on data of unknown length Keras calls
    # the train function once more per epoch, whose iterator fails inside
    # it, and writes that read no data (a window's count) would run first.
    with tf.control_dependencies(_tensors_of(data)):
        return _train_step(model, plan, state, data)


def _tensors_of(data):
    if tf.executing_eagerly():
        return []
    return [t for t in tf.nest.flatten(data, expand_composites=True) if isinstance(t, tf.Tensor)]


def _train_step(model, plan, state, data):
    if not plan.uses_buffers:
        if not plan.splits:
            return keras.Model.train_step(model, data)
        return batch_to_optimizer(model, plan, state, data)
    optimizer, strategy = model.optimizer, model.distribute_strategy
    if internals.replicated(strategy):
        logs = accumulate(model, plan, state, data)
        state.when_full(plan.accum_steps, lambda: window.close(state, optimizer, strategy))
        return logs
    # On one device the micro-batch that fills the window goes straight
    # into the update (`add_or_close`).
    return accumulate(
        model, plan, state, data, close=lambda last: window.close(state, optimizer, None, last)
    )


def accumulate(model, plan, state, data, gradients=None, close=None):
    """Adds `data`'s gradient to `state`'s window; the logs of Keras's train_step.

    Keras's `train_step` with the update replaced by accumulation (kept in
    step with it: _internals/fingerprints.py). `gradients`: the
    `ComputedBatch` of an earlier call (across_replicas.py). `close`: given,
    the window is closed here once full (`add_or_close`), else by the caller.
    """
    internals.build_compiled_loss(model, data)
    buffers = state.buffers
    variables = buffers.window_variables
    if variables is None:
        raise ValueError(
            "This model was not built before its train function was "
            "made, so it has no variables to accumulate gradients for. "
            "Build it (call it on a batch, or `model.build(input_shape)`) "
            "before training it outside `fit`, `train_on_batch` and "
            "`evaluate`."
        )

    def add(batch):
        options = dict(
            normalise=batch.normalise,
            variables=variables,
            statistic=plan.statistic,
            window_occurrences=lambda: _window_batches(plan, split.x),
        )
        if close is None:
            buffers.add(batch.grads, batch.weight, batch.grad_scale, **options)
        else:
            buffers.add_or_close(
                plan.accum_steps, close, batch.grads, batch.weight, batch.grad_scale, **options
            )

    noise = state.noise

    def add_measured(batch, sums):
        # Recorded first: a window closed by `add` reads them.
        if sums is not None:
            noise.record(sums)
        add(batch)

    if plan.splits:
        split = gradients or split_gradients(model, plan, state, data, variables)
        return _write(model, state, split, add_measured)
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    batch = micro_batch_gradients(model, state, x, y, sample_weight, variables)
    split = ComputedBatch(x, y, sample_weight, batch, None, _measured(state, [batch]))
    return _write(model, state, split, add_measured)


def _measured(state, parts):
    # Only a loss averaged over the batch has a mean gradient to measure.
    if state.noise is None or not parts[0].normalise:
        return None
    return noise_scale.micro_batch_sums(parts)


def _window_batches(plan, x):
    """How many of this batch a window holds at most (`accum_steps` full
    batches): from shapes, so a constant under XLA."""
    full = plan.batch_size_seen
    if full is None:
        return plan.accum_steps
    n = internals.batch_size(x)
    return plan.accum_steps * ((full + n - 1) // n)


def batch_to_optimizer(model, plan, state, data, gradients=None):
    """`accum_steps=1` with a split: the batch is its own window, closed by
    `window.close_batch`; no buffers. `gradients`: as for `accumulate`."""
    internals.build_compiled_loss(model, data)
    variables = model.trainable_variables
    split = gradients or split_gradients(model, plan, state, data, variables)

    def update(batch, sums):
        window.close_batch(state, model.optimizer, batch, sums, variables)

    return _write(model, state, split, update)


def _write(model, state, split, update):
    """The step's one state-writing tail: moments, `update(gradients,
    noise_sums)`, loss, metrics. A split batch's writes wait for all of its
    gradients."""
    batch, records = split.gradients, split.batchnorm_records
    after = [] if records is None else microbatch.control_after(batch)
    with tf.control_dependencies(after):
        if records is not None:
            state.moments.record(records)
        internals.track_loss(model, batch.loss, batch.num_samples)
        update(batch, split.noise_sums)
        if split.metric_values is not None:
            return metrics.write(model, split.metric_values)
        return model.compute_metrics(
            split.x, split.y, batch.y_pred, sample_weight=split.sample_weight
        )


def micro_batch_gradients(model, state, x, y, sample_weight, variables, records=None, live=None):
    """One forward and backward pass, as Keras's train_step makes it.

    Returns `window.MicroBatch`, weighted by what Keras normalised the
    loss by (normaliser.py), so that summing them is exact. Moments go to
    the window, or to `records`. `live` (0 or 1) multiplies the weight.
    """
    loss_scale, fold = _weight_folding(model)
    normalisers = []
    with tf.GradientTape() as tape:
        with state.moments.micro_batch(records):
            y_pred = internals.call_for_training(model, x)
        with internals.recording_loss_calls(
            model, lambda *call: normalisers.append(loss_normaliser(*call))
        ):
            loss = internals.compute_loss(model, x, y, y_pred, sample_weight)
        n = internals.batch_size(x)
        weight, normalise = micro_batch_weight(normalisers, n)
        if live is not None:
            weight = weight * live
        scaled = model.optimizer.scale_loss(loss)
        if fold:
            scaled = scaled * tf.cast(weight, loss.dtype)
    grads = tape.gradient(scaled, variables)
    grad_scale = None if fold else scaling.into_window(weight, loss_scale)
    return window.MicroBatch(grads, grad_scale, weight, normalise, loss, n, y_pred)


def _weight_folding(model):
    # The loss scale, and whether the weight is folded into the loss (one
    # scalar multiply, not one per gradient element): not under loss scaling
    # or float16, where it could overflow; the unscale carries it there.
    loss_scale = scaling.loss_scale_of(model.optimizer)
    return loss_scale, loss_scale is None and model.dtype_policy.compute_dtype != "float16"


def compute_split(model, plan, state, data):
    """The first half of a split step (across_replicas.py): the batch's
    `ComputedBatch`, nothing written but by the layers' forward passes."""
    internals.build_compiled_loss(model, data)
    if plan.uses_buffers:
        variables = state.buffers.window_variables
        if variables is None:
            # Raises the ordinary step's error: the model is not built.
            return accumulate(model, plan, state, data)
    else:
        variables = model.trainable_variables
    return split_gradients(model, plan, state, data, variables)


def write_split(model, plan, state, data, split):
    """The second half: `split` (from `compute_split`) written; the logs."""
    if plan.uses_buffers:
        return accumulate(model, plan, state, data, gradients=split)
    return batch_to_optimizer(model, plan, state, data, gradients=split)


def split_gradients(model, plan, state, data, variables):
    """The batch's gradients summed over micro-batches of `plan.split_size`,
    as a `ComputedBatch`; nothing written but by the layers' forward passes."""
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    split = list(microbatch.split((x, y, sample_weight), plan.split_size, plan.batch_size_seen))
    if plan.coupling is not None and plan.split_size is not None:
        loss_scale, fold = _weight_folding(model)
        batch, records = coupling.coupled_gradients(
            model,
            plan.coupling,
            state,
            split,
            (x, y, sample_weight),
            variables,
            fold,
            loss_scale,
            slices.exact_statistic(model.optimizer),
        )
        # No independent micro-batch gradients: no noise scale.
        return ComputedBatch(x, y, sample_weight, batch, records, None)
    records = []
    parts, total = [], None
    # One traced pass called per micro-batch (shared_pass.py), but for one
    # micro-batch (nothing to share), under XLA (one program), or under a
    # strategy: a forward pass may synchronise the replicas (a synchronized
    # BatchNormalization's `merge_call`), which a nested function refuses.
    shared = (
        len(split) > 1
        and not internals.in_xla_context()
        and not internals.replicated(model.distribute_strategy)
    )
    run = shared_pass.micro_batch_pass(micro_batch_gradients, model, state, variables, shared)
    statistic = slices.exact_statistic(model.optimizer)
    # Metrics updated micro-batch by micro-batch (split/metrics.py): no
    # micro-batch's predictions kept for them.
    metric_values = {} if metrics.by_micro_batch(model) else None

    def add_metrics(batch, part, live=None):
        nonlocal metric_values
        if metric_values is None:
            return batch
        x_k, y_k, sample_weight_k = part
        metric_values = metrics.updated(
            model, metric_values, x_k, y_k, batch.y_pred, sample_weight_k, live
        )
        return batch._replace(y_pred=None)

    for part, live in split:
        if parts:
            part = microbatch.after(total, part)
        if live is None:
            parts.append(add_metrics(run(*part, records), part))
            total = microbatch.summed(total, parts[-1], variables, statistic)
            continue
        # A stand-in past a short batch's end: weighs, counts, predicts and
        # adds nothing.
        live = tf.cast(live, tf.float32)
        first = len(records)
        step = run(*part, records, live=live)
        rows = step.num_samples * tf.cast(live, step.num_samples.dtype)
        records[first:] = [
            record._replace(count=record.count * tf.cast(live, record.count.dtype))
            for record in records[first:]
        ]
        step = add_metrics(step, part, live)
        parts.append(
            step._replace(
                loss=step.loss * tf.cast(live, step.loss.dtype),
                num_samples=rows,
                y_pred=microbatch.drop_rows(step.y_pred, rows),
            )
        )
        total = microbatch.summed(total, parts[-1], variables, statistic)
    batch = microbatch.combine(parts, microbatch.as_gradients(total))
    return ComputedBatch(
        x, y, sample_weight, batch, records, _measured(state, parts), metric_values
    )
