"""Memory worker: peak resident memory that one `fit` adds, in a fresh process.

Started by `benchmarks.run`, one fresh Python per configuration, so that no
configuration inherits another's allocator state or traced graphs:

    python -m benchmarks.memory --config "AccumModel b x N" --json out.json

Method (Linux): everything that is not training is done first: TensorFlow
is imported, the model built and compiled, the optimizer's slots created, and
the data turned into a batched `tf.data.Dataset`. Then the process's peak
RSS (VmHWM in /proc/self/status) is reset to its current RSS by writing "5"
to /proc/self/clear_refs, `fit` runs one epoch of two updates' worth of
samples (2*N*b), and the result is VmHWM after `fit` minus VmRSS before it:
the most memory `fit` itself ever held at once. That includes tracing the
train step, which is about the same for every configuration, and for
AccumModel its gradient buffers, which it creates in `fit`.

The driver starts this process with MALLOC_MMAP_THRESHOLD_=131072. That
pins glibc's mmap threshold, which glibc otherwise raises as large blocks are
freed, so every tensor buffer above 128 KiB is mmapped and returned to the
system as soon as it is freed, and RSS follows the memory that training
really holds. With the adaptive default, freed activation buffers stay cached
in malloc arenas at the whim of the allocation history, and the same
configuration measured in two processes differed by tens of MiB.

Where /proc/self/clear_refs cannot be written the peak cannot be reset, and
`resource.getrusage(RUSAGE_SELF).ru_maxrss` after `fit` minus VmRSS before it
is used instead (the output names the method used); it is the same number as
long as nothing before `fit` used more memory than `fit` does.
"""

import argparse
import gc
import json
import os
import resource
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # quiet TensorFlow start-up

import numpy as np  # noqa: E402

from benchmarks import workloads  # noqa: E402

MIB = 1024 * 1024


def _status_bytes(field):
    """A `kB` field of /proc/self/status (e.g. VmRSS, VmHWM) in bytes, or None."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _reset_peak():
    """Resets VmHWM to the current RSS; returns whether that was possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _maxrss_bytes():
    # ru_maxrss is in kilobytes on Linux and in bytes on macOS.
    scale = 1 if sys.platform == "darwin" else 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def fit_peak_growth(fit):
    """`{"growth_mib", "method"}`: the peak resident memory `fit()` adds (the
    method above)."""
    before = _status_bytes("VmRSS")
    if before is not None and _reset_peak():
        fit()
        return {"growth_mib": (_status_bytes("VmHWM") - before) / MIB, "method": "VmHWM"}
    before = before if before is not None else _maxrss_bytes()
    fit()
    return {"growth_mib": (_maxrss_bytes() - before) / MIB, "method": "ru_maxrss"}


def tensor_peak(fit):
    """`{"growth_mib", "method"}`: the most tensor memory `fit()` holds at
    once above what is held before it, from TensorFlow's own allocator
    statistics: the process must run with TF_CPU_ALLOCATOR_USE_BFC=true
    (the CPU's allocator keeps none otherwise). Tensors only: not the
    traced graphs, which RSS counts."""
    import tensorflow as tf

    before = tf.config.experimental.get_memory_info("CPU:0")["current"]
    tf.config.experimental.reset_memory_stats("CPU:0")
    fit()
    peak = tf.config.experimental.get_memory_info("CPU:0")["peak"]
    return {"growth_mib": (peak - before) / MIB, "method": "BFC peak"}


def requested_peak(fit):
    """`{"growth_bytes", "method"}`: the most bytes that tensors made during
    `fit()` asked TensorFlow's allocator for and held at once. Not what the
    allocator handed out (`tensor_peak`): TensorFlow's BFC allocator gives a
    request a whole free chunk when the best fit is under twice its size, so
    the same tensors can take up to twice their bytes, by which chunks the
    run before happened to free (as it does on a GPU). Read from the
    profiler's allocation events (requested bytes by address, in order);
    tensors made before `fit` and freed in it are not subtracted."""
    import tempfile

    import tensorflow as tf

    with tempfile.TemporaryDirectory() as logdir:
        tf.profiler.experimental.start(logdir)
        try:
            fit()
        finally:
            tf.profiler.experimental.stop()
        events = _allocation_events(logdir)
    held, live, peak = 0, {}, 0
    for _, allocated, address, requested in events:
        if allocated:
            held += requested - live.get(address, 0)
            live[address] = requested
            peak = max(peak, held)
        elif address in live:
            held -= live.pop(address)
    return {"growth_bytes": peak, "method": "profiler: requested bytes"}


