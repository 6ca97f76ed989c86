"""Embedding tables smaller than a window, at big-batch parity.

A 2-row table (BERT's segment embedding), a 7-row one (day of week) and a
60-row one, read by windows of 4 x 8 samples x 10 tokens: every window has
many times more occurrences than the tables have rows, so it is kept as
per-row moments (window/slices.py), not as its occurrences. Every reference
is a plain `keras.Model` on the big batch with Keras's own sparse update.
"""

import re

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_accum
from helpers import internals, training
from helpers import mirrored as mirrored_runs
from helpers.assertions import ATOL, assert_weights_close
from helpers.data import small_table_data
from helpers.internals import GradientAccumulator, MicroBatch, microbatch, sparse
from helpers.models import SMALL_TABLES, DenseGradientModel, loss, small_tables_net
from helpers.tiers import wide
from keras_accum import AccumModel, AccumOptimizer

MICRO, N = 8, 4


def _optimizer(name, **kwargs):
    cls = getattr(keras.optimizers, name, None)
    if cls is None:
        pytest.skip(f"keras.optimizers.{name} is not in Keras {keras.__version__}")
    return lambda: cls(**kwargs)


# Every Keras optimizer whose sparse update reads a row's occurrences only
# through their sum and the sum of their squares (or absolute values):
# name -> (class, arguments).
REPRODUCED = {
    "adam": ("Adam", dict(learning_rate=0.01)),
    "adam_amsgrad": ("Adam", dict(learning_rate=0.01, amsgrad=True)),
    "adamw": ("AdamW", dict(learning_rate=0.01, weight_decay=0.1)),
    "rmsprop": ("RMSprop", dict(learning_rate=0.01)),
    "rmsprop_momentum": ("RMSprop", dict(learning_rate=0.01, momentum=0.5)),
    "adagrad": ("Adagrad", dict(learning_rate=0.1)),
    "adadelta": ("Adadelta", dict(learning_rate=1.0)),
    "adamax": ("Adamax", dict(learning_rate=0.01)),
    "adafactor": ("Adafactor", dict(learning_rate=0.01)),
    "nadam": ("Nadam", dict(learning_rate=0.01)),
    "ftrl": ("Ftrl", dict(learning_rate=0.1)),
    "lamb": ("Lamb", dict(learning_rate=0.01)),
    "lion": ("Lion", dict(learning_rate=0.001)),
    "muon": ("Muon", dict(learning_rate=0.01)),
    "sgd_momentum": ("SGD", dict(learning_rate=0.5, momentum=0.9)),
    "sgd_nesterov": ("SGD", dict(learning_rate=0.5, momentum=0.9, nesterov=True)),
    "adam_clipnorm": ("Adam", dict(learning_rate=0.01, clipnorm=0.1)),
    "adam_global_clipnorm": ("Adam", dict(learning_rate=0.01, global_clipnorm=0.1)),
}
# The README's list of what moments cannot reproduce (its occurrences are
# needed): each tested to differ from the big batch.
NOT_REPRODUCED = {
    "adam_clipvalue": ("Adam", dict(learning_rate=0.01, clipvalue=0.01)),
    "adamax_clipnorm": ("Adamax", dict(learning_rate=0.01, clipnorm=0.1)),
}


def optimizer(name):
    cls, kwargs = {**REPRODUCED, **NOT_REPRODUCED}[name]
    return _optimizer(cls, **kwargs)


def fit_pair(
    make_accum,
    x,
    y,
    make_optimizer,
    make_plain=small_tables_net,
    accum_batch=MICRO,
    **compile_kwargs,
):
    # The tables' plain net is every pair's reference unless told.
    return training.fit_pair(
        make_accum,
        make_plain,
        x,
        y,
        make_optimizer,
        big_batch=MICRO * N,
        accum_batch=accum_batch,
        **compile_kwargs,
    )


