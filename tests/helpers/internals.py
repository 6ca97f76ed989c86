"""The only place tests reach past keras_accum's public API.

Used where no public API can observe the thing a test is about: how many
micro-batches an open window holds, which buffers hold slices, the
BatchNormalization moments of a window, the package's private modules
(under test themselves: tests/test_keras_internals.py). Where a public
equivalent exists (`optimizer.iterations`, weights, `flush()`,
`skipped_windows`, `get_config()`, `assertions.assert_no_open_window`),
tests use that instead. A rename inside the package touches this file only.
"""

import tensorflow as tf

from keras_accum import _internals as keras_internals  # noqa: F401 (shared)
from keras_accum._internals import versions as keras_versions  # noqa: F401 (shared)
from keras_accum.backup import restore_point  # noqa: F401 (shared)
from keras_accum.normaliser import loss_normaliser  # noqa: F401 (shared)
from keras_accum.split import microbatch  # noqa: F401 (shared)
from keras_accum.window import (  # noqa: F401 (shared)
    AccumState,
    MicroBatch,  # noqa: F401 (shared)
    close,
    close_batch,
    file_format,  # noqa: F401 (shared)
    noise_scale,  # noqa: F401 (shared)
)
from keras_accum.window import slices as sparse  # noqa: F401 (shared)
from keras_accum.window.buffers import GradientAccumulator  # noqa: F401 (shared)
from keras_accum.window.nonfinite import NonFiniteWindows  # noqa: F401 (shared)
from keras_accum.wrap import RebuiltModel, WrappedModel

# What `keras_accum.wrap` returns, by kind of model (their docstrings are
# part of the API reference).
WRAPPED_CLASSES = (WrappedModel, RebuiltModel)
# Keras's class of functional models, as keras_accum reaches it.
Functional = keras_internals.Functional


def accumulator(owner):
    """The GradientAccumulator of an AccumModel or an AccumOptimizer."""
    return owner._accumulator


def pending(owner):
    """Micro-batches in the open window of an AccumModel or AccumOptimizer."""
    return accumulator(owner).open_micro_batches()


def sparse_indices(owner):
    """Indices of the window's buffers that hold slices (an Embedding's), of
    an AccumModel, an AccumOptimizer or a GradientAccumulator."""
    acc = owner if isinstance(owner, GradientAccumulator) else accumulator(owner)
    return acc.layout.sparse


def batchnorm(model):
    """The AccumModel's BatchNormalization window (its moments, its mode)."""
    return model._batchnorm


def batchnorm_windows(model):
    """The moments pooled per BatchNormalization layer: {key: window}."""
    return batchnorm(model)._windows


def parked_batchnorm_moments(model):
    """Moments loaded from a file that wait for their layers' windows."""
    return batchnorm(model)._restored


def window_variables(model):
    """Every variable of the AccumModel's open window: the accumulator's
    (gradient buffers, slices, counters) and the BatchNormalization moments."""
    return [*accumulator(model).variables, *batchnorm(model).variables]


def local_window(model):
    """The values of the window's state on this process's replicas, read
    without a collective: one list of arrays per state variable."""
    values = file_format.snapshot(accumulator(model))[0]
    return values


def zero_local_window(model):
    """Overwrites the window's state on this process's replicas with zeros."""
    acc = accumulator(model)
    for v in acc.state():
        for c in acc.strategy.experimental_local_results(v) if acc.strategy else (v,):
            c.assign(tf.zeros_like(c))


def restore_points_on_disk(backup):
    """A keras_accum.BackupAndRestore's committed backups, as (epoch, batch)."""
    return backup._restore_points_on_disk()


def mark_window_saved_by(path, shares, replicas):
    """Marks a weights file's window as saved by `shares` processes,
    `replicas` replicas in all (where the file keeps the window's setup)."""
    import h5py

    with h5py.File(path, "r+") as f:
        f["_accumulator/vars/shares"][()] = shares
        f["_accumulator/vars/replicas"][()] = replicas


def break_after_the_skip_count(path, skipped):
    """Edits a weights file: the window's skip count to `skipped`, and one
    BatchNormalization entry more than the model has (`count_9`). Keras
    loads private states last, sorted, so the count loads before
    `_batchnorm` fails the load."""
    import h5py

    with h5py.File(path, "r+") as f:
        f["_accumulator/nonfinite/vars/skipped_windows"][()] = skipped
        f["_batchnorm/vars/count_9"] = f["_batchnorm/vars/count_0"][()]


def batch_size_seen(model):
    """The batch size `model`'s step splits by (learnt from a first batch)."""
    return model.accumulation.batch_size_seen


def settings(model):
    """The AccumModel's checked arguments (`AccumSettings`)."""
    return model.accumulation.settings


def pretend_measured(model, batch_size, measured):
    """Sets what an AccumModel last saw (the per-replica batch size) and
    `measured` (its noise scale), as an epoch of training would."""
    model.accumulation.batch_size_seen = batch_size
    model.accumulation.noise_scale = measured


def compiled_loss(model):
    """Keras's `CompileLoss` of a compiled `model` (None: compiled without a loss)."""
    return model._compile_loss


def compiled_metrics(model):
    """The metrics and weighted metrics `model` was compiled with, as given."""
    metrics = model._compile_metrics
    if metrics is None:
        return [], []
    return list(metrics._user_metrics or []), list(metrics._user_weighted_metrics or [])


def compiled_loss_terms(model):
    """Keras's flattened compiled losses: one (path, fn, weight, name) each."""
    return model._compile_loss._flat_losses


def keras_backup_write(callback):
    """The method through which Keras's BackupAndRestore writes a backup."""
    return callback._save_model()


# The name of the method keras_accum.BackupAndRestore writes its epoch-end
# backups with (a test replaces it to see the call arrive).
EPOCH_END_BACKUP = "_save_epoch_end"


def saving_skipset(obj):
    """The attributes Keras's saving skips on `obj` (those a fresh object of
    its `_obj_type()`'s kind has)."""
    from keras.src.saving import saving_lib

    return saving_lib.get_attr_skipset(obj._obj_type())


def keras_backup_batch_rule():
    """Keras's BackupAndRestore method that decides a batch-level backup."""
    import keras

    return keras.callbacks.BackupAndRestore._should_save_on_batch


def fresh_tracing_detector():
    """A new TensorFlow frequent-retracing detector (its count of traces per
    code object is process-wide)."""
    from tensorflow.python.eager.polymorphic_function import polymorphic_function

    return polymorphic_function._FrequentTracingDetectorManager()


def graphs_as_run(function, *args):
    """The graphs TensorFlow ran for `function(*args)`, after its graph
    optimiser (Grappler) rewrote them: `GraphDef`s."""
    from tensorflow.python.eager import context

    context.enable_run_metadata()
    try:
        function(*args)
        metadata = context.export_run_metadata()
        return list(metadata.partition_graphs) + [
            graph
            for function_graphs in metadata.function_graphs
            for graph in (
                *function_graphs.partition_graphs,
                function_graphs.post_optimization_graph,
            )
        ]
    finally:
        context.disable_run_metadata()
