"""The squared norm of a sparse gradient, as the noise scale measures it.

    python -m benchmarks.sparse_norm              # prints a markdown table
    python -m benchmarks.sparse_norm --rounds 41
    python -m benchmarks.sparse_norm --quick      # smoke run, not a measurement

`noise_scale=True` takes, per micro-batch and per window, the squared norm
of each sparse (`IndexedSlices`) gradient as the dense gradient it stands
for: the occurrences of a row summed first. Summing rows (a segment sum)
is most of that cost on a CPU. Timed here, for the same slices, side by
side in one process:

- `every row`: every occurrence summed into its row (`Unique`, then a
  segment sum over all occurrences), then the sum of squares;
- `keras_accum`: the library's `squared_norm`, which sums only the repeated
  rows when most rows are seen once, and every row otherwise.

Cases: the embedding workload's micro-batch (1,024 occurrences) and window
(8,192) of a 200,000-row table with uniform token ids (rows mostly seen
once), the same micro-batch from a 300-row table (every row repeated), and
a Zipfian (s = 1.1) text-like batch of 4,096 and 8,192 tokens from a
30,000-row vocabulary (about half the occurrences in repeated rows). Each
round times each function on one call repeated `--calls` times inside one
`tf.function` loop, in an order rotated per round; the result is the median
of the per-round ratio `keras_accum / every row`.
"""

import argparse
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # quiet TensorFlow start-up

import numpy as np  # noqa: E402

# name: (occurrences, table rows, distribution of the ids)
CASES = {
    "micro-batch, 200,000 rows": (1_024, 200_000, "uniform"),
    "window, 200,000 rows": (8_192, 200_000, "uniform"),
    "micro-batch, 300 rows": (1_024, 300, "uniform"),
    "4,096 Zipfian tokens, 30,000 rows": (4_096, 30_000, "zipf"),
    "8,192 Zipfian tokens, 30,000 rows": (8_192, 30_000, "zipf"),
}
WIDTH = 64  # the embedding workload's


def every_row(slices):
    """The sum of squares with every occurrence summed into its row."""
    import tensorflow as tf

    rows, segments = tf.unique(tf.reshape(slices.indices, [-1]))
    summed = tf.math.unsorted_segment_sum(slices.values, segments, tf.size(rows))
    return 2.0 * tf.cast(tf.nn.l2_loss(summed), tf.float64)


def _ids(rng, occurrences, rows, distribution):
    if distribution == "zipf":
        return ((rng.zipf(1.1, size=occurrences) - 1) % rows).astype("int32")
    return rng.integers(0, rows, size=occurrences).astype("int32")


def _looped(norm, slices, calls):
    import tensorflow as tf

    values = tf.Variable(slices.values)
    indices = tf.Variable(slices.indices)

    @tf.function
    def run():
        total = tf.constant(0.0, tf.float64)
        # Reads inside the loop: nothing is hoisted out of it.
        for _ in tf.range(calls):
            sliced = tf.IndexedSlices(values.read_value(), indices.read_value())
            total += norm(sliced)
        return total

    return run


def run_case(occurrences, rows, distribution, rounds, calls):
    import tensorflow as tf

    from keras_accum.window import noise_scale

    rng = np.random.default_rng(0)
    ids = _ids(rng, occurrences, rows, distribution)
    slices = tf.IndexedSlices(
        tf.constant(rng.standard_normal((occurrences, WIDTH), dtype=np.float32)),
        tf.constant(ids),
    )
    functions = {
        "every row": _looped(every_row, slices, calls),
        "keras_accum": _looped(lambda s: noise_scale.squared_norm([s]), slices, calls),
    }
    values = {name: float(f()) for name, f in functions.items()}  # traced
    times = {name: [] for name in functions}
    order = list(functions)
    for index in range(rounds):
        shift = index % len(order)
        for name in order[shift:] + order[:shift]:
            start = time.perf_counter()
            functions[name]()
            times[name].append((time.perf_counter() - start) / calls)
    ratios = [a / b for a, b in zip(times["keras_accum"], times["every row"])]
    return {
        "repeated_occurrences": int(np.sum(np.bincount(ids)[ids] > 1)),
        "median_us": {name: statistics.median(t) * 1e6 for name, t in times.items()},
        "ratio_median": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "same_value": bool(np.isclose(values["every row"], values["keras_accum"], rtol=1e-5)),
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=41)
    parser.add_argument("--calls", type=int, default=200, help="calls timed per round")
    parser.add_argument("--quick", action="store_true", help="one round of few calls")
    args = parser.parse_args(argv)
    rounds, calls = (1, 2) if args.quick else (args.rounds, args.calls)
    lines = [
        f"{rounds} rounds of {calls} calls; median per call, and the paired ratio",
        "",
        "| case | occurrences in repeated rows | every row | keras_accum | ratio (min-max) | same value |",
        "|---|---|---|---|---|---|",
    ]
    for name, case in CASES.items():
        r = run_case(*case, rounds, calls)
        lines.append(
            f"| {name} | {r['repeated_occurrences']:,} of {case[0]:,} "
            f"| {r['median_us']['every row']:.0f} µs | {r['median_us']['keras_accum']:.0f} µs "
            f"| {r['ratio_median']:.2f} ({r['ratio_min']:.2f}-{r['ratio_max']:.2f}) "
            f"| {'yes' if r['same_value'] else 'NO'} |"
        )
    print("\n".join(lines))


if __name__ == "__main__":
    main()
