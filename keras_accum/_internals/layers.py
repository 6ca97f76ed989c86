"""Keras's layers and functional models: BatchNormalization's moments, the
layers a model is made of, and `Functional`.

`keras_accum.window.batchnorm` relies on `BatchNormalization.call`
updating the moving statistics as `moving * momentum + batch * (1 -
momentum)` from what `_moments` returns; see fingerprints.py.
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
    """`layer`'s output where the graph that holds it calls it, or None if it
    is called more than once (a shared layer: no one output).

    Not `layer.output`: a nested functional model's (a KerasHub encoder's)
    is its own inner graph's output, not its call's in the outer graph.
    """
    if len(required(layer, "_inbound_nodes")) != 1:
        return None
    return keras.layers.Layer.output.fget(layer)


def batch_normalization_layers(model):
    """Every Keras `BatchNormalization` in `model` (nested ones included), in
    a fixed order, and whether keras_accum may pool its statistics: a layer
    whose class overrides `call` or `_moments`, or that uses batch
    renormalisation, updates its statistics in ways we do not mirror."""
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
    # Batch renormalisation is new after Keras 3.13 (a `renorm` argument):
    # before, no layer renormalises. Where Keras takes the argument, the
    # layer keeps it as `renorm`; read elsewhere, it would be missed.
    if "renorm" not in inspect.signature(BatchNormalization.__init__).parameters:
        return False
    return bool(required(layer, "renorm"))


@contextlib.contextmanager
def recording_moments(layer, record):
    """Inside the block, `record(inputs, mask, mean, variance)` is called with
    every batch's moments that `layer` computes in training mode.

    `BatchNormalization.call` gets its batch mean and variance from
    `self._moments(inputs, mask)`; an instance attribute shadows the method
    for the block (a trace, or one eager step).
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
    """`(layer, first, second)` for each layer with variables of functional
    `model` that two of its top-level layers reach (one may be the layer
    itself).

    Keras's functional config records each top-level layer by its own config,
    so such a layer is re-created once per place: a `.keras` file of the
    model loads with the tie broken, or not at all (KerasHub's tied
    `ReversibleEmbedding`, called by the backbone and by the LM head).
    """
    owners = {}
    shared = []
    for top in model.layers:
        for layer in required(top, "_flatten_layers")(include_self=True, recursive=True):
            if not layer.variables:
                # Inputs a nested model shares with the outer graph, and any
                # stateless layer: made twice, they still compute the same.
                continue
            first = owners.setdefault(id(layer), top)
            if first is not top:
                shared.append((layer, first, top))
    return shared


@contextlib.contextmanager
def moments_recorded_not_applied(layer, record):
    """Inside, `layer`'s batch moments go to `record(inputs, mask, mean,
    variance)` and its own moving-statistics update changes nothing: its
    momentum reads 1.0, and `moving * 1 + batch * 0` is exactly `moving`
    (but for a non-finite batch: the caller puts such values back).

    Example:

    ```python
    with moments_recorded_not_applied(layer, record):
        model(x, training=True)
    ```
    """
    momentum = layer.momentum
    layer.momentum = 1.0
    try:
        with recording_moments(layer, record):
            yield
    finally:
        layer.momentum = momentum


class SharedPatches:
    """Patches of layers, shared by every thread inside `applied`: the
    first to enter applies them, the last to leave takes them off.

    Under MirroredStrategy each replica's step is traced in a thread of its
    own; all enter, and they may interleave at cross-replica calls.

    Example:

    ```python
    patches = SharedPatches()
    with patches.applied(lambda: [moments_recorded_not_applied(layer, record)]):
        model(x, training=True)
    ```
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._entered = 0
        self._stack = None

    @contextlib.contextmanager
    def applied(self, patches):
        """Inside, the context managers `patches()` gives are entered (once,
        by the first thread in)."""
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
