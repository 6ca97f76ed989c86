"""BatchNormalization under accumulation: the window's moving statistics.

A micro-batch normalises with its own statistics ("ghost batch normalisation");
the moving statistics, which inference uses, can be the big batch's: each
micro-batch's moments are pooled over the window, weighted by their count of
values, and folded in once per update with the layer's momentum.
"""

import contextlib
import threading
import weakref
from typing import NamedTuple

import numpy as np
import tensorflow as tf

from keras_accum import _internals as internals
from keras_accum.arguments import BATCHNORM_PER_WINDOW, check_batchnorm
from keras_accum.window import replicas


class BatchNormRecord(NamedTuple):
    """One layer's moments of one micro-batch, recorded to be added later to
    `window`, that layer's `_LayerMoments`; `count`: the values per channel."""

    window: object
    count: object
    mean: object
    variance: object


class _LayerMoments(tf.Module):
    """One layer's moments pooled over the open window, per channel: count, mean
    and m2 (the sum of squared deviations), merged by Chan et al.'s parallel
    update, accurate when the mean is far from 0 (`E[x^2] - E[x]^2` is not)."""

    def __init__(self, shape, dtype, strategy, initial=None, name="bn_moments"):
        super().__init__(name=name)
        # Each replica pools its own. Read across replicas, counts and m2 sum and
        # means average: exact for synchronized layers (the same global moments).
        total = replicas.variable_arguments(strategy, replicas.SUMMED)
        mean = replicas.variable_arguments(strategy, replicas.AVERAGED)
        with tf.init_scope(), replicas.scope_of(strategy):
            zeros = tf.zeros(shape, dtype)
            self.count = tf.Variable(zeros, trainable=False, name="count", **total)
            self.mean = tf.Variable(zeros, trainable=False, name="mean", **mean)
            self.m2 = tf.Variable(zeros, trainable=False, name="m2", **total)
            if initial is not None:
                # Assigned, not initialised: across replicas an assigned sum is
                # shared out, as when it was read for saving.
                for v, value in zip(self.state(), initial):
                    v.assign(tf.constant(value, dtype))

    def state(self):
        return (self.count, self.mean, self.m2)

    def add(self, count, mean, variance):
        count = tf.cast(count, self.count.dtype)
        mean = tf.cast(mean, self.mean.dtype)
        variance = tf.cast(variance, self.m2.dtype)
        seen = self.count.read_value()
        total = seen + count
        delta = mean - self.mean
        share = tf.math.divide_no_nan(count, total)
        self.m2.assign_add(count * variance + delta * delta * seen * share)
        self.mean.assign_add(delta * share)
        self.count.assign(total)

    def reset(self):
        for v in self.state():
            v.assign(tf.zeros_like(v))


