"""Under XLA (`jit_compile=True`, Keras's default on one GPU): every way to
accumulate beside the built-in, the plain model and the floor, in one process.

    python -m benchmarks.xla                       # 31 rounds, every workload
    python -m benchmarks.xla --rounds 101 --workloads embedding
    python -m benchmarks.xla --quick               # smoke run, not a measurement
    python -m benchmarks.xla --memory              # also each mode's peak tensor memory
    python -m benchmarks.xla --workloads transformer --out benchmarks/xla_transformer.json

For each workload (benchmarks/workloads.py: mlp, cnn, embedding by
default; `--workloads transformer` for the 134-variable decoder), compiled
with `jit_compile=True`, Adam, micro-batch b = 32, N = 4 (PRICE_ACCUM_STEPS):

- `built-in`: `keras.Model`, `Adam(gradient_accumulation_steps=N)`, batches of b;
- `step mode`: `AccumModel(accum_steps=N)`, batches of b; `+ noise scale`
  the same with `noise_scale=True`;
- `micro_batch_size`: `AccumModel(micro_batch_size=b)`, batches of N*b;
  `+ noise scale` likewise;
- `plain at b`: `keras.Model`, batches of b (an update per micro-batch);
- `big batch`: `keras.Model`, batches of N*b;
- `floor`: one XLA-compiled `tf.function` with nothing but the forward and
  backward pass of N micro-batches of b, their gradients summed, and Adam's
  update: the least any accumulation of N micro-batches can cost; `bare big
  batch` the same function for one batch of N*b (Keras's own step costs
  what it adds over this);
- `floor, one at a time`: the floor with each micro-batch waiting for the
  sum before it, as `micro_batch_size`'s do (the unordered floor may hold
  every micro-batch's gradient at once: see `--memory`);
- `floor in Keras's step`: that function as a `keras.Model`'s `train_step`
  run by `fit`'s train function (its loss through `compute_loss`, the loss
  tracker updated): `micro_batch_size / floor in Keras's step` is what
  keras_accum adds, `floor in Keras's step / floor, one at a time` what
  Keras's step does.

Each round times one window (N*b samples: N calls of the train function at
b, or one at N*b) of every mode, in an order rotated by one place per round;
only ratios within a round are used (paired): the median over rounds, with
a 95% confidence interval of the median, by wall clock (`ratios`) and by
this process's CPU time (`cpu_ratios`: another process's load delays the
wall clock, not our CPU time). Machine-independent beside the
timings: from each compiled step's optimized HLO
(`experimental_get_compiler_ir`), the bytes its instructions read and write
(`hlo_bytes`), per window: N-1 calls that only accumulate and one that also
updates (each conditional counted by the branch it takes), or one call.
With `--memory`, each mode's peak tensor memory over one window, read from
TensorFlow's allocator in a process of its own.

Writes benchmarks/xla.json (`--out`) and prints Markdown tables
(benchmarks/xla.md holds the committed run's).
"""

import argparse
import datetime
import json
import os
import re
import statistics
import sys
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # quiet TensorFlow start-up

import numpy as np  # noqa: E402

from benchmarks import memory, workloads  # noqa: E402
from benchmarks.noise_scale_cost import median_interval, rotated_rounds  # noqa: E402

N, B = workloads.PRICE_ACCUM_STEPS, workloads.MICRO_BATCH

# How the floors are made: a bare XLA-compiled function (`Bare`).
BARE = ("bare", "bare in order")

# mode: (how it is made, batch size, train-function calls per window)
MODES = {
    "built-in": ("builtin", B, N),
    "step mode": (dict(accum_steps=N), B, N),
    "step mode + noise scale": (dict(accum_steps=N, noise_scale=True), B, N),
    "micro_batch_size": (dict(micro_batch_size=B), N * B, 1),
    "micro_batch_size + noise scale": (dict(micro_batch_size=B, noise_scale=True), N * B, 1),
    "plain at b": ("plain", B, N),
    "big batch": ("plain", N * B, 1),
    "floor": ("bare", B, N),
    "floor, one at a time": ("bare in order", B, N),
    "floor in Keras's step": ("keras floor", N * B, 1),
    "bare big batch": ("bare", N * B, 1),
}