def _allocation_events(logdir):
    # `(time, allocated, address, requested bytes)` of every allocation and
    # deallocation in the profile, by time.
    from pathlib import Path

    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    events = []
    for path in Path(logdir).rglob("*.xplane.pb"):
        space = xplane_pb2.XSpace()
        space.ParseFromString(path.read_bytes())
        for plane in space.planes:
            stat_names = {k: v.name for k, v in plane.stat_metadata.items()}
            kinds = {
                k: v.name == "MemoryAllocation"
                for k, v in plane.event_metadata.items()
                if v.name in ("MemoryAllocation", "MemoryDeallocation")
            }
            for line in plane.lines:
                for event in line.events:
                    if event.metadata_id not in kinds:
                        continue
                    stats = {
                        stat_names.get(s.metadata_id): s.int64_value or s.uint64_value
                        for s in event.stats
                    }
                    events.append(
                        (
                            line.timestamp_ns * 1000 + event.offset_ps,
                            kinds[event.metadata_id],
                            stats.get("addr"),
                            stats.get("requested_bytes", 0),
                        )
                    )
    events.sort(key=lambda e: e[0])
    return events


def configuration(name):
    """`(implementation, batch_size, input_batch)` of a memory configuration.

    `input_batch` is the batch the dataset delivers; the model trains on
    `batch_size`. "plain b, input in N*b batches" is the plain model at the
    micro-batch fed by a pipeline that holds batches of N*b, as
    micro_batch_size's is: the input a step is handed is part of what `fit`
    holds, so this is the micro-batch's memory with micro_batch_size's input.
    """
    n, b = workloads.ACCUM_STEPS, workloads.MICRO_BATCH
    return {
        "plain N*b": ("plain", n * b, n * b),
        "plain b": ("plain", b, b),
        "AccumModel b x N": ("AccumModel", b, b),
        "plain b, input in N*b batches": ("plain", b, n * b),
        "micro_batch_size b of N*b": ("micro_batch_size", n * b, n * b),
    }[name]


def run(config, quick):
    """Measures the peak RSS growth of one `fit` of `config`; returns a dict."""
    import tensorflow as tf

    implementation, batch_size, input_batch = configuration(config)
    workload = workloads.memory_cnn(quick)
    model = workloads.make_model(implementation, workload)
    # Optimizer slots are the same for every configuration: create them
    # before the measurement rather than count them in it.
    model.optimizer.build(model.trainable_variables)
    x, y = workload.data(np.random.default_rng(workloads.SEED))
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(input_batch)
    if input_batch != batch_size:
        dataset = dataset.rebatch(batch_size)
    weight_bytes = sum(int(np.prod(v.shape)) * 4 for v in model.trainable_variables)
    gc.collect()

    before = _status_bytes("VmRSS")
    if before is not None and _reset_peak():
        method = "VmHWM after fit - VmRSS before fit (peak reset via /proc/self/clear_refs)"
        model.fit(dataset, epochs=1, shuffle=False, verbose=0)
        peak = _status_bytes("VmHWM")
    else:
        method = "ru_maxrss after fit - RSS before fit (peak could not be reset)"
        before = before if before is not None else _maxrss_bytes()
        model.fit(dataset, epochs=1, shuffle=False, verbose=0)
        peak = _maxrss_bytes()

    return {
        "config": config,
        "implementation": implementation,
        "batch_size": batch_size,
        "input_batch": input_batch,
        "accum_steps": workloads.ACCUM_STEPS if implementation == "AccumModel" else 1,
        "micro_batch_size": (
            workloads.MICRO_BATCH if implementation == "micro_batch_size" else None
        ),
        "description": workload.description,
        "samples": workload.samples,
        "rss_before_mib": before / MIB,
        "peak_mib": peak / MIB,
        "growth_mib": (peak - before) / MIB,
        "weight_copy_mib": weight_bytes / MIB,
        "parameters": int(model.count_params()),
        "updates": int(model.optimizer.iterations.numpy()),
        "method": method,
        "malloc_mmap_threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_"),
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, choices=workloads.MEMORY_CONFIGS)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", required=True, help="where to write the result")
    args = parser.parse_args(argv)
    result = run(args.config, args.quick)
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
