"""`AccumState`, and the one rule by which a window closes (`close`): the skip
policy (None: every window is applied; `NonFiniteWindows`; called as
`policy(finite, optimizer, apply, discard)`) decides once; applied, in each replica every observer closes its part
(`ClosedWindow`), the optimizer applies the gradient and the buffers start
anew; skipped, every part is discarded. A batch split without buffers is a
window of one step (`close_batch`). Observers (batchnorm.py, noise_scale.py)
have `record(...)`, `close(closed)` and `discard()`.
"""

from typing import NamedTuple

import tensorflow as tf

from keras_accum import _internals as internals
from keras_accum import scaling
from keras_accum.window import nonfinite
from keras_accum.window.buffers import GradientAccumulator


class ClosedWindow(NamedTuple):
    """What a window's observers learn as it is applied (in a replica):
    `gradients` as the optimizer receives them (this replica's share, loss scale
    included); `micro_steps` and `noise_sums` over all replicas, the latter
    None unless the batch is its own window (`close_batch`)."""

    gradients: list
    loss_scale: object
    micro_steps: object
    noise_sums: object
    skipping: bool


class AccumState:
    """A model's accumulation state: one window of gradients, its skip policy
    and its observers; None for each that is off (`moments` for an
    `AccumOptimizer`, which has no layers)."""

    def __init__(self, buffers, moments=None, skip=None, noise=None):
        self.buffers = buffers
        self.moments = moments
        self.skip = skip
        self.noise = noise
        # Also held by the buffers so files keep their layout: Keras saves an
        # object at the first attribute path that reaches it.
        buffers.nonfinite = skip

    @classmethod
    def new(cls, accum_dtype=None, skip_nonfinite=False, moments=None, noise=None):
        """A fresh state: buffers summing in `accum_dtype`, the skip policy
        `skip_nonfinite` asks for, and the observers given."""
        skip = nonfinite.NonFiniteWindows() if skip_nonfinite else None
        return cls(GradientAccumulator(dtype=accum_dtype), moments, skip, noise)

    @property
    def skipped_windows(self):
        """Windows skipped so far for a non-finite gradient (an int)."""
        return int(self.skip.skipped.numpy()) if self.skipping else 0

    @property
    def observers(self):
        """The window's observers present: moments, noise scale."""
        return tuple(o for o in (self.moments, self.noise) if o is not None)

    @property
    def skipping(self):
        """Whether a window can be skipped (`skip_nonfinite`)."""
        return self.skip is not None

    def bind(self, variables, accum_steps, strategy, optimizer):
        """Makes the window the trainable `variables`' and builds `optimizer`,
        eagerly; an open window computed for other variables is refused."""
        self.buffers.bind(variables, accum_steps=accum_steps, strategy=strategy)
        self.build_observers(strategy)
        if not optimizer.built:
            # Built here, eagerly: the optimizer first runs inside a
            # conditional branch, where it cannot create its variables.
            optimizer.build(self.buffers.window_variables)

    def build_observers(self, strategy):
        """Makes the observers' variables (eagerly)."""
        for observer in self.observers:
            observer.build(strategy)

    def prepare_flush(self, variables, optimizer, strategy):
        """Eagerly, before an open window is closed outside a step (`flush`): a
        restored window is paired with `variables` by position, the optimizer
        built, and a window of variables it was not built for refused."""
        buffers = self.buffers
        if buffers.window_variables is None:
            buffers.bind(variables, accum_steps=buffers.window_length())
        if not optimizer.built:
            # `flush` runs outside the strategy's scope, where these must be made.
            with strategy.scope():
                optimizer.build(buffers.window_variables)
        unknown = internals.unknown_variables(optimizer, buffers.window_variables)
        if unknown:
            raise ValueError(
                f"The open window ({self.open_micro_batches()} micro-batches) "
                f"holds gradients for {[v.path for v in unknown]}, which the "
                "optimizer was not built for (the model was compiled again "
                "after what is trainable changed). Call `flush()` before "
                "changing what is trainable, or `reset_window()` to discard "
                "the window."
            )

    def open_micro_batches(self):
        """Micro-batches in the open window (a Python int)."""
        return self.buffers.open_micro_batches()

    def when_full(self, accum_steps, apply):
        """Runs `apply()` once the window holds `accum_steps` micro-batches."""
        self.buffers.when_full(accum_steps, apply)

    def discard(self):
        """Drops the open window: gradients and observers; no update."""
        self.buffers.reset()
        for observer in self.observers:
            observer.discard()

    def snapshot(self):
        """This process's buffers, BatchNormalization moments and skip count as
        numpy, for `restore` (a file can fail to load after its count loaded)."""
        moments = None if self.moments is None else self.moments.snapshot()
        skip = None if self.skip is None else self.skip.snapshot()
        return self.buffers.snapshot(), moments, skip

    def restore(self, snapshot):
        """Puts back a `snapshot()` (after a failed load)."""
        buffers, moments, skipped = snapshot
        self.buffers.restore(buffers)
        if self.moments is not None:
            self.moments.restore(moments)
        if self.skip is not None:
            self.skip.restore(skipped)


