"""Embeddings (sparse `tf.IndexedSlices` gradients) at big-batch parity.

Keras's optimizers apply an `IndexedSlices` gradient occurrence by
occurrence (Adam, RMSprop and Adagrad square each occurrence), so a window
must reach the optimizer as the big batch's occurrences, not as their sum.
Every reference here is a plain `keras.Model` on the big batch with Keras's
own sparse update; tokens come from a small range so they repeat within
every batch, which is where a summed window would differ.
"""

import functools
from itertools import product

import keras
import numpy as np
import pytest
import tensorflow as tf

from helpers import internals, training
from helpers import mirrored as mirrored_runs
from helpers.assertions import ATOL, assert_trained, assert_weights_close
from helpers.data import TEXT_LENGTH as LENGTH
from helpers.data import TEXT_TOKENS as TOKENS
from helpers.data import TEXT_VOCAB as VOCAB
from helpers.data import token_data
from helpers.internals import AccumState, GradientAccumulator, NonFiniteWindows, close, sparse
from helpers.models import DenseGradientModel, loss, ways_in
from helpers.models import text_net as net
from helpers.tiers import wide
from keras_accum import AccumModel, AccumOptimizer

# A window of 4 micro-batches of 8: its 32 x LENGTH tokens stay under the
# table's VOCAB rows, so its gradient is kept as slices.
MICRO, N = 8, 4

OPTIMIZERS = {
    "adam": lambda: keras.optimizers.Adam(0.01),
    "adamw": lambda: keras.optimizers.AdamW(0.01, weight_decay=0.1),
    "rmsprop": lambda: keras.optimizers.RMSprop(0.01, momentum=0.5),
    "adagrad": lambda: keras.optimizers.Adagrad(0.1),
    "sgd_momentum": lambda: keras.optimizers.SGD(0.5, momentum=0.9),
}
# Those whose sparse update differs from the update on the summed gradient.
OCCURRENCE_WISE = ("adam", "adamw", "rmsprop", "adagrad")


class _Net:
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.embedding = keras.layers.Embedding(VOCAB, 8, name="embedding")
        self.pool = keras.layers.GlobalAveragePooling1D()
        self.logits = keras.layers.Dense(3)

    def call(self, x):
        return self.logits(self.pool(self.embedding(x)))


@keras.saving.register_keras_serializable(package="keras_accum_sparse_tests")
class PlainTextNet(_Net, keras.Model):
    pass


@keras.saving.register_keras_serializable(package="keras_accum_sparse_tests")
class AccumTextNet(_Net, AccumModel):
    pass


# helpers.models' ways in, for the text model.
WAYS_IN = ways_in(net, PlainTextNet, AccumTextNet)


def table(model):
    return model.get_layer("embedding").get_weights()[0]


fit_pair = functools.partial(training.fit_pair, big_batch=MICRO * N, accum_batch=MICRO)


def dense_reference(x, y, optimizer, vocab=VOCAB, epochs=2):
    model = net(DenseGradientModel, vocab=vocab)
    model.compile(optimizer(), loss())
    model.fit(x, y, batch_size=MICRO * N, epochs=epochs, shuffle=False, verbose=0)
    return model


# -- the big batch's update, occurrence by occurrence --------------------------


# Uneven windows (the harder) for the inner loop's optimizers; even ones
# and the other optimizers in the slow tier.
@pytest.mark.parametrize(
    "name, samples",
    wide(
        [(name, samples) for name in sorted(OPTIMIZERS) for samples in (64, 76)],
        [(name, 76) for name in ("adam", "rmsprop", "sgd_momentum")],
    ),
    ids=lambda v: {64: "even", 76: "uneven"}.get(v, v) if isinstance(v, int) else v,
)
def test_embedding_matches_keras_sparse_big_batch(name, samples):
    x, y = token_data(samples)
    initial = table(net())
    plain, accum, *_ = fit_pair(*WAYS_IN["functional"](accum_steps=N), x, y, OPTIMIZERS[name])
    assert_trained(plain, net().get_weights())
    assert internals.sparse_indices(accum) == {0}  # the table's gradient is slices
    assert_weights_close(plain, accum)
    if name in OCCURRENCE_WISE and samples == 76:
        # The test can tell: the summed window is measurably elsewhere.
        dense = dense_reference(x, y, OPTIMIZERS[name])
        moved = np.abs(table(plain) - initial).max()
        assert np.abs(table(plain) - table(dense)).max() > 0.01 * moved


