"""Run by test_noise_scale.py in a fresh process (two logical CPU devices
must be configured before TensorFlow initialises its runtime): the noise
scale measured under `MirroredStrategy`, against numpy on per-example
gradients with each replica's share of a batch as its micro-batch.

`python tests/scripts/mirrored_noise_checks.py 1` runs a one-replica
`MirroredStrategy()`. Prints one JSON object; the test asserts.
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
# tests/, for the shared helpers.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import tensorflow as tf  # noqa: E402

REPLICAS = int(sys.argv[1]) if len(sys.argv) > 1 else 2
if REPLICAS > 1:
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * REPLICAS
    )

import keras  # noqa: E402
import numpy as np  # noqa: E402
from helpers.data import make_data  # noqa: E402
from helpers.models import functional  # noqa: E402
from helpers.noise import (  # noqa: E402
    embedding_data,
    embedding_net,
    estimate,
    per_example_gradients,
    regression_data,
    regression_net,
    windows_of,
)

from keras_accum import AccumModel  # noqa: E402

# Global batch 16 (8 per replica) on 92 samples: the last batch is 12 (6
# per replica); uneven windows.
N, BATCH = 92, 16
CONFIGS = {
    "step mode": dict(accum_steps=4),
    "micro_batch_size": dict(micro_batch_size=4),
    "both": dict(accum_steps=2, micro_batch_size=4),
    # No step runs out of memory: each replica's share is one micro-batch.
    "auto": dict(accum_steps=2, micro_batch_size="auto"),
}


def main():
    devices = [f"/cpu:{i}" for i in range(REPLICAS)] if REPLICAS > 1 else None
    strategy = tf.distribute.MirroredStrategy(devices)
    assert strategy.num_replicas_in_sync == REPLICAS
    out = {"replicas": REPLICAS, "estimates": {}, "identical": {}}
    regression = regression_data(N, noise=1.0)
    # "sparse": an Embedding's gradient (IndexedSlices) of a 500-row table,
    # whose rows are summed before its norm (most seen once per window).
    sparse = embedding_data(N, vocab=500)
    for name, kwargs in {**CONFIGS, "sparse": dict(accum_steps=4)}.items():
        x, y = sparse if name == "sparse" else regression
        with strategy.scope():
            if name == "sparse":
                model = embedding_net(AccumModel, 500, noise_scale=True, **kwargs)
            else:
                model = regression_net(AccumModel, noise_scale=True, **kwargs)
        history = model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
        grads = per_example_gradients(model, x, y)
        windows = windows_of(
            N, BATCH, kwargs.get("accum_steps", 1),
            None if kwargs.get("micro_batch_size") == "auto" else kwargs.get("micro_batch_size"),
            replicas=REPLICAS,
        )
        out["estimates"][name] = {
            "logged": history.history["noise_scale"],
            "expected": estimate(grads, windows) if max(map(len, windows)) > 1 else None,
            "last": model.noise_scale,
        }

    # Measuring changes nothing: Adam, metrics, uneven windows.
    xc, yc = make_data(N)
    for name, kwargs in CONFIGS.items():
        runs = []
        for noise_scale in (True, False):
            with strategy.scope():
                model = functional(AccumModel, noise_scale=noise_scale, **kwargs)
                model.compile(keras.optimizers.Adam(0.01), "sparse_categorical_crossentropy",
                              metrics=["accuracy"])
            history = model.fit(xc, yc, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
            runs.append((model, history.history))
        (on, h_on), (off, h_off) = runs
        out["identical"][name] = {
            "weights": all(np.array_equal(a, b) for a, b in zip(on.get_weights(), off.get_weights())),
            "history": all(h_on[k] == h_off[k] for k in h_off),
            "iterations": [int(m.optimizer.iterations.numpy()) for m in (on, off)],
            "noise_scale": h_on["noise_scale"],
        }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