# (numerator, denominator) of each ratio reported, paired within a round.
RATIOS = [
    ("step mode", "built-in"),
    ("micro_batch_size", "built-in"),
    ("step mode", "plain at b"),
    ("micro_batch_size", "big batch"),
    ("micro_batch_size", "floor"),
    ("micro_batch_size", "floor in Keras's step"),
    ("floor in Keras's step", "floor, one at a time"),
    ("floor, one at a time", "floor"),
    ("floor", "bare big batch"),
    ("big batch", "bare big batch"),
    ("step mode + noise scale", "step mode"),
    ("micro_batch_size + noise scale", "micro_batch_size"),
]


def _keras_model(workload, how, jit_compile=True):
    import keras

    import keras_accum

    keras.utils.set_random_seed(workloads.SEED)
    inputs, outputs = workload.build()
    optimizer = keras.optimizers.Adam(workloads.LEARNING_RATE)
    if how == "gradient-accumulator":  # PyPI gradient-accumulator, if installed
        from gradient_accumulator import GradientAccumulateModel

        model = GradientAccumulateModel(accum_steps=N, inputs=inputs, outputs=outputs)
    elif how == "builtin":
        model = keras.Model(inputs, outputs)
        optimizer = keras.optimizers.Adam(workloads.LEARNING_RATE, gradient_accumulation_steps=N)
    elif how == "plain":
        model = keras.Model(inputs, outputs)
    elif how == "keras floor":
        model = _keras_floor(inputs, outputs)
    else:
        model = keras_accum.AccumModel(inputs, outputs, **how)
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=jit_compile,
    )
    return model


class Bare:
    """The floor: the forward and backward pass of `micro_batches` batches,
    gradients summed (an embedding's occurrences joined, as in the big
    batch's gradient), Adam's update, in one XLA-compiled `tf.function`. It
    takes the window's `micro_batches` batches at once (as `micro_batch_size`
    does) and means them as the big batch's gradient does. `in_order`: each
    micro-batch waits for the sum before it (`microbatch.after`), as
    `micro_batch_size`'s do; else XLA may hold them all. `jit_compile=False`:
    the same `tf.function` as a TensorFlow graph."""

    def __init__(self, workload, micro_batches, in_order=False, jit_compile=True):
        import keras
        import tensorflow as tf

        keras.utils.set_random_seed(workloads.SEED)
        inputs, outputs = workload.build()
        self.model = keras.Model(inputs, outputs)
        self.optimizer = keras.optimizers.Adam(workloads.LEARNING_RATE)
        self.optimizer.build(self.model.trainable_variables)
        self.micro_batches = micro_batches
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        variables = self.model.trainable_variables

        @tf.function(jit_compile=jit_compile)
        def step(x, y):
            total, losses = summed_gradients(
                x,
                y,
                micro_batches,
                in_order,
                lambda xs, ys: loss(ys, self.model(xs, training=True)),
                variables,
            )
            self.optimizer.apply(total, variables)
            return losses[-1]

        self.step = step


def summed_gradients(x, y, micro_batches, in_order, loss_of, variables):
    """`(gradients summed, losses)` of `micro_batches` equal cuts of `x, y`,
    each loss (`loss_of(xs, ys)`) divided by `micro_batches` as the big
    batch's mean is. `in_order`: each micro-batch waits for the sum before
    it (`microbatch.after`), as `micro_batch_size`'s do: one held at a time."""
    import tensorflow as tf

    from keras_accum import microbatch

    total, losses = None, []
    for xs, ys in zip(tf.split(x, micro_batches), tf.split(y, micro_batches)):
        if in_order and total is not None:
            xs, ys = microbatch.after(total, (xs, ys))
        with tf.GradientTape() as tape:
            value = loss_of(xs, ys)
            scaled = value / micro_batches
        grads = tape.gradient(scaled, variables)
        losses.append(value)
        total = grads if total is None else [_plus(a, g) for a, g in zip(total, grads)]
    return total, losses


