"""The most tensor memory one XLA-compiled train step with
`micro_batch_size` holds, at as many micro-batches of 8 samples a step as
the first argument says (8 without), for a model whose gradients outweigh
its activations (tests/test_step_graph.py).

TensorFlow's CPU allocator keeps statistics only when the process starts
with TF_CPU_ALLOCATOR_USE_BFC=true: a process of its own, for one model
(a second model's step, measured after a first's in the same process,
read 10 MB more). Prints one JSON object: `{"held": bytes, "gradient":
bytes}`, the peak of a step's call above what was held before it, and
the model's gradient's size.
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from keras_accum import AccumModel  # noqa: E402

MICRO_BATCH, FEATURES, WIDTH = 8, 512, 1024


def peak(micro_batches):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((FEATURES,))
    hidden = keras.layers.Dense(WIDTH, activation="relu")(inputs)
    hidden = keras.layers.Dense(WIDTH, activation="relu")(hidden)
    model = AccumModel(inputs, keras.layers.Dense(10)(hidden), micro_batch_size=MICRO_BATCH)
    model.compile(
        keras.optimizers.Adam(),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=True,
    )
    batch = micro_batches * MICRO_BATCH
    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch, FEATURES)).astype("float32")
    y = rng.integers(0, 10, size=(batch,))
    model.fit(x, y, batch_size=batch, epochs=2, verbose=0)  # traced, compiled
    batches = iter(tf.data.Dataset.from_tensors((x, y)).repeat())
    step = model.train_function
    float(step(batches)["loss"])
    before = tf.config.experimental.get_memory_info("CPU:0")["current"]
    tf.config.experimental.reset_memory_stats("CPU:0")
    float(step(batches)["loss"])
    held = tf.config.experimental.get_memory_info("CPU:0")["peak"] - before
    return held, sum(4 * int(np.prod(v.shape)) for v in model.trainable_variables)


held, gradient = peak(int(sys.argv[1]) if len(sys.argv) > 1 else 8)
print(json.dumps({"held": held, "gradient": gradient}))
