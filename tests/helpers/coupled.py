"""The two-tower contrastive model of the `coupled_from` tests (test_coupled.py,
and the cluster's workers: tests/scripts/cluster_checks.py): its layers, its
losses and its data."""

import keras
import numpy as np
import tensorflow as tf

from helpers.models import Gate
from helpers.oom import Limit

FEATURES, DIM = 6, 8
# 92 samples at batch 32: 32, 32 and a short 28, split into micro-batches
# of 8 (the last batch 8 + 8 + 8 + 4).
SAMPLES, BATCH, MICRO = 92, 32, 8
FIT = dict(batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
TOWERS = ["query_repr", "item_repr"]


class InBatchSoftmax(keras.losses.Loss):
    """Each query's item is the positive; every other item of the batch a
    negative: the loss couples the whole batch."""

    def call(self, y_true, y_pred):
        labels = tf.range(tf.shape(y_pred)[0])
        return keras.losses.sparse_categorical_crossentropy(labels, y_pred, from_logits=True)


class Similarity(keras.layers.Layer):
    """Every query against every item of the batch; with `scale`, cosine
    similarities times a trainable logit scale (CLIP's)."""

    def __init__(self, scale=False, **kwargs):
        super().__init__(**kwargs)
        self.scale = scale

    def build(self, shapes):
        if self.scale:
            self.logit_scale = self.add_weight(
                shape=(), initializer=keras.initializers.Constant(1.0), name="logit_scale"
            )

    def call(self, inputs):
        queries, items = inputs
        if self.scale:
            queries = tf.math.l2_normalize(queries, axis=-1)
            items = tf.math.l2_normalize(items, axis=-1)
        logits = tf.matmul(queries, items, transpose_b=True)
        return logits * tf.exp(self.logit_scale) if self.scale else logits

    def get_config(self):
        return {**super().get_config(), "scale": self.scale}


class Clip(keras.losses.Loss):
    """CLIP's symmetric loss: queries to items and items to queries."""

    def call(self, y_true, y_pred):
        labels = tf.range(tf.shape(y_pred)[0])
        rows = keras.losses.sparse_categorical_crossentropy(labels, y_pred, from_logits=True)
        columns = keras.losses.sparse_categorical_crossentropy(
            labels, tf.transpose(y_pred), from_logits=True
        )
        return (rows + columns) / 2


class BatchCentre(keras.layers.Layer):
    """Subtracts the batch's mean: each sample's output reads the others."""

    def call(self, inputs):
        return inputs - tf.reduce_mean(inputs, axis=0, keepdims=True)


def two_tower(
    cls=keras.Model,
    scale=False,
    dropout=0.0,
    batchnorm=False,
    limit=None,
    centre=False,
    gate=False,
    **kwargs,
):
    """Query and item towers, their representations compared by `Similarity`.
    The item representation has no bias: the loss is blind to a shift of
    every item alike, so its gradient is zero and Adam would amplify float
    noise in it."""
    keras.utils.set_random_seed(1)
    queries = keras.Input((FEATURES,), name="queries")
    items = keras.Input((FEATURES,), name="items")
    h = queries
    if batchnorm:
        h = keras.layers.BatchNormalization(name="query_bn")(h)
    h = keras.layers.Dense(16, activation="relu", name="query_hidden")(h)
    if limit is not None:
        h = Limit(limit)(h)
    if dropout:
        h = keras.layers.Dropout(dropout)(h)
    if centre:
        h = BatchCentre(name="batch_centre")(h)
    if gate:
        h = Gate(name="query_gate")(h)
    q = keras.layers.Dense(DIM, name="query_repr")(h)
    i = keras.layers.Dense(DIM, use_bias=False, name="item_repr")(
        keras.layers.Dense(16, activation="relu", name="item_hidden")(items)
    )
    logits = Similarity(scale, name="similarity")([q, i])
    return cls([queries, items], logits, **kwargs)


def data(seed=0):
    rng = np.random.default_rng(seed)
    queries = rng.normal(size=(SAMPLES, FEATURES)).astype("float32")
    items = (queries @ rng.normal(size=(FEATURES, FEATURES))).astype("float32")
    items += 0.5 * rng.normal(size=items.shape).astype("float32")
    return [queries, items], np.zeros((SAMPLES,), "float32")
