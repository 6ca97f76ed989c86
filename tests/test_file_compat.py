"""Files written by an earlier keras_accum still load, and resume training exactly.

Each folder of `FOLDERS` holds what one keras_accum wrote half-way through
an accumulation window (its README says which commit and Keras;
tests/scripts/make_file_fixtures.py wrote them, and defines the models):
tests/fixtures/files_0_1/ release 0.1.0's, tests/fixtures/files_main_a577af5/
main's at a577af5, which pins the layout across the core's redesign
(issue 37), and tests/fixtures/files_main_7dd4b68/ main's at 7dd4b68,
across the engine's (issue 60). Each holds a `.keras` file, a `.weights.h5` file and a
`tf.train.Checkpoint` for a functional `AccumModel`, for one with
`skip_nonfinite=True` (a window skipped) and for `keras_accum.wrap` of a
subclassed model, and a `BackupAndRestore` backup of the first; the newer
folder also for a plain `keras.Model` compiled with an `AccumOptimizer`
(`skip_nonfinite=True`, a window skipped). A folder's variants are those
its `versions.json` lists. Each file is loaded the way a user would,
training goes on over the epoch's remaining micro-batches, and the result
must be a plain `keras.Model` trained on the big batch from the same
initial weights, with as many optimizer steps and skipped windows. The open
window holds dense gradient sums, an `Embedding`'s slices and
BatchNormalization moments (the optimizer's: sums and slices): a change of
name, key or layout in any of them fails here, also where Keras's loading
would not complain (a state object whose path changed loads nothing,
silently).
"""

import hashlib
import importlib.util
import json
import re
import shutil
import zipfile

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_accum
from helpers.assertions import ATOL, RTOL, assert_trained
from helpers.project import ROOT

_spec = importlib.util.spec_from_file_location(
    "make_file_fixtures", ROOT / "tests" / "scripts" / "make_file_fixtures.py"
)
fixtures = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fixtures)

# The folders of files, each written by one keras_accum (its README says
# which and why), and what each wrote them with (its versions.json).
FIXTURES = ROOT / "tests" / "fixtures"
FOLDERS = ("files_0_1", "files_main_a577af5", "files_main_7dd4b68")
VERSIONS = {
    folder: json.loads((FIXTURES / folder / "versions.json").read_text()) for folder in FOLDERS
}
# Where training goes on: the first sample after the saved micro-batches.
RESUME_AT = fixtures.SAVED_AFTER * fixtures.MICRO_BATCH
# The windows that make updates: skip_nonfinite's and optimizer's first
# window has a NaN sample weight and is skipped, so the big-batch twin
# starts at the second.
FIRST_UPDATE = {
    "accum": 0,
    "skip_nonfinite": fixtures.BIG_BATCH,
    "wrap_subclassed": 0,
    "optimizer": fixtures.BIG_BATCH,
}
SKIPPED = {"accum": 0, "skip_nonfinite": 1, "wrap_subclassed": 0, "optimizer": 1}
# The plain variant resumes as users train, with the traced step; the
# others, whose files differ from it only in what they hold, resume eagerly,
# a third of the time (the files load the same either way).
EAGER = {"accum": False, "skip_nonfinite": True, "wrap_subclassed": True, "optimizer": True}


def _release(version):
    return tuple(int(part) for part in re.findall(r"\d+", version)[:3])


def plain_graph_unreadable(path, written_by):
    """Why this Keras cannot rebuild the plain Keras model inside the
    `.keras` file at `path`, or None (always None on the Keras that wrote
    it, `written_by`, or a newer one: there, a file that does not load is a
    failure).

    Keras does not promise that a release reads the files of a newer one:
    Keras 3.8 refuses the `quantization_config` entry that newer releases
    write into every Dense and Embedding config. The file's own model
    config (for `wrap`, the wrapped model's) is rebuilt with Keras alone.
    """
    if _release(keras.__version__) >= _release(written_by):
        return None
    with zipfile.ZipFile(path) as archive:
        config = json.loads(archive.read("config.json"))["config"]
    try:
        if "model" in config:
            keras.saving.deserialize_keras_object(config["model"])
        else:
            keras.Model.from_config(
                {k: config[k] for k in ("name", "layers", "input_layers", "output_layers")}
            )
    except (TypeError, ValueError) as error:
        return str(error).strip().splitlines()[-1]
    return None


def initial_weights(directory):
    with np.load(directory / "initial.weights.npz") as saved:
        return [saved[f"arr_{i}"] for i in range(len(saved.files))]


def big_batch(variant, initial):
    """A plain keras.Model trained on the big batch, from `initial`, the
    files' start."""
    plain = fixtures.compile_model(fixtures.plain(variant))
    plain.run_eagerly = True  # the same updates, without a trace
    plain.set_weights(initial)
    settings = fixtures.fit_kwargs(variant, start=FIRST_UPDATE[variant])
    settings["batch_size"] = fixtures.BIG_BATCH
    plain.fit(**settings)
    return plain


def fresh(variant):
    """The model a user builds to load into: other initial weights than the
    file's (so that nothing passes unloaded), compiled, optimizer built (as
    Keras needs, to load its state)."""
    model = fixtures.compile_model(fixtures.make(variant, seed=1), variant)
    model.optimizer.build(model.trainable_variables)
    return model


