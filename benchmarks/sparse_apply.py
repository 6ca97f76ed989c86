"""The cost of applying a window of embedding gradients, side by side.

    python -m benchmarks.sparse_apply            # prints a markdown table
    python -m benchmarks.sparse_apply --rounds 40
    python -m benchmarks.sparse_apply --rows 2000  # a table smaller than the window

On the embedding workload's table (200,000 x 64, Adam), one window of
accum_steps=8 micro-batches of 32 sequences of 32 tokens (8,192 slices):

- `bare`: Adam's own update with the big batch's `IndexedSlices` gradient,
  what a plain `keras.Model` does once per big batch;
- `window`: `GradientAccumulator.apply` of that window kept as slices
  (scale the slices, hand them to Adam, start a new window by its count);
- `dense window`: the same window as a dense sum, as before slices (scale
  the 51.2 MB buffer, hand it to Adam, zero it);
- `window gradient only`: what `window` adds to `bare`, alone: reading
  the window's slices and indices and scaling them.

With `--rows` below the window's 8,192 occurrences the window is kept as
per-row sums instead, and `window` hands Adam the synthesised
`IndexedSlices` (window/slices.py).

Each round times each once, in an order rotated per round, so background
load on a shared machine hits them alike; paired ratios are per round.
"""

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from keras_accum.window import AccumState, close, slices  # noqa: E402
from keras_accum.window.buffers import GradientAccumulator  # noqa: E402

ROWS, WIDTH, MICRO, LENGTH, N = 200_000, 64, 32, 32, 8


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--rows", type=int, default=ROWS, help="table rows")
    args = parser.parse_args(argv)
    rows = args.rows
    rng = np.random.default_rng(0)
    tokens = MICRO * LENGTH
    ids = [rng.integers(0, rows, tokens).astype("int32") for _ in range(N)]
    grads = [rng.normal(size=(tokens, WIDTH)).astype("float32") for _ in range(N)]
    window_ids = tf.constant(np.concatenate(ids))
    window_values = tf.constant(np.concatenate(grads) / (N * MICRO))

    def table():
        return tf.Variable(rng.normal(size=(rows, WIDTH)).astype("float32"))

    bare_table, bare_adam = table(), keras.optimizers.Adam(1e-3)
    bare_adam.build([bare_table])

    @tf.function
    def bare():
        bare_adam.apply([tf.IndexedSlices(window_values, window_ids, (rows, WIDTH))], [bare_table])

    ours_table, ours_adam = table(), keras.optimizers.Adam(1e-3)
    ours_adam.build([ours_table])
    acc = GradientAccumulator()
    acc.bind([ours_table], accum_steps=N)
    for i in range(N):
        acc.add(
            [tf.IndexedSlices(tf.constant(grads[i]), tf.constant(ids[i]), (rows, WIDTH))],
            weight=MICRO,
            grad_scale=MICRO,
        )
    count = int(acc.slice_counts[0].numpy())
    assert count == (N * tokens if N * tokens <= rows else slices.ROW_SUMS), count

    @tf.function
    def window():
        # Re-opens the same window (three scalars) so that it can be applied
        # again: the slices themselves stay where the adds put them.
        acc.slice_counts[0].assign(count)
        acc.window_weight.assign(float(N * MICRO))
        acc.micro_step.assign(N)
        close(AccumState(acc), ours_adam)

    @tf.function
    def window_gradient():
        # The part of `window` that is ours: reading and scaling the slices.
        return acc.window_gradients()[0].values

    dense_table, dense_adam = table(), keras.optimizers.Adam(1e-3)
    dense_adam.build([dense_table])
    buffer = tf.Variable(tf.zeros((rows, WIDTH)))
    summed = tf.math.unsorted_segment_sum(tf.concat(grads, 0) * MICRO, window_ids, rows)
    weight = tf.Variable(float(N * MICRO))

    @tf.function
    def dense_window():
        buffer.assign_add(summed)  # refill (not part of an apply's cost)
        return buffer.read_value()

    @tf.function
    def dense_apply():
        # What the accumulator did before slices: scale, apply, zero.
        dense_adam.apply([buffer * (1.0 / weight)], [dense_table])
        buffer.assign(tf.zeros_like(buffer))

    runs = {
        "bare": bare,
        "window": window,
        "dense window": dense_apply,
        "window gradient only": window_gradient,
    }
    times = {name: [] for name in runs}
    for run in runs.values():  # trace and warm up
        dense_window()
        run()
    names = list(runs)
    load_before = os.getloadavg()
    for r in range(args.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            if name == "dense window":
                dense_window()
            start = time.perf_counter()
            runs[name]()
            times[name].append(time.perf_counter() - start)
    load_after = os.getloadavg()
    median = {name: statistics.median(t) for name, t in times.items()}

    def paired(name):
        ratios = [a / b for a, b in zip(times[name], times["bare"])]
        return statistics.median(ratios), min(ratios), max(ratios)

    lines = [
        f"Keras {keras.__version__}, TensorFlow {tf.__version__}; table "
        f"{rows:,} x {WIDTH}, Adam; a window of {N} x {tokens} occurrences, "
        f"kept as {'slices' if count >= 0 else 'row sums'}; "
        f"{args.rounds} rounds; load average {load_before[0]:.2f} before, "
        f"{load_after[0]:.2f} after.",
        "",
        "| apply | median (ms) | / bare Adam: median paired ratio (min-max) |",
        "| --- | ---: | ---: |",
    ]
    for name in names:
        ratio = "-" if name == "bare" else "{:.2f} ({:.2f}-{:.2f})".format(*paired(name))
        lines.append(f"| {name} | {1000 * median[name]:.1f} | {ratio} |")
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
