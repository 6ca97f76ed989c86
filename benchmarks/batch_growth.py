"""How many updates, and how many examples, does each batch size need? The
steps-examples trade-off of McCandlish et al. (2018, "An Empirical Model of
Large-Batch Training"), measured with plain Keras SGD.

    python -m benchmarks.batch_growth                    # the sweep, ~5 min on one core
    python -m benchmarks.batch_growth --seeds 0 1 2      # three seeds each (median)
    python -m benchmarks.batch_growth --plot /tmp/batch_growth.png
    python -m benchmarks.batch_growth --quick            # smoke run, not a measurement

The task is a teacher-student regression with label noise: x ~ N(0, I_d),
y = teacher(x) + N(0, SIGMA^2), the teacher a fixed random tanh MLP scaled
to unit output variance. A student MLP (wider than the teacher) is trained
with `keras.optimizers.SGD` on the mean squared error until its *excess*
loss on a held-out set first reaches TARGET. The held-out targets are the
noise-free teacher's: the MSE against them is the excess loss itself (the
expected MSE against noisy labels is that plus the noise floor SIGMA^2),
without the held-out noise's own scatter.

For every batch size B in BATCH_SIZES, a geometric grid of learning rates
(factor sqrt 2) is walked from the previous batch size's best (up while it
does not get worse, then down): the best learning rate is the one reaching
the target in the fewest updates S (E = S * B examples), the median over
the seeds (default two; a seed draws the student's weights and the data
order). A run stops once it has made more updates than the batch size's
best so far times CUTOFF (it cannot be best), when it diverges, or at the
cap. The best points are fitted with S = S_min + E_min / B (the hyperbola
(S/S_min - 1)(E/E_min - 1) = 1), by least squares on the relative error;
the critical batch is B_crit = E_min / S_min, the knee where S = 2 S_min
and E = 2 E_min.

The held-out loss is checked after an update once the updates made have
grown by RESOLUTION (2%) since the last check (every update for the first
hundred): the count reached is within 2% above the first crossing, for a
few hundred checks a run, each a compiled forward pass over the held-out
set. Near the target that loss jitters from check to check (by some 20%,
SGD's noise in the weights), so S is the first passage of a noisy curve:
one seed's S scatters by 10-20%, which is why the median of seeds; with
one data order for every rate, rates near the best often cross between
the same two checks (ties).

For other scripts (the same task, measured the same way, any model and
callbacks): `make_task(seed)`, `Task.student_layers(seed)`,
`Task.build_student(seed, model_class)`, `Task.student(seed,
learning_rate)`, `ReachTarget`, `run`, `fit_tradeoff`, `plot`. Another
task (benchmarks/batch_growth_adam.py: a classifier trained with Adam)
is a `Task` of its own data carrying how its student is compiled
(`optimizer`, `loss`, `output_dim`) and what is measured on the held-out
set (`held_out`): the sweep, the fit and the scheduler's runs are this
module's, unchanged; the defaults are the regression's.

Writes benchmarks/batch_growth.json (`--out`): every run, the best per
batch size, and the fit; `--plot PATH` draws the trade-off (matplotlib).
"""

import argparse
import copy
import dataclasses
import datetime
import itertools
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # quiet TensorFlow start-up

import numpy as np  # noqa: E402

SIGMA = 0.5  # label noise std: the noise floor is SIGMA**2 = 0.25 in MSE
TARGET = 0.03  # held-out excess loss to reach
N_TRAIN, N_TEST = 65536, 8192
INPUT_DIM = 16
TEACHER_HIDDEN = (32,)
STUDENT_HIDDEN = (64,)
TASK_SEED = 0

BATCH_SIZES = (8, 16, 32, 64, 128, 256, 512, 1024, 2048)
LR_FACTOR = 2**0.5  # the learning-rate grid's step
FIRST_LR = 0.05  # where the walk starts at the smallest batch size
RESOLUTION = 0.02  # relative spacing of the held-out checks, in updates
CUTOFF = 1.25  # stop a run past this many times the batch size's best updates
MAX_EXAMPLES = 4_000_000  # cap on any run, in examples
MAX_UPDATES = 40_000  # and in updates
DIVERGED = 10.0  # an excess loss above this is divergence (the start is ~1)


def excess_mse(outputs, targets):
    """The regression's held-out quantity (`Task.held_out`'s default): the
    MSE of the student's `outputs` against the noise-free `targets`, the
    excess loss itself. Traced into `ReachTarget`'s compiled check."""
    import tensorflow as tf

    return tf.reduce_mean(tf.square(outputs - targets))