@pytest.mark.parametrize("way", wide(sorted(WAYS_IN), ["subclass", "wrap_subclassed"]))
def test_every_way_in(way):
    x, y = token_data()
    plain, accum, *_ = fit_pair(*WAYS_IN[way](accum_steps=N), x, y, OPTIMIZERS["adam"])
    assert_weights_close(plain, accum)


# Slices reach any optimizer alike: Adam's case (the same asserts) is slow.
@pytest.mark.parametrize("name", wide(["adam", "rmsprop"], ["rmsprop"]))
def test_tied_embedding_read_twice(name):
    x, y = token_data()
    plain, accum, *_ = fit_pair(
        lambda: net(AccumModel, tied=True, accum_steps=N),
        lambda: net(tied=True),
        x,
        y,
        OPTIMIZERS[name],
    )
    assert internals.sparse_indices(accum) == {0}
    assert_weights_close(plain, accum)


def test_mask_zero_with_a_masked_per_token_loss():
    # Padded sequences of unequal lengths; per-token tags, mask from the
    # embedding: each micro-batch's loss is a mean over its unmasked tokens.
    rng = np.random.default_rng(1)
    lengths = rng.integers(1, LENGTH + 1, size=76)
    x = np.zeros((76, LENGTH), "int32")
    for i, n in enumerate(lengths):
        x[i, :n] = rng.integers(1, TOKENS, size=n)
    y = (x % 3).astype("int64")

    def tagger(cls=keras.Model, **kwargs):
        keras.utils.set_random_seed(0)
        inputs = keras.Input((LENGTH,), dtype="int32")
        h = keras.layers.Embedding(VOCAB, 8, mask_zero=True, name="embedding")(inputs)
        return cls(inputs, keras.layers.Dense(3)(h), **kwargs)

    plain, accum, *_ = fit_pair(
        lambda: tagger(AccumModel, accum_steps=N), tagger, x, y, OPTIMIZERS["adam"]
    )
    assert_weights_close(plain, accum)


def test_under_xla_the_window_is_padded_to_static_shapes():
    acc = GradientAccumulator()
    weights = tf.Variable(tf.zeros((20, 3)))
    acc.build([weights], accum_steps=2)

    # A longer window first: its slices stay in the buffer, stale.
    acc.add([tf.IndexedSlices(tf.ones((9, 3)), tf.range(9))], weight=1.0)
    acc.reset()
    acc.add([tf.IndexedSlices(tf.ones((4, 3)), tf.constant([3, 3, 5, 0]))], weight=1.0)
    window = acc.window_gradients
    compiled = tf.function(lambda: window()[0], jit_compile=True)()
    # Padded, static shapes: the buffer, then as many again for a window of
    # moments (both branches of the conditional have one shape; no step
    # traced here recorded a window's size, see test_small_tables.py).
    assert compiled.values.shape == (40, 3)
    eager = window()[0]
    assert eager.values.shape == (4, 3)  # only the window's slices
    np.testing.assert_array_equal(
        tf.convert_to_tensor(compiled).numpy(), tf.convert_to_tensor(eager).numpy()
    )


@pytest.fixture
def mixed_float16():
    keras.mixed_precision.set_global_policy("mixed_float16")
    yield
    keras.mixed_precision.set_global_policy("float32")


def test_mixed_float16_within_the_float16_envelope(mixed_float16):
    x, y = token_data()
    plain, accum, *_ = fit_pair(*WAYS_IN["functional"](accum_steps=N), x, y, OPTIMIZERS["adam"])
    assert isinstance(accum.optimizer, keras.optimizers.LossScaleOptimizer)
    assert float(accum.optimizer.dynamic_scale) == float(plain.optimizer.dynamic_scale)
    gap = np.abs(table(plain) - table(accum)).max()
    # float16 rounds at ~5e-4 relative; the big batch and the micro-batches
    # round differently. The envelope is how far float16 itself moves the
    # big batch: the same big batch trained in float32.
    keras.mixed_precision.set_global_policy("float32")
    exact, _ = training.fit_alone(net, x, y, OPTIMIZERS["adam"], MICRO * N)
    envelope = np.abs(table(plain) - table(exact)).max()
    # Within twice the envelope: both are float16 rounding of the same size
    # (on Keras 3.16 the gap is 1.03 envelopes, on 3.15 below one), while
    # the wrong answer, the summed window, is more than 10 envelopes away.
    assert 0 < gap <= 2 * envelope
    # Not the summed window: that is an order of magnitude further.
    dense = dense_reference(x, y, OPTIMIZERS["adam"])
    assert np.abs(table(plain) - table(dense)).max() > 10 * envelope


