"""The gradient buffers' entries in Keras files (`model.save`, `save_weights`).

Each process writes its share of the window (its replicas' sum), with `shares`
and `replicas`, so a window is only resumed in the setup that made it. Entries
beyond `micro_step`, `window_weight`, `accum_steps`, `acc_grad_<i>` are
optional: older files lack them.
"""

import numpy as np

from keras_accum.window import replicas, slices


def save_window(acc, store):
    """Writes this process's share of `acc`'s window into `store`."""
    if not acc.built:
        return
    strategy = acc.strategy
    here = lambda v: replicas.local(strategy, v)  # noqa: E731
    store["micro_step"] = here(acc.micro_step)[0].numpy()
    store["window_weight"] = replicas.local_sum(here(acc.window_weight))
    store["accum_steps"] = here(acc.accum_steps)[0].numpy()
    store["normalise"] = np.int8(here(acc.normalise)[0].numpy())
    count = len(acc.acc_grads)
    store["has_gradient"] = np.array([i not in acc.layout.absent for i in range(count)], "int8")
    store["shares"] = np.int64(replicas.shares(strategy))
    store["replicas"] = np.int64(replicas.replicas(strategy))
    store["sparse"] = np.array([i in acc.layout.sparse for i in range(count)], "int8")
    store["statistic"] = np.int8(acc.layout.statistic == slices.ABS)
    for i, buf in enumerate(acc.acc_grads):
        if i in acc.layout.sparse:
            _save_slices(acc, store, i)
        else:
            store[f"acc_grad_{i}"] = replicas.local_sum(here(buf))


def _save_slices(acc, store, i):
    # A replica's slices cannot be summed with another's: saved one replica
    # after the other, with each one's count; dense spills give `acc_grad_i`.
    here = lambda v: replicas.local(acc.strategy, v)  # noqa: E731
    storages = here(acc.acc_grads[i])
    counts = [int(c.numpy()) for c in here(acc.slice_counts[i])]
    indices = here(acc.slice_indices[i])
    live = [
        (s, slices.live_indices(ix, n).numpy(), n)
        for s, ix, n in zip(storages, indices, counts)
        if n > 0
    ]
    dense = [s.numpy() for s, n in zip(storages, counts) if n < 0]
    shape = tuple(acc.acc_grads[i].shape)
    dtype = acc.acc_grads[i].dtype.as_numpy_dtype
    store[f"acc_grad_{i}"] = sum(dense[1:], dense[0]) if dense else np.zeros(shape, dtype)
    if slices.ROW_SUMS in counts:
        # Row sums add up over replicas: saved as their sum. A replica still
        # holding an older file's dense sum counts one occurrence per row.
        stats = here(acc.stats_of(i))
        statistic = lambda v: np.abs(v) if acc.layout.statistic == slices.ABS else v**2  # noqa: E731
        store[f"slice_stats_{i}"] = sum(
            st.numpy() if n == slices.ROW_SUMS else statistic(s.numpy())
            for s, st, n in zip(storages, stats, counts)
            if n < 0
        )
        store[f"row_counts_{i}"] = sum(
            ix.numpy().astype("int64") if n == slices.ROW_SUMS else np.ones(shape[0], "int64")
            for ix, n in zip(indices, counts)
            if n < 0
        )
        counts = [slices.ROW_SUMS if n < 0 else n for n in counts]
    store[f"slice_counts_{i}"] = np.array(counts, "int64")
    store[f"slice_indices_{i}"] = np.concatenate(
        [ix for _, ix, _ in live] or [np.zeros([0], "int64")]
    ).astype("int64")
    store[f"slice_values_{i}"] = np.concatenate(
        [s.numpy()[:n] for s, _, n in live] or [np.zeros((0,) + shape[1:], dtype)]
    )


