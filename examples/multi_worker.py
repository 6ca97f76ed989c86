"""Accumulation across two worker processes, with MultiWorkerMirroredStrategy.

Run it as

    python examples/multi_worker.py

and it starts two workers on this machine (on free localhost ports), each
with its own TF_CONFIG, as a cluster manager would on real machines. Each
worker trains on its half of every global micro-batch of scikit-learn's
digits; gradients stay on the worker until a window is complete, then are
all-reduced once. Effective batch:

    16 samples per replica x accum_steps 4 x 2 replicas = 128

Afterwards the script trains a plain `keras.Model` in one process with
batch 128 and prints its accuracy next to the workers': the same numbers.
On real machines, set TF_CONFIG on each and run `train()` there.
"""

import json
import os
import socket
import subprocess
import sys
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # quiet TensorFlow start-up

GLOBAL_MICRO_BATCH, ACCUM_STEPS, EPOCHS = 32, 4, 10
WORKERS = 2


def digits():
    from sklearn.datasets import load_digits

    data = load_digits()
    x, y = (data.data / 16.0).astype("float32"), data.target
    return (x[:1400], y[:1400]), (x[1400:], y[1400:])


def build(model_class, **kwargs):
    import keras

    keras.utils.set_random_seed(0)  # same initial weights everywhere
    inputs = keras.Input((64,))
    hidden = keras.layers.Dense(128, activation="relu")(inputs)
    outputs = keras.layers.Dense(10, activation="softmax")(hidden)
    model = model_class(inputs, outputs, **kwargs)
    model.compile(
        optimizer=keras.optimizers.Adam(3e-3),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
    )
    return model


def train():
    """One worker's program: the same on every worker, TF_CONFIG tells them apart."""
    import tensorflow as tf

    import keras_accum

    strategy = tf.distribute.MultiWorkerMirroredStrategy()  # reads TF_CONFIG
    (x_train, y_train), (x_test, y_test) = digits()

    # The dataset is batched with the *global* micro-batch; DATA sharding
    # gives each worker its share of every batch.
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA

    def dataset(x, y):
        return (
            tf.data.Dataset.from_tensor_slices((x, y))
            .batch(GLOBAL_MICRO_BATCH)
            .with_options(options)
        )

    with strategy.scope():
        model = build(keras_accum.AccumModel, accum_steps=ACCUM_STEPS)
    # Fault tolerance: if a worker dies, restart all of them with the same
    # command and training resumes from the newest epoch every worker backed
    # up. One directory per worker, directly in the temporary directory:
    # removed when training completes, leaving nothing behind.
    task = strategy.cluster_resolver.task_id
    backup = keras_accum.BackupAndRestore(
        os.path.join(tempfile.gettempdir(), f"keras_accum_example-worker-{task}"),
        double_checkpoint=True,
    )
    model.fit(
        dataset(x_train, y_train),
        epochs=EPOCHS,
        shuffle=False,
        verbose=0,
        callbacks=[backup],
    )
    accuracy = model.evaluate(dataset(x_test, y_test), verbose=0, return_dict=True)["accuracy"]
    print(
        f"worker {task} of {strategy.num_replicas_in_sync}: test accuracy "
        f"{accuracy:.4f}, {int(model.optimizer.iterations.numpy())} updates"
    )


def free_port():
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def start_local_workers():
    """Starts this script once per worker, each with its own TF_CONFIG."""
    cluster = {"worker": [f"localhost:{free_port()}" for _ in range(WORKERS)]}
    workers = []
    for index in range(WORKERS):
        config = {"cluster": cluster, "task": {"type": "worker", "index": index}}
        workers.append(
            subprocess.Popen(
                [sys.executable, __file__],
                env={**os.environ, "TF_CONFIG": json.dumps(config)},
            )
        )
    try:
        return [worker.wait(timeout=600) for worker in workers]
    finally:
        for worker in workers:  # one failed: its peer would wait forever
            if worker.poll() is None:
                worker.kill()


def one_process_big_batch():
    import keras

    (x_train, y_train), (x_test, y_test) = digits()
    model = build(keras.Model)
    big_batch = GLOBAL_MICRO_BATCH * ACCUM_STEPS
    model.fit(x_train, y_train, batch_size=big_batch, epochs=EPOCHS, shuffle=False, verbose=0)
    accuracy = model.evaluate(x_test, y_test, verbose=0, return_dict=True)["accuracy"]
    print(
        f"one process, batch {big_batch}: test accuracy {accuracy:.4f}, "
        f"{int(model.optimizer.iterations.numpy())} updates"
    )


if __name__ == "__main__":
    if "TF_CONFIG" in os.environ:
        train()
    else:
        if any(start_local_workers()):
            sys.exit("a worker failed")
        one_process_big_batch()
