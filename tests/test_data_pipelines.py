"""What `fit` draws from the user's own data: the samples a plain model
draws, in its order, on every way in.

A `tf.data` pipeline with a seeded `shuffle` reorders at every pass over
it, so a pass drawn before training (to build the model) would make the
first epoch read another order than the plain model's. Without a strategy
plain Keras draws nothing before its first step, and neither may we; under
a strategy Keras draws one batch of a pass of its own to build, and we draw
no more. The reference is the plain model fed the same pipeline, made
anew from the same seed; where the batch changes during the fit (a
schedule), the plain model is fed big batches in the order the pipeline's
passes give.
"""

import itertools

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_accum
from helpers import internals
from helpers.assertions import assert_history_close, assert_trained, assert_weights_close
from helpers.coupled import TOWERS, InBatchSoftmax, two_tower
from helpers.data import make_data
from helpers.models import WAYS_IN, functional, initial_weights, loss
from helpers.replicas import mirrored
from helpers.tiers import WAYS, wide
from helpers.training import InterruptAt

# 92 samples at micro-batch 8 and N=4: windows of 32, 32 and 28 samples.
SAMPLES, MICRO, N = 92, 8, 4
BIG = MICRO * N
SEED = 5
X, Y = make_data(SAMPLES)


class Counted:
    """A seeded, shuffled pipeline as users write it, counting the samples
    read from its source (`read`: a `map` ahead of the shuffle) and
    recording those drawn from it, in order (`drawn`: a `map` after it)."""

    def __init__(self, x=X, y=Y):
        self.x, self.y = x, y
        self.read = 0
        self.drawn = []

    def _count(self, i):
        self.read += 1
        return i

    def _draw(self, i):
        self.drawn.append(int(i))
        return i

    def batches(self, batch_size, seed=SEED, drop_remainder=False):
        def through(function):
            return lambda i: tf.ensure_shape(tf.numpy_function(function, [i], tf.int64), [])

        x = tf.constant(self.x)
        y = tf.constant(self.y)
        index = tf.data.Dataset.range(len(self.y)).map(through(self._count))
        shuffled = index.shuffle(len(self.y), seed=seed).map(through(self._draw))
        samples = shuffled.map(lambda i: (tf.gather(x, i), tf.gather(y, i)))
        return samples.batch(batch_size, drop_remainder)


def _compile(model, make_optimizer=lambda: keras.optimizers.Adam(0.01), **kwargs):
    model.compile(make_optimizer(), loss(), metrics=["accuracy"], **kwargs)
    return model


def _fit_plain(make_plain, epochs=2, fits=1, **compile_kwargs):
    """The plain model fit on the big batch, its histories and its `Counted`."""
    data = Counted()
    plain = _compile(make_plain(), **compile_kwargs)
    dataset = data.batches(BIG)
    history = [plain.fit(dataset, epochs=epochs, verbose=0) for _ in range(fits)]
    return plain, history, data


@pytest.mark.parametrize("way", wide(sorted(WAYS_IN), WAYS))
def test_a_seeded_shuffle_trains_as_the_plain_model_on_every_way_in(way):
    make_accum, make_plain = WAYS_IN[way](accum_steps=N)
    plain, expected, reference = _fit_plain(make_plain)
    data = Counted()
    model = _compile(make_accum())
    history = model.fit(data.batches(MICRO), epochs=2, verbose=0)
    assert data.drawn == reference.drawn and data.read == reference.read == 2 * SAMPLES
    assert_weights_close(plain, model)
    assert_history_close(expected[0], history)
    assert_trained(model, initial_weights(make_plain, X))