def assert_kept_as_moments(model):
    """The next micro-batch leaves every table's window as moments."""
    x, y = small_table_data(MICRO, seed=11)
    model.train_on_batch(x, y)
    counts = internals.accumulator(model).slice_counts
    assert [int(counts[i].numpy()) for i in range(len(SMALL_TABLES))] == [sparse.ROW_SUMS] * len(
        SMALL_TABLES
    )
    model.reset_window()


def tables(model):
    return [model.get_layer(f"table_{rows}").get_weights()[0] for rows in SMALL_TABLES]


# -- what each optimizer reads of a row's occurrences ---------------------------


def _occurrences(rng, rows, width=3, n=40):
    idx = rng.integers(0, rows - 1, size=n)  # the last row is never touched
    return idx, (rng.normal(size=(n, width)) + 0.5).astype("float32")


def _moments(idx, values, rows, kind):
    sums = np.zeros((rows,) + values.shape[1:], "float32")
    stats = np.zeros_like(sums)
    np.add.at(sums, idx, values)
    np.add.at(stats, idx, np.abs(values) if kind == sparse.ABS else values**2)
    return sums, stats, np.bincount(idx, minlength=rows).astype("int32")


def _apply_all(make, gradients, rows=6):
    opt = make()
    variable = keras.Variable(np.ones((rows, 3), "float32"))
    opt.build([variable])
    for idx, values in gradients:
        opt.apply(
            [tf.IndexedSlices(tf.constant(values), tf.constant(idx), tf.constant([rows, 3]))],
            [variable],
        )
    return [variable.numpy()] + [np.asarray(v) for v in opt.variables]


@pytest.mark.parametrize("name", sorted({**REPRODUCED, **NOT_REPRODUCED}))
@pytest.mark.unit
def test_an_optimizer_reads_a_rows_occurrences_only_through_its_moments(name):
    # Keras's own sparse update of real occurrences against one of the
    # synthesised IndexedSlices with the same per-row moments, three steps.
    make = optimizer(name)
    kind = sparse.statistic_of(make())
    rng = np.random.default_rng(0)
    real = [_occurrences(rng, 6) for _ in range(3)]
    synthesised = []
    for idx, values in real:
        sums, stats, counts = _moments(idx, values, 6, kind)
        v, i = sparse.synthesised(tf.constant(sums), tf.constant(stats), tf.constant(counts), kind)
        assert len(i) <= len(idx)  # never more occurrences than the real ones
        synthesised.append((i.numpy(), v.numpy()))
    expected, got = _apply_all(make, real), _apply_all(make, synthesised)
    close = all(np.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(expected, got))
    assert close == (name in REPRODUCED)


@pytest.mark.unit
def test_synthesised_occurrences_have_the_windows_sums_and_fit_a_capacity():
    rng = np.random.default_rng(2)
    idx, values = _occurrences(rng, 5, n=60)
    for kind in (sparse.SQUARE, sparse.ABS):
        sums, stats, counts = _moments(idx, values, 5, kind)
        for capacity in (None, 200, 7):
            v, i = sparse.synthesised(
                tf.constant(sums), tf.constant(stats), tf.constant(counts), kind, capacity
            )
            v, i = v.numpy(), i.numpy()
            if capacity is not None:
                assert len(i) == 5 + capacity  # static: every row once, then the extra
            got = _moments(i, v, 5, kind)
            np.testing.assert_allclose(got[0], sums, rtol=1e-5, atol=1e-5)
            if capacity != 7:  # room for all: the statistic too
                np.testing.assert_allclose(got[1], stats, rtol=1e-5, atol=1e-5)


