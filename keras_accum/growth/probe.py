"""`NoiseProbe`: the noise scale measured on held examples, in windows bigger
than training's, where it has outgrown training's windows: each window's
`|G|^2` is then a small difference of two large, noisy numbers
(docs/batch-growth.md, "Precision" and "A fixed probe").
"""

import operator

import numpy as np
import tensorflow as tf

from keras_accum import _internals as internals
from keras_accum.engine import functions
from keras_accum.growth.estimate import NoiseEstimate
from keras_accum.split.auto import StepState
from keras_accum.window import noise_scale

# Enough for an interval (estimate.MIN_WINDOWS is 3), few enough that each
# is big.
DEFAULT_WINDOWS = 8


class NoiseProbe:
    """Held-out examples the noise scale is measured on at the current weights.

    `data` is `(x, y)` or `(x, y, sample_weight)` as `fit` takes them, split
    into `windows` (>= 3) equal groups of micro-batches, each measured as
    training's window is (the rest left out); their spread is the interval. Each use costs a forward and backward pass of training's
    loss, in training mode; layers' statistics and seeds are put back.
    """

    def __init__(self, data, windows=DEFAULT_WINDOWS):
        x, y, sample_weight = _unpacked(data)
        self.samples = _samples(x, y, sample_weight)
        self.windows = _checked_windows(windows)
        # Windows take consecutive rows: shuffled once (a fixed probe), else
        # one sorted by class would read too little noise.
        self.order = np.random.default_rng(0).permutation(self.samples)
        self.x, self.y, self.sample_weight = tf.nest.map_structure(
            lambda t: None if t is None else tf.gather(t, self.order), (x, y, sample_weight)
        )
        self._measuring = None  # ((model, Captured), traced window function, StepState)

    def micro_batches_per_window(self, micro_batch_size):
        """`m`: the micro-batches of `micro_batch_size` in each window."""
        return self.samples // (self.windows * micro_batch_size)

    def check(self, micro_batch_size):
        """Refuses a probe too small for two micro-batches of `micro_batch_size`
        per window."""
        if self.micro_batches_per_window(micro_batch_size) < 2:
            raise ValueError(
                f"`probe` has {self.samples} samples: too few for {self.windows} "
                f"windows of at least 2 micro-batches of {micro_batch_size} samples "
                "(what one device runs at once: a replica's share of the batch `fit` "
                "draws, or `micro_batch_size`), which need "
                f"{2 * self.windows * micro_batch_size}. "
                "Give a bigger probe (several times the noise scale you expect, "
                "times `probe_windows`) or fewer `probe_windows`."
            )

    def measure(self, model, micro_batch_size):
        """The `NoiseEstimate` at `model`'s current weights, from micro-batches of
        `micro_batch_size`; nothing of the model changes."""
        self.check(micro_batch_size)
        m = self.micro_batches_per_window(micro_batch_size)
        window = m * micro_batch_size
        function, written = self._functions_for(model)
        saved = written.snapshot()
        sums = np.zeros(6)
        try:
            for k in range(self.windows):
                rows = slice(k * window, (k + 1) * window)
                part = tf.nest.map_structure(
                    lambda t: None if t is None else t[rows], (self.x, self.y, self.sample_weight)
                )
                sums += function(*part, tf.constant(m)).numpy()
        finally:
            written.restore(saved)
        # A 95% interval from the spread of few windows: Student's t.
        return NoiseEstimate.of(sums, z=_t_quantile(self.windows - 1))

    def _functions_for(self, model):
        # Traced once per model and compile, as the train functions are
        # (`functions.compiled`); with it, what a training-mode pass writes
        # (layers' statistics and seeds, the loss's metrics), to put back.
        now = (model, functions.compiled(model))
        kept = None if self._measuring is None else self._measuring[0]
        if kept is None or kept[0] is not model or not kept[1].same(now[1]):
            written = StepState(
                lambda: [*model.non_trainable_variables, *model.metrics_variables],
                model.distribute_strategy,
            )
            self._measuring = now, _window_function(model, model.trainable_variables), written
        return self._measuring[1:]


