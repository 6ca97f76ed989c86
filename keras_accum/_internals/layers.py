"""Keras's layers and functional models: BatchNormalization's moments, the
layers a model is made of, and `Functional`. `keras_accum.window.batchnorm`
relies on `BatchNormalization.call`'s moving-statistics update from what
`_moments` returns (fingerprints.py).
"""

import contextlib
import inspect
import threading

import keras

from keras_accum._internals.versions import reach, required

BatchNormalization = reach(
    "keras.src.layers.normalization.batch_normalization", "BatchNormalization"
)
Functional = reach("keras.src.models.functional", "Functional")
functional_init_arguments = reach("keras.src.models.model", "functional_init_arguments")


def output_of_its_call(layer):
    """`layer`'s output where its graph calls it; None if called more than once.
    Not `layer.output`: a nested functional model's (a KerasHub encoder's)
    is its inner graph's output, not its call's in the outer graph."""
    if len(required(layer, "_inbound_nodes")) != 1:
        return None
    return keras.layers.Layer.output.fget(layer)


def batch_normalization_layers(model):
    """`(layer, plain)` for every Keras `BatchNormalization` in `model`, nested
    ones included, in a fixed order. Only a `plain` layer's statistics may be
    pooled: an override of `call` or `_moments`, or renormalisation, updates
    them in ways we do not mirror."""
    for layer in required(model, "_flatten_layers")(include_self=False, recursive=True):
        if isinstance(layer, BatchNormalization):
            cls = type(layer)
            plain = (
                cls.call is BatchNormalization.call
                and required(cls, "_moments") is required(BatchNormalization, "_moments")
                and not _renormalises(layer)
            )
            yield layer, plain


def _renormalises(layer):
    # `renorm` is new after Keras 3.13; where Keras takes it, the layer keeps
    # it as `renorm`.
    if "renorm" not in inspect.signature(BatchNormalization.__init__).parameters:
        return False
    return bool(required(layer, "renorm"))


@contextlib.contextmanager
def recording_moments(layer, record):
    """Inside, `record(inputs, mask, mean, variance)` gets every batch's moments
    `layer` computes in training mode: `BatchNormalization.call` gets them
    from `self._moments`, which an instance attribute shadows for the block.
    """
    original = required(layer, "_moments")

    def moments(inputs, mask):
        mean, variance = original(inputs, mask)
        record(inputs, mask, mean, variance)
        return mean, variance

    layer._moments = moments
    try:
        yield
    finally:
        del layer._moments


def layers_shared_across_nesting(model):
    """`(layer, first, second)` for each layer with variables that two top-level
    layers of functional `model` reach (one may be the layer itself): Keras's
    functional config re-creates it per place, so a `.keras` file loads with
    the tie broken, or not at all (KerasHub's tied `ReversibleEmbedding`)."""
    owners = {}
    shared = []
    for top in model.layers:
        for layer in required(top, "_flatten_layers")(include_self=True, recursive=True):
            if not layer.variables:
                # Stateless (inputs a nested model shares too): made twice,
                # still the same.
                continue
            first = owners.setdefault(id(layer), top)
            if first is not top:
                shared.append((layer, first, top))
    return shared


@contextlib.contextmanager
def moments_recorded_not_applied(layer, record):
    """Inside, `layer`'s batch moments go to `record` and its own update changes
    nothing: its momentum reads 1.0, and `moving * 1 + batch * 0` is exactly
    `moving` (but for a non-finite batch: the caller puts such values back).
    """
    momentum = layer.momentum
    layer.momentum = 1.0
    try:
        with recording_moments(layer, record):
            yield
    finally:
        layer.momentum = momentum


class SharedPatches:
    """Patches of layers shared by every thread inside `applied`: the first in
    enters them, the last out exits them (MirroredStrategy traces each
    replica's step in its own thread; they may interleave at cross-replica
    calls)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._entered = 0
        self._stack = None

    @contextlib.contextmanager
    def applied(self, patches):
        """Inside, the context managers `patches()` gives are entered, once."""
        with self._lock:
            if not self._entered:
                self._stack = contextlib.ExitStack()
                for patch in patches():
                    self._stack.enter_context(patch)
            self._entered += 1
        try:
            yield
        finally:
            with self._lock:
                self._entered -= 1
                if not self._entered:
                    self._stack.close()
