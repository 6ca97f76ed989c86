"""`micro_batch_size="auto"` running out of memory (genuinely:
tests/helpers/oom.py) under a multi-replica strategy: the runs that
test_auto_replicas.py asserts on.

Under MirroredStrategy over the two logical CPUs of the test process
(`AutoRuns(replicas.mirrored(2)).run()`), every replica is short of memory;
in each worker of the test run's MultiWorkerMirroredStrategy cluster
(tests/scripts/cluster_checks.py), only worker `SMALL_TASK` is, and the
others fit whole batches.
"""

import json
import logging

import keras
import numpy as np
import tensorflow as tf

import keras_accum
from helpers import internals
from helpers.data import CLASSES, FEATURES, make_data
from helpers.models import functional, loss
from helpers.oom import Limit, LimitedLoss

ROOMY = 10_000


class Warnings(logging.Handler):
    """Counts keras_accum's 'ran out of memory' warnings."""

    def __init__(self):
        super().__init__()
        self.count = 0
        logging.getLogger("keras_accum").addHandler(self)

    def emit(self, record):
        if "ran out of memory" in record.getMessage():
            self.count += 1


def weights(model):
    return [w.tolist() for w in model.get_weights()]


def bn_dropout_net(micro_batch_size, k, accum_steps=2, batchnorm="window"):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((FEATURES,))
    h = keras.layers.Dense(8, name="hidden")(inputs)
    h = keras.layers.BatchNormalization(momentum=0.6, name="bn")(h)
    h = keras.layers.Dropout(0.5, seed=1, name="dropout")(h)
    outputs = keras.layers.Dense(CLASSES)(Limit(k, name="limit")(h))
    return keras_accum.AccumModel(
        inputs,
        outputs,
        accum_steps=accum_steps,
        micro_batch_size=micro_batch_size,
        batchnorm=batchnorm,
    )


class FailsOnTheSmallWorker(keras.layers.Layer):
    """The identity, but on the small worker an assertion fails in its step."""

    def __init__(self, small, **kwargs):
        super().__init__(**kwargs)
        self.small = small

    def call(self, x):
        if not self.small:
            return x
        check = tf.debugging.assert_less(tf.shape(x)[0], 0, message="not this worker")
        with tf.control_dependencies([check]):
            return tf.identity(x)