def test_under_xla_synthesised_occurrences_need_no_slot_by_row_table():
    # Each extra occurrence's row was found by `searchsorted`, which XLA
    # compiles into a comparison of every slot with every row: 3.3 GB for a
    # 200,000-row table at 4,096 slots, allocated by every sparse step under
    # XLA (its fallback branch) whether it ran or not (the embedding
    # model's step mode held 3.4 GB of tensors against the built-in's 67
    # MB, benchmarks/xla.md). Rows are counted through a histogram now.
    rows, capacity, width = 200_000, 4096, 4
    synthesise = tf.function(
        lambda s, q, c: sparse.synthesised(s, q, c, sparse.SQUARE, capacity), jit_compile=True
    )
    table = tf.zeros((rows, width))
    hlo = synthesise.experimental_get_compiler_ir(table, table, tf.zeros((rows,), tf.int32))(
        stage="optimized_hlo"
    )
    largest = max(
        int(np.prod([int(d) for d in dims.split(",") if d]))
        for dims in re.findall(r"\b(?:f32|s32|u32|pred|s64)\[([0-9,]*)\]", hlo)
    )
    assert largest <= (rows + capacity) * width, largest
    # ... and the same occurrences under XLA as without it.
    rng = np.random.default_rng(2)
    idx, values = _occurrences(rng, 5, n=60)
    moments = [tf.constant(t) for t in _moments(idx, values, 5, sparse.SQUARE)]
    for slots in (200, 7):
        eager = sparse.synthesised(*moments, sparse.SQUARE, slots)
        compiled = tf.function(
            lambda s, q, c: sparse.synthesised(s, q, c, sparse.SQUARE, slots),
            jit_compile=True,
        )(*moments)
        for a, b in zip(eager, compiled):
            np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-6, atol=1e-6)


# -- fit: the big batch's training --------------------------------------------------


# That each optimizer reads a row's occurrences only through their moments
# is a unit test above, for every one. Trained: Adam in the inner loop; in
# the slow tier the optimizers that read them most differently (Adamax's
# absolute values, Adagrad's sum, a norm clipped, Adafactor's factored and
# Ftrl's per-coordinate moments); the others before a release.
IN_CI = ("adamax", "adagrad", "adam_clipnorm", "adafactor", "ftrl")


@pytest.mark.parametrize(
    "name",
    [
        *wide(["adam", *IN_CI], ["adam"]),
        *wide(sorted(set(REPRODUCED) - {"adam", *IN_CI}), [], pytest.mark.release),
    ],
)
def test_small_tables_match_the_big_batch(name):
    x, y = small_table_data(92)  # windows of 8+8+8+8, 8+8+8+8, 8+8+8+4
    plain, accum, *_ = fit_pair(
        lambda: small_tables_net(AccumModel, accum_steps=N), x, y, optimizer(name)
    )
    assert internals.sparse_indices(accum) == set(range(len(SMALL_TABLES)))
    assert_weights_close(plain, accum)
    assert_kept_as_moments(accum)


@pytest.mark.slow  # the documented limit's evidence, not the library's behaviour
@pytest.mark.parametrize("name", sorted(NOT_REPRODUCED))
def test_what_moments_cannot_reproduce_differs_as_the_readme_says(name):
    x, y = small_table_data(92)
    plain, accum, *_ = fit_pair(
        lambda: small_tables_net(AccumModel, accum_steps=N), x, y, optimizer(name)
    )
    gap = max(np.abs(a - b).max() for a, b in zip(tables(plain), tables(accum)))
    assert gap > 100 * ATOL


@pytest.mark.slow  # the matrix's power, not the library's behaviour
def test_the_summed_window_is_far_from_the_big_batch():
    # What the tests above would see if the window were summed densely.
    x, y = small_table_data(92)
    plain, dense, *_ = fit_pair(
        lambda: small_tables_net(DenseGradientModel), x, y, optimizer("adam"), accum_batch=MICRO * N
    )
    gap = max(np.abs(a - b).max() for a, b in zip(tables(plain), tables(dense)))
    assert gap > 1000 * ATOL


# How the tables are trained: by way in and by mode.
MODES = {
    "functional": lambda: small_tables_net(AccumModel, accum_steps=N),
    "fit_accum_steps": lambda: small_tables_net(AccumModel),
    "wrap": lambda: keras_accum.wrap(small_tables_net(), accum_steps=N),
    "micro_batch_size_and_window": lambda: small_tables_net(
        AccumModel, accum_steps=2, micro_batch_size=MICRO
    ),
}