# -- custom loops -------------------------------------------------------------


def test_accum_optimizer_custom_loop():
    x, y = token_data(44)  # 32 + 12: the second window is short (8 + 4)
    sizes = [8, 8, 8, 8, 8, 4]

    def grads(model, xb, yb):
        with tf.GradientTape() as tape:
            value = loss()(yb, model(xb, training=True))
        return tape.gradient(value, model.trainable_variables)

    plain = net()
    adam = keras.optimizers.Adam(0.01)
    for window in (slice(0, 32), slice(32, 44)):
        adam.apply(grads(plain, x[window], y[window]), plain.trainable_variables)
    model = net()
    opt = AccumOptimizer(keras.optimizers.Adam(0.01), accum_steps=4)

    @tf.function
    def step(xb, yb):
        opt.apply(grads(model, xb, yb), model.trainable_variables, weight=len(xb))

    start = 0
    for size in sizes:
        step(x[start : start + size], y[start : start + size])
        start += size
    opt.flush()
    assert int(opt.iterations) == 2
    assert_weights_close(plain, model)


# -- saving and resuming mid-window ----------------------------------------------


def test_resume_mid_window_from_a_weights_file(tmp_path):
    x, y = token_data(64)
    batches = [(x[i : i + MICRO], y[i : i + MICRO]) for i in range(0, 64, MICRO)]

    def model():
        m = net(AccumModel, accum_steps=N)
        m.compile(OPTIMIZERS["adam"](), loss())
        return m

    uninterrupted = model()
    for batch in batches:
        uninterrupted.train_on_batch(*batch)
    first = model()
    for batch in batches[:6]:  # one window applied, two micro-batches pending
        first.train_on_batch(*batch)
    assert internals.pending(first) == 2
    assert int(internals.accumulator(first).slice_counts[0].numpy()) == 2 * MICRO * LENGTH
    first.save_weights(tmp_path / "w.weights.h5")
    resumed = model()
    resumed.optimizer.build(resumed.trainable_variables)  # as fit() would
    resumed.load_weights(tmp_path / "w.weights.h5")
    assert internals.pending(resumed) == 2
    for batch in batches[6:]:
        resumed.train_on_batch(*batch)
    assert_weights_close(uninterrupted, resumed, rtol=0, atol=0)
    plain = net()
    plain.compile(OPTIMIZERS["adam"](), loss())
    plain.fit(x, y, batch_size=MICRO * N, shuffle=False, verbose=0)
    assert_weights_close(plain, uninterrupted)


def test_flush_of_a_window_restored_from_a_keras_file(tmp_path):
    x, y = token_data(64)
    model = net(AccumModel, accum_steps=N)
    model.compile(OPTIMIZERS["adam"](), loss())
    for i in range(0, 3 * MICRO, MICRO):
        model.train_on_batch(x[i : i + MICRO], y[i : i + MICRO])
    model.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras")
    for m in (model, loaded):
        m.flush()  # the restored slices are applied as slices
    assert_weights_close(model, loaded, rtol=0, atol=0)
    plain = net()
    plain.compile(OPTIMIZERS["adam"](), loss())
    plain.train_on_batch(x[: 3 * MICRO], y[: 3 * MICRO])
    assert_weights_close(plain, loaded)


def test_resume_mid_window_from_a_tf_train_checkpoint(tmp_path):
    x, y = token_data(64)
    batches = [(x[i : i + MICRO], y[i : i + MICRO]) for i in range(0, 64, MICRO)]

    def model():
        m = net(AccumModel, accum_steps=N)
        m.compile(OPTIMIZERS["adam"](), loss())
        m.optimizer.build(m.trainable_variables)
        return m

    uninterrupted, first = model(), model()
    for batch in batches:
        uninterrupted.train_on_batch(*batch)
    for batch in batches[:6]:
        first.train_on_batch(*batch)
    path = tf.train.Checkpoint(model=first, optimizer=first.optimizer).save(str(tmp_path / "ckpt"))
    resumed = model()
    resumed.train_on_batch(*batches[0])  # builds the window; then overwritten
    tf.train.Checkpoint(model=resumed, optimizer=resumed.optimizer).restore(path)
    assert internals.pending(resumed) == 2
    for batch in batches[6:]:
        resumed.train_on_batch(*batch)
    assert_weights_close(uninterrupted, resumed, rtol=0, atol=0)


