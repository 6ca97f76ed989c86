"""`coupled_from`: a batch-coupled (contrastive) loss split into micro-batches
trains as the big batch: the loss on the whole batch's representations, the
encoders per micro-batch, twice (coupling.py)."""

import contextlib

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_accum
from helpers.assertions import assert_history_close, assert_weights_close
from helpers.coupled import (
    BATCH,
    DIM,
    FEATURES,
    FIT,
    MICRO,
    TOWERS,
    Clip,
    InBatchSoftmax,
    Similarity,
    data,
    two_tower,
)
from helpers.internals import keras_internals
from helpers.replicas import mirrored
from keras_accum import AccumModel
from keras_accum.split import row_sums


def train(model, loss=None, **fit):
    model.compile(keras.optimizers.Adam(0.01), loss or InBatchSoftmax())
    x, y = data()
    history = model.fit(x, y, **{**FIT, **fit})
    return model, history


@pytest.fixture(scope="module")
def reference():
    return train(two_tower())


def test_in_batch_softmax_is_the_big_batch(reference):
    plain, h_plain = reference
    model, history = train(two_tower(AccumModel, micro_batch_size=MICRO, coupled_from=TOWERS))
    assert_weights_close(plain, model)
    assert_history_close(h_plain, history)
    assert int(model.optimizer.iterations) == int(plain.optimizer.iterations)


# XLA's in the slow tier: the inner loop's XLA case is
# test_under_xla_the_second_forward_pass_is_not_merged_with_the_first.
@pytest.mark.parametrize(
    "jit_compile", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["graph", "xla"]
)
def test_a_short_last_batch_and_xla_are_the_big_batch(jit_compile):
    # 92 at batch 40: the last batch of 12 is 8 + 4 and three stand-ins
    # (the step is traced for batches of 40).
    def fit(model):
        model.compile(keras.optimizers.Adam(0.01), InBatchSoftmax(), jit_compile=jit_compile)
        x, y = data()
        return model, model.fit(x, y, **{**FIT, "batch_size": 40})

    plain, h_plain = fit(two_tower())
    model, history = fit(two_tower(AccumModel, micro_batch_size=MICRO, coupled_from=TOWERS))
    assert_weights_close(plain, model)
    assert_history_close(h_plain, history)


