"""Every public argument of keras_accum, checked and normalised in one place.

Each `check_*` returns its argument in its one internal form (a Python int, a
`tf.DType`, ...) or raises before anything changes, naming the argument, the
value received and what to pass instead.
"""

import difflib
import numbers
from typing import NamedTuple

import tensorflow as tf

# The window length is an int64 counter.
MAX_ACCUM_STEPS = 2**63 - 1

AUTO = "auto"

# `coupled_from=METHODS`: the model's `represent` and `couple` methods split
# it (split/coupling.py), for a model with no layer graph to split.
METHODS = "methods"

# `batchnorm`: how BatchNormalization layers update their moving statistics.
BATCHNORM_PER_WINDOW = "window"
BATCHNORM_PER_MICRO_BATCH = "micro_batch"
BATCHNORM_MODES = (BATCHNORM_PER_WINDOW, BATCHNORM_PER_MICRO_BATCH)


def check_accum_steps(accum_steps):
    """`accum_steps` as a Python int. Rejects bools (a `True` is a mistake, not
    1), and floats and strings even when integral (`2.0` from a config file
    is caught, not guessed)."""
    if isinstance(accum_steps, bool) or not isinstance(accum_steps, numbers.Integral):
        raise TypeError(
            "`accum_steps` must be an integer >= 1. "
            f"Received: accum_steps={accum_steps!r} "
            f"(of type {type(accum_steps).__name__}). "
            "Pass a whole number such as accum_steps=4."
        )
    if accum_steps < 1:
        raise ValueError(
            "`accum_steps` must be an integer >= 1. "
            f"Received: accum_steps={accum_steps!r}. "
            "Use accum_steps=1 for no accumulation."
        )
    if accum_steps > MAX_ACCUM_STEPS:
        raise ValueError(
            f"`accum_steps` must be at most {MAX_ACCUM_STEPS} (2**63 - 1). "
            f"Received: accum_steps={accum_steps!r}."
        )
    return int(accum_steps)


def check_micro_batch_size(micro_batch_size):
    """`micro_batch_size` as a Python int, None or "auto"; rejects bools,
    floats and other strings, as `check_accum_steps` does."""
    if micro_batch_size is None or (isinstance(micro_batch_size, str) and micro_batch_size == AUTO):
        return micro_batch_size
    if isinstance(micro_batch_size, bool) or not isinstance(micro_batch_size, numbers.Integral):
        raise TypeError(
            "`micro_batch_size` must be an integer >= 1, 'auto' or None. "
            f"Received: micro_batch_size={micro_batch_size!r} "
            f"(of type {type(micro_batch_size).__name__}). "
            "Pass a whole number such as micro_batch_size=32, or None to "
            "train on whole batches."
        )
    if micro_batch_size < 1:
        raise ValueError(
            "`micro_batch_size` must be an integer >= 1, 'auto' or None. "
            f"Received: micro_batch_size={micro_batch_size!r}. "
            "Use None to train on whole batches."
        )
    return int(micro_batch_size)


def check_batchnorm(batchnorm):
    """`batchnorm` if it names a mode."""
    if not isinstance(batchnorm, str) or batchnorm not in BATCHNORM_MODES:
        raise ValueError(
            "`batchnorm` must be 'window' (moving statistics updated once per "
            "optimizer update, from the whole window) or 'micro_batch' "
            "(Keras's own update at every micro-batch). "
            f"Received: batchnorm={batchnorm!r}."
        )
    return batchnorm


def check_skip_nonfinite(skip_nonfinite):
    """`skip_nonfinite`, a bool."""
    if not isinstance(skip_nonfinite, bool):
        raise TypeError(
            f"`skip_nonfinite` must be True or False. Received: skip_nonfinite={skip_nonfinite!r}."
        )
    return skip_nonfinite


