"""The Keras code keras_accum mirrors rather than calls, pinned by SHA-256
per reviewed Keras release (`MIRRORED_SOURCES`, `mirrored()`)."""

from keras_accum._internals.layers import BatchNormalization
from keras_accum._internals.losses import apply_mask
from keras_accum._internals.trainer import TensorFlowTrainer, reduce_per_replica
from keras_accum._internals.versions import is_missing, missing, reach

# Keras code keras_accum mirrors rather than calls, by the SHA-256 of its
# source, with the Keras versions that have that source: every one listed
# was read and is handled in this package. `accumulate` and
# `micro_batch_gradients` (engine/step.py) mirror the TF trainer's
# train_step; `make_replicated_function`, `make_step_on_data` and
# `each_batch` (trainer.py) its `_make_function` (`micro_batch_size="auto"`
# also relies on the `function(iterator)` it returns: `fit` passes an
# iterator of batches, and StopIteration or OutOfRangeError ends the epoch);
# `keras_accum.normaliser` the divisor of Keras's `Loss.__call__`,
# `reduce_values` and `apply_mask`, reached through `CompileLoss.call`'s
# terms (losses.py). `symbolic_build` and `reduce_outputs` (trainer.py)
# replace `_maybe_symbolic_build` and the multi-worker branch of
# `reduce_per_replica` (tensorflow/tensorflow#72388).
# `keras_accum.window.batchnorm` relies on `BatchNormalization.call`
# updating the moving statistics as `moving * momentum + batch * (1 -
# momentum)` from what `_moments` returns (layers.py).
# tests/test_keras_internals.py compares these.
#
# What differs between the supported versions, and how it is handled:
# - train_step: Keras < 3.13 counts the logged loss's batch size from the
#   first input, later ones from the first input that is not None;
#   `batch_size` does the latter, the same wherever the former works.
# - _make_function: Keras >= 3.13 turns `tf.experimental.Optional` inputs
#   into None and loops over `steps_per_execution` in a while loop;
#   `make_replicated_function` keeps its own loop (`each_batch`).
# - apply_mask: how the mask's weights are computed (epsilon, divide_no_nan,
#   where); `keras_accum.normaliser` calls Keras's own, so always agrees.
# - CompileLoss.call: the single-loss path reads `_flat_losses` by position
#   (< 3.13) or resolves paths; both call each term's loss function, which
#   `recording_loss_calls` wraps.
# - _maybe_symbolic_build: epoch iterators yield `(step, iterator)` before
#   3.13 and `(begin, end, iterator)` since; `symbolic_build` takes the last.
# - BatchNormalization.call: renormalisation (`renorm`) is new after 3.13,
#   and the statistics update moved after normalising; same update formula.
#   _moments: masking arithmetic only.
# - Keras 3.16 renamed the TF trainer class `TensorFlowTrainer` -> `Trainer`
#   (found by either name). Its `_make_function` takes the batch of a
#   `steps_per_execution=1` step with `get_next_as_optional()` outside the
#   traced step; the contract `auto` relies on is unchanged. `Loss.__call__`
#   reads the mask and name scope from `backend.common`/`backend` (the same
#   functions); `CompileLoss.call` calls each term through `_call_loss` (a
#   clearer shape error), still as `loss_fn(y_true, y_pred, sample_weight)`,
#   which `recording_loss_calls` wraps.
MIRRORED_SOURCES = {
    "TensorFlowTrainer.train_step": {
        "38eff65a3e8e64475bc46a4e655af968166c2909f8127cbf5d9466bdca1a0950": "3.8.0 3.10.0",
        "debf0efab9d5794b017ade2937acbcc51886fc1dc5cf021e7d7e80f974ee707c": "3.13.2 3.15.1 3.16.0.dev2026102704",
    },
    "TensorFlowTrainer._make_function": {
        "55eb952812cac1fbb9934e24de911532f45314c57ed6e6a53c9ebe88f392d2ff": "3.8.0 3.10.0",
        "bb33b7a0da3d27406c70fac54b8e9617156ef225f452b93f6addf8cc34aca0d0": "3.13.2 3.15.1",
        "b96ff481cdc14b4cad4a0fe00d41b6c6c908f4e173bfcca153815fd06533d298": "3.16.0.dev2026102704",
    },
    "Loss.__call__": {
        "f42c42282ee8902b2fb95310f8b9347c728040cf1fbcfdd3b94538c07d2e9fa8": "3.8.0 3.10.0 3.13.2 3.15.1",
        "6d0748313371823bff754a32d265639f628871eea08774c032820bb95e76ad9c": "3.16.0.dev2026102704",
    },
    "reduce_values": {
        "60b0462147725ad25b69cbfa93f1662fd83a803d6b43add1804d48c7f0cdddb9": "3.8.0 3.10.0 3.13.2 3.15.1 3.16.0.dev2026102704",
    },
    "apply_mask": {
        "c08def1fbac14b549d9b8faea29bb814bb2281d7a91bb3bf3ca2db082a71a3c8": "3.8.0 3.10.0",
        "13f8242de3cd4a06973e4cb15e4252ddbbb20c30d19480825673a3a6a1ffbffb": "3.13.2",
        "61d8938cd8663dee3c27b678b4af5f17408c2b03ff039b7b2e9125cd07610d00": "3.15.1 3.16.0.dev2026102704",
    },
    "CompileLoss.call": {
        "def46c01e48ca7207205b4fa60dcdcbef39815790dab91591d7b1d0b91e8f1f2": "3.8.0 3.10.0",
        "41012fc179db545db2f77a0ace0af06c00cebbbe67c0a3f34a53b3d20e639745": "3.13.2",
        "402aaf05f91c73c4a4bcaa65be5a447566fbbbb05f5079b29a35312bcbfd509f": "3.15.1",
        "e69a6e8919f8be2d5f7bd7c59f5d217c151934a68c31cc4e8af85cb2b226f641": "3.16.0.dev2026102704",
    },
    "TensorFlowTrainer._maybe_symbolic_build": {
        "181752273e37d689f7dd4915f31a454130a3761290dc4b6d351465b85d4c6b81": "3.8.0 3.10.0",
        "92a504f5eba9b29f81f1bf26180bdd5bf5186b06b7bda426534b90d2d02bc1c2": "3.13.2 3.15.1 3.16.0.dev2026102704",
    },
    "reduce_per_replica": {
        "2e7d54b1e6edc29a8c6a7e6b66cd4c8be3ba7842412c93753ac3afe169fa7fb8": "3.8.0 3.10.0 3.13.2 3.15.1 3.16.0.dev2026102704",
    },
    "BatchNormalization.call": {
        "9b6a3cfad619b3f6730adc4e1c8241fed02133c60d203305d668f902185c55bb": "3.8.0 3.10.0 3.13.2",
        "31502bd832c5eb64f0bb108a4db21f204b906fff8bebd34ffa3a4f68eab00eb5": "3.15.1 3.16.0.dev2026102704",
    },
    "BatchNormalization._moments": {
        "08ec7edbbc47aaea1afdd90c12915925c685e4466fc22ab369a6ffcf79496e83": "3.8.0",
        "e168ab1449ab50aef696bf76ef7d0474b104f6e7eea3fdc4a3e3b5b6b98a416d": "3.10.0 3.13.2",
        "2ba739b46f4fadea719cd8e41e56d591ef86adae38d58c11930efba046093378": "3.15.1 3.16.0.dev2026102704",
    },
}


