"""The accumulation window: everything a model accumulates between two
optimizer updates, and the one rule by which it is applied, skipped,
discarded, flushed and restored.

The window's state has three parts, each in a module of its own:

- the gradient buffers (buffers.py: the arithmetic; binding.py: which
  variables they belong to; file_format.py: how they are saved; slices.py:
  sparse gradients kept as slices or per-row moments; trace.py: what the
  step being traced added; replicas.py: per-replica state);
- the BatchNormalization moments pooled over the window (batchnorm.py);
- the skip policy (nonfinite.py), asked once per window;
- optionally, the gradient noise scale measured from it (noise_scale.py).

`Window` composes them, so that every part obeys the same decision: a
window skipped for a non-finite gradient moves neither the weights nor the
moving statistics (nor adds to the noise scale); a discarded window drops
them all; a snapshot holds the state.

Example:

```python
window = Window(GradientAccumulator(), BatchNormMoments(model), NonFiniteWindows())
window.buffers.add(grads, weight)               # every micro-batch
window.when_full(4, lambda: window.apply(optimizer, strategy))
```
"""

import tensorflow as tf

from keras_accum import _internals as internals
from keras_accum import scaling
from keras_accum.window import noise_scale


class Window:
    """A model's accumulation window: buffers, moments and skip policy together.

    Args:
        buffers: the `GradientAccumulator`.
        moments: the `BatchNormMoments`, or None (an optimizer's window).
        skip: the skip policy (`NonFiniteWindows`), or None: always apply.
        noise: the `NoiseScale` measured from the window, or None.

    Example:

    ```python
    window = Window(GradientAccumulator(), skip=NonFiniteWindows())
    window.apply(optimizer)  # unless the window's gradient is not finite
    ```
    """

    def __init__(self, buffers, moments=None, skip=None, noise=None):
        self.buffers = buffers
        self.moments = moments
        self.skip = skip
        self.noise = noise
        # Held by the buffers too only so that files keep their layout: Keras
        # saves an object at the first attribute path that reaches it, and
        # the skip count has always been reached through the buffers.
        buffers.nonfinite = skip

    def bind(self, variables, accum_steps, strategy, optimizer):
        """Makes the window the trainable `variables`' and builds `optimizer`.

        Eager, before a step is traced: the step trains the window's
        variables (a trainable change takes effect at the next `compile()`,
        as in Keras), and an open window computed for other variables is
        refused with an error naming them (binding.py).
        """
        self.buffers.bind(variables, accum_steps=accum_steps, strategy=strategy)
        self.build_parts(strategy)
        if not optimizer.built:
            # Built here, eagerly: the optimizer first runs inside a
            # conditional branch, where it cannot create its variables.
            optimizer.build(self.buffers.window_variables)

    def build_parts(self, strategy):
        """Makes the moments' and the noise scale's variables (eagerly)."""
        if self.moments is not None:
            self.moments.build(strategy)
        if self.noise is not None:
            self.noise.build(strategy)

    def prepare_apply(self, variables, optimizer, strategy):
        """Eagerly, before an open window is applied outside a step (`flush`).

        A window restored from a file and not stepped since is paired with
        `variables` by position, as Keras pairs weights; the optimizer is
        built in the strategy's scope if it is not; a window holding
        gradients for variables the optimizer was not built for (compiled
        again after what is trainable changed) is refused, naming them.
        """
        buffers = self.buffers
        if buffers.window_variables is None:
            buffers.bind(variables, accum_steps=buffers.window_length())
        if not optimizer.built:
            # Under a strategy, the optimizer's variables must be made in
            # its scope (flush is called outside it).
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

    def apply(self, optimizer, strategy=None):
        """Applies the window (gradient and moments), or skips it as the
        policy decides; a new window starts either way.

        Under a strategy (one replica included) this runs in cross-replica
        context: a replica's optimizer update is a `merge_call`, which cannot
        run in a conditional traced inside the replica.
        """
        if internals.replicated(strategy):
            self._apply_across_replicas(optimizer, strategy)
            return
        buffers = self.buffers
        if self.skip is None and self.noise is None:
            buffers.apply(optimizer)
            self._apply_moments()
            return
        loss_scale = scaling.loss_scale_of(optimizer)
        grads = buffers.window_gradients(loss_scale)

        def apply():
            if self.noise is not None:
                self.noise.close_window(
                    _unscaled(noise_scale.squared_norm(grads), loss_scale),
                    buffers.micro_step,
                )
            buffers.apply(optimizer, grads=grads)
            self._apply_moments()

        if self.skip is None:
            apply()
            return

        self.skip.one_device(grads, optimizer, apply, self.discard)

    def _apply_across_replicas(self, optimizer, strategy):
        buffers = self.buffers
        # Read here, across replicas: the window's weight over all replicas.
        # Keras divides each replica's loss by the number of replicas (so
        # that summing replica gradients gives a mean); the window's total
        # weight is divided likewise to undo it.
        total = buffers.window_weight.read_value() / strategy.num_replicas_in_sync

        def apply():
            if self.noise is None:
                strategy.run(lambda: buffers.apply(optimizer, total))
            else:
                # Read before the update starts a new window.
                steps = buffers.micro_step.read_value() * strategy.num_replicas_in_sync
                norm = strategy.run(lambda: _apply_measured(buffers, optimizer, total))
                self.noise.close_window(strategy.experimental_local_results(norm)[0], steps)
            strategy.run(self._apply_moments)

        if self.skip is None:
            apply()
            return
        self.skip.across_replicas(
            strategy,
            lambda: buffers.window_gradients(total_weight=total),
            optimizer,
            apply,
            lambda: strategy.run(self.discard),
        )

    def _apply_moments(self):
        # With a skip policy, non-finite statistics (a NaN sample's) are
        # kept out of the moving averages, as the window's update is.
        if self.moments is not None:
            self.moments.apply(finite_only=self.skip is not None)

    def discard(self):
        """Drops the open window: gradients and moments; no update."""
        self.buffers.reset()
        if self.moments is not None:
            self.moments.reset()
        if self.noise is not None:
            self.noise.discard_window()

    def snapshot(self):
        """All of this process's window state as numpy, for `restore`: the
        buffers, the BatchNormalization moments and the skip count (a file
        can fail to load after its count has loaded)."""
        moments = None if self.moments is None else self.moments.snapshot()
        skipped = None if self.skip is None else self.skip.snapshot()
        return self.buffers.snapshot(), moments, skipped

    def restore(self, snapshot):
        """Puts back a `snapshot()` (after a failed load)."""
        buffers, moments, skipped = snapshot
        self.buffers.restore(buffers)
        if self.moments is not None:
            self.moments.restore(moments)
        if self.skip is not None:
            self.skip.restore(skipped)


def _apply_measured(buffers, optimizer, total):
    # In each replica: the window's gradient, its global squared norm (the
    # one all-reduce measuring adds), then the update as without measuring.
    loss_scale = scaling.loss_scale_of(optimizer)
    grads = buffers.window_gradients(loss_scale, total)
    context = tf.distribute.get_replica_context()
    summed = context.all_reduce(
        tf.distribute.ReduceOp.SUM, [g for g in grads if g is not None]
    )
    buffers.apply(optimizer, grads=grads)
    return _unscaled(noise_scale.squared_norm(summed), loss_scale)


def _unscaled(squared_norm, loss_scale):
    if loss_scale is None:
        return squared_norm
    scale = tf.cast(loss_scale, tf.float64)
    return squared_norm / (scale * scale)