def _keras_floor(inputs, outputs):
    """The floor, one at a time, as a `keras.Model`'s `train_step` run by
    `fit`'s train function: its loss through `compute_loss`, the loss
    tracker updated. Beside the bare function, it is what Keras's step
    costs; beside `micro_batch_size`, what keras_accum adds to it."""
    import keras
    import tensorflow as tf

    class KerasFloor(keras.Model):
        def train_step(self, data):
            x, y = data
            total, losses = summed_gradients(
                x,
                y,
                N,
                True,
                lambda xs, ys: self.compute_loss(xs, ys, self(xs, training=True)),
                self.trainable_variables,
            )
            self.optimizer.apply(total, self.trainable_variables)
            tracker = self.metrics[0]  # the loss tracker
            tracker.update_state(tf.add_n(losses) / N, sample_weight=tf.shape(x)[0])
            return {"loss": tracker.result()}

    return KerasFloor(inputs, outputs)


def _plus(a, b):
    # An embedding's gradients as the big batch's: one IndexedSlices of all
    # the occurrences (Keras's sparse update reads each).
    import tensorflow as tf

    if isinstance(a, tf.IndexedSlices):
        return tf.IndexedSlices(
            tf.concat([a.values, b.values], 0),
            tf.concat([a.indices, b.indices], 0),
            a.dense_shape,
        )
    return a + b


def _batches(x, y, batch_size):
    import tensorflow as tf

    dataset = tf.data.Dataset.from_tensor_slices((x, y))
    return iter(dataset.batch(batch_size, drop_remainder=True).repeat())


def _timer(mode, workload, x, y, hlo=True, jit_compile=True, model_out=None):
    """`(time one window, hlo bytes per window)` of `mode` on `x, y` (the
    bytes None when not `hlo` or not `jit_compile`); timing one window
    returns `(wall seconds, process CPU seconds)`. `mode` is a `MODES` name
    or a `(how, batch size, calls per window)` of its own. The model (or
    the floor's `Bare`) is appended to `model_out` when given, after one
    epoch of `fit` (the floor: one call)."""
    import time

    how, batch_size, calls = MODES[mode] if isinstance(mode, str) else mode
    hlo = hlo and jit_compile
    if how in BARE:
        bare = Bare(
            workload,
            N if calls == N else 1,
            in_order=how == "bare in order",
            jit_compile=jit_compile,
        )
        batches = _batches(x, y, N * B)
        first = next(batches)
        bare.step(*first)
        compiled = bare.step
        if model_out is not None:
            model_out.append(bare)

        def one_window():
            wall, cpu = time.perf_counter(), time.process_time()
            float(bare.step(*next(batches)))
            return time.perf_counter() - wall, time.process_time() - cpu

        return one_window, _hlo_bytes(compiled, *first) if hlo else None
    import tensorflow as tf

    model = _keras_model(workload, how, jit_compile)
    model.fit(x, y, batch_size=batch_size, epochs=1, shuffle=False, verbose=0)
    if model_out is not None:
        model_out.append(model)
    batches = _batches(x, y, batch_size)
    # The step as Keras compiles it (its train function calls `train_step`
    # in a `tf.function(jit_compile=True)`), traced once more to read it.
    step_bytes = (
        _hlo_bytes(tf.function(model.train_step, jit_compile=True), next(batches)) if hlo else None
    )

    def one_window():
        function = model.train_function
        wall, cpu = time.perf_counter(), time.process_time()
        for _ in range(calls):
            logs = function(batches)
        float(logs["loss"])  # as fit reads its logs
        return time.perf_counter() - wall, time.process_time() - cpu

    return one_window, step_bytes