@dataclasses.dataclass
class Task:
    """The teacher-student regression; numpy float32 arrays.

    `y_test` is the noise-free teacher's output: the MSE against it is the
    excess loss. `y_test_noisy` has labels drawn like the training set's
    (its MSE is the excess loss plus `noise_floor`, give or take its
    scatter), for whoever wants the noisy version.

    The last fields say how the student is made and judged, so that another
    task (another optimizer, loss, output, held-out measure) runs through
    the same sweep, `ReachTarget` and scheduler's runs; their defaults are
    the regression's (one output, SGD, the MSE, `excess_mse`), which build,
    compile and measure exactly what this module did before they existed:

    - `output_dim`: the student's outputs (a linear last layer);
    - `optimizer`: the name of a `keras.optimizers` class, or a callable
      `learning_rate -> optimizer`;
    - `loss`: `compile`'s loss (a name or a loss object);
    - `held_out`: `(outputs, y_test) -> scalar tensor`, the quantity that
      must fall to `target` (traced once per model into a `tf.function`:
      TensorFlow ops only); a non-finite value is divergence;
    - `held_out_name`: what it is, for printing and plots.
    """

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    y_test_noisy: np.ndarray
    noise_floor: float
    target: float
    seed: int
    input_dim: int = INPUT_DIM
    student_hidden: tuple = STUDENT_HIDDEN
    output_dim: int = 1
    optimizer: object = "SGD"
    loss: object = "mse"
    held_out: object = excess_mse
    held_out_name: str = "held-out excess loss"

    def student_layers(self, seed):
        """`(inputs, outputs)` Keras tensors of the student MLP, its weights
        drawn from `seed` (`keras.utils.set_random_seed(seed)` first): two
        builds from one seed start identical, whichever Model class (say
        `keras.Model` or `keras_accum.AccumModel`) is made of them. Resets
        Keras's (and TensorFlow's, numpy's, Python's) global seed."""
        import keras

        keras.utils.set_random_seed(seed)
        inputs = keras.Input((self.input_dim,))
        hidden = inputs
        for width in self.student_hidden:
            hidden = keras.layers.Dense(width, activation="tanh")(hidden)
        outputs = keras.layers.Dense(self.output_dim)(hidden)
        return inputs, outputs

    def build_student(self, seed, model_class=None, **model_kwargs):
        """The student uncompiled: `model_class(inputs, outputs,
        **model_kwargs)` (default `keras.Model`) of `student_layers(seed)`."""
        import keras

        model_class = model_class or keras.Model
        return model_class(*self.student_layers(seed), **model_kwargs)

    def student(self, seed, learning_rate, model_class=None, **model_kwargs):
        """The student compiled as the sweep's: `build_student(...)`, the
        task's optimizer at `learning_rate` (the regression's: `SGD`), its
        loss (the MSE)."""
        model = self.build_student(seed, model_class, **model_kwargs)
        model.compile(optimizer=self.make_optimizer(learning_rate), loss=self.loss)
        return model

    def make_optimizer(self, learning_rate):
        """A fresh optimizer at `learning_rate`: `optimizer` by name from
        `keras.optimizers` (default arguments otherwise), or called."""
        import keras

        if isinstance(self.optimizer, str):
            return getattr(keras.optimizers, self.optimizer)(learning_rate)
        return self.optimizer(learning_rate)


def make_task(
    seed=TASK_SEED,
    n_train=N_TRAIN,
    n_test=N_TEST,
    target=TARGET,
    input_dim=INPUT_DIM,
    teacher_hidden=TEACHER_HIDDEN,
    student_hidden=STUDENT_HIDDEN,
):
    """The task from `seed`: the teacher's weights, the inputs and the
    label noise, all in numpy (no Keras state touched)."""
    rng = np.random.default_rng(seed)
    # The teacher: tanh layers with N(0, 1/fan_in) weights (unit-scale
    # pre-activations), its output scaled to unit variance so that the
    # target excess loss means the same fraction of the signal whatever
    # the sizes.
    widths = (input_dim, *teacher_hidden)
    weights = [rng.normal(0, 1 / math.sqrt(a), (a, b)) for a, b in itertools.pairwise(widths)]
    biases = [rng.normal(0, 0.1, b) for b in widths[1:]]
    head = rng.normal(0, 1 / math.sqrt(widths[-1]), (widths[-1], 1))

    def teacher(x):
        h = x.astype(np.float64)
        for w, b in zip(weights, biases):
            h = np.tanh(h @ w + b)
        return h @ head

    probe = teacher(rng.normal(size=(65536, input_dim)))
    mean, std = probe.mean(), probe.std()

    def labels(x):
        return ((teacher(x) - mean) / std).astype(np.float32)

    x_train = rng.normal(size=(n_train, input_dim)).astype(np.float32)
    y_train = labels(x_train) + rng.normal(0, SIGMA, (n_train, 1)).astype(np.float32)
    x_test = rng.normal(size=(n_test, input_dim)).astype(np.float32)
    y_test = labels(x_test)
    y_test_noisy = y_test + rng.normal(0, SIGMA, (n_test, 1)).astype(np.float32)
    return Task(
        x_train,
        y_train,
        x_test,
        y_test,
        y_test_noisy,
        SIGMA**2,
        target,
        seed,
        input_dim,
        tuple(student_hidden),
    )


def _keras_callback_base():
    # The callbacks subclass Keras's: importing this module loads Keras (and
    # TensorFlow), though it runs no op, so `main` can still set the threads.
    import keras

    return keras.callbacks.Callback