def test_under_xla_the_second_forward_pass_is_not_merged_with_the_first():
    # XLA merges equal computations: the second pass's forward of a
    # micro-batch, left equal to the first's, would be computed once and
    # its activations kept from the first pass on (the big batch's memory).
    # Counted in the step XLA compiles: each micro-batch's first layer runs
    # once per pass.
    model = two_tower(AccumModel, micro_batch_size=MICRO, coupled_from=TOWERS)
    model.compile(keras.optimizers.Adam(0.01), InBatchSoftmax(), jit_compile=True)
    x, y = data()
    batch = (tuple(tf.constant(t[:BATCH]) for t in x), tf.constant(y[:BATCH]))
    model.train_on_batch(*batch)
    step = tf.function(model.train_step, jit_compile=True)
    hlo = step.experimental_get_compiler_ir(batch)(stage="optimized_hlo")
    first_layer = [
        line
        for line in hlo.splitlines()
        if " dot(" in line
        and "query_hidden" in line
        and f"f32[{MICRO},16]" in line.split("=", 1)[1].split("dot(")[0]
    ]
    assert len(first_layer) == 2 * (BATCH // MICRO), first_layer


@pytest.mark.parametrize(
    "replicas",
    [1, pytest.param(2, marks=pytest.mark.slow)],  # 11 s: the slow tier
    ids=["one_replica", "two_replicas"],
)
def test_under_mirrored_strategy_the_coupled_part_sees_the_global_batch(reference, replicas):
    # Batches of 32 across two replicas: 16 each, in micro-batches of 8; the
    # similarity and the loss over all 32, as on one device.
    plain, h_plain = reference
    with mirrored(replicas).scope():
        model = two_tower(AccumModel, micro_batch_size=MICRO, coupled_from=TOWERS)
        model.compile(keras.optimizers.Adam(0.01), InBatchSoftmax())
    x, y = data()
    history = model.fit(x, y, **FIT)
    assert_weights_close(plain, model)
    if keras_internals.metrics_summed_over_replicas():
        assert_history_close(h_plain, history)


def test_auto_across_replicas_is_refused_before_training():
    with mirrored(2).scope():
        model = two_tower(AccumModel, micro_batch_size="auto", coupled_from=TOWERS)
        model.compile("adam", InBatchSoftmax())
    x, y = data()
    with pytest.raises(ValueError, match="integer `micro_batch_size`"):
        model.fit(x, y, **FIT)
    assert int(model.optimizer.iterations.numpy()) == 0


def test_a_subclassed_model_is_refused_naming_what_to_do():
    class Towers(AccumModel):
        def __init__(self):
            super().__init__(micro_batch_size=MICRO, coupled_from=TOWERS)
            self.query_repr = keras.layers.Dense(DIM, name="query_repr")
            self.item_repr = keras.layers.Dense(DIM, name="item_repr")

        def call(self, inputs):
            return tf.matmul(
                self.query_repr(inputs[0]), self.item_repr(inputs[1]), transpose_b=True
            )

    model = Towers()
    model.compile("adam", InBatchSoftmax())
    x, y = data()
    with pytest.raises(ValueError, match="needs a functional model"):
        model.fit(x, y, **FIT)


class OnlyInTraining(keras.layers.Layer):
    """The identity in training, zeros in inference: called without
    `training`, as a method's Dropout often is, it reads the call's."""

    def call(self, inputs, training=None):
        return inputs if training else tf.zeros_like(inputs)


class Towers(keras.Model):
    """The two-tower model, subclassed: `represent` and `couple` are what
    its `call` is made of. Built from the layers of `two_tower(limit=MICRO)`
    (out of memory above a micro-batch: `represent` sees micro-batches
    only), so it starts from the reference's weights."""

    def __init__(self, source, **kwargs):
        super().__init__(**kwargs)
        self.query_tower = keras.Model(source.inputs[0], source.get_layer("query_repr").output)
        self.item_tower = keras.Model(source.inputs[1], source.get_layer("item_repr").output)
        self.similarity = source.get_layer("similarity")
        self.only_in_training = OnlyInTraining()

    def represent(self, inputs, training=None):
        return {
            "query": self.query_tower(self.only_in_training(inputs[0]), training=training),
            "item": self.item_tower(inputs[1], training=training),
        }

    def couple(self, representations, training=None):
        return self.similarity([representations["query"], representations["item"]])

    def call(self, inputs, training=None):
        return self.couple(self.represent(inputs, training), training)


class AccumTowers(Towers, AccumModel):
    pass


def weights_by_path(model):
    # A subclass tracks its weights in another order than the functional
    # model whose layers it holds; their paths are the layers' names.
    return {v.path: v.numpy() for v in model.weights}


@pytest.mark.parametrize("way_in", ["subclass", "wrap"])
def test_a_subclassed_model_split_at_its_methods_is_the_big_batch(reference, way_in):
    plain, h_plain = reference
    settings = dict(micro_batch_size=MICRO, coupled_from="methods")
    if way_in == "subclass":
        model = AccumTowers(two_tower(limit=MICRO), **settings)
    else:
        model = keras_accum.wrap(Towers(two_tower(limit=MICRO)), **settings)
    model, history = train(model)
    expected, trained = weights_by_path(plain), weights_by_path(model)
    assert sorted(expected) == sorted(trained)
    for path, value in expected.items():
        np.testing.assert_allclose(trained[path], value, rtol=1e-5, atol=1e-6, err_msg=path)
    assert_history_close(h_plain, history)


def test_methods_that_are_missing_are_refused_naming_them():
    class Encoders(AccumTowers):
        couple = None  # `represent` only: `call` compares the representations itself

        def call(self, inputs, training=None):
            representations = self.represent(inputs, training)
            return self.similarity([representations["query"], representations["item"]])

    model = Encoders(two_tower(limit=MICRO), micro_batch_size=MICRO, coupled_from="methods")
    model.compile("adam", InBatchSoftmax())
    x, y = data()
    with pytest.raises(ValueError, match="has no `couple`"):
        model.fit(x, y, **FIT)
    assert int(model.optimizer.iterations.numpy()) == 0


def test_ordinary_micro_batching_of_the_same_model_is_not_the_big_batch(reference):
    # What the tests above tell apart: each micro-batch's own negatives.
    plain, _ = reference
    model, _ = train(two_tower(AccumModel, micro_batch_size=MICRO))
    with pytest.raises(AssertionError):
        assert_weights_close(plain, model)


def test_wrap_with_coupled_from_is_the_big_batch(reference):
    plain, h_plain = reference
    model, history = train(
        keras_accum.wrap(two_tower(), micro_batch_size=MICRO, coupled_from=TOWERS)
    )
    assert_weights_close(plain, model)
    assert_history_close(h_plain, history)


def test_clip_loss_with_a_trainable_logit_scale_is_the_big_batch():
    plain, h_plain = train(two_tower(scale=True), Clip())
    model, history = train(
        two_tower(AccumModel, scale=True, micro_batch_size=MICRO, coupled_from=TOWERS),
        Clip(),
    )
    assert_weights_close(plain, model)
    assert_history_close(h_plain, history)
    scale = model.get_layer("similarity").logit_scale
    assert float(scale.numpy()) != 1.0  # learnt, from the whole batch


@pytest.fixture
def row_sums_made(monkeypatch):
    """What `row_sums.add` returns during the test, in order (a spy)."""
    made = []
    add = row_sums.add
    monkeypatch.setattr(row_sums, "add", lambda *a: made.append(add(*a)) or made[-1])
    return made


def _token_towers(cls=keras.Model, table_dtype=None, **kwargs):
    """The query tower reads 5 tokens of a 12-row table: a batch of 32 has
    each row many times over (a sparse gradient Adam squares by occurrence)."""
    keras.utils.set_random_seed(1)
    tokens = keras.Input((5,), dtype="int32", name="tokens")
    items = keras.Input((FEATURES,), name="items")
    h = keras.layers.Embedding(12, 8, dtype=table_dtype, name="token_table")(tokens)
    if table_dtype is not None:
        h = keras.ops.cast(h, "float32")
    q = keras.layers.Dense(DIM, name="query_repr")(keras.layers.GlobalAveragePooling1D()(h))
    i = keras.layers.Dense(DIM, use_bias=False, name="item_repr")(
        keras.layers.Dense(16, activation="relu", name="item_hidden")(items)
    )
    return cls([tokens, items], Similarity(name="similarity")([q, i]), **kwargs)


def _token_data(samples):
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 12, size=(samples, 5)).astype("int32")
    counts = np.stack([np.bincount(t, minlength=12) for t in tokens]).astype("float32")
    items = counts @ rng.normal(size=(12, FEATURES)).astype("float32")
    return [tokens, items], np.zeros((len(tokens),), "float32")


