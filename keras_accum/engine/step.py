"""The train step: functions of (model, plan, state), traced once per plan.

`train_step(model, plan, state, data)` is `AccumModel.train_step`: the
model hands in its step plan (plan.py), read as Python constants, and its
`AccumState` (window/state.py). The step takes one of three paths:

- no buffers, no split (`accum_steps=1`): Keras's own `train_step`;
- no buffers, split (`micro_batch_size` with `accum_steps=1`): the batch
  is its own window, its gradient summed over its micro-batches and
  applied by the window's rule (`window.close_batch`);
- buffers (`accum_steps > 1` or `skip_nonfinite`): the micro-batch's (or
  split batch's) gradient added to the window, which is applied once full.

Each path computes everything into tensors first and then writes state in
one place, `_write`: BatchNormalization moments, the window or optimizer
update, the loss tracker, the metrics. When the batch is split, every write
waits for all micro-batches' gradients, so a step that fails part-way (out
of memory) writes nothing.

Per micro-batch, beyond what Keras's built-in accumulation runs (its
forward and backward pass, loss, loss tracker and metrics are the same),
the buffered path runs, each for the reason given (measured, with the
traced graphs, in benchmarks/step_mode_ops.md):

- the loss normaliser of each compiled loss term (normaliser.py), read
  while Keras computes the loss: the micro-batch's weight, which makes an
  uneven or masked window exact (Grappler merges the repeated loss with
  Keras's own: a `Size` and a `Cast` remain);
- the weight folded into the scalar loss, two scalar multiplies (under loss
  scaling or float16, one multiply per gradient element instead, which
  also unscales): the buffers hold `weight * gradient`;
- one in-place `assign_add` per variable into its buffer: the window's
  sum, the same memory traffic as the built-in's read, add and assign.
  A sparse gradient's slices are appended instead (two scatters), or,
  once the window holds more occurrences than the table has rows, added
  to its per-row sums (three scatter-adds: sum, statistic, count):
  what makes Keras's occurrence-wise sparse update exact (window/slices.py);
- `window_weight += weight`, `micro_step += 1` and the `normalise` flag,
  three scalar writes: the window's divisor, its position (so that
  `optimizer.iterations` counts updates) and its arithmetic, so that a
  window restored from a file is finished as it began;
- one `tf.cond` on `micro_step + 1 >= accum_steps`, as Keras's own: on
  one device the micro-batch that fills the window is not added but read
  with the buffers' sum by the update (`add_or_close`: added and read back,
  the two ran one after the other and the update micro-batch took 1.12x
  the built-in's); the executor visits the branch, untaken, at every
  micro-batch: nothing per variable in it but the update itself (no
  conditional per buffer: buffers.py). Across replicas the window is
  added to, then closed in cross-replica context.

Example:

```python
class AccumModel(keras.Model):
    def train_step(self, data):
        return step.train_step(self, self._step_plan(), self._accum_state, data)
```
"""

from typing import NamedTuple

import keras
import tensorflow as tf

from keras_accum import _internals as internals
from keras_accum import scaling, window
from keras_accum.split import coupling
from keras_accum.split import microbatch
from keras_accum.normaliser import loss_normaliser, micro_batch_weight
from keras_accum.window import noise_scale


class SplitBatch(NamedTuple):
    """A batch's gradients, computed into tensors and not yet written.

    What `split_gradients` returns and `_write` writes (`tf.nest` flattens
    it in field order: auto_replicas.py passes its tensors between calls).

    Attributes:
        x, y, sample_weight: the batch, as Keras unpacks it.
        gradients: `microbatch.Gradients`, summed over the micro-batches.
        batchnorm_records: the micro-batches' BatchNormalization moments,
            a list of `BatchNormRecord` to be added to the window; None when
            they were added as the forward pass ran (no split).
        noise_sums: the noise scale's sums over the micro-batches; None when
            it is not measured.
    """

    x: object
    y: object
    sample_weight: object
    gradients: object
    batchnorm_records: object
    noise_sums: object