def _legacy_window(optimizer, x, y):
    # Files written before slices existed hold every window as a dense sum
    # (and no entry saying which variables are sparse).
    source = net(AccumModel, accum_steps=N)
    source.compile(optimizer(), loss())
    for part in (slice(0, 8), slice(8, 16)):
        source.train_on_batch(x[part], y[part])
    store = {}
    acc = internals.accumulator(source)
    acc.save_own_variables(store)
    table_sum = sparse.dense_sum(acc.acc_grads[0], acc.slice_indices[0], acc.slice_counts[0])
    old = {k: v for k, v in store.items() if not k.startswith(("slice_", "sparse", "statistic"))}
    old["acc_grad_0"] = table_sum.numpy()
    loaded = net(AccumModel, accum_steps=N)
    loaded.compile(optimizer(), loss())
    loaded.optimizer.build(loaded.trainable_variables)
    internals.accumulator(loaded).load_own_variables(old)
    assert int(internals.accumulator(loaded).slice_counts[0].numpy()) == sparse.DENSE
    return loaded


def test_a_window_saved_before_slices_is_applied_as_its_dense_sum():
    x, y = token_data(32)
    loaded = _legacy_window(OPTIMIZERS["adam"], x, y)
    loaded.flush()
    dense = net(DenseGradientModel)
    dense.compile(OPTIMIZERS["adam"](), loss())
    dense.train_on_batch(x[:16], y[:16])
    assert_weights_close(dense, loaded)


def test_a_window_saved_before_slices_goes_on_losing_nothing():
    # Its dense part counts one occurrence per row, the rest is kept as
    # moments: SGD, which only sums occurrences, is then the big batch.
    x, y = token_data(32)
    loaded = _legacy_window(OPTIMIZERS["sgd_momentum"], x, y)
    for part in (slice(16, 24), slice(24, 32)):
        loaded.train_on_batch(x[part], y[part])
    assert int(loaded.optimizer.iterations) == 1
    plain = net()
    plain.compile(OPTIMIZERS["sgd_momentum"](), loss())
    plain.train_on_batch(x, y)
    assert_weights_close(plain, loaded)


@pytest.mark.unit
def test_snapshot_and_restore_bring_back_the_slices():
    # What all-or-nothing `load_weights` restores after a failed load.
    acc = GradientAccumulator()
    weights = tf.Variable(tf.ones((10, 2)))
    acc.build([weights], accum_steps=4)
    acc.add([tf.IndexedSlices(tf.ones((3, 2)), tf.constant([1, 1, 4]))], weight=1.0)
    snapshot = acc.snapshot()
    before = acc.window_gradients()[0]
    acc.reset()
    acc.add([tf.IndexedSlices(2 * tf.ones((5, 2)), tf.constant([0, 9, 9, 8, 7]))], weight=2.0)
    acc.restore(snapshot)
    after = acc.window_gradients()[0]
    assert internals.sparse_indices(acc) == {0}
    np.testing.assert_array_equal(after.indices.numpy(), before.indices.numpy())
    np.testing.assert_array_equal(after.values.numpy(), before.values.numpy())


# -- slices while they fit, per-row moments beyond (tests/test_small_tables.py) ---


# Adam on a window of moments is test_small_tables' in the inner loop.
@pytest.mark.parametrize("name", wide(sorted(OPTIMIZERS), ["sgd_momentum"]))
def test_window_bigger_than_the_table_is_still_the_big_batch(name):
    # 32 samples x 6 tokens per window over a 40-row table: moments.
    x, y = token_data()
    plain, accum, *_ = fit_pair(
        lambda: net(AccumModel, vocab=40, accum_steps=N),
        lambda: net(vocab=40),
        x,
        y,
        OPTIMIZERS[name],
    )
    assert_weights_close(plain, accum)
    accum.train_on_batch(x[:MICRO], y[:MICRO])  # 48 tokens: moments at once
    assert int(internals.accumulator(accum).slice_counts[0].numpy()) == sparse.ROW_SUMS
    if name in OCCURRENCE_WISE:  # the test can tell the summed window apart
        dense = dense_reference(x, y, OPTIMIZERS[name], vocab=40)
        moved = np.abs(table(plain) - table(net(vocab=40))).max()
        assert np.abs(table(plain) - table(dense)).max() > 0.01 * moved