# XLA and two replicas in the slow tier (the inner loop's are the sparse
# split step's, test_small_tables.py). 92 samples: batches of a size the
# step learns at run time, and decides there whether to sum by row; 96:
# of a size known when traced, the only one XLA sums by row (row_sums.py).
@pytest.mark.parametrize(
    "setting",
    [
        "graph",
        "known_size",
        pytest.param("xla", marks=pytest.mark.slow),
        pytest.param(2, marks=pytest.mark.slow),
    ],
    ids=["graph", "known_size", "xla", "two_replicas"],
)
def test_a_token_tower_is_the_big_batch(row_sums_made, setting):
    # The table's sparse gradient, summed micro-batch by micro-batch, goes
    # on by row once it outgrows two tables (40 tokens a micro-batch, 12
    # rows), as the plain split step's: its memory stays the table's, and
    # Adam, which squares each occurrence, makes the big batch's step. Two
    # replicas: each sums its rows of the batch (16 samples), the
    # occurrences made of the sums are reduced across them.
    known = setting in ("known_size", "xla")
    x, y = _token_data(96 if known else 92)
    plain = _token_towers()
    plain.compile(keras.optimizers.Adam(0.01), InBatchSoftmax())
    h_plain = plain.fit(x, y, **FIT)
    with mirrored(setting).scope() if setting == 2 else contextlib.nullcontext():
        model = _token_towers(AccumModel, micro_batch_size=MICRO, coupled_from=TOWERS)
        model.compile(keras.optimizers.Adam(0.01), InBatchSoftmax(), jit_compile=setting == "xla")
    history = model.fit(x, y, **FIT)
    assert_weights_close(plain, model)
    if setting != 2 or keras_internals.metrics_summed_over_replicas():
        assert_history_close(h_plain, history)
    by_row = [s for s in row_sums_made if isinstance(s, row_sums.RowSums)]
    assert by_row  # the rule applied (at run time, for a size learnt there)
    if known:
        # Decided when traced: sums of the table's shape.
        assert any(s.sums.shape[0] == s.rows for s in by_row)


def test_a_scalar_weight_in_a_tower_is_the_big_batch():
    # Its gradient is summed over the micro-batches as any dense one.
    plain, h_plain = train(two_tower(gate=True))
    model, history = train(
        two_tower(AccumModel, gate=True, micro_batch_size=MICRO, coupled_from=TOWERS)
    )
    assert_weights_close(plain, model)
    assert_history_close(h_plain, history)
    assert float(model.get_layer("query_gate").alpha.numpy()) != 1.0  # learnt