def train_step(model, plan, state, data):
    """One train step of `model` on `data`, as its `plan` says (see above);
    `state`: the model's `AccumState`."""
    # Every op of the step waits for the batch. On a data set of unknown
    # length Keras calls the train function once more per epoch and its
    # iterator fails inside it ("ran out of data"); in a graph, the step's
    # writes that read no data (a window's count, a reset) ran before that
    # and a window's gradients were lost (SGD weights 0.036 from the same
    # data of known length).
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

    `TensorFlowTrainer.train_step` with the update replaced by accumulation
    (keep in step with it: see the internals' fingerprints). `gradients`:
    the `SplitBatch` `split_gradients` returned for `data`, computed in an
    earlier call (auto_replicas.py), else computed here. `close`: given,
    the window is closed here once full, by `close(last)`
    (`GradientAccumulator.add_or_close`); else by the caller.
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
    split = SplitBatch(x, y, sample_weight, batch, None, _measured(state, [batch]))
    return _write(model, state, split, add_measured)


def _measured(state, parts):
    # The noise scale's per-micro-batch sums, when measured (noise_scale.py):
    # of losses averaged over the batch only (a sum has no mean gradient).
    if state.noise is None or not parts[0].normalise:
        return None
    return noise_scale.micro_batch_sums(parts)


def _window_batches(plan, x):
    """How many of this batch a window holds at most: `accum_steps` full
    (first-seen) batches. Derived from shapes, so a constant under XLA."""
    full = plan.batch_size_seen
    if full is None:
        return plan.accum_steps
    n = internals.batch_size(x)
    return plan.accum_steps * ((full + n - 1) // n)


def batch_to_optimizer(model, plan, state, data, gradients=None):
    """`accum_steps=1` with a split: the batch is its own window, its
    gradient (summed over its micro-batches) applied by the window's rule
    (`window.close_batch`); no buffers. `gradients`: as for `accumulate`."""
    internals.build_compiled_loss(model, data)
    variables = model.trainable_variables
    split = gradients or split_gradients(model, plan, state, data, variables)

    def update(batch, sums):
        window.close_batch(state, model.optimizer, batch, sums, variables)

    return _write(model, state, split, update)


def _write(model, state, split, update):
    """The step's one state-writing tail: BatchNormalization records,
    `update(gradients, noise_sums)`, loss, metrics, for the `SplitBatch`
    `split`. With records (a split batch's, deferred), every write waits for
    all of the batch's gradients."""
    batch, records = split.gradients, split.batchnorm_records
    after = [] if records is None else microbatch.control_after(batch)
    with tf.control_dependencies(after):
        if records is not None:
            state.moments.record(records)
        internals.track_loss(model, batch.loss, batch.num_samples)
        update(batch, split.noise_sums)
        return model.compute_metrics(
            split.x, split.y, batch.y_pred, sample_weight=split.sample_weight
        )


def micro_batch_gradients(
    model, state, x, y, sample_weight, variables, records=None, live=None
):
    """One forward and backward pass, as Keras's train_step makes it.

    Returns `microbatch.Gradients`: the gradients and the weight (what
    Keras normalised the loss by) that make them exact to sum.
    BatchNormalization moments go to the window, or to the list `records`
    to be recorded later. `live` (a 0/1 float tensor) multiplies the
    weight: 0 makes the gradient exactly zero.
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
    return microbatch.Gradients(grads, grad_scale, weight, normalise, loss, n, y_pred)


def _weight_folding(model):
    # The optimizer's loss scale, and whether the micro-batch's weight is
    # folded into the loss: one scalar multiply instead of one per gradient
    # element where that is safe. Not under loss scaling or float16, where
    # it could overflow float16 gradients; there the (then needed anyway)
    # per-element unscale carries it.
    loss_scale = scaling.loss_scale_of(model.optimizer)
    return loss_scale, loss_scale is None and model.dtype_policy.compute_dtype != "float16"


def compute_split(model, plan, state, data):
    """The first half of a split step (auto_replicas.py): the batch's
    `SplitBatch` as the plan splits it, no state written but by the layers'
    forward passes."""
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
    """The second half: `split` (what `compute_split` returned for `data`)
    written as the ordinary step writes it; the logs."""
    if plan.uses_buffers:
        return accumulate(model, plan, state, data, gradients=split)
    return batch_to_optimizer(model, plan, state, data, gradients=split)


def split_gradients(model, plan, state, data, variables):
    """The batch's summed gradients from micro-batches of `plan.split_size`
    samples, in tensors; no state is written but by the layers' forward
    passes. Returns a `SplitBatch`."""
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    split = microbatch.split((x, y, sample_weight), plan.split_size, plan.batch_size_seen)
    if plan.coupling is not None and plan.split_size is not None:
        loss_scale, fold = _weight_folding(model)
        batch, records = coupling.coupled_gradients(
            model, plan.coupling, state, split, (x, y, sample_weight), variables,
            fold, loss_scale,
        )
        # A coupled loss has no independent micro-batch gradients: no
        # noise scale (refused with `coupled_from`).
        return SplitBatch(x, y, sample_weight, batch, records, None)
    records = []
    parts, total = [], None
    for part, live in split:
        if parts:
            part = microbatch.after(total, part)
        if live is None:
            parts.append(micro_batch_gradients(model, state, *part, variables, records))
            total = microbatch.summed(total, parts[-1])
            continue
        # A stand-in past a short batch's end: weighs nothing, counts no
        # sample, predicts no row, adds no BatchNormalization moments.
        live = tf.cast(live, tf.float32)
        first = len(records)
        step = micro_batch_gradients(model, state, *part, variables, records, live=live)
        rows = step.num_samples * tf.cast(live, step.num_samples.dtype)
        records[first:] = [
            record._replace(count=record.count * tf.cast(live, record.count.dtype))
            for record in records[first:]
        ]
        parts.append(
            step._replace(
                loss=step.loss * tf.cast(live, step.loss.dtype),
                num_samples=rows,
                y_pred=microbatch.drop_rows(step.y_pred, rows),
            )
        )
        total = microbatch.summed(total, parts[-1])
    return SplitBatch(
        x, y, sample_weight, microbatch.combine(parts, total), records, _measured(state, parts)
    )