def load_window(acc, store):
    """Restores `acc`'s window from `store`; checked first, changed after."""
    keys = set(store.keys())
    if not keys:
        # Saved by a plain model, or before any training: no open window.
        if acc.built:
            acc.reset()
        return
    n = len([k for k in keys if k.startswith("acc_grad_")])
    expected = {"micro_step", "window_weight", "accum_steps"} | {f"acc_grad_{i}" for i in range(n)}
    optional = {"normalise", "has_gradient", "shares", "replicas", "sparse", "statistic"}
    optional |= {
        f"slice_{what}_{i}" for i in range(n) for what in ("counts", "indices", "values", "stats")
    }
    optional |= {f"row_counts_{i}" for i in range(n)}
    if not expected <= keys or keys - expected - optional:
        raise ValueError(
            "The checkpoint's accumulation state is incomplete or not "
            f"keras_accum's: expected entries {sorted(expected)}, found "
            f"{sorted(keys)}."
        )
    values = [np.asarray(store[f"acc_grad_{i}"]) for i in range(n)]
    if acc.built and acc.shapes() != [v.shape for v in values]:
        raise ValueError(
            "The checkpoint's pending window does not fit this model: its "
            f"gradient buffers have shapes {[v.shape for v in values]}, "
            f"this model's trainable variables have {acc.shapes()}."
        )
        # np.asarray: older Keras (3.8) hands back h5py datasets, not arrays.
    entry = lambda key: np.asarray(store[key])  # noqa: E731
    micro_step = int(entry("micro_step"))
    strategy = acc.strategy
    # Files written before these entries existed hold the whole window.
    saved = (
        int(entry("shares")) if "shares" in keys else 1,
        int(entry("replicas")) if "replicas" in keys else replicas.replicas(strategy),
    )
    here = (replicas.shares(strategy), replicas.replicas(strategy))
    if micro_step and saved != here:
        # Buffers hold each process's share, summed over replicas whose losses
        # Keras divided by their number: neither can be re-split.
        raise ValueError(
            f"The checkpoint's pending window ({micro_step} micro-batches) "
            f"was saved by {saved[0]} process(es) with {saved[1]} "
            f"replica(s) in all, but this model runs in {here[0]} with "
            f"{here[1]}. Restore it in the same setup, or load weights "
            "saved at a window boundary (e.g. an epoch-end backup)."
        )
    weight = np.float32(entry("window_weight"))
    if not acc.built:
        acc.build(values, accum_steps=int(entry("accum_steps")))
        strategy = acc.strategy
    local = lambda v: replicas.local(strategy, v)  # noqa: E731
    for buf, value in zip(acc.acc_grads, values):
        replicas.assign_share(local(buf), value)
    replicas.assign_share(local(acc.window_weight), weight)
    replicas.assign_all(local(acc.micro_step), micro_step)
    replicas.assign_all(local(acc.accum_steps), int(entry("accum_steps")))
    if "normalise" in keys:
        replicas.assign_all(local(acc.normalise), bool(entry("normalise")))
    layout = acc.layout
    if "has_gradient" in keys:
        has = entry("has_gradient")
        layout = layout._replace(absent=frozenset(int(i) for i in np.flatnonzero(has == 0)))
    # Files from before slices hold a dense sum (count -1), applied as such.
    legacy = "sparse" not in keys
    layout = layout._replace(
        sparse=frozenset(() if legacy else (int(i) for i in np.flatnonzero(entry("sparse"))))
    )
    if "statistic" in keys:
        layout = layout._replace(statistic=slices.ABS if int(entry("statistic")) else slices.SQUARE)
    acc.layout = layout
    for count in acc.slice_counts:
        replicas.assign_all(local(count), slices.DENSE if legacy and micro_step else 0)
    for i in layout.sparse:
        _load_slices(acc, store, i)


def _load_slices(acc, store, i):
    counts = [int(c) for c in np.asarray(store[f"slice_counts_{i}"])]
    local = lambda v: replicas.local(acc.strategy, v)  # noqa: E731
    components = list(
        zip(local(acc.acc_grads[i]), local(acc.slice_indices[i]), local(acc.slice_counts[i]))
    )
    if len(counts) != len(components):
        # Only a window of no micro-batch gets here (others are refused above).
        return
    indices = np.asarray(store[f"slice_indices_{i}"])
    values = np.asarray(store[f"slice_values_{i}"])
    dense = np.asarray(store[f"acc_grad_{i}"])
    row_sums = slices.ROW_SUMS in counts
    if row_sums:
        stats = local(acc.stats_of(i))
        shares = [
            (dense, np.asarray(store[f"slice_stats_{i}"]), np.asarray(store[f"row_counts_{i}"]))
        ]
    start, dense_given = 0, False
    for r, ((storage, index, count), n) in enumerate(zip(components, counts)):
        count.assign(n)
        if n < 0:
            # The dense share (or row sums) on the first replica that spilled,
            # zeros on the others: summed over replicas, the saved value.
            if row_sums:
                share = shares[0] if not dense_given else [np.zeros_like(a) for a in shares[0]]
                storage.assign(share[0])
                stats[r].assign(share[1])
                index.assign(share[2].astype(index.dtype.as_numpy_dtype))
            else:
                storage.assign(np.zeros_like(dense) if dense_given else dense)
            dense_given = True
        elif n > 0:
            rows = slice(start, start + n)
            slices.write_slices(storage, index, count, values[rows], indices[rows])
            start += n


def snapshot(acc):
    """This process's part of the window as numpy (None if unbuilt), for `restore`."""
    if not acc.built:
        return None
    values = [[c.numpy() for c in replicas.local(acc.strategy, v)] for v in acc.state()]
    return values, acc.layout


def restore(acc, snapshot):
    """Puts back a `snapshot(acc)`: after a failed load, all as it was."""
    if snapshot is None:
        acc.unbuild()
        return
    values, acc.layout = snapshot
    for v, local_values in zip(acc.state(), values):
        for component, value in zip(replicas.local(acc.strategy, v), local_values):
            component.assign(value)