def test_a_float16_token_table_is_summed_by_row_in_float32(row_sums_made):
    # Each micro-batch's part is cast to float32 before it is summed, as a
    # window's buffers are: its squares summed in float16 would overflow
    # from 256 and lose bits with every occurrence.
    model = _token_towers(
        AccumModel, table_dtype="float16", micro_batch_size=MICRO, coupled_from=TOWERS
    )
    model.compile(keras.optimizers.Adam(0.01), InBatchSoftmax())
    x, y = _token_data(96)
    model.fit(x, y, **FIT)
    by_row = [s for s in row_sums_made if isinstance(s, row_sums.RowSums)]
    assert by_row and all(s.stats.dtype == tf.float32 for s in by_row)
    table = model.get_layer("token_table").embeddings
    assert table.dtype == "float16" and np.isfinite(table.numpy()).all()


def _one_tape_gradient(model, x, y):
    """The gradient of the whole batch's loss with the representations of
    each micro-batch computed as the step computes them (same random draws,
    same per-micro-batch normalisation), all under one tape: what the two
    passes must give, with the big batch's memory."""
    per_sample = keras.Model(model.input, [model.get_layer(n).output for n in TOWERS])
    with tf.GradientTape() as tape:
        parts = [
            per_sample([t[s : s + MICRO] for t in x], training=True)
            for s in range(0, len(y), MICRO)
        ]
        whole = [tf.concat(r, 0) for r in zip(*parts)]
        logits = model.get_layer("similarity")(whole, training=True)
        loss = tf.reduce_mean(InBatchSoftmax()(y, logits))
    return tape.gradient(loss, model.trainable_variables)


def test_dropout_and_batchnorm_in_a_tower_replay_the_first_pass():
    # The second pass draws the first pass's dropout masks, and
    # BatchNormalization moves once per step, pooled over the batch.
    model = two_tower(
        AccumModel, dropout=0.5, batchnorm=True, micro_batch_size=MICRO, coupled_from=TOWERS
    )
    model.compile(keras.optimizers.SGD(1.0), InBatchSoftmax())
    x, y = data()
    x, y = [t[:BATCH] for t in x], y[:BATCH]
    model.build([(None, FEATURES)] * 2)
    # The reference moves the seeds and moving statistics: put back.
    state = [(v, v.numpy()) for v in model.non_trainable_variables]
    before = [v.numpy() for v in model.trainable_variables]
    expected = _one_tape_gradient(model, x, y)
    for v, value in state:
        v.assign(value)
    model.train_on_batch(x, y)
    update = [b - v.numpy() for b, v in zip(before, model.trainable_variables)]
    for g, u in zip(expected, update):
        np.testing.assert_allclose(u, g.numpy(), rtol=1e-5, atol=1e-6)
    plain = two_tower(batchnorm=True)
    plain.compile(keras.optimizers.SGD(1.0), InBatchSoftmax())
    plain.train_on_batch(x, y)
    # The first layer's moving statistics: the big batch's update, once.
    bn, plain_bn = (m.get_layer("query_bn") for m in (model, plain))
    for a, b in (
        (bn.moving_mean, plain_bn.moving_mean),
        (bn.moving_variance, plain_bn.moving_variance),
    ):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.slow  # traced whole, then again split: the slow tier
def test_auto_after_a_genuine_out_of_memory_is_the_big_batch(reference):
    plain, h_plain = reference
    model, history = train(
        two_tower(AccumModel, limit=MICRO, micro_batch_size="auto", coupled_from=TOWERS)
    )
    assert model.chosen_micro_batch_size <= MICRO
    assert_weights_close(plain, model)
    assert_history_close(h_plain, history)


def test_a_keras_file_keeps_coupled_from_and_trains_on(tmp_path, reference):
    model = two_tower(AccumModel, micro_batch_size=MICRO, coupled_from=TOWERS)
    train(model, epochs=1)
    path = str(tmp_path / "coupled.keras")
    model.save(path)
    loaded = keras.models.load_model(
        path, custom_objects={"Similarity": Similarity, "InBatchSoftmax": InBatchSoftmax}
    )
    assert loaded.get_config()["coupled_from"] == TOWERS
    x, y = data()
    model.fit(x, y, **{**FIT, "epochs": 1})
    loaded.fit(x, y, **{**FIT, "epochs": 1})
    assert_weights_close(model, loaded)
    plain, _ = reference  # two epochs of the plain model
    assert_weights_close(plain, loaded)