def _window_function(model, variables):
    """A traced function `(x, y, sample_weight, m) -> estimates`: a window's
    rows as `m` equal micro-batches of `b`, its `tr(Sigma)` and `|G|^2`
    estimates in `NoiseScale.estimate_sums`' layout. With `S` the mean of
    their `|g_j|^2` and `L` the squared norm of their mean, as training's
    window (`noise_scale.window_estimates`):

        tr(Sigma) ~ (S - L) / (1/b - 1/(m b))    |G|^2 ~ (L/b - S/(m b)) / (1/b - 1/(m b))
    """

    def gradient(x, y, sample_weight):
        with tf.GradientTape() as tape:
            y_pred = internals.call_for_training(model, x)
            loss = internals.compute_loss(model, x, y, y_pred, sample_weight)
            # Scaled as training's (float16 gradients must not underflow): a
            # constant factor scales tr(Sigma) and |G|^2 alike.
            loss = model.optimizer.scale_loss(loss)
        return tape.gradient(loss, variables)

    @tf.function
    def window(x, y, sample_weight, m):
        b = tf.shape(tf.nest.flatten(x)[0])[0] // m
        total = [tf.zeros(v.shape, tf.float32) for v in variables]
        squares = tf.constant(0.0, tf.float64)
        for j in tf.range(m):
            rows = tf.nest.map_structure(
                lambda t: None if t is None else t[j * b : (j + 1) * b], (x, y, sample_weight)
            )
            grads = gradient(*rows)
            squares += noise_scale.squared_norm(grads)
            total = [
                t if g is None else t + tf.cast(tf.convert_to_tensor(g), tf.float32)
                for t, g in zip(total, grads)
            ]
        count = tf.cast(m, tf.float64)
        size = tf.cast(b, tf.float64)
        sums = tf.stack([squares, count / size, count, count * size, 1.0])
        mean = [t / tf.cast(m, tf.float32) for t in total]
        return noise_scale.window_estimates(sums, noise_scale.squared_norm(mean))

    return window


def probe_argument(noise_scale, probe, probe_windows, schedule=None):
    """`AccumScheduler`'s `probe` and `probe_windows` as a `NoiseProbe`, or None;
    refused with a schedule other than "noise_scale" (`noise_scale` False),
    and `probe_windows` without a probe."""
    if probe is not None and not noise_scale:
        raise ValueError(
            '`probe` is for AccumScheduler("noise_scale"): the held examples '
            "its noise scale is measured on. A dict or callable schedule "
            f"measures nothing. Received: probe with schedule={schedule!r}."
        )
    if probe is None:
        if probe_windows is not None:
            raise ValueError(
                "`probe_windows` splits a `probe`, and none was given: pass "
                "`probe=(x, y)` too, or drop it. Received: "
                f"probe_windows={probe_windows!r}, probe=None."
            )
        return None
    return NoiseProbe(probe, DEFAULT_WINDOWS if probe_windows is None else probe_windows)


def _unpacked(data):
    if not isinstance(data, (tuple, list)) or not 1 <= len(data) <= 3:
        raise ValueError(
            "`probe` must be `(x,)`, `(x, y)` or `(x, y, sample_weight)`, the held "
            "examples the noise scale is measured on. Received: "
            f"probe of type {type(data).__name__}."
        )
    x, y, sample_weight = (tuple(data) + (None, None))[:3]
    convert = lambda t: None if t is None else tf.convert_to_tensor(t)  # noqa: E731
    return (
        tf.nest.map_structure(convert, x),
        tf.nest.map_structure(convert, y),
        convert(sample_weight),
    )


def _samples(*parts):
    counts = {int(t.shape[0]) for t in tf.nest.flatten(parts) if t is not None}
    if len(counts) != 1:
        raise ValueError(
            "`probe`'s arrays must have the same number of samples (their first "
            f"dimension). Received sizes {sorted(counts)}."
        )
    return counts.pop()


# Student's t at 97.5% by degrees of freedom (two-sided 95%); between
# entries the lower one's (wider); from 30 on, 2.0 as training's.
_T = {
    2: 4.303,
    3: 3.182,
    4: 2.776,
    5: 2.571,
    6: 2.447,
    7: 2.365,
    8: 2.306,
    9: 2.262,
    10: 2.228,
    12: 2.179,
    15: 2.131,
    20: 2.086,
    30: 2.0,
}


def _t_quantile(dof):
    return _T[max(k for k in _T if k <= max(dof, 2))]


def _checked_windows(windows):
    given = windows
    try:
        windows = operator.index(windows) if not isinstance(windows, bool) else None
    except TypeError:
        windows = None
    if windows is None or windows < 3:
        raise ValueError(
            "`probe_windows` must be an int >= 3 (the windows the probe is "
            f"split into; their spread is the interval). Received: probe_windows={given!r}."
        )
    return windows
