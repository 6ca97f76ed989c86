"""Every reach of keras_accum into Keras or TensorFlow internals (`keras.src`,
`tensorflow.python`, private attributes), and nowhere else; re-exported here
(`internals.name`). Read against `REVIEWED_KERAS` (Keras >= 3.8, TensorFlow
>= 2.18); where releases differ, the code detects the feature, not the version.
tests/test_keras_internals.py fails, naming the function, when a release changes
mirrored code (`MIRRORED_SOURCES`) or a module outside this package reaches in.
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

# Before any module below reaches into Keras: older releases lack its names.
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
    zero_at_run_time,
)
from keras_accum._internals.fingerprints import MIRRORED_SOURCES, mirrored  # noqa: E402
from keras_accum._internals.layers import (  # noqa: E402
    BatchNormalization,
    Functional,
    SharedPatches,
    batch_normalization_layers,
    functional_init_arguments,
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
    FunctionalVariants,
    HeldAttribute,
    check_fit,
    holder_of,
    init_model,
    training_build,
)
from keras_accum._internals.optimizer import (  # noqa: E402
    build_position,
    built_variables,
    check_optimizer,
    innermost,
    learning_rate_schedule,
    own_variables,
    unknown_variables,
    wrapped,
)
from keras_accum._internals.saving import (  # noqa: E402
    KerasSaveable,
    SavedState,
    building_optimizer_on_load,
    check_saving,
    copy_build_shapes,
    legacy_keras_hint,
    no_automatic_dependency_tracking,
    written_otherwise,
)
from keras_accum._internals.trainer import (  # noqa: E402
    TensorFlowTrainer,
    array_batch_size,
    batch_spec,
    call_for_training,
    called_like,
    compile_arguments,
    each_batch,
    make_replicated_function,
    make_step_on_data,
    not_inlined,
    optionals_to_none,
    reduce_outputs,
    reduce_per_replica,
    symbolic_build,
    without_retracing_warning,
)

# On a Keras not in REVIEWED_KERAS: one warning if anything above changed.
warn_if_unreviewed(mirrored(), MIRRORED_SOURCES)
