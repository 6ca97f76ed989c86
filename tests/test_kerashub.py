"""KerasHub models through every way in, against the plain KerasHub model on
the big batch; `.keras` files and exports of wrapped KerasHub models.

Runs where keras-hub is installed (`nox -s kerashub`, which sets
KERAS_ACCUM_REQUIRE_KERAS_HUB=1 so that a missing keras-hub fails instead of
skipping). Models come from small configs with random weights
(tests/helpers/kerashub.py).
"""

import itertools
import os
import warnings

import keras
import numpy as np
import pytest

if os.environ.get("KERAS_ACCUM_REQUIRE_KERAS_HUB"):
    import keras_hub  # noqa: F401
else:
    pytest.importorskip("keras_hub")

import keras_accum  # noqa: E402
from helpers import internals  # noqa: E402
from helpers import kerashub as hub  # noqa: E402
from helpers.assertions import assert_history_close, assert_trained, assert_weights_close  # noqa: E402
from helpers.oom import LimitedLoss  # noqa: E402
from helpers.processes import run_python, script  # noqa: E402
from helpers.project import ROOT  # noqa: E402
from helpers.tiers import wide  # noqa: E402

# KerasHub models, and processes of their own: the slow tier (CI runs it
# in the `kerashub` nox session, with keras-hub installed).
pytestmark = pytest.mark.slow

MODELS = {"gpt2": (hub.gpt2, hub.gpt2_data), "bert": (hub.bert, hub.bert_data)}


def _optimizer():
    # Adam for BERT in step mode too: its 2-row segment embedding's window
    # outnumbers its rows and is kept as moments (tests/test_small_tables.py).
    # epsilon 1e-4, not Adam's 1e-7: in this tiny GPT-2 a few embedding
    # entries get gradients of about 1e-9, float32 summation noise, which
    # Adam at 1e-7 turns into steps of about the learning rate in a random
    # direction (4.6e-6 apart after 6 updates for the plain big batch and
    # micro_batch_size alike; 3e-8 at 1e-4). The accumulation is not what
    # differs; the tolerance stays rtol 1e-5, atol 1e-6.
    return keras.optimizers.Adam(0.01, epsilon=1e-4)


def _fit(model, data, batch_size, **kwargs):
    x, y, weights = data
    return model.fit(
        x,
        y,
        sample_weight=weights,
        batch_size=batch_size,
        epochs=2,
        shuffle=False,
        verbose=0,
        **kwargs,
    )


def _compile(model, optimizer, loss=None):
    # metrics=[]: KerasHub tasks add their own "auto" metrics otherwise.
    model.compile(optimizer, loss or hub.loss(), metrics=[], weighted_metrics=["accuracy"])


# way: (wrap arguments, fit arguments, batch size of the accumulating run,
# loss of the accumulating run or None). The plain model trains on 32.
WAYS = {
    "wrap": ({"accum_steps": 4}, {}, 8, None),
    "fit_accum_steps": ({}, {"accum_steps": 4}, 8, None),
    "micro_batch_size": ({"micro_batch_size": 8}, {}, 32, None),
    # A loss that runs out of memory (a genuine ResourceExhaustedError) on
    # more than 16 samples at once: "auto" must find 16 and still train as 32.
    "auto": ({"micro_batch_size": "auto"}, {}, 32, lambda: LimitedLoss(16)),
}


# Every way into GPT-2 in CI; into BERT (a 2-row segment table: moments) the
# way that wraps it and micro-batches (its table's occurrences joined across
# them); the rest before a release.
@pytest.mark.parametrize(
    "name, way",
    wide(
        list(itertools.product(sorted(MODELS), sorted(WAYS))),
        [("gpt2", w) for w in WAYS] + [("bert", "wrap"), ("bert", "micro_batch_size")],
        pytest.mark.release,
    ),
)
def test_kerashub_model_trains_as_its_big_batch(name, way):
    make, make_data = MODELS[name]
    data = make_data()
    plain = make()
    initial = plain.get_weights()
    _compile(plain, _optimizer())
    h_plain = _fit(plain, data, 32)

    wrap_args, fit_args, batch_size, limited = WAYS[way]
    model = keras_accum.wrap(make(), **wrap_args)
    _compile(model, _optimizer(), limited() if limited else None)
    h_model = _fit(model, data, batch_size, **fit_args)

    assert_trained(plain, initial)
    assert_weights_close(plain, model)
    assert int(model.optimizer.iterations) == int(plain.optimizer.iterations)
    if way != "auto":  # auto's loss adds an exact 0, but is another loss object
        assert_history_close(h_plain, h_model)
    else:
        assert model.chosen_micro_batch_size == 16


