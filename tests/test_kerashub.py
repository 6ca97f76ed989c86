"""KerasHub models through every way in, against the plain KerasHub model on
the big batch; `.keras` files and exports of wrapped KerasHub models.

Runs where keras-hub is installed (`nox -s kerashub`, which sets
KERAS_ACCUM_REQUIRE_KERAS_HUB=1 so that a missing keras-hub fails instead of
skipping). Models come from small configs with random weights
(tests/helpers/kerashub.py).
"""

import os
import warnings

import keras
import numpy as np
import pytest

if os.environ.get("KERAS_ACCUM_REQUIRE_KERAS_HUB"):
    import keras_hub  # noqa: F401
else:
    pytest.importorskip("keras_hub")

from helpers import internals  # noqa: E402
from helpers import kerashub as hub  # noqa: E402
from helpers.assertions import assert_history_close, assert_trained, assert_weights_close  # noqa: E402
from helpers.oom import LimitedLoss  # noqa: E402
from helpers.processes import run_python, script  # noqa: E402
from helpers.project import PAGES, blocks  # noqa: E402

import keras_accum  # noqa: E402

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
        x, y, sample_weight=weights, batch_size=batch_size, epochs=2,
        shuffle=False, verbose=0, **kwargs,
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


@pytest.mark.parametrize("way", sorted(WAYS))
@pytest.mark.parametrize("name", sorted(MODELS))
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
        type(optimizer).__name__, float(optimizer.learning_rate),
        type(loss).__name__, getattr(loss, "from_logits", None), metrics,
    )


@pytest.mark.parametrize("call", sorted(CALLS))
@pytest.mark.parametrize("name", sorted(COMPILED))
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
            {k: v[begin:end] for k, v in x.items()}, y[begin:end],
            sample_weight=None if weights is None else weights[begin:end],
        )


@pytest.mark.parametrize("name", sorted(MODELS))
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
        script("kerashub_resume.py"), str(tmp_path / "lm.keras"),
        str(tmp_path / "data.npz"), "80", str(hub.N), str(tmp_path / "out.npz"),
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


@pytest.mark.parametrize("name", sorted(MODELS))
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
        str(tmp_path / "serve.py"), str(tmp_path / "served"),
        str(tmp_path / "x.npz"), str(tmp_path / "served.npy"),
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


@pytest.mark.slow
def test_docs_pages_with_kerashub_blocks_run_whole(tmp_path):
    # The pages with KerasHub examples (marked `docs-test: kerashub`), pasted
    # whole into a fresh Python as a reader with keras-hub would:
    # tests/test_docs.py runs them without those blocks where keras_hub is
    # missing.
    from helpers.processes import run_program

    pages = [p for p in PAGES if any(b.marker == "kerashub" for b in blocks(p.read_text()))]
    assert pages
    for i, page in enumerate(pages):
        workdir = tmp_path / str(i)
        workdir.mkdir()
        code = "\n".join(b.code for b in blocks(page.read_text()) if b.lang == "python")
        result = run_program(code, workdir)
        if result.returncode < 0:
            # Killed by a signal in native code: glibc found TensorFlow's
            # heap corrupted ("corrupted double-linked list"), on
            # docs/contrastive.md twice in about six slow-tier runs (TF
            # 2.21.0, oneDNN), never in 40 runs of the page alone. TF
            # 2.21's oneDNN batch matmul is known to write past its
            # buffers (tensorflow/tensorflow#117700, #123109). Run once
            # more; the first crash's tracebacks (faulthandler) are kept
            # as a warning. A second crash, or any Python error, fails.
            warnings.warn(f"{page.name}: died by signal {-result.returncode}, "
                          f"run again:\n{result.stderr[-3000:]}")
            workdir = tmp_path / f"{i}-again"
            workdir.mkdir()
            result = run_program(code, workdir)
        assert result.returncode == 0, f"{page}:\n{result.stderr[-3000:]}"
        if '"lm.keras"' in code:  # the ways-in page's model, saved
            assert (workdir / "lm.keras").exists()


# -- coupled_from: SigLIP's loss on KerasHub's SigLIP encoders ------------------


def _siglip():
    """KerasHub's SigLIPBackbone from a small config, as the functional model
    of its graph (its own class overrides `compute_loss`, which `wrap`
    refuses to ignore: the loss below makes the same labels)."""
    import keras_hub

    keras.utils.set_random_seed(0)
    vision = keras_hub.models.SigLIPVisionEncoder(
        patch_size=4, hidden_dim=16, num_layers=1, num_heads=2, intermediate_dim=32,
        image_shape=(8, 8, 3), name="vision_encoder",
    )
    text = keras_hub.models.SigLIPTextEncoder(
        vocabulary_size=50, embedding_dim=16, hidden_dim=16, num_layers=1, num_heads=2,
        intermediate_dim=32, max_sequence_length=6, name="text_encoder",
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
        model.compile(keras.optimizers.SGD(0.1, momentum=0.9),
                      loss={"text_logits": _pairwise_sigmoid()})
        return model, model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)

    plain, h_plain = fit(_siglip())
    model, history = fit(keras_accum.wrap(
        _siglip(), micro_batch_size=4, coupled_from=["vision_encoder", "text_encoder"]
    ))
    assert_weights_close(plain, model)
    assert_history_close(h_plain, history)