@pytest.mark.parametrize("way", wide(sorted(MODES), ["micro_batch_size_and_window"]))
def test_every_way_in(way):
    x, y = small_table_data(92)
    plain = small_tables_net()
    plain.compile(optimizer("adam")(), loss())
    plain.fit(x, y, batch_size=MICRO * N, epochs=2, shuffle=False, verbose=0)
    accum = MODES[way]()
    accum.compile(optimizer("adam")(), loss())
    batch = {"micro_batch_size_and_window": 2 * MICRO}.get(way, MICRO)
    extra = {"fit_accum_steps": dict(accum_steps=N)}.get(way, {})
    accum.fit(x, y, batch_size=batch, epochs=2, shuffle=False, verbose=0, **extra)
    assert_weights_close(plain, accum)


@pytest.mark.slow  # the inner loop's AccumOptimizer on a sparse table is test_sparse's
def test_accum_optimizer_on_a_plain_model():
    # Keras's fit weighs micro-batches equally: equal windows (96 = 3 x 32).
    x, y = small_table_data(96)
    accum, _ = training.fit_alone(
        small_tables_net,
        x,
        y,
        lambda: AccumOptimizer(keras.optimizers.Adam(0.01), accum_steps=N),
        MICRO,
    )
    reference, _ = training.fit_alone(
        small_tables_net, x, y, lambda: keras.optimizers.Adam(0.01), MICRO * N
    )
    assert_weights_close(reference, accum)


@pytest.mark.slow  # an XLA compile per batch size: the slow tier
def test_jit_compile_needs_room_for_the_whole_window_at_a_short_batch():
    # One row read by every token of the 2-row table, one class: the row's
    # occurrences are nearly alike, so the window needs nearly all of its
    # 280 occurrences; closed by a batch of 4, it still gets room for 4 full
    # batches of 8 (not 4 of 4).
    x, y = small_table_data(92)
    x[:, 0] = 1
    y[:] = 0
    plain, accum, *_ = fit_pair(
        lambda: small_tables_net(AccumModel, accum_steps=N),
        x,
        y,
        optimizer("adam"),
        jit_compile=True,
    )
    assert_weights_close(plain, accum)


@pytest.mark.slow  # the inner loop's mask_zero table is test_sparse's
def test_mask_zero():
    x, y = small_table_data(92)
    plain, accum, *_ = fit_pair(
        lambda: small_tables_net(AccumModel, mask_zero=True, accum_steps=N),
        x,
        y,
        optimizer("adam"),
        make_plain=lambda: small_tables_net(mask_zero=True),
    )
    assert_weights_close(plain, accum)


@pytest.mark.slow  # the inner loop's tied table is test_sparse's
def test_a_table_read_twice():
    x, y = small_table_data(92)
    plain, accum, *_ = fit_pair(
        lambda: small_tables_net(AccumModel, tied=True, accum_steps=N),
        x,
        y,
        optimizer("rmsprop"),
        make_plain=lambda: small_tables_net(tied=True),
    )
    assert internals.sparse_indices(accum) == set(range(len(SMALL_TABLES)))
    assert_weights_close(plain, accum)


@pytest.fixture
def mixed_float16():
    keras.mixed_precision.set_global_policy("mixed_float16")
    yield
    keras.mixed_precision.set_global_policy("float32")


@pytest.mark.slow  # the inner loop's float16 sparse window is test_sparse's
def test_mixed_float16_within_the_float16_envelope(mixed_float16):
    x, y = small_table_data(92)
    make = lambda: small_tables_net(AccumModel, accum_steps=N)  # noqa: E731
    plain, accum, *_ = fit_pair(make, x, y, optimizer("adam"))
    gap = max(np.abs(a - b).max() for a, b in zip(tables(plain), tables(accum)))
    # The envelope: how far float16 itself moves the big batch (the same big
    # batch trained in float32); the wrong answer, the summed window, is
    # thousands of tolerances away (above).
    keras.mixed_precision.set_global_policy("float32")
    exact, _ = training.fit_alone(small_tables_net, x, y, optimizer("adam"), MICRO * N)
    envelope = max(np.abs(a - b).max() for a, b in zip(tables(plain), tables(exact)))
    assert 0 < gap <= 2 * envelope