# A wrapper compiles as the task it wraps: the task's defaults for what is
# not given. GPT-2: a causal LM's Adam at 2e-5, its loss, weighted
# accuracy; BERT: a classifier's Adam at 5e-5 and accuracy, its loss's
# `from_logits` read from the task's `activation`; Gemma: a causal LM that
# samples greedily. Each way a user calls `compile`.
COMPILED = {
    "gpt2": (hub.gpt2, hub.gpt2_data),
    "bert": (hub.bert, hub.bert_data),
    "bert_softmax": (lambda: hub.bert(activation="softmax"), hub.bert_data),
    "gemma": (hub.gemma, hub.gpt2_data),
}
CALLS = {
    "defaults": lambda: {},
    "loss": lambda: {"loss": keras.losses.SparseCategoricalCrossentropy(from_logits=True)},
    "optimizer": lambda: {"optimizer": keras.optimizers.SGD(0.5)},
    "everything": lambda: {
        "optimizer": keras.optimizers.SGD(0.5, momentum=0.9),
        "loss": keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        "metrics": [keras.metrics.SparseCategoricalAccuracy(name="acc")],
        "weighted_metrics": [],
    },
}


def _described(model):
    optimizer = model.optimizer
    loss = model.loss
    plain, weighted = internals.compiled_metrics(model)
    metrics = [(type(m).__name__, m.name) for m in [*plain, *weighted]]
    return (
        type(optimizer).__name__,
        float(optimizer.learning_rate),
        type(loss).__name__,
        getattr(loss, "from_logits", None),
        metrics,
    )


# Each task compiled with its defaults and with everything given, in CI;
# GPT-2's every call too; the rest before a release.
@pytest.mark.parametrize(
    "name, call",
    wide(
        list(itertools.product(sorted(COMPILED), sorted(CALLS))),
        [(n, c) for n in COMPILED for c in CALLS if c in ("defaults", "everything") or n == "gpt2"],
        pytest.mark.release,
    ),
)
def test_a_wrapped_task_compiles_and_trains_as_the_task(name, call):
    make, make_data = COMPILED[name]
    data = make_data()
    plain = make()
    plain.compile(**CALLS[call]())
    h_plain = _fit(plain, data, 32)
    task = make()
    model = keras_accum.wrap(task, accum_steps=4)
    model.compile(**CALLS[call]())
    assert _described(model) == _described(plain)
    if name == "gemma":
        assert type(task.sampler).__name__ == "GreedySampler"
    h_model = _fit(model, data, 8)
    assert_weights_close(plain, model)
    assert_history_close(h_plain, h_model)
    moved = max(np.abs(a - b).max() for a, b in zip(plain.get_weights(), make().get_weights()))
    assert moved > 0  # even at the defaults' small rates, something trained


def test_a_split_task_compiled_with_its_defaults_then_recompiled_trains_as_the_task():
    # A task's own compile adds a weighted accuracy over the padding mask:
    # a split step updates it micro-batch by micro-batch (split/metrics.py),
    # each micro-batch's masked tokens counted, and its token embedding's
    # rows summed by row past two tables (64 rows; 96 a micro-batch). Then
    # the user recompiles with metrics of their own: the next fit's step
    # updates those, not the task's.
    data = hub.gpt2_data()
    plain = hub.gpt2()
    plain.compile()
    defaults = _described(plain)
    histories_plain = [_fit(plain, data, 32)]
    plain.compile(**CALLS["everything"]())
    histories_plain.append(_fit(plain, data, 32))

    model = keras_accum.wrap(hub.gpt2(), micro_batch_size=8)
    model.compile()
    assert _described(model) == defaults
    histories = [_fit(model, data, 32)]
    model.compile(**CALLS["everything"]())
    assert _described(model) == _described(plain)
    histories.append(_fit(model, data, 32))

    assert_weights_close(plain, model)
    for expected, history in zip(histories_plain, histories):
        assert_history_close(expected, history)
    assert [sorted(h.history) for h in histories] == [sorted(h.history) for h in histories_plain]


