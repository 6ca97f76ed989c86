"""The accumulation window: gradient buffers and the counters that go with them.

Everything that accumulates in keras_accum goes through `GradientAccumulator`,
so the arithmetic that makes uneven windows exact lives in one place.
"""

import contextlib
import numbers

import keras
import numpy as np
import tensorflow as tf

from keras_accum import _keras_internals as internals
from keras_accum import sparse


MAX_ACCUM_STEPS = 2**63 - 1


def check_accum_steps(accum_steps):
    """Returns `accum_steps` as a Python int, or raises naming what was received.

    Accepts Python and numpy integers >= 1. Rejects bools (a `True` is almost
    always a mistake, not "1"), floats and strings, even integral ones, so that
    `accum_steps=2.0` coming from a config file is caught rather than guessed.
    """
    if isinstance(accum_steps, bool) or not isinstance(
        accum_steps, numbers.Integral
    ):
        raise TypeError(
            "`accum_steps` must be an integer >= 1. "
            f"Received: accum_steps={accum_steps!r} "
            f"(of type {type(accum_steps).__name__}). "
            "Pass a whole number such as accum_steps=4."
        )
    if accum_steps < 1:
        raise ValueError(
            "`accum_steps` must be an integer >= 1. "
            f"Received: accum_steps={accum_steps!r}. "
            "Use accum_steps=1 for no accumulation."
        )
    if accum_steps > MAX_ACCUM_STEPS:
        # The window length is an int64 counter.
        raise ValueError(
            f"`accum_steps` must be at most {MAX_ACCUM_STEPS} (2**63 - 1). "
            f"Received: accum_steps={accum_steps!r}."
        )
    return int(accum_steps)


def _buffer_dtype(variable_dtype, requested):
    if requested is not None:
        return tf.as_dtype(requested)
    # float32 for float16/bfloat16/float32 variables: summing many low-precision
    # gradients in low precision is where accumulation loses accuracy. float64
    # variables keep float64 so the buffer is never less precise than the weight.
    return tf.float64 if tf.as_dtype(variable_dtype) == tf.float64 else tf.float32


def _check_dtype(accum_dtype):
    try:
        dtype = tf.as_dtype(accum_dtype)
    except TypeError:
        dtype = None
    if dtype is None or not dtype.is_floating:
        raise ValueError(
            "`accum_dtype` must be a floating-point dtype such as 'float32'. "
            f"Received: accum_dtype={accum_dtype!r}. Use None for the default."
        )
    return dtype


def loss_scale_of(optimizer):
    """The factor `optimizer.scale_loss` multiplies losses by, or None for 1.

    A `LossScaleOptimizer` (mixed_float16) gives its dynamic scale, a tensor;
    an optimizer with `loss_scale_factor` gives that; any other gives None, so
    nothing is multiplied on the unscaled path.
    """
    scale = optimizer.scale_loss(1.0)
    if isinstance(scale, (int, float)) and scale == 1:
        return None
    return scale


