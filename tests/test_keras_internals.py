"""Fails loudly when the Keras internals keras_accum relies on move.

If one of these fails after a Keras upgrade, re-read the named Keras source
against keras_accum/_internals/ and the code that mirrors it (named in
_internals/fingerprints.py), adapt, then update the fingerprint.
"""

import ast
import inspect
import pathlib
import re
import subprocess
import sys
import textwrap
import warnings

import keras
import numpy as np
import pytest
from helpers import internals as test_internals
from helpers.internals import GradientAccumulator
from helpers.internals import keras_internals as internals
from helpers.internals import keras_versions as versions

MESSAGE = (
    "Keras {found} changed {what}; keras_accum/_internals/ was "
    f"read against Keras {', '.join(internals.REVIEWED_KERAS)}. Re-read it, "
    "adapt the code that mirrors it (named there), then add the fingerprint."
)


@pytest.mark.parametrize("name", sorted(internals.MIRRORED_SOURCES))
def test_mirrored_keras_source_is_unchanged(name):
    digest = versions.fingerprint(internals.mirrored()[name])
    known = internals.MIRRORED_SOURCES[name]
    if digest not in known:
        pytest.fail(
            MESSAGE.format(found=keras.__version__, what=name)
            + f" Known sources: {sorted(known.values())}. New fingerprint: {digest}"
        )


@pytest.mark.unit
def test_every_reviewed_keras_has_a_fingerprint_of_each_mirrored_function():
    for name, known in internals.MIRRORED_SOURCES.items():
        versions = " ".join(known.values()).split()
        assert sorted(versions) == sorted(internals.REVIEWED_KERAS), name


@pytest.mark.unit
def test_every_keras_src_name_keras_accum_uses_is_found():
    # A name that `reach` could not find would make a stand-in that raises
    # when used; on a supported Keras there must be none.
    if versions.MOVED:
        pytest.fail(MESSAGE.format(found=keras.__version__, what=", ".join(versions.MOVED)))


@pytest.mark.unit
def test_a_name_keras_removed_raises_naming_version_change_and_newest_keras():
    missing = versions.reach("keras.src.losses.loss", "no_such_name", "nor_this")
    try:
        expected = (
            rf"Keras {keras.__version__} changed.*keras\.src\.losses\.loss\.no_such_name.*"
            rf"has no `no_such_name` or `nor_this`.*newest supported is {versions.newest_reviewed()}"
        )
        with pytest.raises(versions.KerasInternalsChanged, match=expected):
            missing()
        with pytest.raises(versions.KerasInternalsChanged, match=expected):
            missing.some_method
        with pytest.raises(versions.KerasInternalsChanged, match=expected):
            isinstance(object(), missing)

        class Defined(missing):  # defining a subclass at import still works
            pass

        with pytest.raises(versions.KerasInternalsChanged, match=expected):
            Defined()
        assert versions.is_missing(missing) and not versions.is_missing(keras.Model)
        gone = versions.reach("keras.src.no_such_module", "X")
        with pytest.raises(versions.KerasInternalsChanged, match=r"module not importable"):
            gone()
    finally:
        versions.MOVED.clear()


def test_unreviewed_keras_warns_once_naming_what_changed(monkeypatch):
    monkeypatch.setattr(keras, "__version__", "3.99.0")
    mirrored = internals.mirrored()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert versions.warn_if_unreviewed(mirrored, internals.MIRRORED_SOURCES) == {}
    assert not seen  # every mirrored source is a reviewed one: nothing to say
    mirrored["apply_mask"] = test_unreviewed_keras_warns_once_naming_what_changed
    with pytest.warns(RuntimeWarning, match=r"this Keras 3\.99\.0 changed.*apply_mask: new source"):
        changed = versions.warn_if_unreviewed(mirrored, internals.MIRRORED_SOURCES)
    assert list(changed) == ["apply_mask"]