def test_a_task_with_a_preprocessor_is_refused_and_trains_as_the_task_on_mapped_data():
    # A task's fit preprocesses; the wrapper's would not, and the task's
    # layers would take raw data: refused, and the remedy the error names
    # (the preprocessor mapped over the data) trains as the task does.
    import tensorflow as tf

    texts, labels = hub.bert_text()
    plain = hub.bert()
    plain.preprocessor = hub.bert_preprocessor()
    _compile(plain, _optimizer())
    h_plain = plain.fit(texts, labels, batch_size=32, epochs=2, shuffle=False, verbose=0)

    task = hub.bert()
    task.preprocessor = preprocessor = hub.bert_preprocessor()
    with pytest.raises(ValueError, match=r"model.preprocessor=.*dataset.map\(task.preprocessor\)"):
        keras_accum.wrap(task, accum_steps=4)
    data = tf.data.Dataset.from_tensor_slices((texts, labels)).batch(8).map(preprocessor)
    task.preprocessor = None
    model = keras_accum.wrap(task, accum_steps=4)
    _compile(model, _optimizer())
    h_model = model.fit(data, epochs=2, verbose=0)
    assert_weights_close(plain, model)
    assert_history_close(h_plain, h_model)


def test_a_wrapped_task_compiled_with_its_defaults_loads_compiled(tmp_path):
    model = keras_accum.wrap(hub.gpt2(), accum_steps=4)
    model.compile()
    x, y, weights = hub.gpt2_data(n=16)
    model.fit(x, y, sample_weight=weights, batch_size=4, verbose=0)
    model.save(tmp_path / "lm.keras")
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        loaded = keras.saving.load_model(tmp_path / "lm.keras")
    assert _described(loaded) == _described(model)
    assert int(loaded.optimizer.iterations) == int(model.optimizer.iterations)
    loaded.fit(x, y, sample_weight=weights, batch_size=4, verbose=0)


def _train_on_batches(model, data, start, stop):
    x, y, weights = data
    for begin in range(start, stop, 8):
        end = min(begin + 8, stop)
        model.train_on_batch(
            {k: v[begin:end] for k, v in x.items()},
            y[begin:end],
            sample_weight=None if weights is None else weights[begin:end],
        )


# GPT-2's in CI, BERT's before a release.
@pytest.mark.parametrize("name", wide(sorted(MODELS), ["gpt2"], pytest.mark.release))
def test_keras_file_saved_mid_window_loads_in_a_fresh_process_and_resumes(name, tmp_path):
    make, make_data = MODELS[name]
    data = make_data()
    x, y, weights = data

    uninterrupted = keras_accum.wrap(make(), accum_steps=4)
    _compile(uninterrupted, keras.optimizers.SGD(0.1, momentum=0.9))
    _train_on_batches(uninterrupted, data, 0, hub.N)

    model = keras_accum.wrap(make(), accum_steps=4)
    _compile(model, keras.optimizers.SGD(0.1, momentum=0.9))
    _train_on_batches(model, data, 0, 80)  # 10 micro-batches: 2 open
    model.save(tmp_path / "lm.keras")
    arrays = dict(x, y=y) if weights is None else dict(x, y=y, sample_weight=weights)
    np.savez(tmp_path / "data.npz", **arrays)

    result = run_python(
        script("kerashub_resume.py"),
        str(tmp_path / "lm.keras"),
        str(tmp_path / "data.npz"),
        "80",
        str(hub.N),
        str(tmp_path / "out.npz"),
    )
    assert result.returncode == 0, result.stderr[-4000:]
    resumed = np.load(tmp_path / "out.npz")
    expected = uninterrupted.get_weights()
    assert len(resumed.files) == len(expected)
    for i, value in enumerate(expected):
        np.testing.assert_allclose(resumed[f"arr_{i}"], value, rtol=1e-5, atol=1e-6)


SERVE = """
import sys
import numpy as np
import tensorflow as tf
data = dict(np.load(sys.argv[2]))
archive = tf.saved_model.load(sys.argv[1])  # held: its variables live in it
served = archive.serve({k: tf.constant(v) for k, v in data.items()})
assert "keras_accum" not in sys.modules and "keras_hub" not in sys.modules
np.save(sys.argv[3], served.numpy())
"""