def mirrored():
    """`{name: function}` of the Keras code named in MIRRORED_SOURCES."""
    compile_loss = reach("keras.src.trainers.compile_utils", "CompileLoss")
    loss = reach("keras.src.losses.loss", "Loss")
    reduce_values = reach("keras.src.losses.loss", "reduce_values")

    def method(owner, name):
        # A method this Keras lacks: a stand-in listed as moved (import
        # warns, a use raises), never an error at import.
        if is_missing(owner):
            return owner
        if not hasattr(owner, name):
            return missing(f"`{owner.__name__}.{name}`", f"{owner.__name__} has no `{name}`")
        return getattr(owner, name)

    return {
        "TensorFlowTrainer.train_step": method(TensorFlowTrainer, "train_step"),
        "TensorFlowTrainer._make_function": method(TensorFlowTrainer, "_make_function"),
        "Loss.__call__": method(loss, "__call__"),
        "reduce_values": reduce_values,
        "apply_mask": apply_mask,
        "CompileLoss.call": method(compile_loss, "call"),
        "TensorFlowTrainer._maybe_symbolic_build": method(
            TensorFlowTrainer, "_maybe_symbolic_build"
        ),
        "reduce_per_replica": reduce_per_replica,
        "BatchNormalization.call": method(BatchNormalization, "call"),
        "BatchNormalization._moments": method(BatchNormalization, "_moments"),
    }