def test_a_micro_batch_that_overflows_turns_the_window_into_moments_losing_nothing():
    # 8 + 8 samples (96 tokens) fit a 110-row table (room for 110 slices); a
    # third micro-batch of 16 samples (96 tokens more) does not: the
    # window's slices become per-row moments, all of them.
    x, y = token_data(32)
    accum = net(AccumModel, vocab=110, accum_steps=3)
    accum.compile(OPTIMIZERS["adam"](), loss())
    for part in (slice(0, 8), slice(8, 16)):
        accum.train_on_batch(x[part], y[part])
    assert int(internals.accumulator(accum).slice_counts[0].numpy()) == 96
    accum.train_on_batch(x[16:], y[16:])
    plain = net(vocab=110)
    plain.compile(OPTIMIZERS["adam"](), loss())
    plain.train_on_batch(x, y)
    assert_weights_close(plain, accum)


@pytest.mark.unit
def test_slices_are_appended_and_a_new_window_starts_by_count():
    acc = GradientAccumulator()
    weights = tf.Variable(tf.ones((10, 2)))
    acc.build([weights], accum_steps=2)
    first = tf.IndexedSlices(tf.constant([[1.0, 2.0], [3.0, 4.0]]), tf.constant([7, 7]))
    second = tf.IndexedSlices(tf.constant([[5.0, 6.0]]), tf.constant([2]))
    acc.add([first], weight=2.0, grad_scale=2.0)
    acc.add([second], weight=2.0, grad_scale=2.0)
    assert int(acc.slice_counts[0].numpy()) == 3
    indices = sparse.live_indices(acc.slice_indices[0], acc.slice_counts[0])
    np.testing.assert_array_equal(indices.numpy(), [7, 7, 2])
    window = acc.window_gradients()[0]  # divided by the window's weight, 4
    assert isinstance(window, tf.IndexedSlices)
    np.testing.assert_array_equal(window.indices.numpy(), [7, 7, 2])
    np.testing.assert_allclose(window.values.numpy(), [[0.5, 1], [1.5, 2], [2.5, 3]])
    stored = acc.acc_grads[0].numpy()
    close(AccumState(acc), keras.optimizers.SGD(1.0))
    np.testing.assert_allclose(weights.numpy()[7], [-1, -2])
    assert int(acc.slice_counts[0].numpy()) == 0
    # No pass over the buffer: the stale rows stay, unread.
    np.testing.assert_array_equal(acc.acc_grads[0].numpy(), stored)


@pytest.mark.unit
def test_nonfinite_slices_skip_the_window():
    acc = GradientAccumulator()
    state = AccumState(acc, skip=NonFiniteWindows())
    weights = tf.Variable(tf.ones((10, 2)))
    acc.build([weights], accum_steps=1)
    bad = tf.IndexedSlices(tf.constant([[np.nan, 1.0]]), tf.constant([4]))
    acc.add([bad], weight=1.0)
    close(state, keras.optimizers.SGD(1.0))
    assert int(state.skip.skipped.numpy()) == 1
    np.testing.assert_array_equal(weights.numpy(), np.ones((10, 2)))


# -- across replicas ------------------------------------------------------------


# Two replicas with Adam in the inner loop; RMSprop, and one replica (the
# strategy path without a cross-replica sum), in the slow tier.
@pytest.mark.parametrize(
    "replicas, optimizer", wide(list(product([1, 2], ["adam", "rmsprop"])), [(2, "adam")])
)
def test_mirrored_strategy_matches_the_big_batch(replicas, optimizer):
    out = mirrored_runs.sparse_checks(replicas, optimizers=(optimizer,))
    names = [optimizer]
    if keras.__version__.startswith("3.8.") and "rmsprop_error" in out:
        # Keras 3.8's RMSprop fails its own sparse update under
        # MirroredStrategy, the plain big batch's as AccumModel's (README:
        # caveats), so there is no reference to compare with there.
        for what in ("error", "accum_error"):
            assert "partially known" in out.pop(f"rmsprop_{what}")
        names.remove("rmsprop")
    # Largest absolute weight differences (weights are O(0.1)): float
    # rounding only; the summed window is ~1e-2 away (above).
    assert sorted(out) == [
        f"{name}_vs_{what}_big_batch" for name in names for what in ("mirrored", "one_device")
    ]
    for name, diff in out.items():
        assert diff <= ATOL, (name, diff)