# GPT-2's in CI, BERT's before a release.
@pytest.mark.parametrize("name", wide(sorted(MODELS), ["gpt2"], pytest.mark.release))
def test_export_of_a_wrapped_kerashub_model_serves_without_keras_accum(name, tmp_path):
    make, make_data = MODELS[name]
    x, y, weights = make_data(n=16)
    # The served signature is the model's Inputs' (KerasHub's masks are int32).
    x = {key: value.astype("int32") for key, value in x.items()}
    model = keras_accum.wrap(make(), accum_steps=2)
    _compile(model, keras.optimizers.Adam(0.01))
    model.fit(x, y, sample_weight=weights, batch_size=4, verbose=0)
    model.export(str(tmp_path / "served"), verbose=False)
    np.savez(tmp_path / "x.npz", **x)
    (tmp_path / "serve.py").write_text(SERVE)
    result = run_python(
        str(tmp_path / "serve.py"),
        str(tmp_path / "served"),
        str(tmp_path / "x.npz"),
        str(tmp_path / "served.npy"),
    )
    assert result.returncode == 0, result.stderr[-4000:]
    np.testing.assert_allclose(
        np.load(tmp_path / "served.npy"), model.predict(x, verbose=0), rtol=1e-5, atol=1e-6
    )


def test_plain_kerashub_file_and_wrapped_file_hold_the_same_weights(tmp_path):
    # The wrapper trains the task's own layers in place: the task saved
    # after training is the plain model a user hands on.
    lm = hub.gpt2()
    model = keras_accum.wrap(lm, accum_steps=2)
    _compile(model, keras.optimizers.Adam(0.01))
    x, y, weights = hub.gpt2_data(n=16)
    model.fit(x, y, sample_weight=weights, batch_size=4, verbose=0)
    lm.save(tmp_path / "plain.keras")
    model.save(tmp_path / "wrapped.keras")
    plain = keras.saving.load_model(tmp_path / "plain.keras")
    wrapped = keras.saving.load_model(tmp_path / "wrapped.keras")
    assert isinstance(wrapped, keras_accum.AccumModel)
    assert wrapped.accum_steps == 2
    assert_weights_close(plain, wrapped, rtol=0, atol=0)
    np.testing.assert_allclose(
        plain.predict(x, verbose=0), wrapped.predict(x, verbose=0), rtol=1e-6, atol=1e-6
    )


# -- coupled_from: SigLIP's loss on KerasHub's SigLIP encoders ------------------


def _siglip():
    """KerasHub's SigLIPBackbone from a small config, as the functional model
    of its graph (its own class overrides `compute_loss`, which `wrap`
    refuses to ignore: the loss below makes the same labels)."""
    import keras_hub

    keras.utils.set_random_seed(0)
    vision = keras_hub.models.SigLIPVisionEncoder(
        patch_size=4,
        hidden_dim=16,
        num_layers=1,
        num_heads=2,
        intermediate_dim=32,
        image_shape=(8, 8, 3),
        name="vision_encoder",
    )
    text = keras_hub.models.SigLIPTextEncoder(
        vocabulary_size=50,
        embedding_dim=16,
        hidden_dim=16,
        num_layers=1,
        num_heads=2,
        intermediate_dim=32,
        max_sequence_length=6,
        name="text_encoder",
    )
    backbone = keras_hub.models.SigLIPBackbone(vision, text)
    return keras.Model(backbone.input, backbone.output)


def _pairwise_sigmoid():
    # SigLIPBackbone.compute_loss's labels (+1 on the diagonal, -1 elsewhere)
    # made in the loss: every pair of the batch.
    from keras_hub.src.models.siglip.siglip_loss import SigLIPLoss

    class PairwiseSigmoid(SigLIPLoss):
        def call(self, y_true, y_pred):
            n = keras.ops.shape(y_pred)[0]
            return super().call(2 * keras.ops.eye(n, dtype=y_pred.dtype) - 1, y_pred)

    return PairwiseSigmoid()


