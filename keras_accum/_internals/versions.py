"""Which Keras releases keras_accum was read against, and what it does on others.

Every `keras.src` name comes through `reach`: one this Keras lacks becomes a
stand-in raising `KerasInternalsChanged` on use, so the import still works.
An unreviewed Keras gets one warning at import if anything changed. setup.cfg
allows `keras<4`: a cap would make pip downgrade a Keras another package needs.
"""

import hashlib
import importlib
import inspect
import re
import warnings

# Read against these (fingerprints in MIRRORED_SOURCES); the last is newest.
REVIEWED_KERAS = ("3.8.0", "3.10.0", "3.13.2", "3.15.1", "3.16.0.dev2026102704")

MIN_KERAS = (3, 8)
MIN_TENSORFLOW = (2, 18)
SUPPORTED = "Keras >= 3.8, < 4 with TensorFlow >= 2.18"


def release(version):
    """`(major, minor)` of a version string such as '3.16.0.dev2026102704'."""
    return tuple(int(part) for part in re.findall(r"\d+", version)[:2])


def newest_reviewed():
    return REVIEWED_KERAS[-1]


def newest_reviewed_release():
    """The newest reviewed version published as `keras` (not a nightly)."""
    return next(v for v in reversed(REVIEWED_KERAS) if "dev" not in v)


def check_versions(keras_version, tensorflow_version):
    """Raises ImportError naming the supported range if these are outside it."""
    found = f"Keras {keras_version} with TensorFlow {tensorflow_version}"
    if keras_version.startswith("2."):
        raise ImportError(
            f"keras_accum needs Keras 3, but found {found}: `tf_keras` (Keras "
            "2, TF_USE_LEGACY_KERAS=1) is not supported. keras_accum supports "
            f"{SUPPORTED}: `pip install 'keras>=3.8,<4'` and leave "
            "TF_USE_LEGACY_KERAS unset."
        )
    keras_release = release(keras_version)
    if keras_release < MIN_KERAS or keras_release[0] != 3:
        raise ImportError(
            f"keras_accum supports {SUPPORTED}; found {found}. Install a "
            "supported Keras: `pip install 'keras>=3.8,<4'`."
        )
    if release(tensorflow_version) < MIN_TENSORFLOW:
        raise ImportError(
            f"keras_accum supports {SUPPORTED}; found {found}. Install a "
            "supported TensorFlow: `pip install 'tensorflow>=2.18'`."
        )


class KerasInternalsChanged(RuntimeError):
    """This Keras moved or changed something keras_accum relies on."""


def _keras_version():
    import keras

    return keras.__version__


# TensorFlow releases tested (noxfile.py's pairs); the reaches into
# TensorFlow (`tensorflow.python`, private attributes) were read against these.
REVIEWED_TENSORFLOW = ("2.18.1", "2.20.0", "2.21.0", "2.23.0.dev20261026")


def _tensorflow_version():
    import tensorflow as tf

    return tf.__version__


def changed_message(what, detail, library="Keras"):
    """The sentence users get when `what` moved in the installed Keras (or
    TensorFlow)."""
    if library == "TensorFlow":
        newest = next(v for v in reversed(REVIEWED_TENSORFLOW) if "dev" not in v)
        return (
            f"TensorFlow {_tensorflow_version()} changed what keras_accum relies "
            f"on: {what} ({detail}). keras_accum was reviewed against TensorFlow "
            f"{', '.join(REVIEWED_TENSORFLOW)}. Install `pip install "
            f"'tensorflow=={newest}'` or a keras_accum release that supports "
            f"TensorFlow {_tensorflow_version()}."
        )
    newest = newest_reviewed()
    return (
        f"Keras {_keras_version()} changed what keras_accum relies on: "
        f"{what} ({detail}). keras_accum was reviewed against Keras "
        f"{', '.join(REVIEWED_KERAS)}; the newest supported is {newest}. "
        f"Install `pip install 'keras=={newest_reviewed_release()}'` or a keras_accum "
        f"release that supports Keras {_keras_version()}."
    )


def moved(what, detail, library="Keras"):
    """The `KerasInternalsChanged` to raise for `what`, moved in the installed
    Keras (or TensorFlow); `detail` says how it was found missing."""
    return KerasInternalsChanged(changed_message(what, detail, library))