@pytest.mark.slow  # Keras's own behaviour (the README's comparison row), not ours
def test_keras_builtin_accumulation_sums_embedding_gradients():
    # The README's comparison row: Keras's gradient_accumulation_steps adds
    # each micro-batch's slices into a dense buffer, so Adam sees one
    # occurrence per row; even windows, so nothing else differs.
    x, y = token_data(64)
    plain, ours, *_ = fit_pair(*WAYS_IN["functional"](accum_steps=N), x, y, OPTIMIZERS["adam"])
    builtin = net()
    builtin.compile(keras.optimizers.Adam(0.01, gradient_accumulation_steps=N), loss())
    builtin.fit(x, y, batch_size=MICRO, epochs=2, shuffle=False, verbose=0)
    moved = np.abs(table(plain) - table(net())).max()
    assert np.abs(table(plain) - table(builtin)).max() > 0.01 * moved
    assert_weights_close(plain, ours)


# float32, the default buffer, is every other test's (slow here).
@pytest.mark.parametrize(
    "dtype", wide(["float16", "bfloat16", "float32", "float64"], ["float16", "bfloat16", "float64"])
)
def test_row_indices_survive_in_any_buffer_dtype(dtype):
    # Row indices (some of them NaN or Inf bit patterns as 16-bit floats,
    # which copies of float buffers may canonicalise) come back intact and
    # address the window's values, whatever the buffer's dtype.
    acc = GradientAccumulator(dtype=dtype)
    weights = tf.Variable(tf.zeros((70000, 2)))
    acc.build([weights], accum_steps=2)
    ids = [31744, 31745, 65535, 69999, 0, 32767, 32768]
    acc.add([tf.IndexedSlices(tf.ones((3, 2)), tf.constant(ids[:3]))], weight=0.5)
    acc.add([tf.IndexedSlices(tf.ones((4, 2)), tf.constant(ids[3:]))], weight=0.5)
    live = sparse.live_indices(acc.slice_indices[0], acc.slice_counts[0])
    assert live.numpy().tolist() == ids
    eager = tf.convert_to_tensor(acc.window_gradients()[0])
    compiled = tf.function(lambda: acc.window_gradients()[0], jit_compile=True)()
    expected = np.zeros((70000, 2), "float32")
    expected[ids] = 1.0
    np.testing.assert_array_equal(eager.numpy(), expected)
    np.testing.assert_array_equal(tf.convert_to_tensor(compiled).numpy(), expected)


@pytest.mark.unit
def test_slices_fill_the_buffer_to_capacity_then_spill():
    # 10 rows x 2: room for 10 slices (window tokens <= table rows).
    acc = GradientAccumulator()
    weights = tf.Variable(tf.zeros((10, 2)))
    acc.build([weights], accum_steps=4)
    rng = np.random.default_rng(0)
    expected = np.zeros((10, 2), "float32")

    def add(ids):
        values = rng.normal(size=(len(ids), 2)).astype("float32")
        np.add.at(expected, ids, values)
        acc.add([tf.IndexedSlices(tf.constant(values), tf.constant(ids))], weight=1.0)

    add([9, 9, 0, 4])
    add([8, 9, 1, 1, 5, 3])
    assert int(acc.slice_counts[0].numpy()) == 10  # full, still slices
    window = acc.window_gradients()[0]
    assert window.values.shape == (10, 2)
    # The window's gradient: the sum over its weight (two micro-batches of 1).
    np.testing.assert_allclose(tf.convert_to_tensor(window).numpy(), expected / 2, rtol=1e-6)
    add([1])
    assert int(acc.slice_counts[0].numpy()) == sparse.ROW_SUMS  # one more: moments
    np.testing.assert_allclose(
        tf.convert_to_tensor(acc.window_gradients()[0]).numpy(), expected / 3, rtol=1e-6
    )