class GradientAccumulator(tf.Module, internals.SavedState):
    """Sums weighted micro-batch gradients until a window is applied.

    A window is the run of micro-batches that together make one optimizer
    update. Each micro-batch adds `weight * gradient`, where `weight` is what
    the micro-batch's loss was normalised by (its number of samples, for
    Keras's default `sum_over_batch_size` reduction). The window's gradient is
    `acc_grads / window_weight`: the gradient of the loss over every sample in
    the window, exactly what one big batch of those samples gives, however
    unevenly the samples were split.

    Buffers hold true (unscaled) gradient sums, also under mixed_float16: a
    micro-batch's loss-scaled gradients are multiplied by
    `weight / loss_scale` as they are added, and by the loss scale again when handed to a `LossScaleOptimizer`, so
    that its overflow check and scale update run once per window, on the
    window, exactly as for a big batch. A non-finite micro-batch makes the
    window's sum non-finite: the optimizer skips the whole window and lowers
    its scale.

    The state is held in `tf.Variable`s, so it lives inside `tf.function`s and
    is saved by `tf.train.Checkpoint` and by Keras's `save`/`save_weights`:

    Attributes:
        micro_step: int64 scalar; micro-batches added since the last update.
        window_weight: float32 scalar; the sum of the weights in this window.
        accum_steps: int64 scalar; the window length this window is being
            accumulated for, so a restored window is never finished under a
            different length by mistake.
        normalise: bool scalar; whether the window's gradient is the sum
            divided by `window_weight` (a mean) or the plain sum (`sum`
            losses). Written by every micro-batch, so a restored window is
            finished with the arithmetic it was started with.
        acc_grads: one buffer per variable of the window holding the sum of
            weighted gradients: float32 (float64 for float64 variables) unless
            `dtype` asks otherwise. For a variable whose gradient is
            `tf.IndexedSlices` (an `Embedding`'s), the buffer holds the
            window's slices instead, one per row, while they fit
            (sparse.py): the window is then handed to the optimizer as one
            `IndexedSlices` of all its occurrences, as the big batch's
            gradient is, for Keras's occurrence-wise sparse updates.
        slice_indices: per buffer, the table row of each slice it holds
            (one int per row of the variable).
        slice_counts: per buffer, how many slices it holds; -1 when it
            holds the dense sum instead.
        window_variables: the variables the buffers belong to, one each, by
            identity; None for a window restored from a file until it is
            bound to a model's variables (by position, as Keras pairs
            weights). A window is only ever applied to these variables.

    Args:
        dtype: buffer dtype; None for the rule above.
        name: the module's name.

    Example:

    ```python
    acc = GradientAccumulator()
    acc.bind(model.trainable_variables, accum_steps=4)
    acc.add(grads, weight=batch_size)   # every micro-batch
    acc.apply_if_full(optimizer, accum_steps=4)
    ```
    """

    def __init__(self, dtype=None, name="gradient_accumulator"):
        super().__init__(name=name)
        self.dtype = None if dtype is None else _check_dtype(dtype)
        # Made inside a strategy's scope (with its model): build per-replica
        # buffers even when the build comes from loading a checkpoint.
        self._strategy = tf.distribute.get_strategy() if tf.distribute.has_strategy() else None
        # A NonFiniteWindows that applies a window only if its gradient is
        # finite; set by the owner (skip_nonfinite=True). None: always apply.
        self.nonfinite = None
        self._unbuild()

    def _unbuild(self):
        self.micro_step = None
        self.window_weight = None
        self.accum_steps = None
        self.normalise = None
        self.acc_grads = []
        # Per buffer: the table rows of its window's slices and how many
        # slices it holds (sparse.py); -1 when it holds a dense sum.
        self.slice_indices = []
        self.slice_counts = []
        self._binding = _Binding(None)
        # Indices of variables whose gradient is None in the traced step: the
        # optimizer must see None for them, as it does for a big batch, not a
        # zero gradient (which would still move Adam or decay). A property of
        # the step's graph, hence Python; saved with the window, so a window
        # restored from a file is applied with it before any step is traced.
        self._absent = frozenset()
        # Indices of variables whose gradient is `tf.IndexedSlices` in the
        # traced step: their window is kept as slices. Known when traced,
        # saved with the window like `_absent`.
        self._sparse = frozenset()
        self._built = False
        # Bumped whenever buffers are made: functions traced with the old
        # ones must be traced again.
        self.generation = getattr(self, "generation", 0) + 1

    @property
    def built(self):
        return self._built

    @property
    def window_variables(self):
        return self._binding.variables

    def pending(self):
        """Micro-batches in the open window (a Python int; 0 when unbuilt)."""
        return int(self.micro_step.numpy()) if self._built else 0

    def window_length(self):
        """The length the open window is accumulated for (a Python int)."""
        return int(self.accum_steps.numpy())

    def shapes(self):
        return [tuple(b.shape) for b in self.acc_grads]

    def bind(self, variables, accum_steps, strategy=None):
        """Makes this the window of `variables`, `accum_steps` micro-batches long.

        Eager only. With no window open, buffers are made for `variables`
        unless they are this window's already. An open window must have been
        computed for exactly these variables (or, restored from a file,
        for variables of the same shapes in the same order) and for the same
        window length; otherwise a ValueError says which differ and what to
        do. A gradient never reaches a variable it was not computed for.

        Returns:
            True if buffers were replaced (functions traced with the old
            ones must be traced again).
        """
        variables = list(variables)
        if self.pending():
            self._check_open_window_fits(variables, accum_steps)
            self._binding.variables = variables
            return False
        bound = self.window_variables
        if self._built and (
            _same(bound, variables)
            or (bound is None and self.shapes() == _shapes(variables))
        ):
            self._binding.variables = variables
            self.accum_steps.assign(accum_steps)
            return False
        replaced = self._built
        self.build(variables, accum_steps, strategy)
        return replaced

    def fits(self, variables, accum_steps):
        """Whether the open window may go on with `variables` and `accum_steps`."""
        try:
            self._check_open_window_fits(list(variables), accum_steps)
        except ValueError:
            return False
        return True

    def _check_open_window_fits(self, variables, accum_steps):
        bound = self.window_variables
        if bound is None:
            if self.shapes() != _shapes(variables):
                raise ValueError(
                    f"This model has a pending window of {self.pending()} "
                    "micro-batches whose gradient buffers (shapes "
                    f"{self.shapes()}) do not fit its trainable variables "
                    f"(shapes {_shapes(variables)}). It was restored from "
                    "another model or the trainable set changed: restore a "
                    "matching checkpoint, load weights saved at a window "
                    "boundary, or call `reset_window()` to discard it."
                )
        elif not _same(bound, variables):
            raise ValueError(
                f"The open window ({self.pending()} micro-batches) holds "
                f"gradients for the variables {_names(bound)}, but training "
                f"now updates {_names(variables)} (the trainable set or the "
                "model changed with a window open). Call `flush()` before "
                "changing what is trainable to apply the window to the "
                "variables it was computed for, or `reset_window()` to "
                "discard it."
            )
        window_length = self.window_length()
        if window_length != accum_steps:
            raise ValueError(
                f"This model's pending window ({self.pending()} micro-batches) "
                f"was accumulated with accum_steps={window_length}, but the "
                f"model now has accum_steps={accum_steps}. Set "
                f"`model.accum_steps = {window_length}` to finish the window "
                "as it began, call `model.flush()` to apply it now, or "
                "`model.reset_window()` to discard it."
            )

    def build(self, variables, accum_steps, strategy=None):
        """Creates a zeroed buffer for each of `variables` and the counters.

        `variables` need only `shape` and `dtype` (numpy arrays will do; the
        window is then bound to variables later, by `bind`). Variables are
        created outside any surrounding `tf.function`. Under a
        `tf.distribute` strategy (one replica included), every variable is
        per-replica (sync-on-read): each replica sums its own micro-batches
        locally, and nothing crosses devices until the window is applied.
        Read across replicas, buffers and `window_weight` give their sum,
        the counters replica 0's value.
        """
        variables = list(variables)
        self._absent = frozenset()
        self._sparse = frozenset()
        self._binding.variables = None
        self.generation += 1
        local = {}
        strategy = strategy or self._strategy
        self._strategy = strategy
        if internals.replicated(strategy):
            # One replica too: its window is applied in cross-replica
            # context (AccumModel._apply_across_replicas), as for several.
            local = {"synchronization": tf.VariableSynchronization.ON_READ}
        total = dict(local, aggregation=tf.VariableAggregation.SUM) if local else {}
        first = (
            dict(local, aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
            if local
            else {}
        )
        scope = strategy.scope() if local else contextlib.nullcontext()
        with tf.init_scope(), scope:
            self.micro_step = tf.Variable(
                0, dtype=tf.int64, trainable=False, name="micro_step", **first
            )
            self.window_weight = tf.Variable(
                0.0, dtype=tf.float32, trainable=False, name="window_weight", **total
            )
            self.accum_steps = tf.Variable(
                accum_steps, dtype=tf.int64, trainable=False, name="accum_steps", **first
            )
            self.normalise = tf.Variable(
                True, dtype=tf.bool, trainable=False, name="normalise", **first
            )
            # Appended one by one to the list tracked since __init__ (not a
            # new list) so that a tf.train.Checkpoint restored before the
            # build fills each buffer as it is created.
            if self.acc_grads:
                self.acc_grads = []
                self.slice_indices = []
                self.slice_counts = []
            for i, v in enumerate(variables):
                self.acc_grads.append(
                    tf.Variable(
                        tf.zeros(v.shape, dtype=_buffer_dtype(v.dtype, self.dtype)),
                        trainable=False,
                        name=f"acc_grad_{i}",
                        **total,
                    )
                )
                # Scalars cannot have sparse gradients: no slices for them.
                rows = v.shape[0] if len(v.shape) else 0
                self.slice_indices.append(
                    tf.Variable(
                        tf.zeros([rows], sparse.index_dtype(rows)),
                        trainable=False,
                        name=f"slice_indices_{i}",
                        **first,
                    )
                )
                self.slice_counts.append(
                    tf.Variable(
                        tf.zeros([], tf.int64), trainable=False,
                        name=f"slice_count_{i}", **first,
                    )
                )
        if variables and all(isinstance(v, _VARIABLE_TYPES) for v in variables):
            self._binding.variables = variables
        self._built = True

    def add(self, grads, weight, grad_scale=None, normalise=True, variables=None):
        """Adds one micro-batch: `acc_grads += grad_scale * grads`, and `weight`.

        Args:
            grads: the micro-batch's gradients, one per buffer. `tf.IndexedSlices`
                are appended to the window's slices (or scatter-added into
                its dense sum once they no longer fit), never densified.
            weight: scalar; what this micro-batch's loss was normalised by.
                The buffers must end up holding `weight * gradient`: either
                the caller folded `weight` into the loss before
                differentiating (free: one scalar multiply), or it passes
                `grad_scale=weight`.
            grad_scale: optional scalar multiplying every gradient as it is
                added, in the buffer's dtype; also how loss-scaled gradients
                are unscaled (`weight / loss_scale`).
            normalise: whether the window's gradient is divided by the
                window's total weight (a mean); False for a sum.
            variables: the variables `grads` belong to, if known: checked,
                when traced, to be the window's own.
        """
        if not self._built:
            raise ValueError(
                "The accumulator has no buffers yet: `bind` it to the "
                "variables before adding gradients."
            )
        if len(grads) != len(self.acc_grads) or (
            variables is not None and not _same(self.window_variables, variables)
        ):
            raise ValueError(
                "These gradients are not for this window's variables: "
                f"{len(grads)} gradients for "
                f"{_names(variables) if variables is not None else '?'}, "
                f"the window holds {len(self.acc_grads)} for "
                f"{_names(self.window_variables)}."
            )
        self._absent = frozenset(i for i, g in enumerate(grads) if g is None)
        self._sparse = frozenset(
            i for i, g in enumerate(grads) if isinstance(g, tf.IndexedSlices)
        )
        for i, (buf, g) in enumerate(zip(self.acc_grads, grads)):
            if g is None:
                continue
            if i in self._sparse:
                values = _scaled(tf.cast(g.values, buf.dtype), grad_scale)
                sparse.append(*self._slice_window(i), g, values)
            else:
                buf.assign_add(_scaled(tf.cast(g, buf.dtype), grad_scale))
        self.window_weight.assign_add(tf.cast(weight, tf.float32))
        self.normalise.assign(bool(normalise))
        self.micro_step.assign_add(1)

    def window_gradients(self, loss_scale=None, total_weight=None):
        """The window's gradient per window variable, in each variable's dtype.

        Multiplied by `loss_scale` when given: what a loss-scaling optimizer
        expects. Divided by `total_weight` when given (the window's weight
        summed over replicas), else by this `window_weight`, unless the
        window is a sum. Variables that had no gradient give None, as they
        would for the big batch.
        """
        if total_weight is None:
            total_weight = self.window_weight
        # divide_no_nan: a window whose loss terms were all masked has weight
        # 0 and, as Keras's big batch, a zero gradient.
        inv = tf.where(
            self.normalise, tf.math.divide_no_nan(1.0, total_weight), 1.0
        )
        if loss_scale is not None:
            inv = inv * tf.cast(loss_scale, tf.float32)
        grads = []
        for i, (buf, v) in enumerate(zip(self.acc_grads, self._bound())):
            if i in self._absent:
                grads.append(None)
            elif i in self._sparse:
                # One IndexedSlices of the window's occurrences: the big
                # batch's gradient, for Keras's own sparse update.
                window = sparse.window_slices(
                    *self._slice_window(i), padded=internals.in_xla_context()
                )
                grads.append(
                    tf.IndexedSlices(
                        tf.cast(window.values * tf.cast(inv, buf.dtype), v.dtype),
                        window.indices,
                        window.dense_shape,
                    )
                )
            else:
                grads.append(
                    tf.cast(self._dense_sum(i) * tf.cast(inv, buf.dtype), v.dtype)
                )
        return grads

    def _slice_window(self, i):
        # This replica's own buffers: each replica keeps its own slices.
        return [
            internals.replica_component(v)
            for v in (self.acc_grads[i], self.slice_indices[i], self.slice_counts[i])
        ]

    def _dense_sum(self, i):
        buf = self.acc_grads[i]
        if not len(buf.shape):
            return buf
        # Slices whose variable is not known to be sparse: a window restored
        # by `tf.train.Checkpoint` (which does not save `_sparse`) and applied
        # before a step is traced. Summed, as their dense gradient.
        storage, indices, count = self._slice_window(i)
        return tf.cond(
            count > 0,
            lambda: sparse.dense_sum(storage, indices, count),
            storage.read_value,
        )

    def apply(self, optimizer, total_weight=None, check_finite=True, grads=None):
        """Applies the window's gradient to its variables through `optimizer`;
        a new window starts.

        In a replica context the optimizer sums the replicas' gradients (its
        one cross-device reduction), so `total_weight` must then be the
        window's weight summed over replicas, and `check_finite` False: a
        conditional update inside a replica cannot be made, the caller
        decides across replicas (`NonFiniteWindows.across_replicas`).
        `grads`: the window's gradients, if the caller has them already
        (`window_gradients(loss_scale_of(optimizer))`).
        """
        if grads is None:
            grads = self.window_gradients(loss_scale_of(optimizer), total_weight)
        if self.nonfinite is None or not check_finite:
            optimizer.apply(grads, self._bound())
        else:
            self.nonfinite.apply(optimizer, grads, self._bound())
        self.reset()

    def apply_if_full(self, optimizer, accum_steps):
        """Applies the window once it holds `accum_steps` micro-batches.

        `accum_steps` may be a Python int (traced as a constant) or a tensor.
        Works eagerly and inside `tf.function`/XLA.
        """
        self.when_full(accum_steps, lambda: self.apply(optimizer))

    def flush(self, optimizer):
        """Applies a partial window, if any; graph-safe."""
        self._when(self.micro_step > 0, lambda: self.apply(optimizer))

    def when_full(self, accum_steps, apply):
        """Runs `apply()` once the window holds `accum_steps` micro-batches."""
        self._when(self.micro_step >= accum_steps, apply)

    @staticmethod
    def _when(condition, apply):
        tf.cond(condition, apply, lambda: None)

    def reset(self):
        """Zeroes the buffers and counters: a new window starts.

        Also how an open window is discarded: its gradients are dropped and
        no update is made. A window kept as slices is emptied by its count
        alone: no pass over the table.
        """
        for i, (buf, count) in enumerate(zip(self.acc_grads, self.slice_counts)):
            if i not in self._sparse:
                buf.assign(tf.zeros_like(buf))
            count.assign(tf.zeros_like(count))
        self.window_weight.assign(0.0)
        self.micro_step.assign(0)

    def _bound(self):
        if self.window_variables is None:
            raise ValueError(
                "This window was restored from a file and is not yet bound to "
                "variables: train a step, or call `flush()` on the model."
            )
        return self.window_variables

    # -- Keras saving (`model.save`, `save_weights`, `load_weights`) ----------
    # Saving and loading touch only this process's replicas: across workers a
    # cross-replica read of a per-replica buffer is a collective, which would
    # make every save wait for (and fail with) a dead peer. Each process
    # writes its share of the window (the sum over its own replicas) and
    # `shares`, how many processes' files together hold the window.

    def save_own_variables(self, store):
        if not self._built:
            return
        first = self._local(self.micro_step)[0]
        store["micro_step"] = first.numpy()
        store["window_weight"] = _local_sum(self._local(self.window_weight))
        store["accum_steps"] = self._local(self.accum_steps)[0].numpy()
        store["normalise"] = np.int8(self._local(self.normalise)[0].numpy())
        store["has_gradient"] = np.array(
            [i not in self._absent for i in range(len(self.acc_grads))], "int8"
        )
        store["shares"] = np.int64(self._shares())
        store["replicas"] = np.int64(self._replicas())
        store["sparse"] = np.array(
            [i in self._sparse for i in range(len(self.acc_grads))], "int8"
        )
        for i, buf in enumerate(self.acc_grads):
            if i in self._sparse:
                self._save_slices(store, i)
            else:
                store[f"acc_grad_{i}"] = _local_sum(self._local(buf))

    def _save_slices(self, store, i):
        # Each of this process's replicas keeps its own slices (they cannot
        # be summed): saved one after the other with each replica's count;
        # the replicas that spilled into a dense sum give `acc_grad_i`.
        storages = self._local(self.acc_grads[i])
        counts = [int(c.numpy()) for c in self._local(self.slice_counts[i])]
        indices = self._local(self.slice_indices[i])
        live = [(s, sparse.live_indices(ix, n).numpy(), n)
                for s, ix, n in zip(storages, indices, counts) if n > 0]
        dense = [s.numpy() for s, n in zip(storages, counts) if n < 0]
        shape = tuple(self.acc_grads[i].shape)
        store[f"acc_grad_{i}"] = (
            sum(dense[1:], dense[0]) if dense
            else np.zeros(shape, self.acc_grads[i].dtype.as_numpy_dtype)
        )
        store[f"slice_counts_{i}"] = np.array(counts, "int64")
        store[f"slice_indices_{i}"] = np.concatenate(
            [ix for _, ix, _ in live] or [np.zeros([0], "int64")]
        ).astype("int64")
        store[f"slice_values_{i}"] = np.concatenate(
            [s.numpy()[:n] for s, _, n in live]
            or [np.zeros((0,) + shape[1:], self.acc_grads[i].dtype.as_numpy_dtype)]
        )

    def load_own_variables(self, store):
        keys = set(store.keys())
        if not keys:
            # Saved by a plain model, or before any training: no open window.
            if self._built:
                self.reset()
            return
        n = len([k for k in keys if k.startswith("acc_grad_")])
        expected = {"micro_step", "window_weight", "accum_steps"} | {
            f"acc_grad_{i}" for i in range(n)
        }
        optional = {"normalise", "has_gradient", "shares", "replicas", "sparse"}
        optional |= {
            f"slice_{what}_{i}" for i in range(n) for what in ("counts", "indices", "values")
        }
        if not expected <= keys or keys - expected - optional:
            raise ValueError(
                "The checkpoint's accumulation state is incomplete or not "
                f"keras_accum's: expected entries {sorted(expected)}, found "
                f"{sorted(keys)}."
            )
        values = [np.asarray(store[f"acc_grad_{i}"]) for i in range(n)]
        if self._built and self.shapes() != [v.shape for v in values]:
            raise ValueError(
                "The checkpoint's pending window does not fit this model: its "
                f"gradient buffers have shapes {[v.shape for v in values]}, "
                f"this model's trainable variables have {self.shapes()}."
            )
        # np.asarray: older Keras (3.8) hands back h5py datasets, not arrays.
        entry = lambda key: np.asarray(store[key])  # noqa: E731
        micro_step = int(entry("micro_step"))
        # Files written before these entries existed hold the whole window.
        saved = (
            int(entry("shares")) if "shares" in keys else 1,
            int(entry("replicas")) if "replicas" in keys else self._replicas(),
        )
        here = (self._shares(), self._replicas())
        if micro_step and saved != here:
            # Buffers hold each process's share, summed over replicas whose
            # losses Keras divided by their number: neither can be re-split.
            raise ValueError(
                f"The checkpoint's pending window ({micro_step} micro-batches) "
                f"was saved by {saved[0]} process(es) with {saved[1]} "
                f"replica(s) in all, but this model runs in {here[0]} with "
                f"{here[1]}. Restore it in the same setup, or load weights "
                "saved at a window boundary (e.g. an epoch-end backup)."
            )
        weight = np.float32(entry("window_weight"))
        if not self._built:
            self.build(values, accum_steps=int(entry("accum_steps")))
        for buf, value in zip(self.acc_grads, values):
            _assign_share(self._local(buf), value)
        _assign_share(self._local(self.window_weight), weight)
        _assign_all(self._local(self.micro_step), micro_step)
        _assign_all(self._local(self.accum_steps), int(entry("accum_steps")))
        if "normalise" in keys:
            _assign_all(self._local(self.normalise), bool(entry("normalise")))
        if "has_gradient" in keys:
            has = entry("has_gradient")
            self._absent = frozenset(int(i) for i in np.flatnonzero(has == 0))
        # Files written before slices existed hold every window as a dense
        # sum: count -1 says so, and such a window is applied as that sum.
        legacy = "sparse" not in keys
        self._sparse = frozenset(
            () if legacy else (int(i) for i in np.flatnonzero(entry("sparse")))
        )
        for count in self.slice_counts:
            _assign_all(self._local(count), -1 if legacy and micro_step else 0)
        for i in self._sparse:
            self._load_slices(store, i)

    def _load_slices(self, store, i):
        counts = [int(c) for c in np.asarray(store[f"slice_counts_{i}"])]
        components = list(zip(
            self._local(self.acc_grads[i]),
            self._local(self.slice_indices[i]),
            self._local(self.slice_counts[i]),
        ))
        if len(counts) != len(components):
            # Only a window saved with no micro-batch gets here (the
            # replica check above refuses others): nothing to restore.
            return
        indices = np.asarray(store[f"slice_indices_{i}"])
        values = np.asarray(store[f"slice_values_{i}"])
        dense = np.asarray(store[f"acc_grad_{i}"])
        start, dense_given = 0, False
        for (storage, index, count), n in zip(components, counts):
            count.assign(n)
            if n < 0:
                # The dense share on the first replica that spilled, zeros on
                # the others: summed over replicas, the saved sum.
                storage.assign(np.zeros_like(dense) if dense_given else dense)
                dense_given = True
            elif n > 0:
                rows = slice(start, start + n)
                sparse.write_slices(storage, index, count, values[rows], indices[rows])
                start += n

    def snapshot(self):
        """This process's state as numpy, for `restore` after a failed load."""
        if not self._built:
            return None
        values = [[c.numpy() for c in self._local(v)] for v in self._state()]
        return values, self._absent, self._sparse

    def restore(self, snapshot):
        if snapshot is None:
            self._unbuild()
            return
        values, self._absent, self._sparse = snapshot
        for v, local_values in zip(self._state(), values):
            for component, value in zip(self._local(v), local_values):
                component.assign(value)

    def _local(self, variable):
        """`variable`'s components on this process's replicas (no collective)."""
        if self._strategy is None:
            return (variable,)
        return self._strategy.experimental_local_results(variable)

    def _shares(self):
        """How many processes hold a part of the window: 1 unless multi-worker."""
        if self._replicas() == 1:
            return 1
        local = len(self._strategy.extended.worker_devices)
        return self._strategy.num_replicas_in_sync // local

    def _replicas(self):
        return 1 if self._strategy is None else self._strategy.num_replicas_in_sync

    def _state(self):
        return [
            self.micro_step,
            self.window_weight,
            self.accum_steps,
            self.normalise,
            *self.acc_grads,
            *self.slice_indices,
            *self.slice_counts,
        ]


class _Binding:
    """Holds the window's variables out of sight of `tf.Module` tracking, so
    that they are neither saved with the accumulator nor listed in its
    `variables`."""

    __slots__ = ("variables",)

    def __init__(self, variables):
        self.variables = variables


_VARIABLE_TYPES = (tf.Variable, keras.Variable)


def _same(a, b):
    return a is not None and len(a) == len(b) and all(x is y for x, y in zip(a, b))


def _shapes(variables):
    return [tuple(v.shape) for v in variables]


def _names(variables):
    if variables is None:
        return "(not yet bound)"
    return [getattr(v, "path", None) or getattr(v, "name", "?") for v in variables]


def _local_sum(components):
    total = components[0].numpy()
    for c in components[1:]:
        total = total + c.numpy()
    return total


def _assign_share(components, value):
    # The whole share on the first local replica, zeros on the others: sums
    # over replicas then give back exactly the saved value.
    components[0].assign(value)
    for c in components[1:]:
        c.assign(np.zeros_like(value))


def _assign_all(components, value):
    for c in components:
        c.assign(value)


def _scaled(grad, scale):
    return grad if scale is None else grad * tf.cast(scale, grad.dtype)
