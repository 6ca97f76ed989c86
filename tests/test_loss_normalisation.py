"""Masked, padded, weighted and summed losses: the window divides as the big batch."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from helpers import internals
from helpers.assertions import assert_trained, assert_weights_close
from helpers.data import FEATURES, make_data, sequences
from helpers.data import SEQ_LENGTH as LENGTH
from helpers.data import SEQ_TAGS as TAGS
from helpers.data import SEQ_VOCAB as VOCAB
from helpers.models import per_sample_model, tagger, token_loss
from keras_accum import AccumModel

MICRO, N = 4, 4


def sgd():
    # Not Adam: the embeddings' sparse gradients meet Keras's per-occurrence
    # sparse Adam (see test_sparse.py), a separate matter.
    return keras.optimizers.SGD(0.5, momentum=0.9)


def train_pair(build, x, y, loss, fit_kwargs=None, optimizer=sgd):
    fit = dict(epochs=2, shuffle=False, verbose=0, **(fit_kwargs or {}))
    plain = build()
    initial = plain.get_weights()
    plain.compile(optimizer(), loss)
    plain.fit(x, y, batch_size=MICRO * N, **fit)
    acc = build(AccumModel, accum_steps=N)
    acc.compile(optimizer(), loss)
    acc.fit(x, y, batch_size=MICRO, **fit)
    assert_trained(plain, initial)
    return plain, acc


def test_masked_token_loss_divides_by_the_windows_real_tokens():
    x, y = sequences()
    plain, acc = train_pair(tagger, x, y, token_loss())
    assert_weights_close(plain, acc)


def test_masked_token_loss_with_tf_data_padded_batches():
    # Each micro-batch padded only to its own longest sequence: shapes and
    # token counts both differ between micro-batches.
    x, y = sequences()
    lengths = (x > 0).sum(axis=1)

    def dataset(batch):
        def gen():
            for tokens, tags, length in zip(x, y, lengths):
                yield tokens[:length], tags[:length]

        ds = tf.data.Dataset.from_generator(
            gen,
            output_signature=(tf.TensorSpec((None,), tf.int32), tf.TensorSpec((None,), tf.int64)),
        )
        return ds.padded_batch(batch)

    def build(cls=keras.Model, **kwargs):
        keras.utils.set_random_seed(0)
        inputs = keras.Input((None,), dtype="int32")
        h = keras.layers.Embedding(VOCAB, 8, mask_zero=True)(inputs)
        outputs = keras.layers.Dense(TAGS)(keras.layers.Dense(16, activation="tanh")(h))
        return cls(inputs, outputs, **kwargs)

    plain = build()
    plain.compile(sgd(), token_loss())
    plain.fit(dataset(MICRO * N), epochs=2, verbose=0)
    acc = build(AccumModel, accum_steps=N)
    acc.compile(sgd(), token_loss())
    acc.fit(dataset(MICRO), epochs=2, verbose=0)
    assert_weights_close(plain, acc)


def test_mean_with_sample_weight_and_uneven_weights():
    x, y = make_data(64)
    # Weights concentrated in a few micro-batches: their sums differ widely.
    sw = np.where(np.arange(64) % 16 < 3, 5.0, 0.1).astype("float32")
    plain, acc = train_pair(
        per_sample_model,
        x,
        y,
        token_loss(reduction="mean_with_sample_weight"),
        fit_kwargs={"sample_weight": sw},
    )
    assert_weights_close(plain, acc)


def test_sum_reduction_sums_over_the_window():
    x, y = make_data(60)  # uneven last window
    plain, acc = train_pair(
        per_sample_model,
        x,
        y,
        token_loss(reduction="sum"),
        optimizer=lambda: keras.optimizers.SGD(0.005, momentum=0.5),
    )
    assert_weights_close(plain, acc)


def test_masked_loss_with_regularisation():
    x, y = sequences()

    def build(cls=keras.Model, **kwargs):
        keras.utils.set_random_seed(0)
        inputs = keras.Input((LENGTH,), dtype="int32")
        h = keras.layers.Embedding(VOCAB, 8, mask_zero=True)(inputs)
        outputs = keras.layers.Dense(TAGS, kernel_regularizer=keras.regularizers.L2(0.1))(h)
        return cls(inputs, outputs, **kwargs)

    plain, acc = train_pair(build, x, y, token_loss())
    assert_weights_close(plain, acc)


def test_custom_loss_function_is_exact():
    # A plain function is wrapped by Keras with the default reduction.
    def my_loss(y_true, y_pred):
        return keras.ops.mean(keras.ops.square(y_pred - keras.ops.one_hot(y_true, 3)), axis=-1)

    x, y = make_data(58)  # the last window's micro-batches: 4, 4 and 2
    plain, acc = train_pair(per_sample_model, x, y, my_loss)
    assert_weights_close(plain, acc)


class ManualLoss:
    """A `compute_loss` override that never calls the compiled loss."""

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        target = keras.ops.one_hot(y, 3)
        return keras.ops.mean(keras.ops.square(y_pred - target))


class PlainManual(ManualLoss, keras.Model):
    pass


class AccumManual(ManualLoss, AccumModel):
    pass


def test_compute_loss_override_falls_back_to_sample_counts():
    # A per-sample mean, so sample-count weighting is exactly right here;
    # the last window's micro-batches hold 4, 4 and 2 samples.
    x, y = make_data(58)

    def build(cls=keras.Model, **kwargs):
        return per_sample_model(AccumManual if cls is AccumModel else PlainManual, **kwargs)

    plain, acc = train_pair(build, x, y, None)
    assert_weights_close(plain, acc)


def two_heads(cls=keras.Model, **kwargs):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((LENGTH,), dtype="int32")
    h = keras.layers.Embedding(VOCAB, 8, mask_zero=True)(inputs)
    tags = keras.layers.Dense(TAGS, name="tags")(h)
    pooled = keras.layers.GlobalAveragePooling1D()(h)
    length = keras.layers.Dense(1, name="length")(pooled)
    return cls(inputs, {"tags": tags, "length": length}, **kwargs)


def test_multi_output_with_proportional_normalisers_is_exact():
    x, y = make_data(64)

    def build(cls=keras.Model, **kwargs):
        keras.utils.set_random_seed(0)
        inputs = keras.Input((FEATURES,))
        h = keras.layers.Dense(8, activation="tanh")(inputs)
        return cls(
            inputs,
            {"a": keras.layers.Dense(3, name="a")(h), "b": keras.layers.Dense(1, name="b")(h)},
            **kwargs,
        )

    targets = {"a": y, "b": x[:, :1]}
    loss = {"a": token_loss(), "b": "mse"}
    plain = build()
    plain.compile(keras.optimizers.Adam(0.02), loss, loss_weights={"a": 1.0, "b": 0.5})
    plain.fit(x, targets, batch_size=16, epochs=2, shuffle=False, verbose=0)
    acc = build(AccumModel, accum_steps=4)
    acc.compile(keras.optimizers.Adam(0.02), loss, loss_weights={"a": 1.0, "b": 0.5})
    acc.fit(x, targets, batch_size=4, epochs=2, shuffle=False, verbose=0)
    assert_weights_close(plain, acc)


def test_multi_output_with_different_normalisers_uses_the_first_terms():
    # "tags" divides by real tokens, "length" by samples: no single weight per
    # micro-batch reproduces both. Documented: micro-batches are weighted by
    # the first term's normaliser (real tokens). Checked against that rule
    # computed by hand on a plain model.
    x, y = sequences(32)
    targets = {"tags": y, "length": (x > 0).sum(axis=1, keepdims=True).astype("float32") / LENGTH}
    loss = {"tags": token_loss(), "length": "mse"}
    acc = two_heads(AccumModel, accum_steps=N)
    acc.compile(keras.optimizers.SGD(0.2), loss)
    acc.fit(x, targets, batch_size=MICRO, epochs=1, shuffle=False, verbose=0)

    ref = two_heads()
    ref.compile(keras.optimizers.SGD(0.2), loss)
    ref.optimizer.build(ref.trainable_variables)
    for start in range(0, 32, MICRO * N):
        total, weight_sum = None, 0.0
        for s in range(start, start + MICRO * N, MICRO):
            xb = x[s : s + MICRO]
            tb = {k: v[s : s + MICRO] for k, v in targets.items()}
            with tf.GradientTape() as tape:
                value = ref.compute_loss(xb, tb, ref(xb, training=True))
            grads = tape.gradient(value, ref.trainable_variables)
            tokens = float((xb > 0).sum())
            scaled = [tf.convert_to_tensor(g) * tokens for g in grads]
            total = scaled if total is None else [a + b for a, b in zip(total, scaled)]
            weight_sum += tokens
        ref.optimizer.apply([g / weight_sum for g in total], ref.trainable_variables)
    assert_weights_close(ref, acc)


def test_a_fully_masked_window_gives_a_zero_gradient_like_the_big_batch():
    x, y = sequences(32)
    x[:16], y[:16] = 0, 0  # the first window is all padding
    plain, acc = train_pair(tagger, x, y, token_loss(), optimizer=lambda: keras.optimizers.SGD(0.5))
    assert all(np.isfinite(w).all() for w in acc.get_weights())
    assert_weights_close(plain, acc)


@pytest.mark.parametrize("case", ["unmasked", "masked", "sample_weight"])
@pytest.mark.unit
def test_the_normaliser_is_the_divisor_keras_applies(case):
    # mean loss x normaliser == the sum of the loss elements Keras counts:
    # exactly what makes a window divide like the big batch. (Keras needs a
    # mask of the loss elements' shape, so with a mask the divisor is the
    # number of unmasked elements.)
    rng = np.random.default_rng(0)
    tokens = np.array([[3, 1, 0, 0, 0], [2, 4, 4, 1, 0], [1, 0, 0, 0, 0], [5, 5, 5, 5, 5]])
    embedded = keras.layers.Embedding(10, 3, mask_zero=True)(tokens)  # carries a mask
    sample_weight = None
    if case == "unmasked":
        y_pred, y_true = rng.normal(size=(4, 3)).astype("float32"), np.array([0, 2, 1, 1])
        make = token_loss
    elif case == "masked":
        y_pred, y_true = embedded, tokens % 3
        make = token_loss
    else:
        y_pred, y_true = rng.normal(size=(4, 3)).astype("float32"), np.array([0, 2, 1, 1])
        sample_weight = np.array([0.5, 3.0, 0.0, 1.0], "float32")
        make = lambda **kw: token_loss(**kw)  # noqa: E731
    reduction = "mean_with_sample_weight" if case == "sample_weight" else "sum_over_batch_size"
    mean = make(reduction=reduction)
    total = make(reduction="sum")(y_true, y_pred, sample_weight)
    normaliser = internals.loss_normaliser(mean, y_true, y_pred, sample_weight)
    np.testing.assert_allclose(
        float(mean(y_true, y_pred, sample_weight)) * float(normaliser), float(total), rtol=1e-6
    )
