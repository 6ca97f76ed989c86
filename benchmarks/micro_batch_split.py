"""Side by side in one process: the big batch, `micro_batch_size`, step mode.

For each timing workload (b=32, N=4): a plain `keras.Model` on batches of
b*N, an `AccumModel(micro_batch_size=b)` on the same batches (split inside
the step), and step-mode `AccumModel(accum_steps=N)` on batches of b.
Epochs are interleaved and the median epoch time of each is reported as a
ratio to the big batch's. Also: micro_batch_size = b*N and b*N/2 (1 and 2
micro-batches), which split the time into the path's fixed cost and the
cost per extra micro-batch; and, in one `tf.function` each, the forward and
backward pass of b*N samples, of N x b samples without summing their
gradients and with summing them: the small-batch penalty of the compute
against the cost of the adds over the weights.

    python -m benchmarks.micro_batch_split [--rounds 7] [--quick] [--jit]
"""

import argparse
import statistics
import time

import numpy as np

from benchmarks import workloads

B, N = 32, 4


def _models(workload, jit):
    import keras

    import keras_accum

    def compiled(model):
        model.compile(
            keras.optimizers.Adam(workloads.LEARNING_RATE),
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            jit_compile=jit,
        )
        return model

    def made(cls, **kwargs):
        keras.utils.set_random_seed(workloads.SEED)
        return compiled(cls(*workload.build(), **kwargs))

    return {
        "big batch": (made(keras.Model), B * N),
        f"micro_batch_size={B}": (made(keras_accum.AccumModel, micro_batch_size=B), B * N),
        f"micro_batch_size={B * N // 2}": (
            made(keras_accum.AccumModel, micro_batch_size=B * N // 2),
            B * N,
        ),
        f"micro_batch_size={B * N}": (
            made(keras_accum.AccumModel, micro_batch_size=B * N),
            B * N,
        ),
        f"step mode accum_steps={N}": (made(keras_accum.AccumModel, accum_steps=N), B),
    }


def _epoch(model, x, y, batch):
    start = time.perf_counter()
    model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)
    return time.perf_counter() - start


def _split_costs_ms(model, x, y, rounds, repeats=10):
    """Median milliseconds of one batch's forward and backward pass: whole,
    as N micro-batches without summing, and as N micro-batches summed."""
    import keras
    import tensorflow as tf

    from keras_accum.split.microbatch import add_gradients

    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    x, y = tf.constant(x[: B * N]), tf.constant(y[: B * N])

    def gradients(k, summed):
        @tf.function
        def step(x, y):
            out = []
            for i in range(k):
                rows = slice(i * B * N // k, (i + 1) * B * N // k)
                with tf.GradientTape() as tape:
                    value = loss(y[rows], model(x[rows], training=True))
                grads = tape.gradient(value, model.trainable_variables)
                if summed and out:
                    out = [add_gradients(a, b) for a, b in zip(out, grads)]
                elif summed:
                    out = grads
                else:
                    out.append(grads)
            return out

        return step

    steps = {
        f"{B * N} samples": gradients(1, True),
        f"{N} x {B}, not summed": gradients(N, False),
        f"{N} x {B}, summed": gradients(N, True),
    }
    times = {label: [] for label in steps}
    for step in steps.values():
        step(x, y)
    for _ in range(rounds):
        for label, step in steps.items():
            start = time.perf_counter()
            for _ in range(repeats):
                out = step(x, y)
            tf.nest.flatten(out, expand_composites=True)[-1].numpy()
            times[label].append((time.perf_counter() - start) / repeats * 1000)
    return {label: statistics.median(t) for label, t in times.items()}


def run(name, rounds, quick, jit):
    workload = workloads.timing_workload(name, quick)
    x, y = workload.data(np.random.default_rng(workloads.SEED))
    models = _models(workload, jit)
    for model, batch in models.values():
        _epoch(model, x, y, batch)  # trace and warm up
    times = {label: [] for label in models}
    for _ in range(rounds):
        for label, (model, batch) in models.items():
            times[label].append(_epoch(model, x, y, batch))
    medians = {label: statistics.median(t) for label, t in times.items()}
    steps = len(x) // (B * N)
    big = medians["big batch"]
    print(f"\n{workload.description} (jit_compile={jit}), {steps} updates/epoch")
    for label, seconds in medians.items():
        print(f"  {label:28s} {seconds * 1000 / steps:8.2f} ms/update  {seconds / big:5.2f}x")
    print("  forward + backward of one batch, in one tf.function:")
    for label, ms in _split_costs_ms(models["big batch"][0], x, y, rounds).items():
        print(f"    {label:26s} {ms:8.2f} ms")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--jit", action="store_true")
    parser.add_argument("--workloads", nargs="*", default=list(workloads.TIMING_WORKLOADS))
    args = parser.parse_args(argv)
    for name in args.workloads:
        run(name, args.rounds, args.quick, args.jit)


if __name__ == "__main__":
    main()
