"""BatchNormalization under accumulation: cost per micro-batch, and a real model.

Run from the repository root:

    python -m benchmarks.batchnorm overhead   # the CNN workload with BN layers
    python -m benchmarks.batchnorm real       # keras.applications ResNet50
    python -m benchmarks.batchnorm real --quick

`overhead` times one epoch of `AccumModel` with `batchnorm="window"` (pooled
moving statistics, the default) and with `batchnorm="micro_batch"` (Keras's
own update at every micro-batch), interleaved, on the CNN of
`benchmarks/workloads.py` with a BatchNormalization after each convolution.

`real` trains a keras.applications model (ResNet50 by default, or
MobileNetV3Small; weights=None, 32x32 inputs, BN in training mode) on scikit-learn's digits, three ways from the same initial weights:
(a) a plain model on the big batch, (b) accumulation with Keras's
per-micro-batch BN updates, (c) accumulation with this library's pooled
moving statistics; it reports each run's moving-statistics distance to (a)
and its evaluation loss on held-out digits.
"""

import argparse
import json
import os
import statistics
import time

import numpy as np

from benchmarks import workloads


def _cnn_with_batchnorm():
    import keras

    layers = keras.layers
    size, channels = 32, 32
    inputs = keras.Input((size, size, 3))
    x = inputs
    for i, width in enumerate((channels, channels, 2 * channels)):
        x = layers.Conv2D(width, 3, padding="same", use_bias=False)(x)
        x = layers.BatchNormalization()(x)
        x = layers.Activation("relu")(x)
        if i > 0:
            x = layers.MaxPooling2D()(x)
    x = layers.Flatten()(x)
    x = layers.Dense(128, activation="relu")(x)
    return inputs, layers.Dense(10)(x)


