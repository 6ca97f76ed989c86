"""`.keras` files of models whose layers are used more than once: tied
embeddings and layers shared across a nested model, for every way in.

A wrapped model's file must load wherever the unwrapped model's does; where
Keras's functional config cannot hold the sharing, `save` refuses before
writing anything.
"""

import keras
import numpy as np
import pytest

import keras_accum
from helpers.assertions import assert_weights_close
from helpers.models import TIED_LENGTH as LENGTH
from helpers.models import TIED_VOCAB as VOCAB
from helpers.models import TIED_WIDTH as WIDTH
from helpers.models import TiedEmbedding, TiedLM, tied_graph


@keras.saving.register_keras_serializable(package="test_shared_layers")
class TiedAccumLM(keras_accum.AccumModel):
    """The same model as a subclass of AccumModel (the base-class swap)."""

    def __init__(self, accum_steps=1, **kwargs):
        super().__init__(accum_steps=accum_steps, **kwargs)
        self.table = TiedEmbedding(VOCAB, WIDTH, name="table")
        self.mix = keras.layers.Dense(WIDTH, activation="tanh", name="mix")

    def call(self, tokens):
        return self.table(self.mix(self.table(tokens)), reverse=True)


def _data(n=24, seed=0):
    rng = np.random.default_rng(seed)
    return rng.integers(0, VOCAB, (n, LENGTH)).astype("int32"), rng.integers(0, VOCAB, (n, LENGTH))


def _compile(model):
    model.compile(
        keras.optimizers.Adam(0.01),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def _train_into_a_window(model, x, y):
    # 3 micro-batches at accum_steps=2: one update, then an open window.
    for i in range(3):
        model.train_on_batch(x[8 * i : 8 * (i + 1)], y[8 * i : 8 * (i + 1)])


def _finish(model, x, y):
    model.train_on_batch(x[:8], y[:8])
    return model


WAYS = {
    "wrap": lambda: keras_accum.wrap(TiedLM(), accum_steps=2),
    "wrap_then_fit_accum_steps": lambda: keras_accum.wrap(TiedLM()),
    "subclass": lambda: TiedAccumLM(accum_steps=2),
}


@pytest.mark.parametrize("way", sorted(WAYS))
def test_tied_model_saved_mid_window_loads_and_resumes_exactly(way, tmp_path):
    x, y = _data()
    original = _compile(WAYS[way]())
    if way == "wrap_then_fit_accum_steps":
        original.fit(x[:16], y[:16], batch_size=8, accum_steps=2, verbose=0)
        original.accum_steps = 2  # fit's accum_steps is for one call
        original.train_on_batch(x[16:], y[16:])
    else:
        _train_into_a_window(original, x, y)
    original.save(tmp_path / "m.keras")
    loaded = keras.saving.load_model(tmp_path / "m.keras")

    assert type(loaded).__name__ == type(original).__name__
    assert_weights_close(original, loaded, rtol=0, atol=0)
    # Still tied: one table, read by the embedding and by the head.
    assert len(loaded.trainable_variables) == len(original.trainable_variables)
    _finish(original, x, y)
    _finish(loaded, x, y)
    assert_weights_close(original, loaded)
    assert int(loaded.optimizer.iterations) == int(original.optimizer.iterations) == 2


def test_plain_keras_writes_a_file_of_such_a_graph_that_does_not_load(tmp_path):
    # Why AccumModel refuses below: Keras's functional config makes the
    # shared table twice. If a Keras release fixes this, the refusal can go.
    plain = _compile(keras.Model(*tied_graph()))
    plain.save(tmp_path / "plain.keras")
    with pytest.raises(ValueError, match="expected 1 variables, but received 0"):
        keras.saving.load_model(tmp_path / "plain.keras")


@pytest.mark.parametrize(
    "make",
    [
        lambda: keras_accum.AccumModel(*tied_graph(), accum_steps=2),
        lambda: keras_accum.wrap(keras.Model(*tied_graph()), accum_steps=2),
    ],
    ids=["functional", "wrap_functional"],
)
def test_functional_graph_that_cannot_be_saved_is_refused_before_writing(make, tmp_path):
    x, y = _data()
    model = _compile(make())
    _train_into_a_window(model, x, y)
    path = tmp_path / "m.keras"
    with pytest.raises(
        ValueError,
        match=r"layer 'table' is used both by 'encoder' and by 'table'.*Nothing was written",
    ):
        model.save(path)
    assert not path.exists()
    # Weights files do not need the config, and resume as ever.
    model.save_weights(tmp_path / "m.weights.h5")
    restored = _compile(make())
    restored.build((None, LENGTH))
    restored.optimizer.build(restored.trainable_variables)
    restored.load_weights(tmp_path / "m.weights.h5")
    assert_weights_close(model, restored, rtol=0, atol=0)


def test_shared_layers_within_one_graph_still_save():
    # A layer called twice by the same (top-level) graph is recorded as one
    # layer with two nodes: nothing to refuse.
    keras.utils.set_random_seed(0)
    tokens = keras.Input((LENGTH,), dtype="int32")
    table = TiedEmbedding(VOCAB, WIDTH, name="table")
    logits = table(keras.layers.Dense(WIDTH)(table(tokens)), reverse=True)
    model = _compile(keras_accum.AccumModel(tokens, logits, accum_steps=2))
    assert model.get_config()["accum_steps"] == 2
