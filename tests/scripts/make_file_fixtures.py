"""Writes the file-format fixtures of tests/test_file_compat.py.

    python tests/scripts/make_file_fixtures.py OUT

OUT is a new folder, e.g. tests/fixtures/files_X_Y for release X.Y. Run it
only to make fixtures for a new release's format (or to pin a layout before
a change that must keep it, as tests/fixtures/files_main_a577af5/): the
committed files are what an older keras_accum wrote, and the test checks
that today's keras_accum still loads and resumes them exactly
(tests/fixtures/files_0_1/README.md). Each folder's `versions.json` names
the variants it holds: a variant added here later is not in older folders.

Each variant (`VARIANTS`) trains a small model on `data()` with
`fit(batch_size=8, shuffle=False)` at `accum_steps=4` (92 samples: windows of
8+8+8+8, 8+8+8+8, 8+8+8+4 samples) and is stopped after `SAVED_AFTER`
micro-batches, half-way through the second window, where it writes:

* `mid_window.keras`: `model.save`;
* `mid_window.weights.h5`: `model.save_weights`;
* `checkpoint/`: `tf.train.Checkpoint(model=, optimizer=).save`;
* `backup/` (`accum` only): the `keras_accum.BackupAndRestore(save_freq=6)`
  backup taken after that micro-batch, as the interrupted `fit` left it.

The window then open holds Adam's dense gradient sums, an `Embedding`'s
gradient as slices (sparse.py) and a `BatchNormalization` layer's pooled
moments (batchnorm="window").

The `optimizer` variant (added after 0.1.0) is a plain `keras.Model`
compiled with `keras_accum.AccumOptimizer(Adam, skip_nonfinite=True)`,
without the `BatchNormalization` (an optimizer pools no moments) and on 96
samples (`EVEN_SAMPLES`: every micro-batch full, as Keras's loss weighs
each micro-batch equally), its first window skipped (a NaN sample weight):
the optimizer's window, slices and skip count are what its files hold.

Each variant's `initial.weights.npz` holds
the weights it started from, for the big-batch reference; `versions.json`
says what wrote the files.

What the test rebuilds (`data`, `plain`, `make`, `compile_model`, ...) is
defined here only, so that it is exactly what wrote the files.
"""

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import keras
import numpy as np
import tensorflow as tf

ROOT = Path(__file__).resolve().parents[2]
if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))  # today's keras_accum, from this checkout

import keras_accum  # noqa: E402

SAMPLES, FEATURES, IDS, VOCAB, CLASSES = 92, 6, 2, 80, 3
MICRO_BATCH, ACCUM_STEPS, BIG_BATCH = 8, 4, 32
# Two windows' worth of micro-batches is 8: 6 is half-way through the second.
SAVED_AFTER = 6
BACKUP_FREQ = 6
# The sample whose weight is NaN in the skip_nonfinite and optimizer
# variants: its window (the first) is skipped, and the file holds the count.
NAN_SAMPLE = 3
# The optimizer variant's samples: 12 full micro-batches, 3 full windows. A
# plain model's AccumOptimizer counts micro-batches equally (Keras's loss is
# each micro-batch's mean): with a short last micro-batch its window would
# not be the big batch's mean.
EVEN_SAMPLES = 96

# name: AccumModel (or AccumOptimizer) arguments, whether it is `wrap` of a
# subclassed model (a `WrappedModel`), whether a sample weight is NaN,
# whether a backup is written (the others' would be their `.weights.h5`
# files again, by another name), whether it is a plain keras.Model compiled
# with an AccumOptimizer (added after 0.1.0: not in tests/fixtures/files_0_1).
VARIANTS = {
    "accum": dict(kwargs={}, wrap=False, nan=False, backup=True, optimizer=False),
    "skip_nonfinite": dict(
        kwargs={"skip_nonfinite": True},
        wrap=False,
        nan=True,
        backup=False,
        optimizer=False,
    ),
    "wrap_subclassed": dict(kwargs={}, wrap=True, nan=False, backup=False, optimizer=False),
    "optimizer": dict(
        kwargs={"skip_nonfinite": True},
        wrap=False,
        nan=True,
        backup=False,
        optimizer=True,
    ),
}