def overhead(rounds):
    import keras

    import keras_accum

    workload = workloads.cnn()
    x, y = workload.data(np.random.default_rng(workloads.SEED))
    models = {}
    for mode in ("micro_batch", "window"):
        keras.utils.set_random_seed(workloads.SEED)
        model = keras_accum.AccumModel(
            *_cnn_with_batchnorm(), accum_steps=workloads.ACCUM_STEPS, batchnorm=mode
        )
        model.compile(
            keras.optimizers.Adam(workloads.LEARNING_RATE),
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
        models[mode] = model
    steps = len(x) // workloads.MICRO_BATCH
    seconds = {mode: [] for mode in models}
    # CPU time of this process (all its threads): less disturbed than wall
    # time by other processes on a shared machine.
    cpu_seconds = {mode: [] for mode in models}
    for round_index in range(rounds + 1):  # the first round traces: left out
        order = list(models) if round_index % 2 else list(models)[::-1]
        for mode in order:
            start, cpu_start = time.perf_counter(), time.process_time()
            models[mode].fit(
                x, y, batch_size=workloads.MICRO_BATCH, epochs=1, shuffle=False, verbose=0
            )
            if round_index:
                seconds[mode].append(time.perf_counter() - start)
                cpu_seconds[mode].append(time.process_time() - cpu_start)
    step_ms = {m: 1000 * statistics.median(s) / steps for m, s in seconds.items()}
    # Other processes share the CPU: epochs vary by tens of percent between
    # rounds. Each round times both modes back to back, so the median of the
    # per-round ratios and the ratio of the fastest epochs are the steadier
    # readings.
    ratios = [w / m for w, m in zip(seconds["window"], seconds["micro_batch"])]
    result = {
        "workload": "CNN of benchmarks/workloads.py with BatchNormalization after "
        "each of its 3 convolutions, Adam, "
        f"{len(x)} samples, micro-batch {workloads.MICRO_BATCH}, "
        f"accum_steps={workloads.ACCUM_STEPS}",
        "rounds": rounds,
        "epoch_seconds": seconds,
        "median_ms_per_micro_batch": step_ms,
        "window_over_micro_batch": {
            "median_of_round_ratios": statistics.median(ratios),
            "fastest_epochs": min(seconds["window"]) / min(seconds["micro_batch"]),
            "median_epochs": step_ms["window"] / step_ms["micro_batch"],
            "median_cpu_seconds": statistics.median(cpu_seconds["window"])
            / statistics.median(cpu_seconds["micro_batch"]),
        },
        "epoch_cpu_seconds": cpu_seconds,
    }
    print(json.dumps(result, indent=1))
    return result


def _digits(size=32):
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = digits.images.astype("float32") * (255.0 / 16.0)  # 0..255 as the model expects
    images = np.kron(images, np.ones((size // 8, size // 8), "float32"))
    x = np.repeat(images[..., None], 3, axis=-1)
    return x, digits.target.astype("int32")


def _batchnorm_layers(model):
    import keras

    return [
        layer
        for layer in model._flatten_layers()
        if isinstance(layer, keras.layers.BatchNormalization)
    ]


def _distance(model, reference):
    """Mean over BN layers of |a - b| / |b| (L2 norms), means and variances."""
    parts = []
    for a, b in zip(_batchnorm_layers(model), _batchnorm_layers(reference)):
        for u, v in ((a.moving_mean, b.moving_mean), (a.moving_variance, b.moving_variance)):
            u, v = u.numpy(), v.numpy()
            parts.append(np.linalg.norm(u - v) / max(np.linalg.norm(v), 1e-12))
    return float(np.mean(parts))


APPLICATIONS = {
    # name: (constructor, extra arguments, input scale)
    "resnet50": ("ResNet50", {}, 1 / 255.0),
    "mobilenetv3small": ("MobileNetV3Small", {"dropout_rate": 0.0}, 1.0),
}


def real(quick=False, epochs=None, micro=8, accum_steps=8, application="resnet50"):
    import keras

    import keras_accum

    constructor, extra, scale = APPLICATIONS[application]
    x, y = _digits()
    x = x * scale
    n_train = 256 if quick else 512
    x_train, y_train = x[:n_train], y[:n_train]
    x_test, y_test = x[n_train : n_train + 256], y[n_train : n_train + 256]
    epochs = epochs or (1 if quick else 3)

    def make(kind):
        keras.utils.set_random_seed(workloads.SEED)
        base = getattr(keras.applications, constructor)(
            input_shape=(32, 32, 3), weights=None, classes=10, **extra
        )
        if kind == "big_batch":
            model = base
        else:
            model = keras_accum.wrap(
                base,
                accum_steps=accum_steps,
                batchnorm="micro_batch" if kind == "per_micro_batch" else "window",
            )
        model.compile(
            keras.optimizers.Adam(1e-3),
            # The applications' heads end with a softmax.
            keras.losses.SparseCategoricalCrossentropy(),
            metrics=["accuracy"],
        )
        return model

    models, results = {}, {}
    for kind in ("big_batch", "per_micro_batch", "window"):
        model = make(kind)
        batch = micro * accum_steps if kind == "big_batch" else micro
        model.fit(x_train, y_train, batch_size=batch, epochs=epochs, shuffle=False, verbose=0)
        loss, accuracy = model.evaluate(x_test, y_test, batch_size=64, verbose=0)
        models[kind] = model
        results[kind] = {
            "eval_loss": float(loss),
            "eval_accuracy": float(accuracy),
        }
    for kind, model in models.items():
        results[kind]["moving_statistics_distance"] = _distance(model, models["big_batch"])
    result = {
        "model": f"keras.applications.{constructor}(input_shape=(32, 32, 3), "
        f"weights=None, classes=10, **{extra}), "
        f"{len(_batchnorm_layers(models['big_batch']))} BatchNormalization layers",
        "data": f"scikit-learn digits upscaled to 32x32x3: {n_train} training, "
        f"{len(x_test)} held-out samples",
        "training": f"Adam(1e-3), {epochs} epochs; big batch "
        f"{micro * accum_steps}; accumulation: micro-batch {micro} x "
        f"accum_steps={accum_steps} via keras_accum.wrap",
        "results": results,
    }
    print(json.dumps(result, indent=1))
    return result


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("overhead", "real"))
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--model", choices=sorted(APPLICATIONS), default="resnet50")
    parser.add_argument("--epochs", type=int)
    parser.add_argument("--out", help="write the result here as JSON")
    args = parser.parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    result = (
        overhead(args.rounds)
        if args.what == "overhead"
        else real(args.quick, args.epochs, application=args.model)
    )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