# -- resuming a window of moments -------------------------------------------------


def _batches(x, y):
    return [(x[i : i + MICRO], y[i : i + MICRO]) for i in range(0, len(x), MICRO)]


def _compiled(make=lambda: small_tables_net(AccumModel, accum_steps=N)):
    model = make()
    model.compile(optimizer("adam")(), loss())
    return model


def _save_and_load(kind, model, tmp_path):
    if kind == "weights":
        model.save_weights(tmp_path / "w.weights.h5")
        resumed = _compiled()
        resumed.optimizer.build(resumed.trainable_variables)  # as fit() would
        resumed.load_weights(tmp_path / "w.weights.h5")
        return resumed
    if kind == "keras":
        model.save(tmp_path / "m.keras")
        return keras.models.load_model(tmp_path / "m.keras")
    path = tf.train.Checkpoint(model=model, optimizer=model.optimizer).save(str(tmp_path / "c"))
    resumed = _compiled()
    resumed.optimizer.build(resumed.trainable_variables)
    # A checkpoint restores into a window that exists (as tests/test_sparse.py).
    resumed.train_on_batch(*small_table_data(MICRO, seed=11))
    tf.train.Checkpoint(model=resumed, optimizer=resumed.optimizer).restore(path)
    return resumed


# Every kind in the slow tier: the inner loop restores moments by snapshot
# (test_snapshot_and_restore_bring_back_the_moments) and resumes a sparse
# window from each kind of file in test_sparse.
@pytest.mark.slow
@pytest.mark.parametrize("kind", ["weights", "keras", "checkpoint"])
def test_resume_mid_window(kind, tmp_path):
    x, y = small_table_data(64)
    batches = _batches(x, y)
    uninterrupted = _compiled()
    for batch in batches:
        uninterrupted.train_on_batch(*batch)
    first = _compiled()
    for batch in batches[:6]:  # one window applied, two micro-batches pending
        first.train_on_batch(*batch)
    counts = internals.accumulator(first).slice_counts
    assert int(counts[0].numpy()) == sparse.ROW_SUMS
    resumed = _save_and_load(kind, first, tmp_path)
    assert internals.pending(resumed) == 2
    for batch in batches[6:]:
        resumed.train_on_batch(*batch)
    assert_weights_close(uninterrupted, resumed, rtol=0, atol=0)
    plain = small_tables_net()
    plain.compile(optimizer("adam")(), loss())
    plain.fit(x, y, batch_size=MICRO * N, shuffle=False, verbose=0)
    assert_weights_close(plain, uninterrupted)


# In the inner loop: test_fault_tolerance's interrupted-mid-window resume
# through the same backup, and test_resume_mid_window's restore of a window
# of moments (the backup's build-then-load).
@pytest.mark.slow
def test_interrupted_mid_window_resumes_from_a_backup(tmp_path):
    from helpers.training import InterruptAt

    x, y = small_table_data(92)

    def fit(model, callbacks=()):
        backup = keras_accum.BackupAndRestore(tmp_path)
        return model.fit(
            x,
            y,
            batch_size=MICRO,
            epochs=3,
            shuffle=False,
            verbose=0,
            callbacks=[*callbacks, backup],
        )

    with pytest.raises(KeyboardInterrupt):
        fit(_compiled(), [InterruptAt(1, 5)])  # the second epoch's window half done
    resumed = _compiled()
    assert len(fit(resumed).history["loss"]) == 2
    plain = small_tables_net()
    plain.compile(optimizer("adam")(), loss())
    plain.fit(x, y, batch_size=MICRO * N, epochs=3, shuffle=False, verbose=0)
    assert_weights_close(plain, resumed)