def resume(model, variant):
    model.run_eagerly = EAGER[variant]
    return model.fit(**fixtures.fit_kwargs(variant, start=RESUME_AT))


def from_keras_file(variant, directory, tmp_path):
    path = directory / "mid_window.keras"
    written_by = VERSIONS[directory.parent.name]["keras"]
    unreadable = plain_graph_unreadable(path, written_by)
    if unreadable:
        pytest.skip(
            f"Keras {keras.__version__} cannot rebuild the Keras layers from "
            f"the config Keras {written_by} wrote into this file (a plain "
            f"keras.Model's file of them fails alike): {unreadable}"
        )
    model = keras.saving.load_model(path)
    skip_nonfinite = fixtures.VARIANTS[variant]["kwargs"].get("skip_nonfinite", False)
    if fixtures.VARIANTS[variant]["optimizer"]:
        assert not isinstance(model, keras_accum.AccumModel)
        assert isinstance(model.optimizer, keras_accum.AccumOptimizer)
        assert model.optimizer.accum_steps == fixtures.ACCUM_STEPS
        assert model.optimizer.get_config()["skip_nonfinite"] == skip_nonfinite
    else:
        assert isinstance(model, keras_accum.AccumModel)
        assert model.accum_steps == fixtures.ACCUM_STEPS
        assert model.skip_nonfinite == skip_nonfinite
    resume(model, variant)
    return model


def from_weights_file(variant, directory, tmp_path):
    model = fresh(variant)
    model.load_weights(directory / "mid_window.weights.h5")
    resume(model, variant)
    return model


def from_checkpoint(variant, directory, tmp_path):
    model = fresh(variant)
    tf.train.Checkpoint(model=model, optimizer=model.optimizer).restore(
        tf.train.latest_checkpoint(directory / "checkpoint")
    ).assert_existing_objects_matched()
    resume(model, variant)
    return model


def from_backup(variant, directory, tmp_path):
    # A copy: resuming writes new backups and deletes the directory at the end.
    backup_dir = tmp_path / "backup"
    shutil.copytree(directory / "backup", backup_dir)
    # The restarted program: a new model, compiled, the same fit call.
    model = fixtures.compile_model(fixtures.make(variant, seed=1), variant)
    model.run_eagerly = EAGER[variant]
    backup = keras_accum.BackupAndRestore(str(backup_dir), save_freq=fixtures.BACKUP_FREQ)
    model.fit(callbacks=[backup], **fixtures.fit_kwargs(variant))
    assert not backup_dir.exists()  # training ended
    return model


KINDS = {
    "keras_file": from_keras_file,
    "weights_file": from_weights_file,
    "tf_checkpoint": from_checkpoint,
    "backup": from_backup,
}


@pytest.fixture(scope="module")
def big_batches():
    """The big-batch twin of a variant's files, made once for the folders
    whose files start from the same weights (all of them, so far)."""
    made = {}

    def get(variant, directory):
        initial = initial_weights(directory)
        start = hashlib.sha256(b"".join(w.tobytes() for w in initial)).hexdigest()
        if (variant, start) not in made:
            made[variant, start] = big_batch(variant, initial)
            assert_trained(made[variant, start], initial)
        return made[variant, start]

    return get


def _inner_loop(folder):
    """The cases of `folder` the inner loop runs: each of its files read in
    every kind (one variant each, in turn by folder), and each variant in
    one kind at least. The others of every folder run in the slow tier
    (and so on the newest pair only, where nox runs the inner loop)."""
    variants = list(VERSIONS[folder]["state_when_saved"])
    shift = FOLDERS.index(folder)
    kept = set()
    for i, kind in enumerate(KINDS):
        can = [v for v in variants if kind != "backup" or fixtures.VARIANTS[v]["backup"]]
        kept.add((can[(shift + i) % len(can)], kind))
    shared_kinds = [k for k in KINDS if k != "backup"]  # what every variant has
    for i, variant in enumerate(variants):
        if all(v != variant for v, _ in kept):
            kept.add((variant, shared_kinds[(shift + i) % len(shared_kinds)]))
    return kept


CASES = [
    pytest.param(
        folder,
        variant,
        kind,
        id=f"{folder}-{variant}-{kind}",
        marks=[] if (variant, kind) in _inner_loop(folder) else [pytest.mark.slow],
    )
    for folder in FOLDERS
    for variant in VERSIONS[folder]["state_when_saved"]
    for kind in KINDS
    if kind != "backup" or fixtures.VARIANTS[variant]["backup"]
]


@pytest.mark.parametrize("folder, variant, kind", CASES)
def test_a_mid_window_file_resumes_as_the_big_batch(folder, variant, kind, big_batches, tmp_path):
    directory = FIXTURES / folder / variant
    model = KINDS[kind](variant, directory, tmp_path)
    plain = big_batches(variant, directory)
    weights, expected = model.get_weights(), plain.get_weights()
    assert len(weights) == len(expected)
    for i, (a, b) in enumerate(zip(weights, expected)):
        np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL, err_msg=f"weight {i}")
    assert int(model.optimizer.iterations.numpy()) == int(plain.optimizer.iterations.numpy())
    assert fixtures.accumulating(model).skipped_windows == SKIPPED[variant]