@pytest.mark.unit
def test_a_window_of_moments_stays_moments_to_its_end():
    # Once a window is kept as moments it stays so until applied, however
    # few slices come next; checked by values, not by an error: a GPU drops
    # an out-of-range scatter silently where the CPU refuses it.
    acc = GradientAccumulator()
    weights = tf.Variable(tf.zeros((10, 2)))
    acc.build([weights], accum_steps=4)
    rng = np.random.default_rng(1)
    expected = np.zeros((10, 2), "float32")

    def add(ids):
        values = rng.normal(size=(len(ids), 2)).astype("float32")
        np.add.at(expected, ids, values)
        acc.add([tf.IndexedSlices(tf.constant(values), tf.constant(ids))], weight=1.0)

    add([0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 0])  # 11 slices, 10 rows: moments at once
    assert int(acc.slice_counts[0].numpy()) == sparse.ROW_SUMS
    np.testing.assert_allclose(acc.acc_grads[0].numpy(), expected, rtol=1e-6)
    add([3])  # would fit as slices on their own
    add([3, 7])
    assert int(acc.slice_counts[0].numpy()) == sparse.ROW_SUMS
    np.testing.assert_array_equal(acc.slice_indices[0].numpy(), [2, 1, 1, 3, 1, 1, 1, 2, 1, 1])
    np.testing.assert_allclose(acc.acc_grads[0].numpy(), expected, rtol=1e-6)
    np.testing.assert_allclose(
        tf.convert_to_tensor(acc.window_gradients()[0]).numpy(), expected / 3, rtol=1e-6
    )
    close(AccumState(acc), keras.optimizers.SGD(1.0))
    np.testing.assert_allclose(weights.numpy(), -expected / 3, rtol=1e-6)
    # The next window starts as slices again.
    assert int(acc.slice_counts[0].numpy()) == 0
    acc.add([tf.IndexedSlices(tf.constant([[1.0, 2.0]]), tf.constant([5]))], weight=1.0)
    assert int(acc.slice_counts[0].numpy()) == 1
    window = acc.window_gradients()[0]
    np.testing.assert_array_equal(window.indices.numpy(), [5])
    np.testing.assert_array_equal(window.values.numpy(), [[1.0, 2.0]])


def test_slices_restored_by_a_tf_train_checkpoint_and_flushed_before_any_step(tmp_path):
    # tf.train.Checkpoint does not save which buffers hold slices: flushed
    # before a step is traced (nothing says the embedding's gradient is
    # sparse), the window is told apart by its slice counts and summed.
    x, y = token_data(64)

    def model():
        m = net(AccumModel, accum_steps=N)
        m.compile(keras.optimizers.SGD(0.5), loss())
        return m

    first = model()
    for i in range(0, 3 * MICRO, MICRO):
        first.train_on_batch(x[i : i + MICRO], y[i : i + MICRO])
    path = tf.train.Checkpoint(model=first).save(str(tmp_path / "ckpt"))
    resumed = model()
    resumed.make_train_function()  # the window's buffers; no step traced
    tf.train.Checkpoint(model=resumed).restore(path)
    acc = internals.accumulator(resumed)
    assert internals.pending(resumed) == 3 and not internals.sparse_indices(resumed)
    assert int(acc.slice_counts[0].numpy()) > 0
    resumed.flush()
    plain = net()
    plain.compile(keras.optimizers.SGD(0.5), loss())
    plain.train_on_batch(x[: 3 * MICRO], y[: 3 * MICRO])
    assert_weights_close(plain, resumed)


def test_under_xla_a_window_of_the_steps_own_slices_is_handed_over_in_its_size():
    # The step adds 4 occurrences a micro-batch, 2 micro-batches a window:
    # its update reads the window's 8 slots, not the table's 1000 rows.
    acc = GradientAccumulator()
    weights = tf.Variable(tf.zeros((1000, 3)))
    acc.build([weights], accum_steps=2)
    rng = np.random.default_rng(0)
    batches = [
        (rng.normal(size=(4, 3)).astype("float32"), rng.integers(0, 1000, 4).astype("int32"))
        for _ in range(3)
    ]

    @tf.function(jit_compile=True)
    def step(values, ids):
        acc.add(
            [tf.IndexedSlices(values, ids, tf.constant([1000, 3], tf.int64))],
            weight=1.0,
            window_occurrences=2,
        )
        sizes = acc.compact_sizes()
        return acc.within(sizes), acc.window_gradients(compact=sizes)[0]

    expected = np.zeros((1000, 3))
    for k, (values, ids) in enumerate(batches[:2]):
        np.add.at(expected, ids, values)
        within, window = step(values, ids)
        assert bool(within)
        assert window.values.shape == (8, 3)
        np.testing.assert_allclose(
            tf.convert_to_tensor(window).numpy(), expected / (k + 1), rtol=1e-6
        )
    # A window begun with more occurrences than this step's can hold (a
    # step of longer sequences) is not within them: handed over whole.
    acc.reset()
    acc.add([tf.IndexedSlices(tf.ones((12, 3)), tf.range(12))], weight=1.0)
    within, _ = step(*batches[2])
    assert not bool(within)