def required(obj, name, library="Keras"):
    """`obj.<name>`, a private attribute every reviewed release has; else
    `KerasInternalsChanged` naming it, never a bare `AttributeError`."""
    try:
        return getattr(obj, name)
    except AttributeError:
        owner = obj.__name__ if isinstance(obj, type) else type(obj).__name__
        raise moved(f"`{owner}.{name}`", f"this {owner} has no `{name}`", library) from None


def require(obj, *names, library="Keras"):
    """Raises `KerasInternalsChanged` unless `obj` has every one of `names`: a
    check before training of attributes a `fit` reads later."""
    for name in names:
        required(obj, name, library)


# What `reach` could not find in the installed Keras: {what: message}.
MOVED = {}


class _StandIn(type):
    """The type of `reach`'s stand-in for a name this Keras lacks: it can be
    subclassed (keras_accum's classes still define at import); calling it,
    instantiating a subclass, `isinstance` or an attribute raises
    `KerasInternalsChanged`."""

    def _fail(cls, *_args, **_kwargs):
        raise KerasInternalsChanged(type.__getattribute__(cls, "_message"))

    __call__ = _fail
    __instancecheck__ = _fail
    __subclasscheck__ = _fail

    def __getattr__(cls, name):
        if name.startswith("__"):  # introspection (copy, inspect, pickle)
            raise AttributeError(name)
        cls._fail()


def is_missing(obj):
    """Whether `obj` is a stand-in made by `reach` for a missing name."""
    return isinstance(obj, _StandIn)


def missing(what, detail, library="Keras"):
    """A stand-in for `what`, which this Keras lacks (listed in `MOVED`)."""
    message = changed_message(what, detail, library)
    MOVED[what] = message
    return _StandIn(what, (), {"__doc__": message, "_message": message})


def reach(module, *names):
    """The first of `names` (newest first) defined in module `module`, or a
    stand-in raising `KerasInternalsChanged` when used if none is."""
    what = f"`{module}.{names[0]}`"
    library = "TensorFlow" if module.split(".")[0] == "tensorflow" else "Keras"
    try:
        found = importlib.import_module(module)
    except ImportError as error:
        return missing(what, f"module not importable: {error}", library)
    for name in names:
        if hasattr(found, name):
            return getattr(found, name)
    tried = " or ".join(f"`{name}`" for name in names)
    return missing(what, f"`{module}` has no {tried}", library)


def fingerprint(function):
    """SHA-256 of a function's source, as `MIRRORED_SOURCES` records it."""
    return hashlib.sha256(inspect.getsource(function).encode()).hexdigest()


def changed_sources(mirrored, known):
    """`{name: why}` for each function of `mirrored` (`{name: function}`, as
    found) whose source is not one of `known` (`MIRRORED_SOURCES`)."""
    changed = {}
    for name, function in mirrored.items():
        try:
            digest = fingerprint(function)
        except (KerasInternalsChanged, TypeError, OSError) as error:
            changed[name] = f"not found: {error}"
            continue
        if digest not in known[name]:
            changed[name] = f"new source, fingerprint {digest}"
    return changed


def warn_if_unreviewed(mirrored, known):
    """Warns once, at import, when this Keras changed what keras_accum uses;
    silent where every mirrored source is a reviewed one."""
    version = _keras_version()
    if version in REVIEWED_KERAS and not MOVED:
        return {}
    changed = changed_sources(mirrored, known)
    for what in MOVED:
        changed.setdefault(what, "not found")
    if changed:
        names = "; ".join(f"{name}: {why}" for name, why in sorted(changed.items()))
        warnings.warn(
            f"keras_accum was reviewed against Keras {', '.join(REVIEWED_KERAS)} "
            f"(newest {newest_reviewed()}); this Keras {version} changed "
            f"functions it mirrors or names it uses ({names}). Training may "
            "fail with KerasInternalsChanged, or differ from the big batch: "
            f"install `keras=={newest_reviewed_release()}` for reviewed behaviour.",
            RuntimeWarning,
            stacklevel=3,
        )
    return changed
