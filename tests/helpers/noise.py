"""The gradient noise scale computed from per-example gradients, in numpy:
what `noise_scale=True` must log (its estimator on the same windows), and
what that estimator estimates.

A model whose weights do not move (learning rate 0) has one gradient per
example; every micro-batch's and window's gradient is a mean of them, so the
estimator of McCandlish et al. (appendix A) can be evaluated exactly for any
partition of the data into windows and micro-batches.
"""

import keras
import numpy as np
import tensorflow as tf


def regression_data(n, noise, features=6, seed=0):
    """`y = x w + noise * e`: the noise level sets the noise scale."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, features)).astype("float32")
    w = rng.normal(size=(features, 1)).astype("float32")
    y = (x @ w + noise * rng.normal(size=(n, 1))).astype("float32")
    return x, y


def regression_net(cls=keras.Model, features=6, hidden=0, seed=1, **kwargs):
    """A linear (or one-hidden-layer) regression net, compiled at lr 0."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((features,))
    h = inputs
    if hidden:
        h = keras.layers.Dense(hidden, activation="tanh")(h)
    outputs = keras.layers.Dense(1)(h)
    model = cls(inputs, outputs, **kwargs)
    model.compile(keras.optimizers.SGD(0.0), "mse")
    return model


def embedding_data(n, vocab, seed=4):
    """Sequences of 5 ids from `vocab` rows, and targets far from the
    initial predictions (a clear signal |G|^2)."""
    rng = np.random.default_rng(seed)
    x = rng.integers(0, vocab, size=(n, 5)).astype("int32")
    y = (3.0 + rng.normal(size=(n, 1))).astype("float32")
    return x, y


def embedding_net(cls, vocab, seed=2, **kwargs):
    """Embedding (sparse gradient), average pooling and Dense 1, compiled
    at lr 0."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((5,), dtype="int32")
    h = keras.layers.Embedding(vocab, 4)(inputs)
    h = keras.layers.GlobalAveragePooling1D()(h)
    outputs = keras.layers.Dense(1)(h)
    model = cls(inputs, outputs, **kwargs)
    model.compile(keras.optimizers.SGD(0.0), "mse")
    return model


def per_example_gradients(model, x, y, loss=None):
    """One row per example: its loss's gradient over every trainable
    variable, flattened (dense rows for an embedding's)."""
    loss = loss or (lambda y_true, y_pred: tf.reduce_mean(tf.square(y_pred - y_true), -1))
    variables = model.trainable_variables
    with tf.GradientTape() as tape:
        losses = loss(y, model(x, training=True))
    jacobians = tape.jacobian(losses, variables)
    n = len(x) if not isinstance(x, (list, tuple)) else len(x[0])
    return np.concatenate([np.asarray(j, np.float64).reshape(n, -1) for j in jacobians], axis=1)


def windows_of(n, batch_size, accum_steps=1, micro_batch_size=None, replicas=1):
    """The micro-batches (index arrays) of each window of one epoch of `fit`
    on `n` samples in order: `accum_steps` batches per window (the last one
    shorter), each batch split evenly over `replicas`, then into
    `micro_batch_size` pieces."""
    batches = [np.arange(s, min(s + batch_size, n)) for s in range(0, n, batch_size)]
    windows = []
    for first in range(0, len(batches), accum_steps):
        window = []
        for batch in batches[first : first + accum_steps]:
            assert len(batch) % replicas == 0, "uneven replica shares"
            for share in np.split(batch, replicas):
                size = micro_batch_size or len(share)
                window.extend(share[s : s + size] for s in range(0, len(share), size))
        windows.append(window)
    return windows


def estimate(grads, windows):
    """The estimator on these windows: the ratio of the sums of the
    windows' `tr(Sigma)` and `|G|^2` estimates (windows of one micro-batch
    left out)."""
    trace = signal = 0.0
    for window in windows:
        if len(window) < 2:
            continue
        squares = np.mean([np.sum(grads[m].mean(0) ** 2) for m in window])
        a = np.mean([1.0 / len(m) for m in window])
        c = 1.0 / sum(len(m) for m in window)
        big = np.sum(grads[np.concatenate(window)].mean(0) ** 2)
        trace += (squares - big) / (a - c)
        signal += (big * a - squares * c) / (a - c)
    return trace / signal


def target(grads):
    """What the estimator estimates over random epochs of these examples.

    Micro-batches drawn without replacement from n examples make the
    `tr(Sigma)` estimate unbiased for the sample covariance's trace (ddof=1)
    and the `|G|^2` estimate for `|G|^2 - tr/n`: the true
    `B_simple = tr / |G|^2` up to that O(B_simple / n) term.
    """
    n = len(grads)
    mean = grads.mean(0)
    trace = np.sum((grads - mean) ** 2) / (n - 1)
    return trace / (np.sum(mean**2) - trace / n), trace / np.sum(mean**2)