@pytest.mark.slow  # 12 s; the inner loop's XLA sparse window is test_execution_modes'
def test_under_xla_a_window_begun_at_longer_sequences_is_exact():
    # Each window's micro-batches padded to their own, shrinking lengths
    # (8, 6, 4, 2 tokens): the last one's step can hold fewer occurrences
    # than the window has, so its update hands over the whole buffer.
    # Adam reads each occurrence (test above for the size it is handed in).
    vocab, micro, n = 500, 4, 4
    rng = np.random.default_rng(3)
    lengths = np.tile(np.repeat([8, 6, 4, 2], micro), 3)
    tokens = [rng.integers(1, vocab, k).astype("int32") for k in lengths]
    labels = rng.integers(0, 3, len(tokens)).astype("int64")

    def dataset(batch):
        ds = tf.data.Dataset.from_generator(
            lambda: zip(tokens, labels),
            output_signature=(tf.TensorSpec((None,), tf.int32), tf.TensorSpec((), tf.int64)),
        )
        # Its length known: on one of unknown length Keras's extra call per
        # epoch counts an update in the plain model's `iterations` (its
        # weights unchanged), which Adam then reads; the window's model
        # counts none (test_workflows.py).
        ds = ds.apply(tf.data.experimental.assert_cardinality(len(tokens)))
        return ds.padded_batch(batch)

    def build(cls=keras.Model, **kwargs):
        keras.utils.set_random_seed(0)
        inputs = keras.Input((None,), dtype="int32")
        h = keras.layers.Embedding(vocab, 8, mask_zero=True, name="embedding")(inputs)
        h = keras.layers.GlobalAveragePooling1D()(h)
        return cls(inputs, keras.layers.Dense(3)(h), **kwargs)

    plain = build()
    initial = plain.get_weights()
    plain.compile(OPTIMIZERS["adam"](), loss())
    plain.fit(dataset(micro * n), epochs=2, verbose=0)
    accum = build(AccumModel, accum_steps=n)
    accum.compile(OPTIMIZERS["adam"](), loss(), jit_compile=True)
    accum.fit(dataset(micro), epochs=2, verbose=0)
    assert_trained(plain, initial)
    assert_weights_close(plain, accum)


class _Positions(keras.layers.Layer):
    """A position table added to the tokens' embedding, read as `read` says."""

    def __init__(self, read, **kwargs):
        super().__init__(**kwargs)
        self.read = read
        self.tokens = keras.layers.Embedding(VOCAB, 8)
        self.positions = keras.layers.Embedding(LENGTH, 8)

    def build(self, input_shape):
        self.tokens.build(input_shape)
        self.positions.build((LENGTH,))

    def call(self, x):
        positions = keras.ops.arange(LENGTH)
        if self.read == "slice":
            table = self.positions.embeddings[:LENGTH][None]  # KerasHub's PositionEmbedding
        elif self.read == "broadcast":
            table = self.positions(keras.ops.broadcast_to(positions, keras.ops.shape(x)))
        else:
            table = self.positions(positions)[None]  # one occurrence per row a batch
        return self.tokens(x) + table


@pytest.mark.parametrize("read", ["lookup", "broadcast", "slice"])
def test_a_position_table_is_exact_read_by_slice_or_batch_shaped_indices(read):
    # docs/sparse.md: a table read with indices without a batch dimension
    # has each row once in the big batch's gradient and N times in a
    # window's; Adam squares occurrences, so that one read differs.
    def net_of(cls, **kwargs):
        keras.utils.set_random_seed(0)
        inputs = keras.Input((LENGTH,), dtype="int32")
        x = keras.layers.GlobalAveragePooling1D()(_Positions(read)(inputs))
        return cls(inputs, keras.layers.Dense(3)(x), **kwargs)

    x, y = token_data(76)
    plain, accum, *_ = fit_pair(
        functools.partial(net_of, AccumModel, accum_steps=N),
        functools.partial(net_of, keras.Model),
        x,
        y,
        OPTIMIZERS["adam"],
    )
    if read == "lookup":
        gap = max(
            float(np.abs(a - b).max()) for a, b in zip(plain.get_weights(), accum.get_weights())
        )
        assert gap > 1e-4, gap
    else:
        assert_weights_close(plain, accum)