def test_siglip_loss_on_a_wrapped_siglip_backbone_coupled_at_its_encoders_is_the_big_batch():
    rng = np.random.default_rng(0)
    n = 44  # batches of 16, 16 and 12, micro-batches of 4
    x = {
        "images": rng.uniform(size=(n, 8, 8, 3)).astype("float32"),
        "token_ids": rng.integers(1, 50, size=(n, 6)).astype("int32"),
    }
    y = {"text_logits": np.zeros((n,), "float32")}  # the loss makes the labels

    def fit(model):
        # SGD with momentum, not Adam: SigLIP's position embeddings are an
        # `ops.take` of positions broadcast over the batch, a sparse gradient
        # whose rows the big batch sums over its samples and micro-batches
        # each sum over theirs; Adam reads each row's square, SGD the sum
        # only (so does ordinary micro-batching, not coupling, differ there).
        model.compile(
            keras.optimizers.SGD(0.1, momentum=0.9), loss={"text_logits": _pairwise_sigmoid()}
        )
        return model, model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)

    plain, h_plain = fit(_siglip())
    model, history = fit(
        keras_accum.wrap(
            _siglip(), micro_batch_size=4, coupled_from=["vision_encoder", "text_encoder"]
        )
    )
    assert_weights_close(plain, model)
    assert_history_close(h_plain, history)


# -- fine-tuning with LoRA: which checkpoint resumes (docs/fine-tuning.md) ------
#
# Keras writes a LoRA layer's kernel with its adapters merged in to weights
# and .keras files, and sets the adapters to zero when it loads one into a
# layer with LoRA on; tf.train.Checkpoint holds the adapters apart.


def _lora_wrapped(dropout=0.0, rank=2, optimizer=_optimizer):
    model = keras_accum.wrap(hub.gpt2_lora(dropout=dropout, rank=rank), accum_steps=4)
    _compile(model, optimizer())
    return model


def _lora_big_batch(data, rank=2, optimizer=_optimizer):
    """The plain task, LoRA on (`rank` None: off), on the big batch (32): 2
    epochs, 6 updates."""
    plain = hub.gpt2_lora(rank=rank)
    initial = plain.get_weights()
    _compile(plain, optimizer())
    _fit(plain, data, 32)
    assert_trained(plain, initial)
    return plain


def _momentum():
    # The window's sum reaches the weights in proportion (Adam's steps
    # hardly tell a window from half of it).
    return keras.optimizers.SGD(0.1, momentum=0.9)


def test_lora_task_resumes_mid_window_from_a_tf_train_checkpoint(tmp_path):
    data = hub.gpt2_data()
    plain = _lora_big_batch(data, optimizer=_momentum)
    model = _lora_wrapped(optimizer=_momentum)
    _train_on_batches(model, data, 0, hub.N)  # epoch 1: windows of 4, 4 and 4 micro-batches
    _train_on_batches(model, data, 0, 80)  # epoch 2: 4, 4 and 2 of the next 4
    assert int(model.optimizer.iterations) == 5
    path = hub.lora_checkpoint(model).save(str(tmp_path / "ckpt"))

    resumed = _lora_wrapped(optimizer=_momentum)  # as a new process builds it: nothing trained
    hub.lora_checkpoint(resumed).restore(path).assert_existing_objects_matched()
    _train_on_batches(resumed, data, 80, hub.N)  # the window's last 2 micro-batches
    assert int(resumed.optimizer.iterations) == 6
    assert all(np.any(v.numpy()) for v in hub.adapters(resumed))
    assert_weights_close(plain, resumed)


