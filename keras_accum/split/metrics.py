"""A split batch's metrics: updated micro-batch by micro-batch, written once.

Keras updates compiled metrics once a batch, on the batch's predictions. A
split step that kept every micro-batch's predictions for them held, for a
language model, batch x tokens x vocabulary floats: the step's largest tensor
(the transformer benchmark at B = 256, m = 8: 121 MB with
`metrics=["accuracy"]` against 21.5 MB without). Keras's metrics accumulate
sums and counts, so updating them micro-batch by micro-batch gives the
batch's values, as step mode's one micro-batch a step does. Each update is
made in a `keras.StatelessScope` on the values so far (nothing is written),
and the micro-batch's predictions are freed; the step writes the last values
with the rest of its state, once every micro-batch has run, so a step that
fails part-way still writes nothing. A model that overrides `compute_metrics`
gets the whole batch, as before.
"""

import keras
import tensorflow as tf


def by_micro_batch(model):
    """Whether `model`'s metrics are updated micro-batch by micro-batch:
    unless it overrides `compute_metrics`, which gets the whole batch."""
    return type(model).compute_metrics is keras.Model.compute_metrics


def updated(model, values, x, y, y_pred, sample_weight, live=None):
    """`values` (what the micro-batches so far wrote to the metrics, by
    `id` of each of `model.metrics_variables`) after `compute_metrics` on one
    more micro-batch, nothing written. `live` (a stand-in past a short
    batch's end: its one row, not live) False keeps them as they were: an
    update on no rows is NaN for a metric of a batch-level mean.

    Example:
        values = {}  # none written yet
        for x, y, y_pred, sample_weight in micro_batches:
            values = updated(model, values, x, y, y_pred, sample_weight)
        logs = write(model, values)  # once, with the step's other writes
    """
    mapping = [(v, values[id(v)]) for v in model.metrics_variables if id(v) in values]
    with keras.StatelessScope(state_mapping=mapping) as scope:
        model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
    values = dict(values)
    # Read again: metrics built by this first update are among them now.
    for variable in model.metrics_variables:
        value = scope.get_current_value(variable)
        if value is None:
            continue
        if live is not None:
            before = values.get(id(variable), variable.value)
            value = tf.where(tf.cast(live, tf.bool), value, before)
        values[id(variable)] = value
    return values


def write(model, values):
    """Writes `values` (from `updated`) to the metrics; their logs, as
    `compute_metrics` returns them."""
    for variable in model.metrics_variables:
        if id(variable) in values:
            variable.assign(values[id(variable)])
    return model.get_metrics_result()