class AutoRuns:
    """The runs, on `strategy`, as task `task` of its cluster; `small`: this
    process is the one short of memory; `multi_worker`: the checks only a
    cluster has (a refused synchronized BatchNorm, another worker's
    error)."""

    def __init__(self, strategy, task=0, small=True, multi_worker=False):
        self.strategy, self.task, self.small = strategy, task, small
        self.multi_worker = multi_worker

    def limit(self, k):
        return k if self.small else ROOMY

    def state(self, model):
        """Every value on this process's replicas that training can change."""
        variables = [
            *model.variables,
            *model.optimizer.variables,
            *model.metrics_variables,
            *internals.window_variables(model),
        ]
        values = []
        for v in variables:
            inner = v.value if isinstance(v, keras.Variable) else v
            values.extend(
                (getattr(v, "path", v.name), c.numpy())
                for c in self.strategy.experimental_local_results(inner)
            )
        return values

    def fit_with_limit(self, out, name, accum_steps, samples, batch, k):
        """Trains 2 epochs, then 1 more in a second fit call (the size kept)."""
        warnings = Warnings()
        with self.strategy.scope():
            model = functional(
                keras_accum.AccumModel, accum_steps=accum_steps, micro_batch_size="auto"
            )
            model.compile(keras.optimizers.Adam(0.01), LimitedLoss(self.limit(k)))
        data = make_data(samples)
        model.fit(*data, batch_size=batch, epochs=2, shuffle=False, verbose=0)
        first = warnings.count
        chosen = model.chosen_micro_batch_size
        model.fit(*data, batch_size=batch, epochs=1, shuffle=False, verbose=0)
        out[name] = {
            "weights": weights(model),
            "iterations": int(model.optimizer.iterations.numpy()),
            "chosen": chosen,
            "chosen_later": model.chosen_micro_batch_size,
            "warnings": [first, warnings.count - first],
        }

    def batchnorm_retry_equals_the_integer_size(self, out):
        # A retry leaves no trace: auto (out of memory at 4 per replica, then 2)
        # trains exactly as micro_batch_size=2 from the start, moving
        # statistics and dropout seeds included. 5 batches of 8: windows of 2, 2
        # and 1, and no short batch (which auto, traced per shape, splits
        # without stand-ins: the same gradients, fewer dropout draws).
        runs = {}
        for setting in ("auto", 2):
            with self.strategy.scope():
                model = bn_dropout_net(setting, self.limit(2) if setting == "auto" else ROOMY)
                model.compile(keras.optimizers.Adam(0.01), loss())
            model.fit(*make_data(40), batch_size=8, epochs=2, shuffle=False, verbose=0)
            runs[setting] = model
        out["batchnorm"] = {
            "auto": weights(runs["auto"]),
            "integer": weights(runs[2]),
            "chosen": runs["auto"].chosen_micro_batch_size,
            "iterations": [int(m.optimizer.iterations.numpy()) for m in runs.values()],
        }

    def nothing_fits_changes_nothing(self, out):
        # One step trained, then the limit made 0 on the small worker: every
        # attempt there runs out of memory, down to 1 sample per replica; every
        # worker raises the same error and no value changed on any. Keras's own
        # moving-statistics updates (batchnorm="micro_batch"), which a failed
        # attempt makes before the failing layer, differ between replicas: each
        # replica's own copy must be put back.
        with self.strategy.scope():
            model = bn_dropout_net("auto", ROOMY, batchnorm="micro_batch")
            model.compile(keras.optimizers.Adam(0.01), loss(), metrics=["accuracy"])
        x, y = make_data(8)
        model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
        if self.small:
            model.get_layer("limit").k = 0
        model.make_train_function(force=True)
        model.reset_metrics()  # as fit does first
        before = self.state(model)
        try:
            model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
            out["nothing_fits"] = {"raised": None}
            return
        except tf.errors.ResourceExhaustedError as error:
            message = error.message
        after = self.state(model)
        out["nothing_fits"] = {
            "raised": message,
            "changed": [
                name for (name, a), (_, b) in zip(before, after) if not np.array_equal(a, b)
            ],
            "values": len(before),
            "chosen": model.chosen_micro_batch_size,
        }

    def synchronized_batchnorm_refused(self, out):
        with self.strategy.scope():
            keras.utils.set_random_seed(0)
            inputs = keras.Input((FEATURES,))
            h = keras.layers.BatchNormalization(synchronized=True)(inputs)
            model = keras_accum.AccumModel(
                inputs, keras.layers.Dense(CLASSES)(h), micro_batch_size="auto"
            )
            model.compile(keras.optimizers.Adam(0.01), loss())
        try:
            model.fit(*make_data(16), batch_size=8, epochs=1, shuffle=False, verbose=0)
            out["synchronized"] = "trained"
        except ValueError as error:
            out["synchronized"] = str(error)
        out["synchronized_iterations"] = int(model.optimizer.iterations.numpy())

    def another_error_stops_every_worker(self, out):
        # Not out of memory: the failing worker raises its own error, the other
        # stops too (instead of waiting for it in a collective).
        with self.strategy.scope():
            keras.utils.set_random_seed(0)
            inputs = keras.Input((FEATURES,))
            h = FailsOnTheSmallWorker(self.small)(keras.layers.Dense(4)(inputs))
            model = keras_accum.AccumModel(
                inputs, keras.layers.Dense(CLASSES)(h), micro_batch_size="auto"
            )
            model.compile(keras.optimizers.Adam(0.01), loss())
        try:
            model.fit(*make_data(16), batch_size=8, epochs=1, shuffle=False, verbose=0)
            out["other_error"] = "trained"
        except tf.errors.OpError as error:
            out["other_error"] = f"{type(error).__name__}: {error.message[:200]}"
        out["other_error_iterations"] = int(model.optimizer.iterations.numpy())

    def run(self):
        """Every check; one dict of results (the test asserts)."""
        out = {"task": self.task, "replicas": self.strategy.num_replicas_in_sync}
        # 56 samples, batches of 16 (8 per replica), out of memory above 4.
        self.fit_with_limit(out, "accum_1", 1, 56, 16, 4)
        # 92 samples, micro-batches of 8 (4 per replica), windows of 4 (uneven
        # last window), out of memory above 2.
        self.fit_with_limit(out, "accum_4", 4, 92, 8, 2)
        self.batchnorm_retry_equals_the_integer_size(out)
        self.nothing_fits_changes_nothing(out)
        if self.multi_worker:
            self.synchronized_batchnorm_refused(out)
            self.another_error_stops_every_worker(out)
        return json.loads(json.dumps(out))