class ReachTarget(_keras_callback_base()):
    """Stops `fit` when the held-out excess loss (the task's `held_out`
    quantity; the regression's is the excess loss) first reaches the target.

    Counts updates from `model.optimizer.iterations` (a model that
    accumulates gradients makes one update per several `fit` batches:
    `keras_accum`'s models, and Keras's own `gradient_accumulation_steps`,
    whose `iterations` is its batch counter floor-divided by N) and
    examples as the training samples fed: `batch_size` per `fit` batch (the
    last batch of an epoch of `n_samples` the remainder; `n_samples=None`
    counts every batch as full). After an update, once the updates have
    grown by `resolution` (relative) since the last check, it evaluates
    the excess loss (`task.held_out`: by default the MSE against the
    noise-free held-out targets) in a compiled `tf.function` and appends
    `(updates, examples, excess_loss)` to `path`. Its state persists over
    several `fit` calls (`reset()` clears it; once it has stopped, a later
    `fit` stops at its first batch); `updates` is counted from
    `iterations` itself, so start from a fresh optimizer. On a data set of
    unknown length Keras's extra call per epoch may count an update that
    changes nothing: give the data set a known cardinality (as `run`
    does).

    Args:
        task: the `Task` (its `x_test`, `y_test`, `held_out`, `target`).
        batch_size: samples per `fit` batch.
        target: the excess loss to reach (default: `task.target`).
        n_samples: samples per epoch (default: the training set's).
        resolution: relative spacing of the checks, in updates.
        max_examples, max_updates: stop (not reached) at or past these.
        diverged: stop (not reached) when a check's excess loss exceeds this
            or is not finite.
        verbose: print each check.
    """

    def __init__(
        self,
        task,
        batch_size,
        target=None,
        n_samples="train",
        resolution=RESOLUTION,
        max_examples=MAX_EXAMPLES,
        max_updates=MAX_UPDATES,
        diverged=DIVERGED,
        verbose=0,
    ):
        super().__init__()
        self.task = task
        self.batch_size = int(batch_size)
        self.target = task.target if target is None else target
        self.n_samples = len(task.x_train) if n_samples == "train" else n_samples
        self.resolution = resolution
        self.max_examples = max_examples
        self.max_updates = max_updates
        self.diverged = diverged
        self.verbose = verbose
        self._excess_fn = None
        self._fn_model = None
        self.reset()

    def reset(self):
        """Forgets the counts, the path and the outcome."""
        self.examples = 0
        self.updates = 0
        self.next_check = 0
        self.path = []
        self.reached = False
        self.stopped = None  # why it stopped: "target", "cap", "diverged", "cutoff"
        self.seconds = 0.0
        self._began = None

    def _excess(self):
        import tensorflow as tf

        if self._fn_model is not self.model:
            x = tf.constant(self.task.x_test)
            y = tf.constant(self.task.y_test)
            model, measure = self.model, self.task.held_out

            # Compiled once per model: a forward pass and the task's measure
            # (the regression's: a mean of squares), no `evaluate` (its data
            # adapter and callbacks cost more than the pass). No control
            # flow to convert: AutoGraph off.
            @tf.function(autograph=False)
            def excess():
                return measure(model(x, training=False), y)

            self._excess_fn, self._fn_model = excess, model
        return float(self._excess_fn())

    def on_train_begin(self, logs=None):
        self._began = time.perf_counter()

    def on_train_end(self, logs=None):
        if self._began is not None:
            self.seconds += time.perf_counter() - self._began
            self._began = None

    def _stop(self, why):
        self.stopped = why
        self.model.stop_training = True

    def on_train_batch_end(self, batch, logs=None):
        if self.n_samples:
            steps = -(-self.n_samples // self.batch_size)
            fed = min(self.batch_size, self.n_samples - (batch % steps) * self.batch_size)
        else:
            fed = self.batch_size
        self.examples += fed
        if self.stopped:  # a later fit, after the target or a cap
            self.model.stop_training = True
            return
        updates = int(self.model.optimizer.iterations)
        if updates == self.updates:
            return  # no update this batch (accumulating)
        self.updates = updates
        if updates >= self.next_check:
            excess = self._excess()
            self.path.append((updates, self.examples, excess))
            if self.verbose:
                print(f"  update {updates:6d}  examples {self.examples:9d}  excess {excess:.4f}")
            # The next check after `resolution` more (relative): the count
            # at the first check past the target is within that of the
            # first update past it.
            self.next_check = updates + max(1, int(self.resolution * updates))
            if excess <= self.target:
                self.reached = True
                return self._stop("target")
            if not math.isfinite(excess) or excess > self.diverged:
                return self._stop("diverged")
        if (self.max_examples and self.examples >= self.max_examples) or (
            self.max_updates and updates >= self.max_updates
        ):
            self._stop("cap")

    def record(self):
        """The outcome as a JSON-able dict: `updates` and `examples` at the
        check that reached the target (None if not reached), where it
        stopped, why, and the path of checks."""
        return {
            "batch_size": self.batch_size,
            "reached": self.reached,
            "updates": self.updates if self.reached else None,
            "examples": self.examples if self.reached else None,
            "stopped": self.stopped,
            "stopped_at": {"updates": self.updates, "examples": self.examples},
            "seconds": round(self.seconds, 3),
            "path": [[u, e, round(x, 6)] for u, e, x in self.path],
        }


class _Cutoff(_keras_callback_base()):
    """Stops a sweep's run once it has made more updates than `max_updates`
    (the batch size's best so far times CUTOFF): it cannot be best."""

    def __init__(self, reach, max_updates):
        super().__init__()
        self.reach, self.max_updates = reach, max_updates

    def on_train_batch_end(self, batch, logs=None):
        if self.reach.updates > self.max_updates and not self.model.stop_training:
            self.reach._stop("cutoff")


def dataset(task, batch_size, shuffle_seed=0):
    """The training set as a `tf.data.Dataset` of `batch_size` batches,
    reshuffled each epoch in an order fixed by `shuffle_seed` (the same
    sample order for every batch size), its length known."""
    import tensorflow as tf

    # Dataset.shuffle's order also depends on the global seed: set it, so
    # that the order does not depend on what ran before.
    tf.random.set_seed(shuffle_seed)
    data = tf.data.Dataset.from_tensor_slices((task.x_train, task.y_train))
    data = data.shuffle(len(task.x_train), seed=shuffle_seed, reshuffle_each_iteration=True)
    return data.batch(batch_size).prefetch(2)


def run(
    task,
    model,
    batch_size,
    callbacks=(),
    max_epochs=None,
    shuffle_seed=0,
    reach=None,
    **reach_kwargs,
):
    """Fits `model` (a compiled model, or a function returning one) on the
    task's training set in batches of `batch_size` until the held-out excess
    loss reaches the target, or a cap; returns `ReachTarget.record()`.

    Args:
        task: the `Task`.
        model: compiled model, or a zero-argument function making one.
        batch_size: the `fit` batch size (samples fed per train batch).
        callbacks: more callbacks, run after the `ReachTarget`.
        max_epochs: epochs cap (default: enough for `MAX_EXAMPLES`).
        shuffle_seed: the per-epoch shuffles' seed.
        reach: a `ReachTarget` to use (default: one made with
            `reach_kwargs`).
    """
    model = model() if callable(model) and not hasattr(model, "fit") else model
    reach = reach or ReachTarget(task, batch_size, **reach_kwargs)
    if max_epochs is None:
        max_epochs = math.ceil((reach.max_examples or MAX_EXAMPLES) / len(task.x_train))
    model.fit(
        dataset(task, batch_size, shuffle_seed),
        epochs=max_epochs,
        verbose=0,
        shuffle=False,
        callbacks=[reach, *callbacks],
    )
    return reach.record()


def fit_tradeoff(points):
    """Fits S = S_min + E_min / B to `points`, `[(batch_size, updates)]`,
    by least squares on the relative error (each point weighs alike,
    whether it took 400 updates or 10,000): rows [1/S, 1/(B S)] times
    [S_min, E_min] = 1. Returns S_min, E_min, B_crit = E_min / S_min and
    the knee (S = 2 S_min, E = 2 E_min), and each point's residual."""
    b = np.array([p[0] for p in points], dtype=float)
    s = np.array([p[1] for p in points], dtype=float)
    design = np.stack([1 / s, 1 / (b * s)], axis=1)
    (s_min, e_min), *_ = np.linalg.lstsq(design, np.ones_like(s), rcond=None)
    predicted = s_min + e_min / b
    return {
        "S_min": float(s_min),
        "E_min": float(e_min),
        "B_crit": float(e_min / s_min),
        "knee": {"updates": float(2 * s_min), "examples": float(2 * e_min)},
        "relative_residuals": [float(r) for r in (s - predicted) / predicted],
        "method": "least squares of (S_min + E_min/B - S)/S over the best points",
    }


def _lr_key(lr):
    return f"{lr:.6g}"


def _trial(task, batch_size, lr, seeds, max_updates, verbose):
    """Trains the student at `lr` from each seed (its weights and the
    shuffle), each run stopped past `max_updates`; returns the median
    updates to the target (inf unless every seed reached it) and the runs'
    records. After the first seed that fails the others are not run: the
    rate cannot be best."""
    import keras

    counts, records = [], []
    for seed in seeds:
        reach = ReachTarget(task, batch_size)
        record = run(
            task,
            task.student(seed, lr),
            batch_size,
            callbacks=[_Cutoff(reach, max_updates)],
            shuffle_seed=seed,
            reach=reach,
        )
        record.update(learning_rate=lr, seed=seed)
        records.append(record)
        counts.append(record["updates"] if record["reached"] else math.inf)
        if verbose:
            print(
                f"B={batch_size:5d} lr={lr:<8.4g} seed={seed} "
                f"{record['stopped']:8s} updates={record['stopped_at']['updates']:6d} "
                f"examples={record['stopped_at']['examples']:9d} "
                f"({record['seconds']:.1f} s)",
                flush=True,
            )
        keras.backend.clear_session()  # the graphs of the runs before
        if math.isinf(counts[-1]):
            break
    median = statistics.median(counts) if len(counts) == len(seeds) else math.inf
    return median, records


def sweep(
    task,
    batch_sizes=BATCH_SIZES,
    seeds=(0, 1),
    first_lr=FIRST_LR,
    lr_factor=LR_FACTOR,
    cutoff=CUTOFF,
    verbose=True,
):
    """The sweep: for each batch size, walks the learning-rate grid
    (`lr_factor ** i`) from the previous batch size's best, up while the
    median updates do not grow, then (unless that found fewer) down
    likewise; every learning rate trained from each seed in `seeds`. A
    run stops past `cutoff` times the batch size's best median so far.
    Returns the JSON-able results: every run, the best per batch size
    (fewest median updates; a tie goes to the rate tried first), the fit."""
    runs, best = [], {}
    lr_index = round(math.log(first_lr) / math.log(lr_factor))

    def grid(i):
        return float(f"{lr_factor**i:.4g}")

    for batch_size in batch_sizes:
        tried = {}  # grid index: median updates (inf when any seed failed)

        def worse(i, than, tried=tried, batch_size=batch_size):
            # Runs grid point i (once); whether it did worse than `than`.
            if i not in tried:
                best_updates = min(tried.values(), default=math.inf)
                tried[i], records = _trial(
                    task, batch_size, grid(i), seeds, best_updates * cutoff, verbose
                )
                runs.extend(records)
            return math.isinf(tried[i]) or tried[i] > tried[than]

        # Ties go on walking: with one data order for all the rates, a flat
        # optimum crosses the target between the same two checks.
        start = i = lr_index
        worse(start, start)
        while not worse(i + 1, i):
            i += 1
        if tried[i] >= tried[start]:  # no better up: down from the start too
            i = start
            while not worse(i - 1, i):
                i -= 1
        winner = min(tried, key=tried.get)
        if math.isinf(tried[winner]):
            if verbose:
                print(f"B={batch_size}: no learning rate reached the target")
            continue
        lr_index = winner
        lr = grid(winner)
        updates = tried[winner]
        best[str(batch_size)] = {
            "learning_rate": lr,
            "updates": updates,
            "examples": updates * batch_size,
            "tried": {
                _lr_key(grid(j)): (None if math.isinf(v) else v) for j, v in sorted(tried.items())
            },
            "best_at_grid_edge": winner in (min(tried), max(tried)),
        }
    points = [(int(b), v["updates"]) for b, v in best.items()]
    fit = fit_tradeoff(points) if len(points) >= 2 else None
    return {"runs": runs, "best": best, "fit": fit}


# The schedule's runs (issue "grow the batch without wasting samples"):
# micro-batches of 8 at accum_steps=2 (batch 16), up to 128 (batch 1024).
SCHEDULE_MICRO, SCHEDULE_START, SCHEDULE_CAP = 8, 2, 128
# Each start: the batch whose swept best rate the optimizer is given, and
# whether the scheduler is told so (`tuned_batch`).
STARTS = {
    "rate tuned for 16": dict(rate_of=16, tuned_batch=None),
    "rate tuned for 256, tuned_batch=256": dict(rate_of=256, tuned_batch=256),
}
# The other `learning_rate_rule`s from the rate tuned for 16 (the starts
# above run the default, "auto": "adascale" for SGD), each to a cap of
# RULES_MAX_EXAMPLES (a rule that never reaches the target, or no rule,
# would otherwise run to the sweep's 4M examples at micro-batches of 8).
RULES = ("sqrt", "adascale_sqrt", "linear", None)
RULES_MAX_EXAMPLES = 2_000_000
# The default schedule deciding on a probe where the window is outgrown:
# the held-out inputs with labels drawn as the training set's (8,192
# examples, never trained on), 8 windows.
PROBE_STARTS = {
    f"{name}, probe of 8,192 held-out examples": start for name, start in STARTS.items()
}


def rule_name(rule):
    """The report's row for `rule` run from the rate tuned for 16."""
    return f"learning_rate_rule={rule!r}, rate tuned for 16"


def rule_runs(task, best, fit, seeds, rules=RULES, **scheduler_kwargs):
    """`schedule_runs` from the rate tuned for 16 once per rule in `rules`,
    each to RULES_MAX_EXAMPLES examples."""
    out = {}
    for rule in rules:
        out.update(
            schedule_runs(
                task,
                best,
                fit,
                seeds,
                {rule_name(rule): dict(rate_of=16, tuned_batch=None)},
                reach_kwargs=dict(max_examples=RULES_MAX_EXAMPLES),
                learning_rate_rule=rule,
                **scheduler_kwargs,
            )
        )
    return out


def schedule_runs(task, best, fit, seeds, starts=STARTS, *, reach_kwargs=None, **scheduler_kwargs):
    """The default `AccumScheduler("noise_scale", max_accum_steps=128)` on
    the task, from batch 16, with each start's rate, per seed: updates and
    examples to the target (also in S_min and E_min), its decisions, and
    the checks' path. `best` is the sweep's best per batch size (its rates).
    `reach_kwargs`: `ReachTarget`'s arguments (say a lower cap, for a rule
    that may never reach the target), by default its defaults."""
    import keras_accum

    out = {}
    for name, start in starts.items():
        rate = best[str(start["rate_of"])]["learning_rate"]
        runs = []
        for seed in seeds:
            model = task.student(
                seed,
                rate,
                model_class=keras_accum.AccumModel,
                accum_steps=SCHEDULE_START,
                noise_scale=True,
            )
            scheduler = keras_accum.AccumScheduler(
                "noise_scale",
                max_accum_steps=SCHEDULE_CAP,
                tuned_batch=start["tuned_batch"],
                **scheduler_kwargs,
            )
            record = run(
                task,
                model,
                SCHEDULE_MICRO,
                callbacks=[scheduler],
                shuffle_seed=seed,
                **(reach_kwargs or {}),
            )
            record["decisions"] = [
                {
                    "updates": d.updates,
                    "samples": d.samples,
                    "batch": d.accum_steps * SCHEDULE_MICRO,
                    "learning_rate": d.learning_rate,
                    "noise_scale": d.estimate.value,
                    "low": d.estimate.low,
                    "high": d.estimate.high,
                    "resolved": d.estimate.resolved,
                    "probed": d.probed,
                }
                for d in scheduler.path
            ]
            record["seed"] = seed
            if scheduler_kwargs.get("probe") is not None:
                # Measured, not trained on: a forward and backward pass each.
                record["probe_samples"] = len(scheduler_kwargs["probe"][0]) * sum(
                    d.probed for d in scheduler.path
                )
            runs.append(record)
            print(
                f"{name}, seed {seed}: {record['updates']} updates, "
                f"{record['examples']} examples ({record['stopped']})",
                flush=True,
            )
        reached = [r for r in runs if r["reached"]]
        summary = {
            "learning_rate": rate,
            "tuned_batch": start["tuned_batch"],
            "reached": len(reached),
            "runs": runs,
        }
        if reached and fit:
            summary["updates"] = statistics.median(r["updates"] for r in reached)
            summary["examples"] = statistics.median(r["examples"] for r in reached)
            summary["updates_in_S_min"] = summary["updates"] / fit["S_min"]
            summary["examples_in_E_min"] = summary["examples"] / fit["E_min"]
        out[name] = summary
    return out


def _compact_json(results):
    """The JSON written: the sweep's runs without their checks' paths (the
    scheduler's keep theirs, for the plot), each path on one line."""
    results = copy.deepcopy(
        dict(
            results, runs=[{k: v for k, v in run.items() if k != "path"} for run in results["runs"]]
        )
    )
    paths = {}
    for summary in results.get("schedule", {}).values():
        for run in summary["runs"]:
            key = f"@path{len(paths)}@"
            paths[key] = json.dumps(run["path"])
            run["path"] = key
    text = json.dumps(results, indent=1)
    for key, path in paths.items():
        text = text.replace(json.dumps(key), path)
    return text + "\n"


def report(results):
    """The Markdown of a run: the sweep's best points, the fit, and the
    scheduler's runs against them (benchmarks/batch_growth.md)."""
    lines = ["| batch B | best rate | updates S | examples E |", "|---|---|---|---|"]
    for b, v in results["best"].items():
        lines.append(
            f"| {b} | {v['learning_rate']:.3g} | {v['updates']:g} | {v['examples']:,.0f} |"
        )
    fit = results["fit"]
    seeds = ", ".join(str(s) for s in results["sweep"]["seeds"])
    lines += [
        "",
        f"Medians over seeds {seeds} (a seed draws the student's weights and the "
        "data order). Fit: "
        f"`S_min` = {fit['S_min']:.0f} updates, `E_min` = {fit['E_min']:,.0f} examples, "
        f"critical batch `B_crit = E_min / S_min` = {fit['B_crit']:.0f}; the knee is "
        f"{2 * fit['S_min']:.0f} updates and {2 * fit['E_min']:,.0f} examples.",
        "",
        '| AccumScheduler("noise_scale", max_accum_steps=128), from batch 16 | rate '
        "| updates (in `S_min`) | examples (in `E_min`) | reached |",
        "|---|---|---|---|---|",
    ]
    for name, summary in results.get("schedule", {}).items():
        if "updates" not in summary:
            lines.append(
                f"| {name} | {summary['learning_rate']:.3g} | - | - | 0 of {len(summary['runs'])} |"
            )
            continue
        per_seed = ", ".join(f"{r['updates']}" for r in summary["runs"] if r["reached"])
        probed = [r["probe_samples"] for r in summary["runs"] if "probe_samples" in r]
        measured = f"; and {statistics.median(probed):,.0f} measured on the probe" if probed else ""
        lines.append(
            f"| {name} | {summary['learning_rate']:.3g} | {summary['updates']:g} "
            f"({summary['updates_in_S_min']:.2f}; seeds: {per_seed}) | "
            f"{summary['examples']:,.0f} ({summary['examples_in_E_min']:.2f}){measured} | "
            f"{summary['reached']} of {len(summary['runs'])} |"
        )
    for b in ("16", "256"):
        if b in results["best"]:
            v = results["best"][b]
            lines.append(
                f"| fixed batch {b}, its best rate (the sweep) | {v['learning_rate']:.3g} | "
                f"{v['updates']:g} ({v['updates'] / fit['S_min']:.2f}) | "
                f"{v['examples']:,.0f} ({v['examples'] / fit['E_min']:.2f}) | |"
            )
    lines += [
        "",
        f"Run {results['date']}, TensorFlow {results['versions']['tensorflow']}, "
        f"Keras {results['versions']['keras']}, {results['threads']} thread(s), "
        f"{results['wall_seconds']:.0f} s",
    ]
    if "sweep_run" in results:  # the scheduler's runs on a committed sweep
        sweep_run = results["sweep_run"]
        lines[-1] += (
            f" for the scheduler's runs, on the sweep of {sweep_run['date']} "
            f"({sweep_run['wall_seconds']:.0f} s, {sweep_run['threads']} thread(s))"
        )
    lines[-1] += "."
    return "\n".join(lines) + "\n"


def _as_path(item):
    """`(label, examples array, updates array)` from an extra path: a
    `ReachTarget.record()` dict, a sequence of `(examples, updates)` pairs
    or of `(updates, examples, excess)` triples (the record's path), each
    optionally as `(label, path)`."""
    label = None
    if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str):
        label, item = item
    if isinstance(item, dict):
        label = label or item.get("label")
        item = item["path"]
    rows = [tuple(r) for r in item]
    if rows and len(rows[0]) == 3:
        return label, [r[1] for r in rows], [r[0] for r in rows]
    return label, [r[0] for r in rows], [r[1] for r in rows]