@pytest.mark.unit
@pytest.mark.parametrize("coupled_from", [TOWERS, "methods"])
def test_config_round_trips_coupled_from(coupled_from):
    model = two_tower(AccumModel, micro_batch_size=MICRO, coupled_from=coupled_from)
    config = model.get_config()
    assert config["coupled_from"] == coupled_from
    again = AccumModel.from_config(config, custom_objects={"Similarity": Similarity})
    assert again.get_config()["coupled_from"] == coupled_from


@pytest.mark.unit
@pytest.mark.parametrize(
    "value, error, match",
    [
        ("", TypeError, "coupled_from=''"),
        ([1], TypeError, r"coupled_from=\[1\]"),
        (["a", "a"], ValueError, "twice"),
    ],
)
def test_bad_coupled_from_is_refused_naming_it(value, error, match):
    with pytest.raises(error, match=match):
        two_tower(AccumModel, coupled_from=value)


@pytest.mark.unit
@pytest.mark.parametrize(
    "settings, match",
    [
        (dict(accum_steps=4), "accum_steps=4"),
        (dict(noise_scale=True), "noise_scale"),
    ],
)
def test_coupled_from_with_a_setting_it_cannot_honour_is_refused(settings, match):
    with pytest.raises(ValueError, match=match):
        two_tower(AccumModel, coupled_from=TOWERS, **settings)


def test_accum_steps_set_later_is_refused_before_anything_changes():
    model = two_tower(AccumModel, micro_batch_size=MICRO, coupled_from=TOWERS)
    with pytest.raises(ValueError, match="accum_steps=2"):
        model.accum_steps = 2
    assert model.accum_steps == 1
    x, y = data()
    model.compile("adam", InBatchSoftmax())
    with pytest.raises(ValueError, match="accum_steps=2"):
        model.fit(x, y, accum_steps=2, **FIT)
    assert int(model.optimizer.iterations) == 0


@pytest.mark.parametrize(
    "names, match",
    [
        (["query_repr", "no_such_layer"], "'no_such_layer'"),
        (["query_repr"], "do not split the model"),
    ],
)
def test_layers_that_do_not_split_the_model_are_refused_before_training(names, match):
    model = two_tower(AccumModel, micro_batch_size=MICRO, coupled_from=names)
    model.compile("adam", InBatchSoftmax())
    before = [v.numpy() for v in model.weights]
    x, y = data()
    with pytest.raises(ValueError, match=match):
        model.fit(x, y, **FIT)
    for a, b in zip(before, model.weights):
        np.testing.assert_array_equal(a, b.numpy())


def test_an_encoder_that_mixes_samples_is_refused_naming_the_layer():
    model = two_tower(AccumModel, centre=True, micro_batch_size=MICRO, coupled_from=TOWERS)
    model.compile("adam", InBatchSoftmax())
    x, y = data()
    with pytest.raises(ValueError, match="'batch_centre'.*mixes the samples"):
        model.fit(x, y, **FIT)
    assert int(model.optimizer.iterations) == 0


def test_with_skip_nonfinite_and_after_a_recompile_it_is_the_big_batch(reference):
    # skip_nonfinite keeps a window (of one step) in buffers: the coupled
    # gradient goes through the buffers' path; a recompile makes a new step.
    plain, h_plain = reference
    model = two_tower(AccumModel, micro_batch_size=MICRO, coupled_from=TOWERS, skip_nonfinite=True)
    model.compile("sgd", InBatchSoftmax())
    x, y = data()
    model.fit(x, y, **{**FIT, "epochs": 1})
    model.set_weights(two_tower().get_weights())
    model, history = train(model)  # compiled again: a fresh Adam
    assert_weights_close(plain, model)
    np.testing.assert_allclose(
        h_plain.history["loss"], history.history["loss"], rtol=1e-5, atol=1e-6
    )
    assert model.skipped_windows == 0


def test_mixed_float16_is_the_big_batch_in_float16():
    # Under loss scaling the batch's weight scales the gradients instead of
    # the loss (step._weight_folding): the other arithmetic path.
    from helpers.assertions import FLOAT16_ATOL, FLOAT16_RTOL

    keras.mixed_precision.set_dtype_policy("mixed_float16")
    try:
        plain, h_plain = train(two_tower())
        model, history = train(two_tower(AccumModel, micro_batch_size=MICRO, coupled_from=TOWERS))
    finally:
        keras.mixed_precision.set_dtype_policy("float32")
    for a, b in zip(plain.get_weights(), model.get_weights()):
        np.testing.assert_allclose(a, b, rtol=FLOAT16_RTOL, atol=FLOAT16_ATOL)
    np.testing.assert_allclose(
        h_plain.history["loss"], history.history["loss"], rtol=FLOAT16_RTOL, atol=FLOAT16_ATOL
    )