@pytest.mark.unit
def test_snapshot_and_restore_bring_back_the_moments():
    acc = GradientAccumulator()
    weights = tf.Variable(tf.ones((3, 2)))
    acc.build([weights], accum_steps=4)
    acc.add([tf.IndexedSlices(tf.ones((5, 2)), tf.constant([1, 1, 0, 2, 1]))], weight=1.0)
    assert int(acc.slice_counts[0].numpy()) == sparse.ROW_SUMS
    snapshot = acc.snapshot()
    before = tf.convert_to_tensor(acc.window_gradients()[0]).numpy()
    acc.add([tf.IndexedSlices(3 * tf.ones((4, 2)), tf.constant([0, 0, 0, 2]))], weight=1.0)
    acc.restore(snapshot)
    np.testing.assert_array_equal(tf.convert_to_tensor(acc.window_gradients()[0]).numpy(), before)
    np.testing.assert_array_equal(acc.slice_indices[0].numpy(), [1, 3, 1])


@pytest.mark.unit
def test_a_nonfinite_window_of_moments_is_skipped_and_the_next_starts_clean():
    from helpers.internals import AccumState, NonFiniteWindows, close

    acc = GradientAccumulator()
    state = AccumState(acc, skip=NonFiniteWindows())
    weights = tf.Variable(tf.ones((3, 2)))
    acc.build([weights], accum_steps=1)
    bad = tf.constant([[np.nan, 1.0], [1.0, 1.0], [2.0, 2.0], [1.0, 3.0]])
    acc.add([tf.IndexedSlices(bad, tf.constant([0, 0, 1, 1]))], weight=1.0)
    assert int(acc.slice_counts[0].numpy()) == sparse.ROW_SUMS
    close(state, keras.optimizers.SGD(1.0))
    assert int(state.skip.skipped.numpy()) == 1
    np.testing.assert_array_equal(weights.numpy(), np.ones((3, 2)))
    # The next window, moments again, holds only its own occurrences.
    good = tf.constant([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0], [7.0, 8.0]])
    acc.add([tf.IndexedSlices(good, tf.constant([2, 2, 0, 2]))], weight=1.0)
    close(state, keras.optimizers.SGD(1.0))
    np.testing.assert_allclose(weights.numpy(), [[-4, -5], [1, 1], [-10, -13]], rtol=1e-6)


# -- micro_batch_size: a batch's occurrences past two tables, as row sums -------------


def _split_sum(parts, rows, statistic, known=True):
    """The micro-batches' occurrences `parts` summed as a split step sums them,
    traced with their counts `known` or not (a batch of unknown size): the
    sum's row tables, then the `IndexedSlices` the optimizer gets."""
    variable = keras.Variable(np.zeros((rows, 3), "float32"))
    width = tf.TensorSpec([None, 3] if not known else [len(parts[0][0]), 3], tf.float32)
    index = tf.TensorSpec([None] if not known else [len(parts[0][0])], tf.int32)

    @tf.function(input_signature=[[index] * len(parts), [width] * len(parts)])
    def run(indices, values):
        total = None
        for idx, vals in zip(indices, values):
            grad = tf.IndexedSlices(vals, idx, tf.constant([rows, 3]))
            total = microbatch.summed(
                total, MicroBatch([grad], None, 1.0, True), [variable], statistic
            )
        summed = total[0]
        tables = summed.sums if isinstance(summed, microbatch.RowSums) else tf.zeros([0, 3])
        grad = microbatch.as_gradients(total)[0]
        return tables, grad.values, grad.indices

    return run([tf.constant(i, tf.int32) for i, _ in parts], [tf.constant(v) for _, v in parts])


