"""How big should the batch be? The gradient noise scale, measured while training.

Trains a small network on scikit-learn's handwritten digits (shipped inside
the package, no download) with `noise_scale=True`, starting from 16-sample
micro-batches and `accum_steps=2`, and lets
`AccumScheduler("noise_scale")` grow `accum_steps` towards 1.5 times the
measured noise scale every 25 updates (a batch-size warm-up; McCandlish et al. 2018),
the learning rate following the batch (Adam: the square root of the
batch's growth). Prints each decision: the smoothed noise scale with its 95%
interval, the `accum_steps` chosen and the rate; then one line per epoch:
the epoch's raw noise scale `B_simple` (in samples), the `accum_steps` at
its end, the effective batch and the validation accuracy.

    python examples/noise_scale.py
    python examples/noise_scale.py --plot docs/assets/noise_scale.png  # the docs' plot

Runs in about a minute on two CPU cores.
"""

import argparse
import os

# TensorFlow's C++ log level, read when TensorFlow loads: set before anything
# (keras included) imports it.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

import keras_accum  # noqa: E402

MICRO_BATCH, START_ACCUM_STEPS, MAX_ACCUM_STEPS = 16, 2, 32


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--plot", help="write the plot to this PNG (needs matplotlib)")
    args = parser.parse_args(argv)

    digits = load_digits()
    x = (digits.data / 16.0).astype("float32")
    y = digits.target
    x_train, y_train, x_test, y_test = x[:1400], y[:1400], x[1400:], y[1400:]

    keras.utils.set_random_seed(0)
    inputs = keras.Input((64,))
    hidden = keras.layers.Dense(128, activation="relu")(inputs)
    outputs = keras.layers.Dense(10, activation="softmax")(hidden)
    model = keras_accum.AccumModel(inputs, outputs, accum_steps=START_ACCUM_STEPS, noise_scale=True)
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
    )
    grow = keras_accum.AccumScheduler(
        "noise_scale", max_accum_steps=MAX_ACCUM_STEPS, every_updates=25
    )
    history = model.fit(
        x_train,
        y_train,
        batch_size=MICRO_BATCH,
        epochs=args.epochs,
        validation_data=(x_test, y_test),
        callbacks=[grow],
        verbose=0,
    ).history

    print("update  noise_scale  (95% interval)     resolved  accum_steps  learning_rate")
    for d in grow.path:
        e = d.estimate
        rate = "" if d.learning_rate is None else f"{d.learning_rate:.6f}"
        print(
            f"{d.updates:6d}  {e.value:11.1f}  ({e.low:.1f}, {e.high:.1f})"
            f"  {e.resolved!s:>8}  {d.accum_steps:11d}  {rate}"
        )
    print()
    print("epoch  noise_scale  accum_steps  effective batch  val accuracy")
    for epoch in range(args.epochs):
        steps = history["accum_steps"][epoch]
        print(
            f"{epoch + 1:5d}  {history['noise_scale'][epoch]:11.1f}  {steps:11d}"
            f"  {steps * MICRO_BATCH:15d}  {history['val_accuracy'][epoch]:12.3f}"
        )
    if args.plot:
        plot(history, args.plot)
        print(f"wrote {args.plot}")


def plot(history, path):
    import matplotlib

    matplotlib.use("Agg")  # no display; must precede pyplot
    import matplotlib.pyplot as plt

    epochs = np.arange(1, len(history["noise_scale"]) + 1)
    figure, (top, bottom) = plt.subplots(2, 1, figsize=(7, 5.5), sharex=True)
    top.plot(epochs, history["noise_scale"], "o-", label="noise_scale (B_simple, samples)")
    top.step(
        epochs,
        np.array(history["accum_steps"]) * MICRO_BATCH,
        where="mid",
        label="effective batch chosen (16 x accum_steps)",
    )
    top.axhline(MAX_ACCUM_STEPS * MICRO_BATCH, color="grey", ls=":", label="cap (max_accum_steps)")
    top.set_yscale("log")
    top.set_ylabel("samples")
    top.legend(loc="upper left", fontsize=8)
    top.set_title("Digits MLP: noise scale measured, batch grown to it every 25 updates")
    bottom.plot(epochs, history["loss"], label="training loss")
    bottom.plot(epochs, history["val_accuracy"], label="validation accuracy")
    bottom.set_xlabel("epoch")
    bottom.legend(loc="center right", fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