@pytest.mark.slow  # imports keras_accum in a fresh process
def test_a_keras_that_renamed_the_trainer_still_imports_and_says_so():
    # What Keras 3.16 did to 3.15 (`TensorFlowTrainer` -> `Trainer`), done
    # again to whichever name this Keras has: `import keras_accum` must
    # still work, warn naming it, and the fingerprint check must name it.
    script = textwrap.dedent(
        """
        import warnings
        warnings.simplefilter("always")
        import keras.src.backend.tensorflow.trainer as trainer
        for name in ("Trainer", "TensorFlowTrainer"):
            if isinstance(getattr(trainer, name, None), type):
                delattr(trainer, name)
        with warnings.catch_warnings(record=True) as seen:
            import keras_accum
        from keras_accum import _internals as internals
        from keras_accum._internals import versions
        print("WARNING", [str(w.message) for w in seen if "keras_accum was reviewed" in str(w.message)])
        print("CHANGED", sorted(versions.changed_sources(internals.mirrored(), internals.MIRRORED_SOURCES)))
        try:
            internals.TensorFlowTrainer.train_step
        except versions.KerasInternalsChanged as error:
            print("ERROR", error)
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=240,
        env={**__import__("os").environ, "TF_CPP_MIN_LOG_LEVEL": "3"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert "WARNING ['keras_accum was reviewed" in out and "backend.tensorflow.trainer.Trainer" in out
    assert "CHANGED ['TensorFlowTrainer._make_function', 'TensorFlowTrainer._maybe_symbolic_build', 'TensorFlowTrainer.train_step']" in out
    assert f"ERROR Keras {keras.__version__} changed" in out
    assert f"newest supported is {versions.newest_reviewed()}" in out


@pytest.mark.parametrize(
    "keras_version, tensorflow_version, message",
    [
        ("3.4.1", "2.17.0", r"supports Keras >= 3\.8, < 4 with TensorFlow >= 2\.18; found Keras 3\.4\.1"),
        ("4.0.0", "2.21.0", r"supports Keras >= 3\.8, < 4.*found Keras 4\.0\.0"),
        ("3.8.0", "2.17.1", r"found Keras 3\.8\.0 with TensorFlow 2\.17\.1.*tensorflow>=2\.18"),
        ("2.18.0", "2.18.1", r"needs Keras 3.*tf_keras.*TF_USE_LEGACY_KERAS"),
    ],
)
@pytest.mark.unit
def test_unsupported_versions_are_refused_naming_the_range(
    keras_version, tensorflow_version, message
):
    with pytest.raises(ImportError, match=message):
        internals.check_versions(keras_version, tensorflow_version)


@pytest.mark.parametrize("versions", [("3.8.0", "2.18.1"), ("3.13.2", "2.20.0"), ("3.15.1", "2.21.0"), ("3.16.0.dev2026", "2.22.0rc1")])
@pytest.mark.unit
def test_supported_versions_are_accepted(versions):
    internals.check_versions(*versions)


@pytest.mark.unit
def test_saving_visits_every_attribute_of_our_state():
    # Keras's saving skips the attributes a fresh object of `_obj_type()`'s
    # kind has; none of ours may be among them, and the kind must be one
    # this Keras knows.
    skipped = test_internals.saving_skipset(GradientAccumulator())
    for attribute in ("nonfinite", "acc_grads", "micro_step", "_windows", "skipped"):
        assert attribute not in skipped


def test_compiled_loss_terms_are_recorded_once_each():
    inputs = keras.Input((2,))
    model = keras.Model(
        inputs, {"a": keras.layers.Dense(1, name="a")(inputs), "b": keras.layers.Dense(1, name="b")(inputs)}
    )
    model.compile("sgd", {"a": "mse", "b": "mae"})
    x = np.zeros((4, 2), "float32")
    y = {"a": np.zeros((4, 1)), "b": np.zeros((4, 1))}
    internals.build_compiled_loss(model, (x, y))
    seen = []
    with internals.recording_loss_calls(model, lambda fn, *_: seen.append(fn.name)):
        model.compute_loss(x, y, model(x))
    assert sorted(seen) == ["mae", "mse"]
    assert len(test_internals.compiled_loss_terms(model)[0]) == 4  # (path, fn, weight, name)


@pytest.mark.parametrize(
    "attribute", ["_call_has_training_arg", "_compute_loss", "_loss_tracker"]
)
def test_model_private_attributes_exist(attribute):
    inputs = keras.Input((2,))
    model = keras.Model(inputs, keras.layers.Dense(1)(inputs))
    model.compile("sgd", "mse")
    if not hasattr(model, attribute):
        pytest.fail(MESSAGE.format(found=keras.__version__, what=f"Model.{attribute}"))


@pytest.mark.unit
def test_functional_init_arguments_signature_detection():
    a, b = keras.Input((2,)), keras.Input((2,))
    assert internals.functional_init_arguments((a, b), {})
    assert internals.functional_init_arguments((), {"inputs": a, "outputs": b})
    assert not internals.functional_init_arguments((), {"name": "x"})
    assert issubclass(internals.Functional, keras.Model)


@pytest.mark.unit
def test_output_of_its_call_is_a_nested_models_output_in_the_outer_graph():
    # coupling.py splits a model at layers by their outputs in its graph; a
    # nested functional model's own `output` is its inner graph's.
    inner_input = keras.Input((2,), name="inner_input")
    inner = keras.Model(inner_input, keras.layers.Dense(3)(inner_input), name="inner")
    shared = keras.layers.Dense(3)
    outer_input = keras.Input((2,))
    called = inner(outer_input)
    shared(called), shared(called)
    assert internals.output_of_its_call(inner) is called
    assert inner.output is not called
    assert internals.output_of_its_call(shared) is None


@pytest.mark.unit
def test_keras_still_rebases_model_subclasses_called_functionally():
    # The behaviour AccumModel.__new__ guards against; if Keras stops doing
    # this, the guard may be simplified.
    class Probe(keras.Model):
        pass

    inputs = keras.Input((2,))
    Probe(inputs, keras.layers.Dense(1)(inputs))
    assert Probe.__bases__ == (internals.Functional,)


@pytest.mark.unit
def test_tf_keras_objects_are_refused_saying_why():
    # Under TF_USE_LEGACY_KERAS=1, `tf.keras` hands out tf_keras (Keras 2)
    # objects while `import keras` stays Keras 3; stand-ins from a module of
    # that name are enough to check the message.
    import keras_accum

    legacy = type("Sequential", (), {"__module__": "tf_keras.src.engine.sequential"})()
    with pytest.raises(TypeError, match=r"`model` must be a keras\.Model.*tf_keras \(Keras 2\).*import keras"):
        keras_accum.wrap(legacy)
    legacy = type("SGD", (), {"__module__": "tf_keras.src.optimizers.sgd"})()
    with pytest.raises(TypeError, match=r"`optimizer` must be.*tf_keras \(Keras 2\)"):
        keras_accum.AccumOptimizer(legacy)
    with pytest.raises(TypeError) as plain:
        keras_accum.wrap(object())
    assert "tf_keras" not in str(plain.value)


@pytest.mark.unit
def test_tensorflow_still_reads_its_frequent_retracing_flag():
    # internals.without_retracing_warning sets it on the flush functions.
    import tensorflow as tf
    from tensorflow.python.eager.polymorphic_function import polymorphic_function

    source = inspect.getsource(polymorphic_function.Function.__call__)
    if "_omit_frequent_tracing_warning" not in source:
        pytest.fail(
            f"TensorFlow {tf.__version__} no longer reads tf.function's "
            "`_omit_frequent_tracing_warning`: adapt "
            "_internals.trainer.without_retracing_warning."
        )


@pytest.mark.unit
def test_backup_and_restore_batch_counting_is_still_keras_own(tmp_path):
    # internals.backup_* set and call these on keras_accum.BackupAndRestore.
    callback = keras.callbacks.BackupAndRestore(str(tmp_path), save_freq=2)
    source = inspect.getsource(test_internals.keras_backup_batch_rule())
    for name in ("_last_batch_seen", "_batches_seen_since_last_saving"):
        if name not in source or not hasattr(callback, name):
            pytest.fail(MESSAGE.format(found=keras.__version__, what=f"BackupAndRestore.{name}"))
    internals.backup_counts_from_zero(callback)
    assert [internals.backup_due_after_batch(callback, b) for b in range(4)] == [
        False, True, False, True
    ]


@pytest.mark.unit
def test_the_internals_package_re_exports_every_public_name():
    # `from keras_accum import _internals as internals` is the one way in:
    # every public name of its modules is the package's, in `__all__`.
    # (versions.py's own helpers are used as `versions.name`.)
    import types

    from keras_accum import _internals

    def public(module):
        return {
            name: value
            for name, value in vars(module).items()
            if not name.startswith("_") and not isinstance(value, types.ModuleType)
        }

    assert sorted(public(_internals)) == sorted(_internals.__all__)
    modules = [m for m in vars(_internals).values() if isinstance(m, types.ModuleType)]
    modules = [m for m in modules if m.__name__.startswith(_internals.__name__ + ".")]
    files = {p.stem for p in pathlib.Path(_internals.__file__).parent.glob("*.py")}
    assert {m.__name__.rpartition(".")[2] for m in modules} == files - {"__init__"}
    for module in modules:
        if module is not versions:
            for name, value in public(module).items():
                assert getattr(_internals, name, None) is value, f"{module.__name__}.{name}"


@pytest.mark.parametrize(
    "attribute",
    [
        "_trainable_variables", "_trainable_variables_indices", "_var_key",
        "_get_variable_index", "_variables", "_learning_rate",
    ],
)
@pytest.mark.unit
def test_optimizer_private_attributes_exist(attribute):
    optimizer = keras.optimizers.Adam()
    optimizer.build([keras.Variable([1.0]), keras.Variable([2.0, 3.0])])
    if not hasattr(optimizer, attribute):
        pytest.fail(MESSAGE.format(found=keras.__version__, what=f"Optimizer.{attribute}"))


@pytest.mark.unit
def test_optimizer_bookkeeping_is_the_build_order_and_own_variables():
    variables = [keras.Variable([1.0]), keras.Variable([2.0, 3.0]), keras.Variable([4.0])]
    optimizer = keras.optimizers.Adam()
    optimizer.build(variables[::-1])
    assert list(map(id, internals.built_variables(optimizer))) == list(map(id, variables[::-1]))
    assert [internals.build_position(optimizer, v) for v in variables] == [2, 1, 0]
    # Adam's own (iterations, learning rate, two slots per variable): what
    # `variables` lists for an optimizer that wraps none.
    own = internals.own_variables(optimizer)
    assert len(own) == 2 + 2 * len(variables)
    assert list(map(id, own)) == list(map(id, optimizer.variables))
    extra = keras.Variable([0.0])
    unknown = internals.unknown_variables(optimizer, [*variables, extra])
    assert len(unknown) == 1 and unknown[0] is extra


@pytest.mark.unit
def test_the_schedule_object_an_optimizer_was_given_is_found():
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.5)
    assert internals.learning_rate_schedule(keras.optimizers.SGD(schedule)) is schedule
    scaled = keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(schedule))
    assert internals.learning_rate_schedule(scaled) is schedule
    assert internals.learning_rate_schedule(keras.optimizers.SGD(0.1)) is None


@pytest.mark.unit
def test_keras_backups_go_through_keras_accum_backup_and_restore(tmp_path, monkeypatch):
    # Keras's BackupAndRestore writes its backups in `_save_model`, from
    # on_epoch_end and on_train_batch_end; keras_accum's routes it to its own.
    import keras_accum

    source = inspect.getsource(keras.callbacks.BackupAndRestore)
    if "def _save_model(self)" not in source or "self._save_model()" not in source:
        pytest.fail(MESSAGE.format(found=keras.__version__, what="BackupAndRestore._save_model"))
    callback = keras_accum.BackupAndRestore(str(tmp_path))
    saved = []
    monkeypatch.setattr(callback, test_internals.EPOCH_END_BACKUP, lambda: saved.append("ours"))
    test_internals.keras_backup_write(callback)
    assert saved == ["ours"]


# Private names of Keras and TensorFlow objects that keras_accum reads, sets,
# calls or overrides: only keras_accum/_internals/ may name them, as it alone
# may import from `keras.src` or `tensorflow.python`.
PRIVATE_NAMES = {
    # Model and trainer
    "_call_has_training_arg", "_compute_loss", "_loss_tracker", "_compile_loss",
    "_flat_losses", "_symbolic_build", "_maybe_symbolic_build", "_make_function",
    "_distribute_strategy", "_initial_epoch", "_build_shapes_dict", "_flatten_layers",
    "_obj_type", "_collective_all_reduce_multi_worker",
    # Layers
    "_moments", "_inbound_nodes",
    # Optimizer
    "_trainable_variables", "_trainable_variables_indices", "_var_key",
    "_get_variable_index", "_variables", "_learning_rate",
    # BackupAndRestore
    "_should_save_on_batch", "_last_batch_seen", "_batches_seen_since_last_saving",
    "_save_model",
    # TensorFlow
    "_get_default_strategy", "_get_on_device_or_primary", "_omit_frequent_tracing_warning",
}
PRIVATE_MODULES = re.compile(r"\bkeras\.src\b|\btensorflow\.python\b")


def _private_reaches(path):
    """`(line, what)` for each private Keras or TensorFlow name `path` uses."""
    text = path.read_text()
    found = [
        (text.count("\n", 0, m.start()) + 1, m.group()) for m in PRIVATE_MODULES.finditer(text)
    ]
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Attribute):
            name = node.attr
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            name = node.value  # getattr(obj, "_name"), hasattr, setattr
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            name = node.name  # an override of a private method
        elif isinstance(node, ast.alias):
            name = node.name.rsplit(".", 1)[-1]
        else:
            continue
        if name in PRIVATE_NAMES:
            found.append((getattr(node, "lineno", 0), name))
    return sorted(found)


@pytest.mark.unit
def test_only_the_internals_package_reaches_into_keras():
    import keras_accum

    package = pathlib.Path(keras_accum.__file__).parent
    modules = sorted(p for p in package.rglob("*.py") if "_internals" not in p.relative_to(package).parts)
    outside = [
        f"keras_accum/{p.relative_to(package)}:{line}: {what}"
        for p in modules
        for line, what in _private_reaches(p)
    ]
    assert not outside, (
        "Keras or TensorFlow internals named outside keras_accum/_internals/; "
        "add a function there (guarded by a test here) and call it instead: "
        + "; ".join(outside)
    )


@pytest.mark.unit
def test_every_private_name_listed_is_one_the_internals_package_uses():
    # Keeps PRIVATE_NAMES the package's own list, not a guess.
    import keras_accum

    package = pathlib.Path(keras_accum.__file__).parent / "_internals"
    used = {what for path in package.glob("*.py") for _, what in _private_reaches(path)}
    assert sorted(PRIVATE_NAMES - used) == []


def _own_names(package):
    """Every name keras_accum defines itself: functions, classes, names and
    `self`/`cls` attributes it assigns, import aliases, dict-literal keys
    (a class namespace given to `type`)."""
    own = set()
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                own.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                    own.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                own.add(node.id)
            elif isinstance(node, ast.alias) and node.asname:
                own.add(node.asname)
            elif isinstance(node, ast.Dict):
                own |= {k.value for k in node.keys if isinstance(k, ast.Constant)}
    return own


@pytest.mark.unit
def test_every_private_name_the_internals_package_uses_is_listed():
    # The other direction of the test above: PRIVATE_NAMES is complete, so
    # a reach into Keras added to _internals/ must be listed (and guarded).
    import keras_accum

    package = pathlib.Path(keras_accum.__file__).parent
    own = _own_names(package)
    unlisted = set()
    for path in (package / "_internals").glob("*.py"):
        tree = ast.parse(path.read_text())
        pieces = {id(v) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) for v in n.values}
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute):
                name = node.attr
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                if id(node) in pieces or not node.value.isidentifier():
                    continue  # a piece of an f-string, or not a name
                name = node.value
            elif isinstance(node, ast.alias):
                name = node.name.rsplit(".", 1)[-1]
            else:
                continue
            if name.startswith("_") and not name.startswith("__") and name != "_":
                unlisted.add(name)
    assert sorted(unlisted - own - PRIVATE_NAMES) == [], (
        "a private Keras or TensorFlow name used in keras_accum/_internals/ "
        "is not in PRIVATE_NAMES: list it, with a test that it still exists"
    )