def test_lora_task_resumes_from_epoch_checkpoints_of_a_repeating_stream(tmp_path):
    # The guide's way to checkpoint a LoRA run within fit: epochs of
    # steps_per_epoch batches of a stream repeating in a fixed order, a
    # tf.train.Checkpoint at each epoch's end, and the resumed fit given the
    # stream with the batches already trained skipped.
    import tensorflow as tf

    x, y, weights = hub.gpt2_data()

    def stream(batch_size):  # made anew each time, as a new process makes it
        dataset = tf.data.Dataset.from_tensor_slices((x, y, weights))
        return dataset.shuffle(hub.N, seed=0).repeat().batch(batch_size)

    class Checkpoints(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            self.manager = tf.train.CheckpointManager(
                hub.lora_checkpoint(self.model), str(tmp_path), max_to_keep=5
            )

        def on_epoch_end(self, epoch, logs=None):
            self.manager.save(checkpoint_number=epoch + 1)

    plain = hub.gpt2_lora()
    _compile(plain, _optimizer())
    plain.fit(stream(32), steps_per_epoch=2, epochs=4, shuffle=False, verbose=0)  # 8 updates
    model = _lora_wrapped()
    model.fit(
        stream(8), steps_per_epoch=8, epochs=4, shuffle=False, verbose=0, callbacks=[Checkpoints()]
    )
    assert_weights_close(plain, model)

    resumed = _lora_wrapped()
    hub.lora_checkpoint(resumed).restore(str(tmp_path / "ckpt-2")).assert_existing_objects_matched()
    resumed.fit(
        stream(8).skip(2 * 8),
        steps_per_epoch=8,
        epochs=4,
        initial_epoch=2,
        shuffle=False,
        verbose=0,
    )
    assert int(resumed.optimizer.iterations) == 8
    assert_weights_close(plain, resumed)


def test_dropout_resumes_the_same_masks_only_with_the_seeds_in_the_checkpoint(tmp_path):
    # Dropout's random state (its seed generators' variables) reaches a
    # tf.train.Checkpoint only when listed (weights files never hold it:
    # test_backup_and_restore_of_a_kerashub_task[dropout]).
    data = hub.gpt2_data()

    def first_pass_and(stop, model):
        _train_on_batches(model, data, 0, hub.N)
        _train_on_batches(model, data, 0, stop)
        return model

    uninterrupted = first_pass_and(hub.N, _lora_wrapped(dropout=0.1))
    model = first_pass_and(80, _lora_wrapped(dropout=0.1))
    differences = {}
    for seeds in (True, False):
        path = hub.lora_checkpoint(model, seeds=seeds).save(str(tmp_path / f"seeds-{seeds}"))
        resumed = _lora_wrapped(dropout=0.1)
        hub.lora_checkpoint(resumed, seeds=seeds).restore(path).assert_existing_objects_matched()
        _train_on_batches(resumed, data, 80, hub.N)
        assert int(resumed.optimizer.iterations) == 6
        if seeds:
            assert_weights_close(uninterrupted, resumed)
        differences[seeds] = max(
            float(np.abs(a - b).max())
            for a, b in zip(uninterrupted.get_weights(), resumed.get_weights())
        )
    assert differences[False] > 1e-4, differences  # other masks after the resume


def test_weights_files_of_a_lora_task_hold_the_adapters_merged(tmp_path):
    data = hub.gpt2_data()
    x, y, weights = data
    model = _lora_wrapped()
    _train_on_batches(model, data, 0, 80)  # 2 updates, a window of 2 micro-batches open
    assert all(np.any(v.numpy()) for v in hub.adapters(model))
    model.save_weights(tmp_path / "lora.weights.h5")

    reloaded = _lora_wrapped()
    reloaded.load_weights(tmp_path / "lora.weights.h5")
    # The adapters are zero; the kernels they adapt are the merged ones, so
    # the predictions are the saved model's. Optimizer state and window are back.
    assert len(hub.adapters(reloaded)) == 4
    assert not any(np.any(v.numpy()) for v in hub.adapters(reloaded))
    np.testing.assert_allclose(
        reloaded.predict(x, verbose=0), model.predict(x, verbose=0), rtol=1e-5, atol=1e-6
    )
    assert int(reloaded.optimizer.iterations) == 2
    reloaded.flush()  # the open window, applied
    assert int(reloaded.optimizer.iterations) == 3

    # Not a resume: from zero adapters, training goes elsewhere.
    model.flush()
    _train_on_batches(model, data, 80, hub.N)
    _train_on_batches(reloaded, data, 80, hub.N)
    moved_apart = max(
        float(np.abs(a - b).max()) for a, b in zip(model.get_weights(), reloaded.get_weights())
    )
    assert moved_apart > 1e-2, moved_apart


@pytest.mark.parametrize(
    "lora, dropout", [(False, 0.0), (True, 0.0), (False, 0.1)], ids=["full", "lora", "dropout"]
)
def test_backup_and_restore_of_a_kerashub_task(lora, dropout, tmp_path):
    # keras_accum.BackupAndRestore resumes a task interrupted mid-window
    # exactly: a full fine-tune as the big batch; with LoRA the adapters (a
    # weights file merges them into the kernels) and with dropout the seed
    # generators' states (a weights file leaves them out) come back too.
    from helpers.training import InterruptAt

    x, y, weights = data = hub.gpt2_data()
    rank = 2 if lora else None

    class Adapters(keras.callbacks.Callback):  # after the backup's restore
        def on_train_begin(self, logs=None):
            self.restored = [v.numpy() for v in hub.adapters(self.model)]

    def fitted(*callbacks):
        model = keras_accum.wrap(hub.gpt2_lora(dropout=dropout, rank=rank), accum_steps=4)
        _compile(model, _optimizer())
        model.fit(
            x,
            y,
            sample_weight=weights,
            batch_size=8,
            epochs=2,
            shuffle=False,
            verbose=0,
            callbacks=list(callbacks),
        )
        return model

    def backup():
        return keras_accum.BackupAndRestore(
            str(tmp_path / "backup"), save_freq=3, double_checkpoint=True
        )

    with pytest.raises(KeyboardInterrupt):
        fitted(backup(), InterruptAt(epoch=1, batch=7))  # the newest backup 6 micro-batches in
    assert any("batch" in p.name for p in (tmp_path / "backup").iterdir())
    adapters = Adapters()
    resumed = fitted(backup(), adapters)
    if lora:
        assert len(adapters.restored) == 4 and all(np.any(a) for a in adapters.restored)
    if lora or dropout:
        assert_weights_close(fitted(), resumed)  # the same run, uninterrupted
    else:
        assert_weights_close(_lora_big_batch(data, rank=None), resumed)


def test_keras_file_of_a_lora_task_loads_without_lora(tmp_path):
    data = hub.gpt2_data()
    x, y, weights = data
    task = hub.gpt2_lora()
    model = keras_accum.wrap(task, accum_steps=4)
    _compile(model, _optimizer())
    _train_on_batches(model, data, 0, 64)  # 2 updates, no window open
    without_lora = hub.gpt2()

    model.save(tmp_path / "wrapped.keras")
    with pytest.warns(UserWarning, match="Skipping variable loading for optimizer"):
        loaded = keras.saving.load_model(tmp_path / "wrapped.keras")
    task.save(tmp_path / "task.keras")  # the task itself: the same
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        loaded_task = keras.saving.load_model(tmp_path / "task.keras")
    for reloaded in (loaded, loaded_task):
        # The task without LoRA: its weights, all trainable, the adapters
        # merged into the kernels.
        assert len(reloaded.weights) == len(reloaded.trainable_weights) == len(without_lora.weights)
        assert not hub.adapters(reloaded)
        np.testing.assert_allclose(
            reloaded.predict(x, verbose=0), model.predict(x, verbose=0), rtol=1e-5, atol=1e-6
        )
    assert int(loaded.optimizer.iterations) == 0  # the adapters' optimizer state was skipped

    # Saved mid-window: the window's buffers are the adapters', which the
    # loaded model has not; training refuses until the window is dropped.
    _train_on_batches(model, data, 64, 80)
    model.save(tmp_path / "open.keras")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        reopened = keras.saving.load_model(tmp_path / "open.keras")
    with pytest.raises(ValueError, match="do not fit its trainable variables"):
        _train_on_batches(reopened, data, 80, hub.N)
    reopened.reset_window()
    _train_on_batches(reopened, data, 0, 32)  # a window of 4: one update
    assert int(reopened.optimizer.iterations) == 1


def test_fine_tune_example_trains_resumes_and_generates(tmp_path):
    import re

    import tensorflow as tf

    result = run_python(
        str(ROOT / "examples" / "fine_tune_lm.py"),
        "--quick",
        "--output-dir",
        str(tmp_path),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    before, after = map(
        float, re.search(r"validation loss: (\S+) before, (\S+) after training", out).groups()
    )
    assert before > 5.0 and after < before - 1.5, out  # 5.55 (uniform over 258 tokens) -> 2.93
    resumed = re.search(r"^resumed from ckpt-2 in a new model: .*: (\S+)$", out, flags=re.M)
    assert resumed and float(resumed[1]) < 1e-6, out
    if not tf.config.list_physical_devices("GPU"):
        assert out.startswith("precision: float32 (no GPU"), out
    assert re.search(
        r"^saved fine_tuned.keras: (\d+) weights, all \1 trainable "
        r"\(the adapters merged in, the same predictions\)$",
        out,
        flags=re.M,
    ), out
    assert (
        len(re.findall(r"^generate\('(Beautiful is|Return the)'\): '\1", out, flags=re.M)) == 2
    ), out
    assert re.search(r"^finished in \d+ s \(process time \d+ s\)$", out, flags=re.M), out
    assert (tmp_path / "fine_tuned.keras").is_file() and (tmp_path / "checkpoints").is_dir()
    # Nothing on stderr: no TensorFlow start-up lines, no warnings.
    assert result.stderr.strip() == "", result.stderr[-3000:]
