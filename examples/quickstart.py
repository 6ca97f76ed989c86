"""Big-batch training on a small-batch budget, checked against the big batch.

Trains the same small network on scikit-learn's handwritten digits (shipped
inside the package, no download) twice from the same initial weights:

* a plain `keras.Model` with batch size 256;
* a `keras_accum.AccumModel` with batch size 32 and `accum_steps=8`.

Both make the same optimizer updates, so they end with the same weights
(to float rounding) and the same accuracy. Runs in well under a minute on
two CPU cores.

    python examples/quickstart.py
"""

import os

# TensorFlow's C++ log level, read when TensorFlow loads: set before anything
# (keras included) imports it.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


def _import_tensorflow_quietly():
    """Imports TensorFlow without its start-up lines on stderr.

    TensorFlow 2.20 and later log a few lines while loading (e.g.
    "Could not find cuda drivers") before their log level is applied, so
    TF_CPP_MIN_LOG_LEVEL cannot hide them: the process's stderr is pointed
    at /dev/null for the import alone. An import error is still raised
    (and shown) as usual.
    """
    stderr = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        import tensorflow  # noqa: F401
    finally:
        os.dup2(stderr, 2)
        os.close(stderr)
        os.close(devnull)


_import_tensorflow_quietly()

import keras  # noqa: E402
import numpy as np  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

import keras_accum  # noqa: E402

MICRO_BATCH, ACCUM_STEPS, EPOCHS = 32, 8, 15


def build(model_class, **kwargs):
    keras.utils.set_random_seed(0)  # same initial weights for both runs
    inputs = keras.Input((64,))
    x = keras.layers.Dense(128, activation="relu")(inputs)
    outputs = keras.layers.Dense(10, activation="softmax")(x)
    model = model_class(inputs, outputs, **kwargs)
    model.compile(
        optimizer=keras.optimizers.Adam(3e-3),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
    )
    return model


def main():
    digits = load_digits()
    x = (digits.data / 16.0).astype("float32")
    y = digits.target
    x_train, y_train, x_test, y_test = x[:1400], y[:1400], x[1400:], y[1400:]
    fit = dict(epochs=EPOCHS, shuffle=False, verbose=0)

    big = build(keras.Model)
    big.fit(x_train, y_train, batch_size=MICRO_BATCH * ACCUM_STEPS, **fit)

    accum = build(keras_accum.AccumModel, accum_steps=ACCUM_STEPS)
    accum.fit(x_train, y_train, batch_size=MICRO_BATCH, **fit)

    big_acc = big.evaluate(x_test, y_test, verbose=0, return_dict=True)["accuracy"]
    acc_acc = accum.evaluate(x_test, y_test, verbose=0, return_dict=True)["accuracy"]
    diff = max(float(np.abs(a - b).max()) for a, b in zip(big.get_weights(), accum.get_weights()))
    print(
        f"plain keras.Model, batch {MICRO_BATCH * ACCUM_STEPS}: "
        f"test accuracy {big_acc:.4f}, {int(big.optimizer.iterations)} updates"
    )
    print(
        f"AccumModel, batch {MICRO_BATCH} x accum_steps {ACCUM_STEPS}: "
        f"test accuracy {acc_acc:.4f}, {int(accum.optimizer.iterations)} updates"
    )
    print(f"largest weight difference: {diff:.3g}")


if __name__ == "__main__":
    main()