def check_noise_scale(noise_scale):
    """`noise_scale`, a bool."""
    if not isinstance(noise_scale, bool):
        raise TypeError(
            "`noise_scale` must be True (measure the gradient noise scale "
            "and log it every epoch) or False. "
            f"Received: noise_scale={noise_scale!r}."
        )
    return noise_scale


def check_coupled_from(coupled_from):
    """`coupled_from` as a tuple of layer names, "methods" (the model's
    `represent` and `couple` methods) or None."""
    if coupled_from is None:
        return None
    if isinstance(coupled_from, str) and coupled_from == METHODS:
        return METHODS
    names = (coupled_from,) if isinstance(coupled_from, str) else coupled_from
    try:
        names = tuple(names)
    except TypeError:
        names = None
    if not names or not all(isinstance(n, str) and n for n in names):
        raise TypeError(
            "`coupled_from` must be a list of layer names (the layers whose "
            "outputs are the per-sample representations), 'methods' (the "
            "model's `represent` and `couple` methods split it), or None. "
            f"Received: coupled_from={coupled_from!r}."
        )
    if len(set(names)) != len(names):
        raise ValueError(
            f"`coupled_from` names a layer twice. Received: coupled_from={coupled_from!r}."
        )
    return names


def shown_coupled_from(coupled_from):
    """`coupled_from` as a user writes it (a list of names, or "methods"), for
    messages and configs."""
    return coupled_from if coupled_from == METHODS else list(coupled_from)


def check_coupled_settings(settings):
    """Raises if `coupled_from` is combined with a setting it cannot honour."""
    if settings.coupled_from is None:
        return settings
    if settings.accum_steps > 1:
        raise ValueError(
            "`coupled_from` couples the samples of one batch, and a window "
            "of `accum_steps` batches would not see each other's samples "
            "(each batch's negatives would be its own). Received: "
            f"accum_steps={settings.accum_steps}. Use `micro_batch_size` "
            "with the batch size you want instead: the step splits each "
            "batch and computes the loss on the whole of it."
        )
    if settings.noise_scale:
        raise ValueError(
            "`noise_scale=True` measures the noise scale from independent "
            "micro-batch gradients, which a batch-coupled loss "
            f"(`coupled_from={shown_coupled_from(settings.coupled_from)!r}`) does not have. "
            "Set one of them only."
        )
    return settings


def check_accum_dtype(accum_dtype):
    """`accum_dtype` as a floating `tf.DType`; None stays None (the default
    rule, `scaling.buffer_dtype`)."""
    if accum_dtype is None:
        return None
    try:
        dtype = tf.as_dtype(accum_dtype)
    except TypeError:
        dtype = None
    if dtype is None or not dtype.is_floating:
        raise ValueError(
            "`accum_dtype` must be a floating-point dtype such as 'float32'. "
            f"Received: accum_dtype={accum_dtype!r}. Use None for the default."
        )
    return dtype


class AccumSettings(NamedTuple):
    """The settings an `AccumModel` is made with, checked, in the forms the
    `check_*` functions return (`coupled_from`: split/coupling.py)."""

    accum_steps: int = 1
    accum_dtype: object = None
    skip_nonfinite: bool = False
    batchnorm: str = BATCHNORM_PER_WINDOW
    micro_batch_size: object = None
    noise_scale: bool = False
    coupled_from: object = None

    def config(self):
        """The settings as `get_config` writes them: defaults left out, as earlier
        releases wrote them, but for `accum_steps` and `batchnorm`."""
        config = {"accum_steps": self.accum_steps}
        if self.accum_dtype is not None:
            config["accum_dtype"] = self.accum_dtype.name
        if self.skip_nonfinite:
            config["skip_nonfinite"] = True
        config["batchnorm"] = self.batchnorm
        if self.micro_batch_size is not None:
            config["micro_batch_size"] = self.micro_batch_size
        if self.noise_scale:
            config["noise_scale"] = True
        if self.coupled_from is not None:
            config["coupled_from"] = shown_coupled_from(self.coupled_from)
        return config