def plot(results, path, extra_paths=()):
    """Draws the trade-off in log-log axes, examples E across, updates S up:
    the best point of each batch size, the fitted hyperbola
    (S/S_min - 1)(E/E_min - 1) = 1 with its asymptotes, the knee
    (2 E_min, 2 S_min), and `extra_paths` (other runs, e.g. a batch-size
    scheduler's: see `_as_path` for the forms accepted) as lines through
    their checks. Needs matplotlib."""
    import matplotlib

    matplotlib.use("Agg")  # no display; must precede pyplot
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 5))
    best = results["best"]
    batch = np.array([int(b) for b in best], dtype=float)
    updates = np.array([v["updates"] for v in best.values()], dtype=float)
    ax.plot(updates * batch, updates, "o", color="C0", label="best learning rate per batch")
    for b, s in zip(batch, updates):
        ax.annotate(f"{int(b)}", (s * b, s), textcoords="offset points", xytext=(4, 4), fontsize=8)
    fit = results.get("fit")
    if fit:
        s_min, e_min = fit["S_min"], fit["E_min"]
        bs = np.geomspace(batch.min() / 2, batch.max() * 4, 200)
        bs = bs[s_min + e_min / bs > 0]
        ax.plot(
            bs * (s_min + e_min / bs),
            s_min + e_min / bs,
            "-",
            color="C1",
            label=f"S = S_min + E_min/B: S_min={s_min:.0f}, E_min={e_min:.3g}",
        )
        # A fit of a non-positive S_min or E_min (points not on a
        # hyperbola) has no asymptote or knee in log axes.
        if s_min > 0:
            ax.axhline(s_min, color="C1", ls=":", lw=0.8)
        if e_min > 0:
            ax.axvline(e_min, color="C1", ls=":", lw=0.8)
        if s_min > 0 and e_min > 0:
            ax.plot(
                [2 * e_min],
                [2 * s_min],
                "*",
                ms=14,
                color="C3",
                label=f"knee: B_crit = E_min/S_min = {fit['B_crit']:.0f}",
            )
    for index, item in enumerate(extra_paths):
        label, e, s = _as_path(item)
        ax.plot(e, s, "-", color=f"C{index + 4}", lw=1.5, label=label or f"path {index + 1}")
        ax.plot(e[-1:], s[-1:], "s", color=f"C{index + 4}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("examples E to the target")
    ax.set_ylabel("optimizer updates S to the target")
    task = results.get("task", {})
    measure = task.get("held_out_name", "held-out excess loss")
    ax.set_title(f"{measure} {task.get('target', TARGET)}: steps vs examples")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_record(threads, seconds, quick):
    """The fields every batch-growth benchmark's JSON starts with: the
    date, the versions, the threads, the wall seconds and whether a smoke
    run."""
    import keras
    import tensorflow as tf

    return {
        "date": datetime.date.today().isoformat(),
        "versions": {
            "tensorflow": tf.__version__,
            "keras": keras.__version__,
            "python": sys.version.split()[0],
        },
        "threads": threads,
        "wall_seconds": round(seconds, 1),
        "quick": quick,
    }


def print_summary(results):
    """Prints a run's best points, fit and scheduler outcomes (a results
    dict as `main` writes it; the classifier's too)."""
    print()
    print("| B | best lr | updates S | examples E |")
    print("|---|---|---|---|")
    for b, v in results["best"].items():
        edge = " (grid edge)" if v["best_at_grid_edge"] else ""
        # A median of two seeds may end in .5.
        print(f"| {b} | {v['learning_rate']:.4g}{edge} | {v['updates']:g} | {v['examples']:g} |")
    fit = results["fit"]
    if fit:
        print(
            f"\nS_min = {fit['S_min']:.0f} updates, E_min = {fit['E_min']:.0f} examples, "
            f"B_crit = {fit['B_crit']:.0f}; knee at S = {2 * fit['S_min']:.0f}, "
            f"E = {2 * fit['E_min']:.0f}"
        )
    for name, summary in results.get("schedule", {}).items():
        if "updates" in summary:
            print(
                f"AccumScheduler, {name}: {summary['updates']:g} updates "
                f"({summary['updates_in_S_min']:.2f} S_min), {summary['examples']:g} "
                f"examples ({summary['examples_in_E_min']:.2f} E_min); reached in "
                f"{summary['reached']} of {len(summary['runs'])} seeds"
            )
        else:
            print(f"AccumScheduler, {name}: not reached")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=list(BATCH_SIZES))
    parser.add_argument(
        "--seeds",
        type=int,
        nargs="+",
        default=[0, 1],
        help="student and shuffle seeds; the median is used (default: 0 1)",
    )
    parser.add_argument("--task-seed", type=int, default=TASK_SEED)
    parser.add_argument(
        "--first-lr",
        type=float,
        default=FIRST_LR,
        help="learning rate the walk starts from at the first batch size",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="TensorFlow intra- and inter-op threads (default: 1; the machine is shared)",
    )
    parser.add_argument("--quick", action="store_true", help="a few batch sizes: a smoke run")
    parser.add_argument(
        "--out",
        default=None,
        help="JSON path (default: benchmarks/batch_growth.json; none when --quick)",
    )
    parser.add_argument("--plot", help="draw the trade-off to this PNG (needs matplotlib)")
    parser.add_argument(
        "--schedule-only",
        metavar="JSON",
        help="skip the sweep: take it from this JSON (a committed run) and run the scheduler only",
    )
    parser.add_argument(
        "--no-schedule", action="store_true", help="the sweep only, without the scheduler's runs"
    )
    parser.add_argument(
        "--no-rules",
        action="store_true",
        help="the default rule only, without the other rules' runs",
    )
    parser.add_argument(
        "--no-probe", action="store_true", help="without the runs deciding on a probe"
    )
    parser.add_argument(
        "--add-runs",
        action="store_true",
        help="with --schedule-only: keep its JSON's scheduler runs and run "
        "only the ones it lacks (the seconds add up)",
    )
    args = parser.parse_args(argv)
    import tensorflow as tf

    # Before any op runs: the thread pools are fixed at their first use.
    tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    tf.config.threading.set_inter_op_parallelism_threads(args.threads)

    out = args.out or (None if args.quick else str(Path(__file__).parent / "batch_growth.json"))
    task = make_task(args.task_seed)
    batch_sizes, seeds = args.batch_sizes, tuple(args.seeds)
    if args.quick:
        seeds = seeds[:1]
        # An easy target and three batch sizes: seconds, not a measurement.
        task.target = 0.1
        batch_sizes = [b for b in batch_sizes if b >= 64][:5:2] or batch_sizes[-2:]
    began, kept, kept_seconds = time.perf_counter(), {}, 0.0
    if args.schedule_only:
        swept = json.loads(Path(args.schedule_only).read_text())
        results = {k: swept[k] for k in ("runs", "best", "fit")}
        results["sweep_run"] = swept.get("sweep_run") or {
            k: swept[k] for k in ("date", "wall_seconds", "threads")
        }
        seeds = tuple(swept["sweep"]["seeds"])
        if args.add_runs:  # the JSON's scheduler runs kept, the missing ones run
            kept, kept_seconds = swept.get("schedule", {}), swept["wall_seconds"]
    else:
        results = sweep(task, batch_sizes, seeds, first_lr=args.first_lr)
    if not args.no_schedule:
        starts, every = STARTS, {}
        if args.quick:  # one start, from the batch sizes swept; decisions early
            rate_of = min(results["best"], key=int)
            starts = {f"rate tuned for {rate_of}": dict(rate_of=int(rate_of), tuned_batch=None)}
            every = dict(every_updates=5)
        results["schedule"] = dict(kept)

        def missing(names):
            return any(name not in kept for name in names)

        if missing(starts):
            results["schedule"].update(
                schedule_runs(task, results["best"], results["fit"], seeds, starts, **every)
            )
        if not args.quick and not args.no_rules and missing(map(rule_name, RULES)):
            results["schedule"].update(
                rule_runs(task, results["best"], results["fit"], seeds, **every)
            )
        if not args.quick and not args.no_probe and missing(PROBE_STARTS):
            results["schedule"].update(
                schedule_runs(
                    task,
                    results["best"],
                    results["fit"],
                    seeds,
                    PROBE_STARTS,
                    probe=(task.x_test, task.y_test_noisy),
                    **every,
                )
            )
    seconds = time.perf_counter() - began + kept_seconds
    results = {
        **run_record(args.threads, seconds, args.quick),
        "task": {
            "seed": args.task_seed,
            "n_train": len(task.x_train),
            "n_test": len(task.x_test),
            "input_dim": INPUT_DIM,
            "teacher_hidden": list(TEACHER_HIDDEN),
            "student_hidden": list(STUDENT_HIDDEN),
            "activation": "tanh",
            "sigma": SIGMA,
            "noise_floor": task.noise_floor,
            "target": task.target,
            "held_out": "noise-free teacher targets (the MSE is the excess loss)",
        },
        "sweep": {
            "seeds": list(seeds),
            "batch_sizes": list(batch_sizes),
            "lr_factor": LR_FACTOR,
            "first_lr": args.first_lr,
            "resolution": RESOLUTION,
            "cutoff": CUTOFF,
            "max_examples": MAX_EXAMPLES,
            "max_updates": MAX_UPDATES,
            "optimizer": "keras.optimizers.SGD, no momentum",
            "loss": "mse",
        },
        **results,
    }
    print_summary(results)
    print(f"{seconds:.0f} s with {args.threads} thread(s)")
    if out:
        Path(out).write_text(_compact_json(results))
        Path(out).with_suffix(".md").write_text(report(results))
        print(f"wrote {out} and its .md")
    if args.plot:
        try:
            plot(
                results,
                args.plot,
                extra_paths=[
                    (f"AccumScheduler, {name}, seed {r['seed']}", r)
                    for name, summary in results.get("schedule", {}).items()
                    if name in STARTS
                    for r in summary["runs"][:1]
                ],
            )
            print(f"wrote {args.plot}")
        except ImportError:
            print("matplotlib is not importable: no plot")


if __name__ == "__main__":
    main()