# Each way of changing what a step does, on the pipeline a user brings:
# fit's own `accum_steps`, a split inside the step (whose size the first
# step must see: the pipeline's batch dimension is dynamic), "auto", XLA,
# several steps per execution (the first call's batches trained as one
# step each), and a second `fit` on the same pipeline (its next passes).
CASES = {
    "fit_accum_steps": (dict(), dict(batch=MICRO, fit=dict(accum_steps=N))),
    "micro_batch_size": (dict(micro_batch_size=MICRO), dict(batch=BIG)),
    "micro_batch_size_and_accum_steps": (
        dict(micro_batch_size=MICRO // 2, accum_steps=2),
        dict(batch=BIG // 2),
    ),
    "auto": (dict(micro_batch_size="auto", accum_steps=N), dict(batch=MICRO)),
    "xla_split": (dict(micro_batch_size=MICRO), dict(batch=BIG, jit_compile=True)),
    "steps_per_execution": (dict(accum_steps=N), dict(batch=MICRO, steps_per_execution=3)),
    "two_fits": (dict(micro_batch_size=MICRO), dict(batch=BIG, fits=2)),
}


@pytest.mark.parametrize(
    "case", wide(sorted(CASES), ["micro_batch_size", "steps_per_execution", "two_fits"])
)
def test_a_seeded_shuffle_trains_as_the_plain_model_in_every_mode(case):
    settings, how = CASES[case]
    compile_kwargs = {k: how[k] for k in ("jit_compile", "steps_per_execution") if k in how}
    fits = how.get("fits", 1)
    plain, expected, reference = _fit_plain(functional, epochs=2, fits=fits, **compile_kwargs)
    data = Counted()
    model = _compile(functional(keras_accum.AccumModel, **settings), **compile_kwargs)
    dataset = data.batches(how["batch"])
    history = [model.fit(dataset, epochs=2, verbose=0, **how.get("fit", {})) for _ in range(fits)]
    assert data.drawn == reference.drawn
    assert data.read == reference.read == 2 * fits * SAMPLES
    assert_weights_close(plain, model)
    for e, h in zip(expected, history):
        assert_history_close(e, h)


def test_a_schedule_trains_what_the_plain_model_draws_in_its_order():
    # The plain model's draws at the micro-batch (a shuffle before the
    # batching orders samples alike at any batch size) are the reference's
    # samples, each epoch's in scheduled windows.
    reference = Counted()
    _compile(functional()).fit(reference.batches(MICRO), epochs=2, verbose=0)
    data = Counted()
    model = _compile(functional(keras_accum.AccumModel))
    schedule = keras_accum.AccumScheduler({0: 2, 1: N})
    model.fit(data.batches(MICRO), epochs=2, verbose=0, callbacks=[schedule])
    assert data.drawn == reference.drawn and data.read == reference.read
    plain = _compile(functional())
    for epoch, accum_steps in enumerate((2, N)):
        order = np.array(reference.drawn[epoch * SAMPLES : (epoch + 1) * SAMPLES])
        big = MICRO * accum_steps
        for start in range(0, SAMPLES, big):
            batch = order[start : start + big]
            plain.train_on_batch(X[batch], Y[batch])
    assert_weights_close(plain, model)


def test_coupled_losses_train_each_pass_in_the_pipelines_order():
    queries, items = np.random.default_rng(0).normal(size=(2, SAMPLES, 6)).astype("float32")

    def pipeline():
        return (
            tf.data.Dataset.from_tensor_slices(((queries, items), np.zeros(SAMPLES, "float32")))
            .shuffle(SAMPLES, seed=SEED)
            .batch(BIG)
        )

    plain = two_tower()
    plain.compile(keras.optimizers.Adam(0.01), InBatchSoftmax())
    plain.fit(pipeline(), epochs=2, verbose=0)
    model = two_tower(keras_accum.AccumModel, micro_batch_size=MICRO, coupled_from=TOWERS)
    model.compile(keras.optimizers.Adam(0.01), InBatchSoftmax())
    model.fit(pipeline(), epochs=2, verbose=0)
    assert_weights_close(plain, model)


def test_a_source_read_once_trains():
    # A source that cannot be read twice (a stream, a generator): a pass
    # drawn before training would use it up.
    calls = []

    def once():
        calls.append(1)
        assert len(calls) == 1, "the source was read twice"
        yield from zip(X, Y)

    def pipeline(batch):
        calls.clear()
        return tf.data.Dataset.from_generator(
            once,
            output_signature=(
                tf.TensorSpec((X.shape[1],), tf.float32),
                tf.TensorSpec((), tf.int64),
            ),
        ).batch(batch)

    plain = _compile(functional())
    plain.fit(pipeline(BIG), epochs=1, verbose=0)
    for settings, batch in ((dict(accum_steps=N), MICRO), (dict(micro_batch_size=MICRO), BIG)):
        model = _compile(functional(keras_accum.AccumModel, **settings))
        model.fit(pipeline(batch), epochs=1, verbose=0)
        assert len(calls) == 1
        assert_weights_close(plain, model)


def test_a_resumed_split_sees_the_batch_size_in_the_skipped_batches(tmp_path):
    # A resumed epoch's first batches are skipped, not trained: the first
    # of them gives the size the split is for (the pipeline's batch
    # dimension is dynamic), not the short batch trained after them (28
    # samples: 3 micro-batches of 10, where full batches need 4).
    micro = 10

    def pipeline():
        return tf.data.Dataset.from_tensor_slices((X, Y)).batch(BIG)

    plain = _compile(functional())
    plain.fit(pipeline(), epochs=2, verbose=0)
    model = _compile(functional(keras_accum.AccumModel, micro_batch_size=micro))
    backup = keras_accum.BackupAndRestore(str(tmp_path), save_freq=1)
    with pytest.raises(KeyboardInterrupt):
        model.fit(pipeline(), epochs=2, verbose=0, callbacks=[backup, InterruptAt(0, 1)])
    resumed = _compile(functional(keras_accum.AccumModel, micro_batch_size=micro))
    resumed.fit(pipeline(), epochs=2, verbose=0, callbacks=[backup])
    assert internals.batch_size_seen(resumed) == BIG
    assert_weights_close(plain, resumed)


# One replica (two replicas' path with one component) in the slow tier.
@pytest.mark.parametrize("replicas", [pytest.param(1, marks=pytest.mark.slow), 2])
def test_under_a_strategy_no_more_is_drawn_than_plain_keras_draws(replicas):
    # Keras builds a model under a strategy from one batch of a pass of its
    # own (`_maybe_symbolic_build`): the first epoch reads the next pass.
    strategy = mirrored(replicas)
    reads = []
    for cls, settings, batch in (
        (keras.Model, {}, BIG),
        (keras_accum.AccumModel, dict(accum_steps=N), MICRO),
    ):
        data = Counted()
        with strategy.scope():
            model = _compile(functional(cls, **settings))
        model.fit(data.batches(batch * replicas), epochs=1, verbose=0)
        reads.append(data.read)
        if cls is keras.Model:
            plain = model
    assert reads[1] <= reads[0]
    assert_weights_close(plain, model)


# Micro-batches split by each replica's share in the slow tier: the
# window's split is the same cut.
@pytest.mark.parametrize(
    "settings",
    [dict(accum_steps=N), pytest.param(dict(micro_batch_size=MICRO // 2), marks=pytest.mark.slow)],
)
def test_under_a_strategy_arrays_are_split_by_each_replicas_share(settings):
    # Keras's array adapter gives the global batch; each replica's step sees
    # its share, which the split and the samples counted go by.
    strategy = mirrored(2)
    batch = MICRO if "accum_steps" in settings else BIG
    with strategy.scope():
        plain = _compile(functional())
        model = _compile(functional(keras_accum.AccumModel, **settings))
    plain.fit(X, Y, batch_size=BIG, epochs=2, shuffle=False, verbose=0)
    model.fit(X, Y, batch_size=batch, epochs=2, shuffle=False, verbose=0)
    assert internals.batch_size_seen(model) == batch // 2
    assert model.accumulation.batch_drawn() == batch
    assert_weights_close(plain, model)


def test_the_spec_of_a_pipeline_with_optional_entries_builds():
    # A generator's absent sample weights reach the spec as Optionals
    # (Keras >= 3.13), read as absent.
    def batches():
        for start in itertools.count(0, MICRO):
            if start >= SAMPLES:
                return
            yield X[start : start + MICRO], Y[start : start + MICRO], None

    plain = _compile(functional())
    plain.fit(
        ((X[s : s + BIG], Y[s : s + BIG]) for s in range(0, SAMPLES, BIG)),
        epochs=1,
        steps_per_epoch=3,
        verbose=0,
    )
    model = _compile(functional(keras_accum.AccumModel, accum_steps=N))
    model.fit(batches(), epochs=1, steps_per_epoch=12, verbose=0)
    assert_weights_close(plain, model)


def test_evaluate_before_fit_draws_what_a_plain_model_draws():
    # An unbuilt model is built for evaluate too: from the spec, drawing
    # nothing a plain model would not.
    reads = []
    for make in (functional, lambda: functional(keras_accum.AccumModel, accum_steps=N)):
        data = Counted()
        _compile(make()).evaluate(data.batches(BIG), verbose=0)
        reads.append(data.drawn)
    assert reads[1] == reads[0] and len(reads[0]) == SAMPLES


def test_the_first_batch_is_trained_by_the_traced_step():
    # Where only the first step can tell the batch size, its batches still go
    # through the traced train function (one trace for the fit, as for
    # arrays), not step by step eagerly, which holds twice the memory.
    calls = []

    class Counting(keras_accum.AccumModel):
        def train_step(self, data):
            calls.append(1)  # Python: once per trace, or per eager step
            return super().train_step(data)

    def traces(data, **fit_kwargs):
        calls.clear()
        keras.utils.set_random_seed(0)
        inputs = keras.Input((X.shape[1],))
        model = Counting(inputs, keras.layers.Dense(3)(inputs), accum_steps=N)
        _compile(model, steps_per_execution=3)
        model.fit(data, epochs=1, verbose=0, **fit_kwargs)
        return len(calls)

    arrays = traces(X, y=Y, batch_size=MICRO, shuffle=False)
    assert traces(Counted().batches(MICRO)) == arrays
