"""Every place keras_accum reaches into Keras or TensorFlow internals
(`keras.src`, private attributes), and nowhere else.

Supports Keras 3.8 to 3.x on the TensorFlow backend (TensorFlow >= 2.18);
read against the Keras sources listed in `REVIEWED_KERAS`. Keras releases
move these names; where a supported version differs, the code here detects
the feature, not the version. `tests/test_keras_internals.py` fails loudly,
naming the function, when a Keras release changes a function that
keras_accum mirrors (`MIRRORED_SOURCES`), and when a module of keras_accum
outside this package reaches into Keras itself.

By concern:

- `versions`: the reviewed and supported releases, `reach` (every name from
  `keras.src`; a missing one raises `KerasInternalsChanged` when used, not
  at import) and the warning on an unreviewed Keras.
- `fingerprints`: the mirrored Keras code, by SHA-256 per reviewed release.
- `trainer`: the forward pass, the symbolic build, the train and test
  functions made in place of Keras's, their loop over a call's batches
  and their reduced outputs.
- `losses`: the compiled loss and its terms, the logged loss, masks.
- `layers`: BatchNormalization's moments, nested layers, `Functional`.
- `saving`: training state in a model's files, tracking, build shapes,
  tf_keras objects.
- `distribute`: replicas, workers, per-replica variables, XLA.
- `optimizer`: the variables an optimizer was built for, its own, and
  the schedule object it was given.
- `callbacks`: `BackupAndRestore`'s batch counting and backups, the epoch
  `fit` starts at.
- `model_hooks`: the private `Model` hooks `AccumModel` overrides (the
  first-batch build, functional subclassing, test functions across workers)
  and the `train_function` attribute Keras assigns, held by the model's
  own object (`HeldAttribute`).

Everything is re-exported here: `from keras_accum import _internals as
internals`, then `internals.name`.
"""

import keras
import tensorflow as tf

from keras_accum._internals.versions import (
    MIN_KERAS,
    MIN_TENSORFLOW,
    REVIEWED_KERAS,
    SUPPORTED,
    KerasInternalsChanged,
    check_versions,
    is_missing,
    missing,
    moved,
    reach,
    require,
    required,
    warn_if_unreviewed,
)

# The supported range, checked before any module below reaches into Keras:
# older releases lack names used there (and fail with confusing errors).
check_versions(keras.__version__, tf.__version__)

from keras_accum._internals.callbacks import (  # noqa: E402
    LoggedCount,
    backup_batch_seen,
    backup_counts_from_zero,
    backup_due_after_batch,
    backup_epoch_ended,
    backups_made_by,
    set_initial_epoch,
)
from keras_accum._internals.distribute import (  # noqa: E402
    branch_keeping_zero,
    current_graph,
    in_xla_context,
    metrics_summed_over_replicas,
    multi_worker,
    replica_component,
    replicated,
    tracing_inside,
    whole_sum,
)
from keras_accum._internals.fingerprints import MIRRORED_SOURCES, mirrored  # noqa: E402
from keras_accum._internals.layers import (  # noqa: E402
    BatchNormalization,
    Functional,
    batch_normalization_layers,
    functional_init_arguments,
    SharedPatches,
    layers_shared_across_nesting,
    moments_recorded_not_applied,
    output_of_its_call,
    recording_moments,
)
from keras_accum._internals.losses import (  # noqa: E402
    apply_mask,
    batch_size,
    build_compiled_loss,
    compute_loss,
    get_keras_mask,
    loss_tracker,
    recording_loss_calls,
    set_keras_mask,
    squeeze_or_expand_to_same_rank,
    track_loss,
    unscale_loss_for_distribution,
)
from keras_accum._internals.model_hooks import (  # noqa: E402
    BuildFromFirstBatch,
    check_fit,
    FunctionalVariants,
    HeldAttribute,
    holder_of,
    init_model,
    training_build,
)
from keras_accum._internals.optimizer import (  # noqa: E402
    build_position,
    built_variables,
    check_optimizer,
    innermost,
    wrapped,
    learning_rate_schedule,
    own_variables,
    unknown_variables,
)
from keras_accum._internals.saving import (  # noqa: E402
    KerasSaveable,
    SavedState,
    building_optimizer_on_load,
    check_saving,
    copy_build_shapes,
    legacy_keras_hint,
    no_automatic_dependency_tracking,
)
from keras_accum._internals.trainer import (  # noqa: E402
    TensorFlowTrainer,
    array_batch_size,
    batch_spec,
    compile_arguments,
    call_for_training,
    called_like,
    each_batch,
    make_replicated_function,
    make_step_on_data,
    optionals_to_none,
    reduce_outputs,
    reduce_per_replica,
    symbolic_build,
    without_retracing_warning,
)

# On a Keras not in REVIEWED_KERAS, one warning if anything above changed.
warn_if_unreviewed(mirrored(), MIRRORED_SOURCES)

__all__ = [
    # versions
    "MIN_KERAS",
    "MIN_TENSORFLOW",
    "REVIEWED_KERAS",
    "SUPPORTED",
    "KerasInternalsChanged",
    "check_versions",
    "is_missing",
    "missing",
    "moved",
    "reach",
    "require",
    "required",
    "warn_if_unreviewed",
    # fingerprints
    "MIRRORED_SOURCES",
    "mirrored",
    # trainer
    "TensorFlowTrainer",
    "array_batch_size",
    "batch_spec",
    "compile_arguments",
    "call_for_training",
    "called_like",
    "each_batch",
    "make_replicated_function",
    "make_step_on_data",
    "optionals_to_none",
    "reduce_outputs",
    "reduce_per_replica",
    "symbolic_build",
    "without_retracing_warning",
    # losses
    "apply_mask",
    "batch_size",
    "build_compiled_loss",
    "compute_loss",
    "get_keras_mask",
    "loss_tracker",
    "recording_loss_calls",
    "set_keras_mask",
    "squeeze_or_expand_to_same_rank",
    "track_loss",
    "unscale_loss_for_distribution",
    # layers
    "BatchNormalization",
    "Functional",
    "batch_normalization_layers",
    "functional_init_arguments",
    "layers_shared_across_nesting",
    "SharedPatches",
    "recording_moments",
    "moments_recorded_not_applied",
    "output_of_its_call",
    # saving
    "KerasSaveable",
    "SavedState",
    "building_optimizer_on_load",
    "check_saving",
    "copy_build_shapes",
    "legacy_keras_hint",
    "no_automatic_dependency_tracking",
    # distribute
    "in_xla_context",
    "branch_keeping_zero",
    "current_graph",
    "metrics_summed_over_replicas",
    "multi_worker",
    "replica_component",
    "replicated",
    "tracing_inside",
    "whole_sum",
    # model hooks
    "BuildFromFirstBatch",
    "check_fit",
    "FunctionalVariants",
    "HeldAttribute",
    "holder_of",
    "init_model",
    "training_build",
    # optimizer
    "build_position",
    "built_variables",
    "check_optimizer",
    "innermost",
    "wrapped",
    "learning_rate_schedule",
    "own_variables",
    "unknown_variables",
    # callbacks
    "LoggedCount",
    "backup_batch_seen",
    "backup_counts_from_zero",
    "backup_due_after_batch",
    "backup_epoch_ended",
    "backups_made_by",
    "set_initial_epoch",
]