def peak_of(name, mode, quick):
    """The most tensor memory one window of `mode` holds above what is held
    before it, in bytes, from TensorFlow's allocator (this process must
    start with TF_CPU_ALLOCATOR_USE_BFC=true: `peaks` starts one per mode)."""
    workload = workloads.timing_workload(name, quick)
    x, y = workload.data(np.random.default_rng(workloads.SEED))
    one_window, _ = _timer(mode, workload, x, y, hlo=False)
    one_window()
    return round(memory.tensor_peak(one_window)["growth_mib"] * memory.MIB)


def peaks(name, quick):
    """`{mode: peak_of(...)}`, each mode in a fresh process."""
    import subprocess

    env = {**os.environ, "TF_CPU_ALLOCATOR_USE_BFC": "true"}
    result = {}
    for mode in MODES:
        args = [sys.executable, "-m", "benchmarks.xla", "--peak-of", name, mode]
        done = subprocess.run(
            args + (["--quick"] if quick else []), env=env, capture_output=True, text=True
        )
        if done.returncode:
            raise RuntimeError(f"{name}, {mode}: {done.stderr[-3000:]}")
        result[mode] = int(done.stdout.strip().splitlines()[-1])
    return result


def _hlo_bytes(function, *args):
    """Bytes the optimized HLO's instructions read and write (see hlo_bytes)."""
    try:
        text = function.experimental_get_compiler_ir(*args)(stage="optimized_hlo")
    except Exception:  # noqa: BLE001 - a measurement, not a requirement
        return None
    return hlo_bytes(text)