def accum_settings(
    accum_steps=1,
    accum_dtype=None,
    skip_nonfinite=False,
    batchnorm=BATCHNORM_PER_WINDOW,
    micro_batch_size=None,
    noise_scale=False,
    coupled_from=None,
):
    """Checks every setting of an `AccumModel`; returns them as `AccumSettings`."""
    return check_coupled_settings(
        AccumSettings(
            accum_steps=check_accum_steps(accum_steps),
            accum_dtype=check_accum_dtype(accum_dtype),
            skip_nonfinite=check_skip_nonfinite(skip_nonfinite),
            batchnorm=check_batchnorm(batchnorm),
            micro_batch_size=check_micro_batch_size(micro_batch_size),
            noise_scale=check_noise_scale(noise_scale),
            coupled_from=check_coupled_from(coupled_from),
        )
    )


def settings_from_config(config):
    """Pops the settings `AccumSettings.config()` wrote from `config`, checked;
    the rest is the Keras model's."""
    return accum_settings(
        **{name: config.pop(name) for name in AccumSettings._fields if name in config}
    )


def check_positive(name, value, default, meaning, kind=int):
    """`value` (the argument `name`) as a positive `kind` (int: an integer),
    `default` if None; or raises naming it and its `meaning`."""
    if value is None:
        return default
    wanted = numbers.Integral if kind is int else numbers.Real
    if isinstance(value, bool) or not isinstance(value, wanted) or not value > 0:
        what = "a positive integer" if kind is int else "a number > 0"
        raise ValueError(f"`{name}` must be {what} ({meaning}). Received: {name}={value!r}.")
    return kind(value)


MODEL_ARGUMENTS = AccumSettings._fields
FIT_ARGUMENTS = ("accum_steps", "micro_batch_size")
OPTIMIZER_ARGUMENTS = ("accum_steps", "accum_dtype", "skip_nonfinite")

# Names other libraries give our arguments, suggested as if misspelt.
_OTHER_NAMES = {
    "gradient_accumulation_steps": "accum_steps",
    "accumulation_steps": "accum_steps",
}


def check_keywords(kwargs, where, accepted, passed_on=None):
    """Raises TypeError for a keyword argument `where` would not honour.

    Keras would ignore a misspelt argument of ours (a functional model), or
    name only itself (`fit`, a subclass), and training would go on with the
    default: a name close to one of ours (difflib), or one of ours that
    belongs to another way in (`noise_scale` given to `fit`), is refused
    first. `kwargs`: those `where` did not take; `accepted`: ours it takes;
    `passed_on`: names Keras takes, left alone even when close to ours
    (`dtype`), or None: every name left is refused.
    """
    for name, value in kwargs.items():
        if passed_on is not None and name in passed_on:
            continue
        ours = MODEL_ARGUMENTS + FIT_ARGUMENTS + OPTIMIZER_ARGUMENTS
        if name in ours:
            # Ours, but not taken here.
            owners = [
                owner
                for owner, names in (
                    ("AccumModel(...) and keras_accum.wrap(...)", MODEL_ARGUMENTS),
                    ("AccumModel.fit(...)", FIT_ARGUMENTS),
                    ("AccumOptimizer(...)", OPTIMIZER_ARGUMENTS),
                )
                if name in names
            ]
            hint = f"`{name}` is an argument of {' and '.join(owners)}, not of {where}."
        else:
            close = _OTHER_NAMES.get(name) or next(
                iter(difflib.get_close_matches(name, sorted(set(ours)), n=1)), None
            )
            if close is None and passed_on is not None:
                continue  # for Keras to take or refuse
            hint = "" if close is None else f"Did you mean `{close}`?"
            if close is not None and close not in accepted:
                hint += f" (It is not an argument of {where} either.)"
        raise TypeError(
            f"{where} got an unexpected keyword argument `{name}`. {hint} "
            f"Received: {name}={value!r}. keras_accum's arguments of "
            f"{where} are: {', '.join(accepted)}."
        )