def close(state, optimizer, strategy=None, last=None):
    """Closes `state`'s window: applied, or skipped as its policy decides.

    Under a strategy (one replica included) this runs in cross-replica context:
    a replica's optimizer update is a `merge_call`, which cannot run in a
    conditional traced inside the replica. `last`: see `add_or_close`.
    """
    buffers = state.buffers
    loss_scale = scaling.loss_scale_of(optimizer)
    if internals.replicated(strategy):
        # Keras divides each replica's loss by the replicas (summed, their
        # gradients give a mean): the window's total weight is divided likewise.
        replicas = strategy.num_replicas_in_sync
        total = buffers.window_weight.read_value() / replicas
        gradients = lambda: buffers.window_gradients(loss_scale, total)  # noqa: E731
        finite = lambda: _finite_across(strategy, gradients)  # noqa: E731
        _decide(state, optimizer, loss_scale, replicas, strategy.run, gradients, finite, last)
        return

    def on_one_device(compact):
        # On one device, the gradient the policy checks is the one applied.
        gradients = _once(lambda: buffers.window_gradients(loss_scale, last=last, compact=compact))
        finite = lambda: nonfinite.all_finite(gradients())  # noqa: E731
        _decide(state, optimizer, loss_scale, 1, _call, gradients, finite, last)

    sizes = buffers.compact_sizes()
    if sizes is None:
        on_one_device(None)
    else:
        # Under XLA a sparse window of the traced step's own slices is handed
        # over in the size that step can fill (slices.compact_window), any other
        # in the table's: two updates in the graph, one runs.
        tf.cond(
            buffers.within(sizes),
            lambda: on_one_device(sizes),
            lambda: on_one_device(None),
        )


def _decide(state, optimizer, loss_scale, replicas, run, gradients, finite, last):
    buffers = state.buffers

    def apply():
        # Read before the update starts a new window.
        steps = buffers.micro_steps(last) * replicas

        def in_replica():
            closed = ClosedWindow(gradients(), loss_scale, steps, None, state.skipping)
            _apply(state.observers, closed, optimizer, buffers.window_variables)
            buffers.reset()

        run(in_replica)

    if state.skip is None:
        apply()
    else:
        state.skip(finite, optimizer, apply, lambda: run(state.discard))


def close_batch(state, optimizer, batch, noise_sums, variables):
    """A batch split without buffers is its own window: `batch`'s gradient is
    applied to `variables` by the same rule, in its replica; no skip policy."""
    total = batch.weight
    context = tf.distribute.get_replica_context()
    replicas = context.num_replicas_in_sync
    if replicas > 1:
        # As in `close`: Keras divided each replica's loss by the replicas.
        total = context.all_reduce(tf.distribute.ReduceOp.SUM, total) / replicas
        if noise_sums is not None:
            noise_sums = context.all_reduce(tf.distribute.ReduceOp.SUM, noise_sums)
    loss_scale = scaling.loss_scale_of(optimizer)
    scale = scaling.out_of_window(batch.normalise, total, loss_scale)
    grads = [
        None if g is None else tf.cast(scaling.scaled(g, scale), v.dtype)
        for g, v in zip(batch.grads, variables)
    ]
    observers = state.observers
    if noise_sums is None:
        # A sum loss has no mean gradient: nothing for the noise scale to measure.
        observers = tuple(o for o in observers if o is not state.noise)
    closed = ClosedWindow(grads, loss_scale, float(replicas), noise_sums, False)
    _apply(observers, closed, optimizer, variables)


def _apply(observers, closed, optimizer, variables):
    # The one place a window is applied: its observers close, then the update.
    for observer in observers:
        observer.close(closed)
    optimizer.apply(closed.gradients, variables)


def _finite_across(strategy, gradients):
    # One scalar per replica crosses devices: every replica skips or none does.
    flags = strategy.run(
        lambda: tf.cast(tf.logical_not(nonfinite.all_finite(gradients())), tf.float32)
    )
    return tf.equal(strategy.reduce("SUM", flags, axis=None), 0.0)


def _call(function):
    return function()


def _once(make):
    made = []

    def get():
        if not made:
            made.append(make())
        return made[0]

    return get
