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
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=240,
        env={**__import__("os").environ, "TF_CPP_MIN_LOG_LEVEL": "3"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert (
        "WARNING ['keras_accum was reviewed" in out and "backend.tensorflow.trainer.Trainer" in out
    )
    assert (
        "CHANGED ['TensorFlowTrainer._make_function', 'TensorFlowTrainer._maybe_symbolic_build', 'TensorFlowTrainer.train_step']"
        in out
    )
    assert f"ERROR Keras {keras.__version__} changed" in out
    assert f"newest supported is {versions.newest_reviewed()}" in out


@pytest.mark.parametrize(
    "keras_version, tensorflow_version, message",
    [
        (
            "3.4.1",
            "2.17.0",
            r"supports Keras >= 3\.8, < 4 with TensorFlow >= 2\.18; found Keras 3\.4\.1",
        ),
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


@pytest.mark.parametrize(
    "versions",
    [
        ("3.8.0", "2.18.1"),
        ("3.13.2", "2.20.0"),
        ("3.15.1", "2.21.0"),
        ("3.16.0.dev2026", "2.22.0rc1"),
    ],
)
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
        inputs,
        {
            "a": keras.layers.Dense(1, name="a")(inputs),
            "b": keras.layers.Dense(1, name="b")(inputs),
        },
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


@pytest.mark.parametrize("attribute", ["_call_has_training_arg", "_compute_loss", "_loss_tracker"])
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
    with pytest.raises(
        TypeError, match=r"`model` must be a keras\.Model.*tf_keras \(Keras 2\).*import keras"
    ):
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
        False,
        True,
        False,
        True,
    ]


@pytest.mark.unit
def test_the_internals_package_re_exports_every_public_name():
    # `from keras_accum import _internals as internals` is the one way in:
    # every public name of its modules is the package's.
    # (versions.py's own helpers are used as `versions.name`.)
    import types

    from keras_accum import _internals

    def public(module):
        return {
            name: value
            for name, value in vars(module).items()
            if not name.startswith("_") and not isinstance(value, types.ModuleType)
        }

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
        "_trainable_variables",
        "_trainable_variables_indices",
        "_var_key",
        "_get_variable_index",
        "_variables",
        "_learning_rate",
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
    "_call_has_training_arg",
    "_compute_loss",
    "_loss_tracker",
    "_compile_loss",
    "_flat_losses",
    "_symbolic_build",
    "_maybe_symbolic_build",
    "_make_function",
    "_distribute_strategy",
    "_initial_epoch",
    "_build_shapes_dict",
    "_flatten_layers",
    "_obj_type",
    "_collective_all_reduce_multi_worker",
    "_compile_config",
    "_distributed_dataset",
    # Layers
    "_moments",
    "_inbound_nodes",
    # Optimizer
    "_trainable_variables",
    "_trainable_variables_indices",
    "_var_key",
    "_get_variable_index",
    "_variables",
    "_learning_rate",
    # BackupAndRestore
    "_should_save_on_batch",
    "_last_batch_seen",
    "_batches_seen_since_last_saving",
    "_save_model",
    # TensorFlow
    "_get_default_strategy",
    "_get_on_device_or_primary",
    "_omit_frequent_tracing_warning",
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
    modules = sorted(
        p for p in package.rglob("*.py") if "_internals" not in p.relative_to(package).parts
    )
    outside = [
        f"keras_accum/{p.relative_to(package)}:{line}: {what}"
        for p in modules
        for line, what in _private_reaches(p)
    ]
    assert not outside, (
        "Keras or TensorFlow internals named outside keras_accum/_internals/; "
        "add a function there (guarded by a test here) and call it instead: " + "; ".join(outside)
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


# -- every reach taken away: a clear error before training ---------------------
#
# Each private name keras_accum reads is taken away from the Keras (or
# TensorFlow) object that has it, as a release that moved it would, and the
# use that reads it must raise KerasInternalsChanged naming the release and
# the name, before anything trains: never a bare AttributeError, never a
# fallback that trains differently.


def _small_fit(model, **fit_kwargs):
    """A short fit of `model` on 16 samples (4 steps of 4)."""
    from helpers.data import make_data

    x, y = make_data(16)
    fit_kwargs = {"epochs": 1, **fit_kwargs}
    return model.fit(x, y, batch_size=4, shuffle=False, verbose=0, **fit_kwargs)


def _accumulating(**kwargs):
    import keras_accum
    from helpers.models import functional, loss

    model = functional(keras_accum.AccumModel, **{"accum_steps": 2, **kwargs})
    model.compile(keras.optimizers.Adam(0.01), loss())
    return model


def _take_away(monkeypatch, obj, name):
    """`obj.<name>` gone: from the instance and every class of its MRO that
    holds it (undone by `monkeypatch`)."""
    holders = [] if isinstance(obj, type) else [obj]
    holders += list((obj if isinstance(obj, type) else type(obj)).__mro__)
    holders = [h for h in holders if name in getattr(h, "__dict__", {})]
    assert holders, f"{name} is not on {obj!r}"
    for holder in holders:
        monkeypatch.delattr(holder, name)
    assert not hasattr(obj, name)


def _moved_error(name, library="Keras"):
    import tensorflow as tf

    version = keras.__version__ if library == "Keras" else tf.__version__
    return pytest.raises(
        versions.KerasInternalsChanged, match=rf"{library} {re.escape(version)} changed.*{name}"
    )


def _assert_nothing_trained(model, before):
    assert int(model.optimizer.iterations.numpy()) == 0
    for a, b in zip(before, model.get_weights()):
        np.testing.assert_array_equal(a, b)


# What a fit reads of the model, its compiled loss and its optimizer: taken
# from the object that holds it (the instance, or its class). Keras's own
# fit reads some of them too, and would fail first without them: what a
# release that renamed one would break is our read, checked by
# `check_fit` before any step is made (and a fit calls it: below).
FIT_READS = {
    "_call_has_training_arg": lambda m: m,
    "_compute_loss": lambda m: m,
    "_loss_tracker": lambda m: m,
    "_compile_loss": lambda m: m,
    "_symbolic_build": lambda m: m,
    "_distribute_strategy": lambda m: m,
    "_flatten_layers": lambda m: m,
    "_flat_losses": lambda m: test_internals.compiled_loss(m),
    "_trainable_variables": lambda m: m.optimizer,
    "_trainable_variables_indices": lambda m: m.optimizer,
    "_var_key": lambda m: m.optimizer,
    "_get_variable_index": lambda m: m.optimizer,
    "_variables": lambda m: m.optimizer,
    "_learning_rate": lambda m: m.optimizer,
    "_maybe_symbolic_build": lambda m: internals.TensorFlowTrainer,
    "_obj_type": lambda m: internals.KerasSaveable,
}


@pytest.fixture(scope="module")
def fitted():
    """One model after a short fit (built, compiled loss and optimizer too)
    for every name below: each test takes a name away and `monkeypatch`
    puts it back, and `check_fit` only reads."""
    model = _accumulating()
    _small_fit(model)
    return model


@pytest.mark.parametrize("name", sorted(FIT_READS))
def test_a_fit_whose_keras_moved_a_name_it_reads_is_refused_by_the_check(name, fitted, monkeypatch):
    _take_away(monkeypatch, FIT_READS[name](fitted), name)
    with _moved_error(name):
        internals.check_fit(fitted)


def test_a_fit_checks_every_name_before_its_first_step(monkeypatch):
    import keras_accum._internals as package

    model = _accumulating()
    model.build((None, 6))
    before = model.get_weights()
    moved = versions.moved("`Something._moved`", "gone")

    def check_fit(checked):
        assert checked is model
        raise moved

    monkeypatch.setattr(package, "check_fit", check_fit)
    with pytest.raises(versions.KerasInternalsChanged, match="Something._moved"):
        _small_fit(model)
    monkeypatch.undo()
    _assert_nothing_trained(model, before)


def test_a_compiled_loss_computed_without_its_terms_fails_before_training(monkeypatch):
    # `_flat_losses` kept, but no longer what the compiled loss calls (a
    # copy kept elsewhere): the micro-batches' weights would silently
    # become their sample counts.
    from helpers.data import make_data

    model = _accumulating()
    x, y = make_data(4)
    model.evaluate(x, y, verbose=0)  # builds the compiled loss
    before = model.get_weights()
    kept_elsewhere = list(test_internals.compiled_loss_terms(model))
    compile_loss = type(test_internals.compiled_loss(model))
    call = compile_loss.call

    def from_the_copy(self, *args, **kwargs):
        terms, self._flat_losses = self._flat_losses, kept_elsewhere
        try:
            return call(self, *args, **kwargs)
        finally:
            self._flat_losses = terms

    monkeypatch.setattr(compile_loss, "call", from_the_copy)
    with _moved_error("CompileLoss.call"):
        _small_fit(model)
    monkeypatch.undo()
    _assert_nothing_trained(model, before)


def test_a_model_without_a_compiled_loss_weighs_by_samples_as_documented():
    # compile(loss=None) with the model's own `compute_loss`: no terms to
    # read, and no error (the one legitimate "nothing recorded").
    import keras_accum
    from helpers.models import FEATURES

    class OwnLoss(keras_accum.AccumModel):
        def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
            return keras.ops.mean(keras.ops.square(y_pred))

    keras.utils.set_random_seed(0)
    inputs = keras.Input((FEATURES,))
    model = OwnLoss(inputs, keras.layers.Dense(2)(inputs), accum_steps=2)
    model.compile(keras.optimizers.SGD(0.1))
    _small_fit(model)
    assert int(model.optimizer.iterations.numpy()) == 2


@pytest.mark.parametrize("name", ["_distributed_dataset", "data_adapter"])
def test_a_fit_on_an_epoch_iterator_that_moved_its_data_fails_before_training(name, monkeypatch):
    trainer = __import__("keras.src.backend.tensorflow.trainer", fromlist=["TFEpochIterator"])
    init = trainer.TFEpochIterator.__init__

    def without(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.__dict__.pop(name)

    model = _accumulating()
    model.build((None, 6))
    before = model.get_weights()
    monkeypatch.setattr(trainer.TFEpochIterator, "__init__", without)
    with _moved_error(name):
        _small_fit(model)
    monkeypatch.undo()
    _assert_nothing_trained(model, before)


def test_a_batchnorm_model_whose_keras_moved_the_moments_fails_before_training(monkeypatch):
    import keras_accum
    from helpers.models import bn_net

    model = bn_net(keras_accum.AccumModel, accum_steps=2)
    model.compile(keras.optimizers.Adam(0.01), "sparse_categorical_crossentropy")
    before = model.get_weights()
    _take_away(monkeypatch, internals.BatchNormalization, "_moments")
    with _moved_error("_moments"):
        _small_fit(model)
    monkeypatch.undo()
    _assert_nothing_trained(model, before)


def test_a_renormalising_layer_whose_flag_moved_fails_before_training(monkeypatch):
    if "renorm" not in inspect.signature(keras.layers.BatchNormalization.__init__).parameters:
        pytest.skip("this Keras has no batch renormalisation: nothing to read")
    import keras_accum
    from helpers.models import bn_net, bn_of

    model = bn_net(keras_accum.AccumModel, accum_steps=2)
    model.compile(keras.optimizers.Adam(0.01), "sparse_categorical_crossentropy")
    before = model.get_weights()
    monkeypatch.delattr(bn_of(model), "renorm")
    with _moved_error("renorm"):
        _small_fit(model)
    monkeypatch.undo()
    _assert_nothing_trained(model, before)


# BackupAndRestore's bookkeeping, read from its first batch on: checked as
# the fit starts.
BACKUP_READS = {
    "_should_save_on_batch": lambda b: b,
    "_last_batch_seen": lambda b: b,
    "_batches_seen_since_last_saving": lambda b: b,
    "_save_model": lambda b: keras.callbacks.BackupAndRestore,
}


@pytest.mark.parametrize("name", sorted(BACKUP_READS))
def test_a_backup_whose_keras_moved_its_bookkeeping_fails_before_training(
    name, monkeypatch, tmp_path
):
    import keras_accum

    model = _accumulating()
    model.build((None, 6))
    before = model.get_weights()
    backup = keras_accum.BackupAndRestore(str(tmp_path), save_freq=1)
    _take_away(monkeypatch, BACKUP_READS[name](backup), name)
    with _moved_error(name):
        _small_fit(model, callbacks=[backup])
    monkeypatch.undo()
    _assert_nothing_trained(model, before)


def test_a_resume_whose_keras_moved_the_initial_epoch_fails_before_training(monkeypatch, tmp_path):
    import keras_accum

    model = _accumulating()
    _small_fit(
        model,
        callbacks=[
            keras_accum.BackupAndRestore(str(tmp_path), save_freq=1, delete_checkpoint=False)
        ],
    )
    resumed = _accumulating()
    resumed.build((None, 6))
    before = resumed.get_weights()
    monkeypatch.delattr(resumed, "_initial_epoch")
    with _moved_error("_initial_epoch"):
        _small_fit(resumed, epochs=2, callbacks=[keras_accum.BackupAndRestore(str(tmp_path))])
    monkeypatch.undo()
    _assert_nothing_trained(resumed, before)  # not even restored


@pytest.mark.parametrize("name", ["_inbound_nodes"])
def test_coupling_whose_keras_moved_a_layers_calls_fails_before_training(name, monkeypatch):
    import keras_accum
    from helpers.coupled import TOWERS, InBatchSoftmax, data, two_tower

    model = two_tower(keras_accum.AccumModel, micro_batch_size=8, coupled_from=TOWERS)
    model.compile(keras.optimizers.Adam(0.01), InBatchSoftmax())
    before = model.get_weights()
    for layer in model.layers:
        if layer.name in TOWERS:
            monkeypatch.delattr(layer, name)
    x, y = data()
    with _moved_error(name):
        model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    monkeypatch.undo()
    _assert_nothing_trained(model, before)


def test_wrapping_whose_keras_moved_the_training_argument_fails_at_wrap(monkeypatch):
    import keras_accum
    from helpers.models import subclassed

    built = subclassed()
    monkeypatch.delattr(built, "_call_has_training_arg")
    with _moved_error("_call_has_training_arg"):
        keras_accum.wrap(built, accum_steps=2)


def test_wrapping_a_built_model_whose_keras_moved_its_build_shapes_fails_at_wrap(monkeypatch):
    import keras_accum
    from helpers.models import subclassed

    built = subclassed()
    _take_away(monkeypatch, built, "_build_shapes_dict")
    with _moved_error("_build_shapes_dict"):
        keras_accum.wrap(built, accum_steps=2)


def test_a_wrapper_of_a_model_with_its_own_compile_fails_if_keras_moved_what_compile_got(
    monkeypatch,
):
    import keras_accum
    from helpers.models import FEATURES

    class OwnCompile(keras.Model):
        def compile(self, optimizer="sgd", **kwargs):
            super().compile(optimizer=optimizer, loss="mse", **kwargs)

    inputs = keras.Input((FEATURES,))
    source = OwnCompile(inputs, keras.layers.Dense(1)(inputs))
    model = keras_accum.wrap(source, accum_steps=2)
    original = keras.Model.compile

    def compile_then_move(self, *args, **kwargs):
        original(self, *args, **kwargs)
        if self is source:
            del self._compile_config

    monkeypatch.setattr(keras.Model, "compile", compile_then_move)
    with _moved_error("_compile_config"):
        model.compile()


# Module-level reaches (`reach`): the name as a release that lacks it leaves
# it, a stand-in, in the module of ours that holds it; then the fit that
# uses it. name: (our module, its attribute, library, the fit).
def _fit_arrays(settings):
    return _accumulating(**settings), lambda model: _small_fit(model)


def _fit_weighted(settings):
    # A loss divided by its sample weights: the divisor through Keras's mask
    # and rank helpers.
    import keras_accum
    from helpers.data import make_data
    from helpers.models import functional, token_loss

    model = functional(keras_accum.AccumModel, accum_steps=2, **settings)
    model.compile(keras.optimizers.Adam(0.01), token_loss(reduction="mean_with_sample_weight"))
    x, y = make_data(16)
    weights = np.linspace(0.5, 1.5, 16).astype("float32")
    return model, lambda m: m.fit(x, y, sample_weight=weights, batch_size=4, verbose=0)


def _fit_masked_split(settings):
    # Predictions with a mask, cut into micro-batches past a short batch.
    import tensorflow as tf

    import keras_accum
    from helpers.data import sequences
    from helpers.models import tagger, token_loss

    model = tagger(keras_accum.AccumModel, micro_batch_size=3, **settings)
    model.compile(keras.optimizers.Adam(0.01), token_loss())
    x, y = sequences(14)
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(8)
    return model, lambda m: m.fit(data, verbose=0)


MODULE_REACHES = {
    "_get_default_strategy": ("distribute", "_default_strategy", "TensorFlow", _fit_arrays, {}),
    "GraphOrParentsInXlaContext": ("distribute", "_in_xla", "TensorFlow", _fit_arrays, {}),
    "FuncGraph": ("distribute", "_FuncGraph", "TensorFlow", _fit_arrays, {}),
    "_collective_all_reduce_multi_worker": (
        "distribute",
        "_collective_all_reduce_multi_worker",
        "Keras",
        _fit_arrays,
        {"accum_steps": 1, "micro_batch_size": 2},
    ),
    "ArrayDataAdapter": ("trainer", "_ArrayDataAdapter", "Keras", _fit_arrays, {}),
    # A split step's micro-batches call one pass, kept a call.
    "NO_INLINE": ("trainer", "_NO_INLINE", "TensorFlow", _fit_arrays, {"micro_batch_size": 2}),
    "TensorFlowTrainer": ("model_hooks", "trainer.TensorFlowTrainer", "Keras", _fit_arrays, {}),
    # "auto" steps on the batch in hand, its logs reduced as Keras reduces them.
    "reduce_per_replica": (
        "trainer",
        "reduce_per_replica",
        "Keras",
        _fit_arrays,
        {"micro_batch_size": "auto"},
    ),
    "BatchNormalization": ("layers", "BatchNormalization", "Keras", _fit_arrays, {}),
    "KerasSaveable": ("saving", "KerasSaveable", "Keras", _fit_arrays, {}),
    "unscale_loss_for_distribution": (
        "losses",
        "unscale_loss_for_distribution",
        "Keras",
        _fit_arrays,
        {},
    ),
    "get_keras_mask": ("losses", "get_keras_mask", "Keras", _fit_arrays, {}),
    "apply_mask": ("losses", "apply_mask", "Keras", _fit_weighted, {}),
    "squeeze_or_expand_to_same_rank": (
        "losses",
        "squeeze_or_expand_to_same_rank",
        "Keras",
        _fit_weighted,
        {},
    ),
    "set_keras_mask": ("losses", "set_keras_mask", "Keras", _fit_masked_split, {}),
}


@pytest.mark.parametrize("name", sorted(MODULE_REACHES))
def test_a_fit_whose_release_moved_a_module_name_fails_before_training(name, monkeypatch):
    import importlib

    module_name, attribute, library, make_fit, settings = MODULE_REACHES[name]
    model, fit = make_fit(settings)
    model.build(model.inputs[0].shape if model.inputs else (None, 6))
    before = model.get_weights()
    stand_in = versions.missing(f"`{name}`", f"has no `{name}`", library)
    versions.MOVED.pop(f"`{name}`")
    holder = importlib.import_module(f"keras_accum._internals.{module_name}")
    *path, attribute = attribute.split(".")
    for part in path:
        holder = getattr(holder, part)
    monkeypatch.setattr(holder, attribute, stand_in)
    package = importlib.import_module("keras_accum._internals")
    if hasattr(package, attribute):  # re-exported: read as `internals.<name>`
        monkeypatch.setattr(package, attribute, stand_in)
    with _moved_error(name, library):
        fit(model)
    monkeypatch.undo()
    _assert_nothing_trained(model, before)


def test_a_functional_model_whose_keras_moved_functional_models_fails_at_construction(
    monkeypatch,
):
    import keras_accum
    from helpers.models import functional
    from keras_accum._internals import layers, model_hooks

    for name in ("Functional", "functional_init_arguments"):
        stand_in = versions.missing(f"`{name}`", f"has no `{name}`")
        versions.MOVED.pop(f"`{name}`")
        with monkeypatch.context() as patch:
            patch.setattr(layers, name, stand_in)
            patch.setattr(model_hooks.layers, name, stand_in)
            with _moved_error(name):
                functional(keras_accum.AccumModel, accum_steps=2)


@pytest.mark.parametrize("name", ["_get_on_device_or_primary"])
def test_a_per_replica_variable_whose_tensorflow_moved_its_parts_fails_loudly(name, monkeypatch):
    import tensorflow as tf

    from helpers.replicas import mirrored

    with mirrored(1).scope():
        variable = tf.Variable(
            0.0,
            synchronization=tf.VariableSynchronization.ON_READ,
            aggregation=tf.VariableAggregation.SUM,
        )
    _take_away(monkeypatch, variable, name)
    with _moved_error(name, "TensorFlow"):
        mirrored(1).run(lambda: internals.replica_component(variable))
    # A variable that is not distributed is its own component.
    plain = tf.Variable(0.0)
    assert internals.replica_component(plain) is plain


def test_a_graph_whose_tensorflow_moved_its_outer_graph_fails_loudly():
    # TensorFlow's own tracing reads `outer_graph` too: it is taken away
    # from a branch's graph for the read of ours only.
    import tensorflow as tf

    assert internals.current_graph() is None  # eagerly, none
    seen, outer = [], []

    def branch():
        seen.append(internals.tracing_inside(outer[0]))
        with pytest.MonkeyPatch.context() as patch:
            _take_away(patch, tf.compat.v1.get_default_graph(), "outer_graph")
            try:
                internals.tracing_inside(outer[0])
            except versions.KerasInternalsChanged as error:
                seen.append(str(error))
        return tf.constant(0)

    @tf.function
    def traced():
        outer.append(internals.current_graph())
        return tf.cond(tf.constant(True), branch, lambda: tf.constant(1))

    traced()
    assert seen[0] is True
    assert re.search(rf"TensorFlow {re.escape(tf.__version__)} changed.*outer_graph", seen[1])


def test_an_import_on_a_keras_that_moved_a_mirrored_method_still_works(monkeypatch):
    # A mirrored method gone: listed as moved (import warns), a stand-in.
    _take_away(monkeypatch, internals.BatchNormalization, "_moments")
    try:
        found = internals.mirrored()["BatchNormalization._moments"]
        assert versions.is_missing(found)
        assert "BatchNormalization._moments" in " ".join(versions.MOVED)
    finally:
        versions.MOVED.clear()