@pytest.mark.unit
@pytest.mark.parametrize("known", [True, False], ids=["counts_known", "counts_unknown"])
def test_a_split_batchs_occurrences_past_two_tables_are_summed_by_row(known):
    # 4 micro-batches of 4 occurrences of a 5-row table: held as the 16
    # occurrences they are, they grow with the batch; past 10 (two tables:
    # the sums and the statistic), as row sums of the table's shape, decided
    # when traced or, counts unknown, at run time.
    rng = np.random.default_rng(0)
    parts = [_occurrences(rng, 5, n=4) for _ in range(4)]
    idx = np.concatenate([i for i, _ in parts])
    values = np.concatenate([v for _, v in parts])
    tables, got_values, got_idx = _split_sum(parts, 5, sparse.SQUARE, known)
    assert tables.shape == (5, 3)
    want = _moments(idx, values, 5, sparse.SQUARE)
    got = [tf.math.unsorted_segment_sum(t, got_idx, 5).numpy() for t in (got_values, got_values**2)]
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=ATOL)
    # Two micro-batches (8 occurrences) fit: kept as they are.
    tables, got_values, got_idx = _split_sum(parts[:2], 5, sparse.SQUARE, known)
    assert tables.shape == (0, 3)
    np.testing.assert_array_equal(got_idx.numpy(), idx[:8])
    # Where the optimizer reads every occurrence (`clipvalue`), all are kept.
    tables, got_values, got_idx = _split_sum(parts, 5, None, known)
    np.testing.assert_array_equal(got_idx.numpy(), idx)


# Adam by rows' squares, Adamax by absolute values; `clipvalue` keeps the
# occurrences. Arrays of 92 samples: batches of unknown size, the rule made
# at run time; under XLA, which needs the counts when traced (a static
# number of synthesised occurrences), 96 (batches of known size: row sums)
# and 92 (unknown: the occurrences kept).
@pytest.mark.parametrize(
    "name,jit_compile,samples",
    wide(
        [
            ("adam", False, 92),
            ("adam", True, 96),
            ("adam", True, 92),
            ("adamax", False, 92),
            ("adam_clipvalue", False, 92),
        ],
        [("adam", False, 92), ("adam", True, 96)],
    ),
)
def test_micro_batch_size_splits_of_small_tables_match_the_big_batch(name, jit_compile, samples):
    # Micro-batches of 80 occurrences a table (8 samples x 10 tokens): each
    # table's batch outgrows it.
    x, y = small_table_data(samples)
    plain, accum, *_ = fit_pair(
        lambda: small_tables_net(AccumModel, micro_batch_size=MICRO),
        x,
        y,
        optimizer(name),
        accum_batch=MICRO * N,
        jit_compile=jit_compile,
    )
    assert_weights_close(plain, accum)


# -- memory ---------------------------------------------------------------------------


def test_a_sparse_windows_memory_is_at_most_three_tables():
    # The README's figure: the sums and the statistic, one float32 table
    # each, plus one int32 per row and a counter.
    model = _compiled()
    x, y = small_table_data(MICRO)
    model.train_on_batch(x, y)
    acc = internals.accumulator(model)
    for i, rows in enumerate(SMALL_TABLES):
        table = 4 * rows * 4  # float32 table of width 4
        held = sum(
            v.numpy().nbytes
            for v in (acc.acc_grads[i], acc.stats_of(i), acc.slice_indices[i], acc.slice_counts[i])
        )
        assert held <= 3 * table
    # Dense variables get no statistic buffer.
    assert sorted(acc.acc_stats) == [str(i) for i in range(len(SMALL_TABLES))]


# -- across replicas -------------------------------------------------------------------


# Both in the slow tier (a dozen trainings under a strategy); the inner
# loop's cross-replica sum of a sparse gradient is test_sparse's.
@pytest.mark.slow
@pytest.mark.parametrize("replicas", [1, 2], ids=["one_replica", "two_replicas"])
def test_mirrored_strategy_matches_the_big_batch(replicas):
    out = mirrored_runs.sparse_checks(replicas, small=True, optimizers=("adam",))
    assert sorted(out) == [
        "adam_micro_batch_size_vs_one_device_big_batch",
        "adam_vs_mirrored_big_batch",
        "adam_vs_one_device_big_batch",
    ]
    for name, diff in out.items():
        assert diff <= ATOL, (name, diff)