def data(variant="accum"):
    """([x, ids], y, sample_weight): 92 samples (the optimizer variant's
    96), one NaN weight if `nan`."""
    samples = EVEN_SAMPLES if VARIANTS[variant]["optimizer"] else SAMPLES
    rng = np.random.default_rng(0)
    # Scaled and shifted, so that the batch-norm moments are far from 0 and 1.
    x = (rng.normal(size=(samples, FEATURES)) * np.arange(1, FEATURES + 1) + 2).astype("float32")
    ids = rng.integers(0, VOCAB, size=(samples, IDS)).astype("int32")
    y = ((x[:, 0] + x[:, 1] > 4).astype("int64") + (ids[:, 0] >= VOCAB // 2)).astype("int64")
    weight = np.ones(samples, "float32")
    if VARIANTS[variant]["nan"]:
        weight[NAN_SAMPLE] = np.nan
    return [x, ids], y, weight


def _layers():
    return dict(
        embedding=keras.layers.Embedding(VOCAB, 3, name="embedding"),
        flatten=keras.layers.Flatten(name="flatten"),
        concat=keras.layers.Concatenate(name="concat"),
        hidden=keras.layers.Dense(8, activation="tanh", name="hidden"),
        logits=keras.layers.Dense(CLASSES, name="logits"),
        batchnorm=keras.layers.BatchNormalization(momentum=0.6, name="batchnorm"),
        probe=keras.layers.Dense(
            CLASSES,
            use_bias=False,
            kernel_initializer="zeros",
            trainable=False,
            name="probe",
        ),
        out=keras.layers.Add(name="out"),
    )


def _forward(layers, x, ids):
    """The model's graph, from `layers` (attributes named as in `_layers`):
    Dense layers over features and an `Embedding` of ids (sparse slices),
    and a `BatchNormalization` on the features whose output reaches the loss
    through a frozen zero kernel: its moving statistics are the big batch's
    exactly (the window's pooled moments), and the gradients are too, though
    each micro-batch is normalised by its own moments."""
    embedded = layers.flatten(layers.embedding(ids))
    logits = layers.logits(layers.hidden(layers.concat([x, embedded])))
    probe = layers.probe(layers.batchnorm(x))
    return layers.out([logits, probe])


def net(cls=keras.Model, seed=0, batchnorm=True, **kwargs):
    """The functional model (see `_forward`); `seed` sets its weights.
    Without `batchnorm`, the Dense layers over features and embedded ids
    only (the optimizer variant: an AccumOptimizer pools no moments)."""
    keras.utils.set_random_seed(seed)
    x = keras.Input((FEATURES,), name="x")
    ids = keras.Input((IDS,), dtype="int32", name="ids")
    layers = types.SimpleNamespace(**_layers())
    if batchnorm:
        out = _forward(layers, x, ids)
    else:
        embedded = layers.flatten(layers.embedding(ids))
        out = layers.logits(layers.hidden(layers.concat([x, embedded])))
    return cls([x, ids], out, name="fixture_net", **kwargs)


@keras.saving.register_keras_serializable(package="keras_accum_fixtures")
class FixtureNet(keras.Model):
    """The same layers in a subclassed model, for `wrap` (a `WrappedModel`)."""

    def __init__(self, **kwargs):
        kwargs.setdefault("name", "fixture_net")
        super().__init__(**kwargs)
        for name, layer in _layers().items():
            setattr(self, name, layer)

    def call(self, inputs, training=None):
        # `training` in the signature: without it, Keras runs the layers of
        # a plain model in inference mode under `fit`, the batch
        # normalisation's moving statistics never moving.
        x, ids = inputs
        return _forward(self, x, ids)


def plain(variant, seed=0):
    """The variant's plain keras.Model, built (`seed` sets its weights)."""
    if VARIANTS[variant]["optimizer"]:
        return net(seed=seed, batchnorm=False)
    if not VARIANTS[variant]["wrap"]:
        return net(seed=seed)
    keras.utils.set_random_seed(seed)
    model = FixtureNet()
    (x, ids), _, _ = data(variant)
    model([x[:1], ids[:1]])
    return model


def make(variant, seed=0):
    """The variant's accumulating model, built, neither compiled nor trained
    (the optimizer variant's is its plain model: `compile_model` gives it
    the AccumOptimizer)."""
    settings = VARIANTS[variant]
    if settings["optimizer"]:
        return plain(variant, seed)
    kwargs = dict(settings["kwargs"], accum_steps=ACCUM_STEPS)
    if settings["wrap"]:
        return keras_accum.wrap(plain(variant, seed), **kwargs)
    return net(keras_accum.AccumModel, seed=seed, **kwargs)


def compile_model(model, variant=None):
    """Compiled with Adam; for the optimizer `variant`, Adam inside its
    AccumOptimizer (the big-batch twin passes no variant)."""
    optimizer = keras.optimizers.Adam(0.01)
    if variant is not None and VARIANTS[variant]["optimizer"]:
        optimizer = keras_accum.AccumOptimizer(
            optimizer, accum_steps=ACCUM_STEPS, **VARIANTS[variant]["kwargs"]
        )
    model.compile(
        optimizer,
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def accumulating(model):
    """What holds the window: the model, or a plain model's AccumOptimizer."""
    if isinstance(model.optimizer, keras_accum.AccumOptimizer):
        return model.optimizer
    return model


def fit_kwargs(variant, start=0):
    """`fit`'s data and settings for the micro-batches from `start` on."""
    inputs, y, weight = data(variant)
    return dict(
        x=[i[start:] for i in inputs],
        y=y[start:],
        sample_weight=weight[start:],
        batch_size=MICRO_BATCH,
        epochs=1,
        shuffle=False,
        verbose=0,
    )


class _StopAfter(keras.callbacks.Callback):
    """Ctrl-C once micro-batch `batches` has been trained."""

    def __init__(self, batches):
        super().__init__()
        self.batches = batches

    def on_train_batch_end(self, batch, logs=None):
        if batch + 1 == self.batches:
            raise KeyboardInterrupt


def write_variant(variant, out):
    out.mkdir(parents=True)
    model = compile_model(make(variant), variant)
    # What the big-batch reference starts from (`plain(variant)`'s weights
    # are in the same order).
    np.savez(out / "initial.weights.npz", *model.get_weights())
    callbacks = [_StopAfter(SAVED_AFTER)]
    if VARIANTS[variant]["backup"]:
        # First, so that the backup is written before the interruption.
        callbacks.insert(
            0, keras_accum.BackupAndRestore(str(out / "backup"), save_freq=BACKUP_FREQ)
        )
    try:
        model.fit(callbacks=callbacks, **fit_kwargs(variant))
    except KeyboardInterrupt:
        pass
    else:
        raise AssertionError("fit was not interrupted")
    if VARIANTS[variant]["backup"]:
        assert sorted(os.listdir(out / "backup")) == [
            f"epoch-0-batch-{BACKUP_FREQ}.json",
            f"epoch-0-batch-{BACKUP_FREQ}.weights.h5",
        ], os.listdir(out / "backup")
    model.save(out / "mid_window.keras")
    model.save_weights(out / "mid_window.weights.h5")
    tf.train.Checkpoint(model=model, optimizer=model.optimizer).save(
        str(out / "checkpoint" / "mid_window")
    )
    return {
        "optimizer_iterations": int(model.optimizer.iterations.numpy()),
        "skipped_windows": accumulating(model).skipped_windows,
        "pending_micro_batches": accumulating(model)._accumulator.open_micro_batches(),
    }


def _git(*args):
    try:
        return subprocess.run(
            ["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def main(out):
    out = Path(out)
    if out.exists():
        # Committed fixtures are never written over (their README says why).
        raise SystemExit(f"{out} exists: give a new folder")
    out.mkdir(parents=True)
    states = {}
    for variant in VARIANTS:
        states[variant] = write_variant(variant, out / variant)
    versions = {
        "keras_accum": keras_accum.__version__,
        "commit": _git("rev-parse", "HEAD"),
        # Uncommitted changes to the package when the files were written
        # (empty: the files are the commit's).
        "keras_accum_changes": _git("status", "--porcelain", "keras_accum"),
        "keras": keras.__version__,
        "tensorflow": tf.__version__,
        "numpy": np.__version__,
        "h5py": __import__("h5py").__version__,
        "python": sys.version.split()[0],
        "saved_after_micro_batches": SAVED_AFTER,
        "state_when_saved": states,
    }
    (out / "versions.json").write_text(json.dumps(versions, indent=2) + "\n")
    print(json.dumps(versions, indent=2))


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__.split("\n\n")[1])
    main(sys.argv[1])