_SIZES = {
    "f32": 4,
    "s32": 4,
    "u32": 4,
    "f16": 2,
    "bf16": 2,
    "f64": 8,
    "s64": 8,
    "u64": 8,
    "pred": 1,
    "s8": 1,
    "u8": 1,
}
_SHAPE = re.compile(r"\b(f32|s32|u32|f16|bf16|f64|s64|u64|pred|s8|u8)\[([0-9,]*)\]")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?(%[\w.\-]+) = (.*?) ([\w\-]+)\((.*)$")
# Instructions that move no data of their own.
_FREE = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast", "after-all"}


def _bytes_of_shapes(text):
    total = 0
    for dtype, dims in _SHAPE.findall(text):
        count = 1
        for d in filter(None, dims.split(",")):
            count *= int(d)
        total += count * _SIZES[dtype]
    return total


def _computations(text):
    # {name: [instruction lines]}, and the entry computation's name.
    computations, entry, name = {}, None, None
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.endswith("{") and " -> " in stripped:
            head = stripped.split(" (", 1)[0]
            name = head.split()[-1]
            if head.startswith("ENTRY"):
                entry = name
            computations[name] = []
        elif stripped == "}":
            name = None
        elif name is not None:
            computations[name].append(stripped)
    return computations, entry


# Ops that read or write only the rows they index, not their whole operand
# (a slice too: a micro-batch waits on one element of each gradient).
_INDEXED_READS = {"gather", "dynamic-slice", "slice"}
_INDEXED_WRITES = {"scatter", "dynamic-update-slice"}


def _indexed_parameters(lines):
    # A fused computation's parameters that it only indexes into (operand 0
    # of a gather, dynamic slice, scatter or dynamic update), and whether
    # its root writes in place (a scatter or dynamic update).
    params, indexed, in_place = {}, set(), False
    for line in lines:
        match = _INSTRUCTION.match(line)
        if not match:
            continue
        result, _, opcode, rest = match.groups()
        if opcode == "parameter":
            params[result] = int(rest.split(")", 1)[0])
        elif opcode in _INDEXED_READS | _INDEXED_WRITES:
            first = re.findall(r"%[\w.\-]+", rest)[:1]
            if first and first[0] in params:
                indexed.add(params[first[0]])
        if line.startswith("ROOT") and opcode in _INDEXED_WRITES:
            in_place = True
    return indexed, in_place


def hlo_bytes(text):
    """`(accumulate, of which copies, update, of which copies)`: the bytes an
    optimized HLO module reads and writes in one call, and how many of them
    are whole-buffer copies (XLA puts them around a conditional's branches
    in the module as read for inspection, whose variables are not aliased
    to its results; whether the executable Keras runs makes them is not
    seen here: an embedding's accumulating micro-batch showed three copies
    of its 51 MB table and took 1.4-2.2 ms in all): each instruction reads its operands and writes its
    result, by their shapes; a fusion counts as one instruction (its body
    stays in registers); tuples, parameters and constants move nothing; a
    gather, scatter or slice (or a fusion of one) moves the rows it indexes
    (its result or updates), not the whole operand. Conditionals: for
    `accumulate` each takes its cheaper branch (a micro-batch that only
    adds); for `update` the entry's take their dearer branch (the window's
    update) and those inside it their cheaper (the window's own slices, not
    the fallback for a window begun elsewhere). Machine-independent: an
    estimate of the memory traffic a GPU would see, not of time."""
    computations, entry = _computations(text)

    def cost(name, pick, inner):
        # (bytes, of which copies) of one call of computation `name`.
        sizes, total, copies = {}, 0, 0
        for line in computations.get(name, []):
            match = _INSTRUCTION.match(line)
            if not match:
                continue
            result, shape, opcode, rest = match.groups()
            sizes[result] = _bytes_of_shapes(shape)
            if opcode in _FREE:
                continue
            if opcode == "conditional":
                branches = re.findall(r"(?:true|false)_computation=(%[\w.\-]+)", rest)
                if "branch_computations={" in rest:
                    listed = rest.split("branch_computations={", 1)[1].split("}", 1)[0]
                    branches += re.findall(r"%[\w.\-]+", listed)
                if branches:
                    taken = pick((cost(b, inner, inner) for b in branches), key=lambda c: c[0])
                    total, copies = total + taken[0], copies + taken[1]
                continue
            operands = re.findall(r"%[\w.\-]+", rest.split("),", 1)[0])
            indexed, in_place = set(), opcode in _INDEXED_WRITES
            if opcode in _INDEXED_READS | _INDEXED_WRITES:
                indexed = {0}
            elif opcode == "fusion":
                called = re.search(r"calls=(%[\w.\-]+)", rest)
                if called:
                    indexed, in_place = _indexed_parameters(computations.get(called.group(1), []))
            moved = [0 if k in indexed else sizes.get(o, 0) for k, o in enumerate(operands)]
            written = sizes[result]
            if in_place:
                # Writes the updates' rows into a buffer it does not copy.
                written = max(moved[1:], default=0)
            elif indexed:
                moved = [written if k in indexed else m for k, m in enumerate(moved)]
            total += written + sum(moved)
            if opcode == "copy":
                copies += written + sum(moved)
        return total, copies

    return (*cost(entry, min, min), *cost(entry, max, min))


def run_workload(name, rounds, quick, memory=False):
    workload = workloads.timing_workload(name, quick)
    x, y = workload.data(np.random.default_rng(workloads.SEED))
    timers, hlo = {}, {}
    for mode in MODES:
        timers[mode], hlo[mode] = _timer(mode, workload, x, y)
    measured = rotated_rounds(timers, rounds)
    seconds = {mode: [wall for wall, _ in values] for mode, values in measured.items()}
    cpu_seconds = {mode: [cpu for _, cpu in values] for mode, values in measured.items()}
    ratios = paired_ratios(seconds, RATIOS)
    cpu_ratios = paired_ratios(cpu_seconds, RATIOS)
    window_bytes = {}
    for mode, measured in hlo.items():
        if measured is not None:
            accumulate, accumulate_copies, update, update_copies = measured
            # The floor's function takes a whole window in one call.
            calls = 1 if MODES[mode][0] in BARE else MODES[mode][2]
            window_bytes[mode] = [
                (calls - 1) * accumulate + update,
                (calls - 1) * accumulate_copies + update_copies,
            ]
    return {
        "description": workload.description,
        "peak_tensor_bytes": peaks(name, quick) if memory else None,
        "median_window_ms": {m: 1000 * statistics.median(s) for m, s in seconds.items()},
        "median_window_cpu_ms": {m: 1000 * statistics.median(s) for m, s in cpu_seconds.items()},
        "ratios": ratios,
        "cpu_ratios": cpu_ratios,
        "hlo_bytes_per_step": hlo,
        "hlo_bytes_per_window": window_bytes,
    }


def paired_ratios(seconds, pairs):
    """`{"a / b": summary}` of each `(a, b)` in `pairs` whose both are in
    `seconds` (`{mode: [seconds per round]}`): the ratios within a round,
    their median with its 95% confidence interval, min-max."""
    ratios = {}
    for a, b in pairs:
        if a not in seconds or b not in seconds:
            continue
        values = [p / q for p, q in zip(seconds[a], seconds[b])]
        ratios[f"{a} / {b}"] = {
            "median": statistics.median(values),
            "median_ci95": median_interval(values),
            "min": min(values),
            "max": max(values),
            "rounds": len(values),
        }
    return ratios


def markdown(results):
    lines = [
        "| workload | ratio | median | 95% CI of the median | min-max | CPU time: median (95% CI) |",
        "|---|---|---|---|---|---|",
    ]
    for name, result in results["workloads"].items():
        for label, r in result["ratios"].items():
            low, high = r["median_ci95"]
            c = result.get("cpu_ratios", {}).get(label)
            cpu = (
                "-"
                if c is None
                else f"{c['median']:.3f} ({c['median_ci95'][0]:.3f}-{c['median_ci95'][1]:.3f})"
            )
            lines.append(
                f"| {name} | {label} | {r['median']:.3f} | {low:.3f}-{high:.3f} "
                f"| {r['min']:.2f}-{r['max']:.2f} | {cpu} |"
            )
    lines += [
        "",
        "| workload | mode | median window, ms | HLO traffic per window, MB "
        "| of which copies, MB | peak tensor memory, MB |",
        "|---|---|---|---|---|---|",
    ]
    for name, result in results["workloads"].items():
        held = result.get("peak_tensor_bytes") or {}
        for mode, ms in result["median_window_ms"].items():
            size = result["hlo_bytes_per_window"].get(mode)
            cells = ["-", "-"] if size is None else [f"{v / 1e6:.1f}" for v in size]
            peak = f"{held[mode] / 1e6:.1f}" if mode in held else "-"
            lines.append(f"| {name} | {mode} | {ms:.1f} | {cells[0]} | {cells[1]} | {peak} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--workloads",
        nargs="+",
        default=list(workloads.TIMING_WORKLOADS),
        choices=workloads.ALL_WORKLOADS,
    )
    parser.add_argument("--rounds", type=int, default=31)
    parser.add_argument("--quick", action="store_true", help="tiny models: a smoke run")
    parser.add_argument("--out", default=None, help="JSON path (default: none when --quick)")
    parser.add_argument(
        "--memory",
        action="store_true",
        help="each mode's peak tensor memory, in a process of its own",
    )
    parser.add_argument(
        "--peak-of", nargs=2, metavar=("WORKLOAD", "MODE"), help=argparse.SUPPRESS
    )  # one mode's peak (`peaks` runs it)
    args = parser.parse_args(argv)
    if args.peak_of:
        print(peak_of(*args.peak_of, args.quick))
        return
    import keras
    import tensorflow as tf

    results = {
        "date": datetime.date.today().isoformat(),
        "versions": {
            "tensorflow": tf.__version__,
            "keras": keras.__version__,
            "python": sys.version.split()[0],
        },
        "accum_steps": N,
        "micro_batch": B,
        "rounds": args.rounds,
        "workloads": {},
    }
    for name in args.workloads:
        results["workloads"][name] = run_workload(name, args.rounds, args.quick, args.memory)
        print(json.dumps({name: results["workloads"][name]["median_window_ms"]}), flush=True)
    print(markdown(results))
    out = args.out or (None if args.quick else "benchmarks/xla.json")
    if out:
        Path(out).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
