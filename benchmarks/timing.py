"""Timing worker: one workload, every implementation, rotated epoch by epoch.

Started by `benchmarks.run` in a fresh Python per workload:

    python -m benchmarks.timing --workload mlp --rounds 8 --json out.json

All implementations are built in this one process from the same seed and
trained on the same data at the same micro-batch size. Each round trains
every implementation for one epoch, in an order rotated by one place per
round. Interleaving epochs (rather than timing one implementation's epochs,
then the next's) exposes all of them to the same background load on a
shared machine, so a paired ratio within a round cancels most of it; the
rotation keeps any first/last-in-round effect from favouring one of them.
Writes raw per-epoch times as JSON; `report` takes medians and ratios.
"""

import argparse
import json
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # quiet TensorFlow start-up

import numpy as np  # noqa: E402

from benchmarks import workloads  # noqa: E402


def _epoch_timer():
    """A callback recording the wall-clock time of each epoch (`seconds`),
    and this process's CPU time (`cpu_seconds`, all its threads: another
    process's load delays the wall clock, not our CPU time).

    It is appended after the model's own callbacks, so its `on_epoch_end`
    runs after AccumModel's window flush: everything an epoch costs is timed,
    `fit`'s one-off setup (data adapter, callbacks) is not.
    """
    import keras

    class EpochTimer(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.seconds = []
            self.cpu_seconds = []

        def on_epoch_begin(self, epoch, logs=None):
            self._start = time.perf_counter(), time.process_time()

        def on_epoch_end(self, epoch, logs=None):
            wall, cpu = self._start
            self.seconds.append(time.perf_counter() - wall)
            self.cpu_seconds.append(time.process_time() - cpu)

    return EpochTimer()


def train_one_epoch(model, x, y, batch_size=workloads.MICRO_BATCH, cpu=None):
    """Trains `model` for one epoch of `batch_size`; returns its seconds
    (and appends its CPU seconds to the list `cpu`, when given)."""
    timer = _epoch_timer()
    model.fit(
        x,
        y,
        batch_size=batch_size,
        epochs=1,
        shuffle=False,  # the same micro-batches, in the same order, for all
        verbose=0,
        callbacks=[timer],
    )
    if cpu is not None:
        cpu.append(timer.cpu_seconds[0])
    return timer.seconds[0]


def paired_train_steps(models, x, y, batch_size, rounds):
    """Seconds per train step of each of `models` (`{name: model}`, traced
    already) on batches of `x, y`, called as `fit` calls it and its logs
    read as `fit` reads them: one step of each per round, in an order
    rotated by one place per round; round 0 is a warm-up, dropped. Returns
    `{name: [seconds per round]}`: ratios within a round are paired."""
    import tensorflow as tf

    if isinstance(x, list):
        x = tuple(x)
    iterators = {
        name: iter(
            tf.data.Dataset.from_tensor_slices((x, y))
            .batch(batch_size, drop_remainder=True)
            .repeat()
        )
        for name in models
    }
    names = list(models)
    seconds = {name: [] for name in names}
    for index in range(rounds + 1):
        shift = index % len(names)
        times = {}
        for name in names[shift:] + names[:shift]:
            start = time.perf_counter()
            float(models[name].train_function(iterators[name])["loss"])
            times[name] = time.perf_counter() - start
        if index:
            for name in names:
                seconds[name].append(times[name])
    return seconds


def _describe(error):
    return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"[:300]


def run(workload_name, rounds, quick):
    """Trains every implementation for `rounds` epochs, interleaved.

    Returns:
        A JSON-able dict: the per-round epoch times of each implementation
        (None where it did not run), the implementations that could not run
        and why, and a weight comparison against AccumModel.
    """
    import keras
    import tensorflow as tf

    workload = workloads.timing_workload(workload_name, quick)
    x, y = workload.data(np.random.default_rng(workloads.SEED))

    models, unavailable = {}, {}
    for name in workloads.IMPLEMENTATIONS:
        try:
            models[name] = workloads.make_model(name, workload)
        except Exception as error:  # an optional implementation may not work
            if name in workloads.REQUIRED:
                raise
            unavailable[name] = _describe(error)

    # The price of the memory saved: the modes are timed in the same rounds,
    # against the plain model trained with the big batch itself.
    batch_sizes = {name: workloads.MICRO_BATCH for name in models}
    for mode in workloads.PRICE_MODES:
        models[mode], batch_sizes[mode] = workloads.make_price_model(mode, workload)

    names_timed = (*workloads.IMPLEMENTATIONS, *workloads.PRICE_MODES)
    seconds = {name: [None] * rounds for name in names_timed}
    cpu_seconds = {name: [None] * rounds for name in names_timed}
    for round_index in range(rounds):
        names = list(models)
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            try:
                cpu = []
                seconds[name][round_index] = train_one_epoch(
                    models[name], x, y, batch_sizes[name], cpu
                )
                cpu_seconds[name][round_index] = cpu[0]
            except Exception as error:
                if name in workloads.REQUIRED:
                    raise
                unavailable[name] = _describe(error)
                del models[name]
        print(
            f"  {workload_name} round {round_index + 1}/{rounds}: "
            + ", ".join(f"{n} {seconds[n][round_index]:.3f}s" for n in models),
            flush=True,
        )

    # A sanity check that the accumulating implementations did the same
    # training: after the same epochs from the same start, their weights
    # should agree with AccumModel's up to float rounding (and, for the
    # embedding with Adam, up to how each treats sparse gradients).
    reference = models["AccumModel"].get_weights()
    weight_difference = {}
    for name, model in models.items():
        if name in ("AccumModel", "plain") or name in workloads.PRICE_MODES:
            continue
        weight_difference[name] = max(
            float(np.max(np.abs(a - b))) for a, b in zip(model.get_weights(), reference)
        )

    return {
        "workload": workload.name,
        "description": workload.description,
        "samples": workload.samples,
        "micro_batch": workloads.MICRO_BATCH,
        "accum_steps": workloads.ACCUM_STEPS,
        "steps_per_epoch": workload.samples // workloads.MICRO_BATCH,
        "parameters": int(models["plain"].count_params()),
        "rounds": rounds,
        "seconds": seconds,
        "cpu_seconds": cpu_seconds,
        "unavailable": unavailable,
        "max_weight_difference_vs_AccumModel": weight_difference,
        "price_accum_steps": workloads.PRICE_ACCUM_STEPS,
        "price_batch_sizes": {m: batch_sizes[m] for m in workloads.PRICE_MODES},
        "max_weight_difference_vs_big_batch": {
            mode: max(
                float(np.max(np.abs(a - b)))
                for a, b in zip(models[mode].get_weights(), models["big batch"].get_weights())
            )
            for mode in workloads.PRICE_MODES
            if mode != "big batch" and mode in models
        },
        "versions": _versions(tf, keras),
    }


def _versions(tf, keras):
    from importlib import metadata

    try:
        gradient_accumulator = metadata.version("gradient-accumulator")
    except metadata.PackageNotFoundError:
        gradient_accumulator = None
    return {
        "tensorflow": tf.__version__,
        "keras": keras.__version__,
        "numpy": np.__version__,
        "gradient-accumulator": gradient_accumulator,
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", required=True, choices=workloads.ALL_WORKLOADS)
    parser.add_argument("--rounds", type=int, required=True)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", required=True, help="where to write the result")
    args = parser.parse_args(argv)
    result = run(args.workload, args.rounds, args.quick)
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