class BatchNormMoments(tf.Module, internals.SavedState):
    """Pools each BatchNormalization's micro-batch moments over a window.

    Inside `micro_batch()` a pooled layer's own moving-statistics update is a
    no-op (momentum reads 1.0: `moving * 1 + batch * 0` is `moving`) and its
    moments are recorded; `apply()`, run with each optimizer update, folds in
    `mean = sum(n_i mean_i) / sum(n_i)` and `variance = sum(n_i (var_i +
    (mean_i - mean)^2)) / sum(n_i)`: the big batch's update exactly, for a
    layer whose input does not depend on another batch-normalised layer.
    Frozen layers, `renorm=True` and subclasses overriding `call` or
    `_moments` keep Keras's own update. `mode='micro_batch'`: does nothing.
    """

    def __init__(self, model, mode=BATCHNORM_PER_WINDOW, name="batchnorm_window"):
        super().__init__(name=name)
        self.mode = check_batchnorm(mode)
        self._model = weakref.ref(model)
        # Keyed by position among the BatchNormalization layers (Keras numbers
        # names per process). `_windows` is a key of `tf.train.Checkpoint` files.
        self._windows = {}
        # Restored from a file before the layer was built: used when built.
        self._restored = {}
        self._patches = internals.SharedPatches()
        # Per thread (replica): the moving statistics before this micro-batch.
        self._before = threading.local()

    def _layers(self):
        model = self._model()
        if model is None or self.mode != BATCHNORM_PER_WINDOW:
            return []
        return list(internals.batch_normalization_layers(model))

    def build(self, strategy=None):
        """Makes the pooled moments of the layers already built, eagerly: under a
        strategy they cannot be made inside a replica's step."""
        for index, (layer, plain) in enumerate(self._layers()):
            if plain and layer.built and layer.trainable:
                self._layer_moments(index, layer, strategy)

    def _layer_moments(self, index, layer, strategy=None):
        key = str(index)
        if key not in self._windows:
            if strategy is None and tf.distribute.has_strategy():
                strategy = tf.distribute.get_strategy()
            self._windows[key] = _LayerMoments(
                tuple(layer.moving_mean.shape),
                layer.moving_mean.dtype,
                strategy,
                initial=self._restored.pop(key, None),
                name=f"bn_window_{index}",
            )
        return self._windows[key]

    @contextlib.contextmanager
    def micro_batch(self, deferred=None):
        """Records the moments of every pooled layer's forward pass in the block,
        or appends them to a list `deferred`, for `record(deferred)` once every
        micro-batch of the step has run. Reentrant across threads (under
        MirroredStrategy each replica traces in its own): the first in patches
        the layers, the last out restores them."""

        def patches():
            return [
                internals.moments_recorded_not_applied(layer, self._recorder(index, layer))
                for index, (layer, plain) in enumerate(self._layers())
                if plain and layer.trainable
            ]

        with self._patches.applied(patches):
            self._before.values = []
            self._before.deferred = deferred
            try:
                yield
                # Momentum 1 leaves the moving statistics as they were, but for a
                # non-finite micro-batch (nan * 0 is nan): put back what they were.
                for variable, value in self._before.values:
                    variable.assign(value)
            finally:
                self._before.values = []
                self._before.deferred = None

    def _recorder(self, index, layer):
        def record(inputs, mask, mean, variance):
            self._before.values.extend(
                (v, tf.identity(v.value)) for v in (layer.moving_mean, layer.moving_variance)
            )
            pooled = self._layer_moments(index, layer)
            count = _count(layer, inputs, mask, mean.dtype)
            if layer.synchronized:
                # The moments are over every replica's share: so is the count.
                context = tf.distribute.get_replica_context()
                if context is not None and context.num_replicas_in_sync > 1:
                    count = context.all_reduce(tf.distribute.ReduceOp.SUM, count)
            shape = pooled.mean.shape
            moments = BatchNormRecord(
                window=pooled,
                count=tf.broadcast_to(count, shape),
                mean=tf.reshape(mean, shape),
                variance=tf.reshape(variance, shape),
            )
            deferred = getattr(self._before, "deferred", None)
            if deferred is None:
                pooled.add(moments.count, moments.mean, moments.variance)
            else:
                deferred.append(moments)

        return record

    def record(self, deferred):
        """Adds moments collected by `micro_batch(deferred)` to the pooled ones;
        an empty micro-batch (NaN moments, count 0) adds nothing."""
        for moments in deferred:
            seen = moments.count > 0
            moments.window.add(
                moments.count,
                tf.where(seen, moments.mean, tf.zeros_like(moments.mean)),
                tf.where(seen, moments.variance, tf.zeros_like(moments.variance)),
            )

    def apply(self, finite_only=False):
        """Folds the pooled moments into each layer's moving statistics; a new
        window starts. A layer that saw nothing is left unchanged, and with
        `finite_only` (`skip_nonfinite`) one whose statistics are not finite."""
        layers = self._layers()
        for key, pooled in self._windows.items():
            layer = layers[int(key)][0]
            count, mean, m2 = (v.read_value() for v in pooled.state())
            variance = tf.math.divide_no_nan(m2, count)
            seen = count > 0
            if finite_only:
                seen = tf.logical_and(
                    seen,
                    tf.reduce_all(tf.math.is_finite(mean))
                    & tf.reduce_all(tf.math.is_finite(variance)),
                )
            for moving, batch in (
                (layer.moving_mean, mean),
                (layer.moving_variance, variance),
            ):
                # Keras's own expression, in the same dtype, so a window that
                # is a whole big batch gives the big batch's update.
                old = tf.cast(moving, batch.dtype)
                new = old * layer.momentum + batch * (1.0 - layer.momentum)
                moving.assign(tf.cast(tf.where(seen, new, old), moving.dtype))
            pooled.reset()

    def close(self, closed):
        """The window is applied (`state.ClosedWindow` `closed`): its moments
        are folded in; those not finite are kept out under a skip policy."""
        self.apply(finite_only=closed.skipping)

    def discard(self):
        """The window is dropped: so are its moments."""
        self.reset()

    def reset(self):
        """Drops the open window's moments."""
        for pooled in self._windows.values():
            pooled.reset()

    # -- Keras saving (`model.save`, `save_weights`, `load_weights`) ----------

    def save_own_variables(self, store):
        for key, pooled in self._windows.items():
            for part, v in zip(("count", "mean", "m2"), pooled.state()):
                store[f"{part}_{key}"] = v.numpy()

    def load_own_variables(self, store):
        keys = set(store.keys())
        layers = self._layers()
        restored = {}
        for key in keys:
            part, _, index = key.rpartition("_")
            if part not in ("count", "mean", "m2") or not index.isdigit():
                raise ValueError(
                    "The checkpoint's BatchNormalization window is not "
                    f"keras_accum's: unexpected entry {key!r}."
                )
            if int(index) >= len(layers):
                raise ValueError(
                    "The checkpoint holds a pending BatchNormalization window "
                    f"for layer #{index}, but this model has "
                    f"{len(layers)} BatchNormalization layers."
                )
            restored.setdefault(index, {})[part] = np.asarray(store[key])
        values = {}
        for index, parts in restored.items():
            layer = layers[int(index)][0]
            if set(parts) != {"count", "mean", "m2"}:
                raise ValueError(
                    "The checkpoint's BatchNormalization window for layer "
                    f"#{index} is incomplete: found {sorted(parts)}."
                )
            shape = parts["mean"].shape
            if layer.built and tuple(layer.moving_mean.shape) != shape:
                raise ValueError(
                    "The checkpoint's BatchNormalization window does not fit "
                    f"this model: layer #{index} ({layer.name}) has "
                    f"{layer.moving_mean.shape[0]} channels, the window {shape}."
                )
            values[index] = (parts["count"], parts["mean"], parts["m2"])
        # Checked first, changed after: a bad file changes nothing.
        self.reset()
        self._restored = {}
        for index, value in values.items():
            if index in self._windows:
                for v, array in zip(self._windows[index].state(), value):
                    v.assign(array)
            else:
                self._restored[index] = value

    def snapshot(self):
        """The pooled and restored moments as numpy, for `restore` after a failed load."""
        return (
            {k: [v.numpy() for v in w.state()] for k, w in self._windows.items()},
            dict(self._restored),
        )

    def restore(self, snapshot):
        windows, self._restored = snapshot
        for key, pooled in self._windows.items():
            if key in windows:
                for v, value in zip(pooled.state(), windows[key]):
                    v.assign(value)
            else:
                pooled.reset()


def _count(layer, inputs, mask, dtype):
    """How many values each channel's moments were computed over."""
    rank = len(inputs.shape)
    channel = layer.axis % rank
    axes = [i for i in range(rank) if i != channel]
    if mask is None:
        return tf.cast(tf.reduce_prod(tf.gather(tf.shape(inputs), axes)), dtype)
    # As BatchNormalization._moments broadcasts it.
    weights = tf.broadcast_to(
        tf.expand_dims(tf.cast(tf.cast(mask, tf.bool), dtype), -1), tf.shape(inputs)
    )
    return tf.reduce_sum(weights, axis=axes)
