"""AccumScheduler (batch-size warm-up): the big batch the schedule names,
epoch by epoch; bad schedules refused before training.

That a schedule traces one step per distinct value: test_train_functions.py.
"""

import re

import keras
import numpy as np
import pytest
import tensorflow as tf

from helpers.assertions import assert_history_close, assert_trained, assert_weights_close
from helpers.data import make_data
from helpers.models import OPTIMIZERS, WAYS_IN, functional, initial_weights, loss
from helpers.tiers import each_way_once
from keras_accum import AccumModel, AccumScheduler, SampleSchedule

# 92 samples at micro-batch 8: 11 micro-batches of 8 and one of 4, so every
# epoch ends on a short window (8+4 at N=2, 8+8+8+4 at N=4), which is exact
# only if micro-batches are weighted by their size.
X, Y = make_data(92)
MICRO = 8
SCHEDULE = {0: 1, 2: 2, 3: 4}
EPOCHS = 5
FIT = dict(shuffle=False, verbose=0)


def plain_following(schedule, optimizer="adam", make=functional, start=0, epochs=EPOCHS):
    """A plain model whose batch size follows `schedule` (through initial_epoch);
    returns it and its history over all epochs."""
    plain = make()
    plain.compile(OPTIMIZERS[optimizer](), loss(), metrics=["accuracy"])
    history = {}
    for epoch in range(start, epochs):
        h = plain.fit(
            X, Y, batch_size=MICRO * schedule(epoch), epochs=epoch + 1, initial_epoch=epoch, **FIT
        )
        for key, values in h.history.items():
            history.setdefault(key, []).extend(values)
    return plain, history


def step_of(schedule):
    return lambda epoch: max(v for e, v in schedule.items() if e <= epoch)


def without_accum_steps(history):
    history = dict(history.history)
    history.pop("accum_steps")
    return history


# Never built before fit; each way and each optimizer once in the inner loop.
@pytest.mark.parametrize(
    "kind, optimizer",
    each_way_once(["adam_exponential_decay", "sgd_momentum"]),
)
def test_dict_schedule_equals_a_plain_model_with_the_scheduled_batch(kind, optimizer):
    model = WAYS_IN[kind]()[0]()
    model.compile(OPTIMIZERS[optimizer](), loss(), metrics=["accuracy"])
    history = model.fit(
        X, Y, batch_size=MICRO, epochs=EPOCHS, callbacks=[AccumScheduler(SCHEDULE)], **FIT
    )
    plain, plain_history = plain_following(step_of(SCHEDULE), optimizer, WAYS_IN[kind]()[1])
    assert_trained(plain, initial_weights(WAYS_IN[kind]()[1], X))
    assert_weights_close(plain, model)
    # Updates: 12 + 12 at batch 8, 6 at 16, 3 + 3 at 32; the LR schedule saw them.
    assert int(model.optimizer.iterations.numpy()) == 36
    assert int(plain.optimizer.iterations.numpy()) == 36
    assert_history_close(without_accum_steps(history), plain_history)
    assert history.history["accum_steps"] == [1, 1, 2, 4, 4]
    # As fit(accum_steps=...): the model's own setting is back after fit.
    assert model.accum_steps == 1


def test_callable_schedule_equals_a_plain_model_with_the_scheduled_batch():
    def schedule(epoch):
        return [2, 4, 1, 4][epoch]

    model = functional(AccumModel, accum_steps=3)
    model.compile(OPTIMIZERS["adam"](), loss(), metrics=["accuracy"])
    history = model.fit(
        X, Y, batch_size=MICRO, epochs=4, callbacks=[AccumScheduler(schedule)], **FIT
    )
    plain, plain_history = plain_following(schedule, epochs=4)
    assert_weights_close(plain, model)
    assert (
        model.optimizer.iterations.numpy() == plain.optimizer.iterations.numpy() == 6 + 3 + 12 + 3
    )
    assert_history_close(without_accum_steps(history), plain_history)
    assert model.accum_steps == 3


def test_epochs_before_the_first_key_keep_the_models_accum_steps():
    model = functional(AccumModel, accum_steps=2)
    model.compile(OPTIMIZERS["adam"](), loss())
    model.fit(X, Y, batch_size=MICRO, epochs=3, callbacks=[AccumScheduler({2: 4})], **FIT)
    plain, _ = plain_following(lambda epoch: 2 if epoch < 2 else 4, epochs=3)
    assert_weights_close(plain, model)


def test_a_callable_returning_none_keeps_the_current_value():
    model = functional(AccumModel, accum_steps=3)
    model.compile(OPTIMIZERS["adam"](), loss())
    schedule = AccumScheduler(lambda epoch: 2 if epoch == 1 else None)
    history = model.fit(X, Y, batch_size=MICRO, epochs=3, callbacks=[schedule], **FIT)
    assert history.history["accum_steps"] == [3, 2, 2]
    plain, _ = plain_following(lambda epoch: 3 if epoch == 0 else 2, epochs=3)
    assert_weights_close(plain, model)


def test_initial_epoch_applies_the_schedule_for_the_starting_epoch():
    # The model's own accum_steps (3) is not in the schedule: had the
    # schedule not been applied at epoch 2, the windows would differ.
    model = functional(AccumModel, accum_steps=3)
    model.compile(OPTIMIZERS["adam"](), loss())
    model.fit(
        X,
        Y,
        batch_size=MICRO,
        epochs=EPOCHS,
        initial_epoch=2,
        callbacks=[AccumScheduler(SCHEDULE)],
        **FIT,
    )
    plain, _ = plain_following(step_of(SCHEDULE), start=2)
    assert_weights_close(plain, model)
    assert model.optimizer.iterations.numpy() == 6 + 3 + 3


class Interrupt(keras.callbacks.Callback):
    def __init__(self, epoch, batch):
        super().__init__()
        self.at = (epoch, batch)

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if (self.epoch, batch) == self.at:
            raise RuntimeError("interrupted")


def test_backup_and_restore_resume_reapplies_the_schedule(tmp_path):
    def compiled():
        model = functional(AccumModel)
        model.compile(OPTIMIZERS["adam"](), loss())
        return model

    fit = dict(batch_size=MICRO, epochs=EPOCHS, **FIT)
    reference = compiled()
    reference.fit(X, Y, callbacks=[AccumScheduler(SCHEDULE)], **fit)

    backup = keras.callbacks.BackupAndRestore(str(tmp_path / "backup"))
    model = compiled()
    with pytest.raises(RuntimeError, match="interrupted"):
        # Mid-window in epoch 4, where accum_steps is 4 (set at epoch 3).
        model.fit(X, Y, callbacks=[AccumScheduler(SCHEDULE), backup, Interrupt(4, 5)], **fit)
    # A new process would start from a fresh model with accum_steps=1 and
    # resume at epoch 4, which is no key of the schedule.
    model = compiled()
    model.fit(X, Y, callbacks=[AccumScheduler(SCHEDULE), backup], **fit)
    assert_weights_close(reference, model, rtol=0, atol=0)
    assert model.optimizer.iterations.numpy() == reference.optimizer.iterations.numpy()
    plain, _ = plain_following(step_of(SCHEDULE))
    assert_weights_close(plain, model)


def test_verbose_reports_changes(capsys):
    model = functional(AccumModel)
    model.compile(OPTIMIZERS["adam"](), loss())
    model.fit(
        X[:16],
        Y[:16],
        batch_size=MICRO,
        epochs=2,
        callbacks=[AccumScheduler({1: 2}, verbose=1)],
        **FIT,
    )
    assert "Epoch 2: AccumScheduler setting accum_steps to 2." in capsys.readouterr().out


# -- bad schedules ----------------------------------------------------------------


@pytest.mark.parametrize(
    "schedule, error, match",
    [
        ({0: 0}, ValueError, r"`schedule` value for epoch 0.*Received: accum_steps=0"),
        ({0: 1, 3: 2.5}, TypeError, r"`schedule` value for epoch 3.*Received: accum_steps=2.5"),
        ({0: True}, TypeError, r"`schedule` value for epoch 0.*Received: accum_steps=True"),
        ({-1: 2}, ValueError, r"`schedule` keys must be epochs.*with key -1"),
        ({"2": 2}, ValueError, r"`schedule` keys must be epochs.*with key '2'"),
        ({1.0: 2}, ValueError, r"`schedule` keys must be epochs.*with key 1.0"),
        ({}, ValueError, r"`schedule` must map at least one epoch.*Received: schedule=\{\}"),
        ([(0, 2)], TypeError, r"`schedule` must be a dict.*Received: schedule=\[\(0, 2\)\]"),
        (4, TypeError, r"`schedule` must be a dict.*Received: schedule=4"),
    ],
)
@pytest.mark.unit
def test_bad_dict_schedules_are_refused_at_construction(schedule, error, match):
    with pytest.raises(error, match=match):
        AccumScheduler(schedule)


@pytest.mark.parametrize("value, error", [(0, ValueError), (1.5, TypeError), ("2", TypeError)])
def test_bad_callable_schedule_is_refused_before_training(value, error):
    # Wrong only for the last epoch: still refused before the first step.
    model = functional(AccumModel)
    model.compile(OPTIMIZERS["adam"](), loss())
    initial = model.get_weights()
    scheduler = AccumScheduler(lambda epoch: value if epoch == 2 else 2)
    with pytest.raises(error, match=rf"`schedule` returned {value!r} for epoch 2"):
        model.fit(X, Y, batch_size=MICRO, epochs=3, callbacks=[scheduler], **FIT)
    assert int(model.optimizer.iterations.numpy()) == 0
    for w, w0 in zip(model.get_weights(), initial):
        np.testing.assert_array_equal(w, w0)
    assert model.accum_steps == 1


@pytest.mark.parametrize(
    "schedule",
    [lambda: 2, lambda epoch, logs: 2, lambda *, epoch: 2],
    ids=["none", "two", "keyword"],
)
@pytest.mark.unit
def test_a_callable_of_the_wrong_arity_is_refused_at_construction(schedule):
    with pytest.raises(
        TypeError,
        match=r"(?s)`schedule` must be a callable taking the epoch.*Received: schedule=<function",
    ):
        AccumScheduler(schedule)


@pytest.mark.unit
def test_callables_taking_the_epoch_are_accepted():
    AccumScheduler(lambda epoch, logs=None: 2)
    AccumScheduler(lambda *args: 2)
    AccumScheduler(max)  # a builtin: no signature to read, checked when called


def test_a_plain_model_is_refused_before_training():
    model = functional()
    model.compile(OPTIMIZERS["adam"](), loss())
    initial = model.get_weights()
    with pytest.raises(ValueError, match="AccumScheduler needs a keras_accum model"):
        model.fit(X, Y, batch_size=MICRO, callbacks=[AccumScheduler({0: 2})], **FIT)
    for w, w0 in zip(model.get_weights(), initial):
        np.testing.assert_array_equal(w, w0)


# -- with fit(accum_steps=...) ----------------------------------------------------


@pytest.mark.parametrize(
    "schedule", [{0: 2}, {0: 2, 2: 4}, lambda epoch: 2], ids=["dict", "dict_later", "callable"]
)
def test_fit_accum_steps_that_the_schedule_would_replace_is_refused_before_training(schedule):
    model = functional(AccumModel, accum_steps=3)
    model.compile(OPTIMIZERS["adam"](), loss())
    before = model.get_weights()
    with pytest.raises(
        ValueError, match=r"fit\(accum_steps=8\).*schedule says 2.*Nothing was trained"
    ):
        model.fit(
            X,
            Y,
            batch_size=MICRO,
            epochs=2,
            accum_steps=8,
            callbacks=[AccumScheduler(schedule)],
            **FIT,
        )
    assert model.accum_steps == 3 and int(model.optimizer.iterations.numpy()) == 0
    for a, b in zip(before, model.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_fit_accum_steps_is_where_a_later_schedule_starts_from():
    model = functional(AccumModel)
    model.compile(OPTIMIZERS["adam"](), loss())
    model.fit(
        X, Y, batch_size=MICRO, epochs=3, accum_steps=2, callbacks=[AccumScheduler({2: 4})], **FIT
    )
    plain, _ = plain_following(lambda epoch: 2 if epoch < 2 else 4, epochs=3)
    assert_weights_close(plain, model)
    assert model.accum_steps == 1


def test_the_progress_bar_prints_accum_steps_as_an_integer(capsys):
    model = functional(AccumModel)
    model.compile(OPTIMIZERS["adam"](), loss())
    history = model.fit(
        X,
        Y,
        batch_size=MICRO,
        epochs=2,
        shuffle=False,
        verbose=2,
        callbacks=[AccumScheduler({0: 1, 1: 2})],
    )
    out = capsys.readouterr().out
    assert out.count("accum_steps: 1\n") == 1 and out.count("accum_steps: 2\n") == 1, out
    # Still an int for everything else (a batch size, say).
    assert history.history["accum_steps"] == [1, 2]
    assert all(isinstance(v, int) for v in history.history["accum_steps"])


# -- learning_rate_rule ---------------------------------------------------------


def test_a_rule_sets_the_rate_of_each_scheduled_batch():
    # sqrt: the rate tuned for batch 8 (the first), times sqrt(batch / 8).
    model = functional(AccumModel, accum_steps=3)
    model.compile(OPTIMIZERS["adam"](), loss(), metrics=["accuracy"])
    scheduler = AccumScheduler(SCHEDULE, learning_rate_rule="sqrt")
    model.fit(X, Y, batch_size=MICRO, epochs=EPOCHS, callbacks=[scheduler], **FIT)
    plain = functional()
    plain.compile(OPTIMIZERS["adam"](), loss(), metrics=["accuracy"])
    tuned = float(plain.optimizer.learning_rate)
    for epoch in range(EPOCHS):
        steps = step_of(SCHEDULE)(epoch)
        plain.optimizer.learning_rate = tuned * np.sqrt(steps)
        plain.fit(X, Y, batch_size=MICRO * steps, epochs=epoch + 1, initial_epoch=epoch, **FIT)
    assert_weights_close(plain, model)
    assert [d.learning_rate for d in scheduler.path] == pytest.approx(
        [tuned, tuned * np.sqrt(2), tuned * 2], rel=1e-6
    )
    # For this fit only: the tuned rate is back with the model's accum_steps.
    assert float(model.optimizer.learning_rate) == pytest.approx(tuned)


def test_a_rate_tuned_for_a_bigger_batch_is_scaled_down_from_the_first_step():
    # Rate tuned for 32 samples; the fit starts at 8, then 16, then 32.
    model = functional(AccumModel)
    model.compile(OPTIMIZERS["sgd_momentum"](), loss())
    scheduler = AccumScheduler({1: 2, 2: 4}, learning_rate_rule="linear", tuned_batch=32)
    model.fit(X, Y, batch_size=MICRO, epochs=3, callbacks=[scheduler], **FIT)
    plain = functional()
    plain.compile(OPTIMIZERS["sgd_momentum"](), loss())
    tuned = float(plain.optimizer.learning_rate)
    for epoch, steps in enumerate([1, 2, 4]):
        plain.optimizer.learning_rate = tuned * MICRO * steps / 32
        plain.fit(X, Y, batch_size=MICRO * steps, epochs=epoch + 1, initial_epoch=epoch, **FIT)
    assert_weights_close(plain, model)
    assert [d.learning_rate for d in scheduler.path] == pytest.approx([tuned / 2, tuned], rel=1e-6)
    assert float(model.optimizer.learning_rate) == pytest.approx(tuned)


def test_a_rule_changes_nothing_when_the_batch_does_not():
    weights = []
    for rule in (None, "linear"):
        model = functional(AccumModel, accum_steps=2)
        model.compile(OPTIMIZERS["sgd_momentum"](), loss())
        model.fit(
            X,
            Y,
            batch_size=MICRO,
            epochs=2,
            callbacks=[AccumScheduler({0: 2}, learning_rate_rule=rule)],
            **FIT,
        )
        weights.append(model.get_weights())
    for a, b in zip(*weights):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize(
    "optimizer, kwargs, match",
    [
        (
            "adam_exponential_decay",
            dict(learning_rate_rule="sqrt"),
            r"rate is a ExponentialDecay, not a number.*SampleSchedule.*learning_rate_rule=None",
        ),
        (
            "adam",
            dict(tuned_batch=256),
            r"`tuned_batch` is.*neither.*Nothing was trained. Received: tuned_batch=256",
        ),
    ],
)
def test_a_rule_or_tuned_batch_the_rate_cannot_follow_is_refused_before_training(
    optimizer, kwargs, match
):
    model = functional(AccumModel)
    model.compile(OPTIMIZERS[optimizer](), loss())
    with pytest.raises(ValueError, match=match):
        model.fit(
            X, Y, batch_size=MICRO, epochs=2, callbacks=[AccumScheduler({1: 2}, **kwargs)], **FIT
        )
    assert int(model.optimizer.iterations.numpy()) == 0


# -- SampleSchedule: a Keras schedule whose steps count samples ------------------


def decay():
    return keras.optimizers.schedules.ExponentialDecay(0.02, decay_steps=10, decay_rate=0.5)


@pytest.mark.unit
def test_a_sample_schedule_nothing_drives_is_its_schedule_bit_for_bit():
    inner, counted = decay(), SampleSchedule(decay())
    for step in [0, 1, 5, 17, 1000, 2**20 + 1]:
        assert float(counted(step)) == float(inner(step)), step


@pytest.mark.unit
def test_a_sample_schedule_counts_each_updates_samples_since_each_change():
    inner, counted = decay(), SampleSchedule(decay())
    counted.follow(10, scale=2.0, factor=3.0)  # updates 0-9 held one tuned batch each
    assert counted.step_at(14) == 10 + 4 * 2
    counted.follow(14, scale=4.0, factor=0.5)
    assert counted.step_at(15) == 18 + 4
    np.testing.assert_allclose(float(counted(15)), 0.5 * float(inner(22.0)), rtol=1e-6)
    # Its count travels in its config (a .keras file's optimizer).
    again = keras.optimizers.schedules.deserialize(keras.optimizers.schedules.serialize(counted))
    assert isinstance(again, SampleSchedule) and again.state() == counted.state()
    assert float(again(15)) == float(counted(15))


@pytest.mark.unit
def test_a_sample_schedule_of_what_is_not_a_schedule_is_refused_naming_it():
    with pytest.raises(
        TypeError, match=r"`schedule` must be a keras.*schedule=0.1 \(of type float\)"
    ):
        SampleSchedule(0.1)
    for state in (5, "12345", [1.0, 2.0]):
        with pytest.raises(
            ValueError, match=rf"`state` must be the 5 numbers.*state={re.escape(repr(state))}"
        ):
            SampleSchedule(decay(), state=state)


@pytest.mark.unit
def test_an_optimizer_behind_the_count_restarts_it_from_its_own_iterations():
    # A new optimizer given an earlier one's schedule, or weights loaded
    # from earlier: never a negative step (a negative rate for a warm-up).
    inner, counted = decay(), SampleSchedule(decay())
    counted.follow(32, scale=0.25, factor=1.0)  # 32 updates of the tuned batch
    assert counted.behind(5) and not counted.behind(32)
    assert counted.step_at(5) == 5.0
    assert float(counted(5)) == float(inner(5))
    counted.follow(5, scale=2.0, factor=1.0)  # restarted at update 5
    assert counted.step_at(7) == 5 + 2 * 2


def test_a_later_fit_counts_in_the_first_fits_tuned_batch():
    model = functional(AccumModel)
    counted = SampleSchedule(decay())
    model.compile(keras.optimizers.Adam(counted), loss())
    model.fit(X, Y, batch_size=MICRO, epochs=1, callbacks=[AccumScheduler({0: 1})], **FIT)
    assert counted.tuned_batch == MICRO and counted.step_at(12) == 12
    # This fit starts at batch 16: still counted in batches of 8.
    model.fit(
        X, Y, batch_size=MICRO, epochs=1, accum_steps=2, callbacks=[AccumScheduler({0: 2})], **FIT
    )
    assert counted.step_at(int(model.optimizer.iterations)) == 12 + 2 * 6
    # Recompiled with a new optimizer: behind the count, restarted, warned.
    model.compile(keras.optimizers.Adam(counted), loss())
    with pytest.warns(UserWarning, match=r"iterations \(0\) are behind its SampleSchedule"):
        model.fit(X, Y, batch_size=MICRO, epochs=1, callbacks=[AccumScheduler({0: 1})], **FIT)
    assert counted.step_at(12) == 12
    assert float(model.optimizer.learning_rate) == pytest.approx(float(decay()(12.0)))


class PiecewiseReference(keras.optimizers.schedules.LearningRateSchedule):
    """By hand: `inner` at the samples trained (in batches of 8) times the
    rule's factor, for updates of 8 x `steps[i]` samples from `starts[i]`."""

    def __init__(self, inner, starts, steps, rule):
        self.inner, self.starts, self.steps, self.rule = inner, starts, steps, rule

    def __call__(self, step):
        step = tf.cast(step, tf.float64)
        ends = self.starts[1:] + [np.inf]
        progress = sum(
            tf.clip_by_value(step - start, 0.0, end - start) * k
            for start, end, k in zip(self.starts, ends, self.steps)
        )
        factor = tf.gather(
            tf.constant([self.rule(k) for k in self.steps], tf.float32),
            tf.reduce_sum(tf.cast(step >= tf.constant(self.starts[1:], tf.float64), tf.int32)),
        )
        return self.inner(tf.cast(progress, tf.float32)) * factor


# Without a rule in the slow tier: the rule's case follows the samples too.
@pytest.mark.parametrize("rule", [pytest.param(None, marks=pytest.mark.slow), "sqrt"])
def test_a_sample_schedule_follows_the_samples_and_the_rule_exactly(rule):
    model = functional(AccumModel)
    model.compile(keras.optimizers.Adam(SampleSchedule(decay())), loss())
    scheduler = AccumScheduler(SCHEDULE, learning_rate_rule=rule)
    model.fit(X, Y, batch_size=MICRO, epochs=EPOCHS, callbacks=[scheduler], **FIT)
    # Updates per epoch: 12 of 8 samples, 12, 6 of 16, 3 of 32, 3.
    factor = (lambda k: 1.0) if rule is None else np.sqrt
    plain = functional()
    plain.compile(
        keras.optimizers.Adam(PiecewiseReference(decay(), [0, 24, 30], [1, 2, 4], factor)), loss()
    )
    for epoch in range(EPOCHS):
        steps = step_of(SCHEDULE)(epoch)
        plain.fit(X, Y, batch_size=MICRO * steps, epochs=epoch + 1, initial_epoch=epoch, **FIT)
    assert_weights_close(plain, model)
    assert [d.updates for d in scheduler.path] == [24, 30]
    assert [d.learning_rate for d in scheduler.path] == pytest.approx(
        [factor(2) * float(decay()(24.0)), factor(4) * float(decay()(36.0))], rel=1e-6
    )
    # After the fit the count goes on in updates of the tuned batch, from
    # the samples trained: 24 + 2 x 6 + 4 x 6 = 60.
    assert model.optimizer.learning_rate.numpy() == pytest.approx(float(decay()(60.0)), rel=1e-6)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (
            dict(schedule={0: 2}, every_updates=10),
            ValueError,
            r"`every_updates` is for.*every_updates=10",
        ),
        (
            dict(schedule="noise_scale", max_accum_steps=8, every_updates=5, every_samples=100),
            ValueError,
            r"not both.*every_updates=5, every_samples=100",
        ),
        (
            dict(schedule="noise_scale", max_accum_steps=8, every_updates=0),
            ValueError,
            r"`every_updates` must be a positive integer.*every_updates=0",
        ),
        (
            dict(schedule="noise_scale", max_accum_steps=8, every_samples=2.5),
            ValueError,
            r"`every_samples` must be a positive integer.*every_samples=2.5",
        ),
        (
            dict(schedule="noise_scale", max_accum_steps=8, noise_scale_multiple=0),
            ValueError,
            r"`noise_scale_multiple` must be a number > 0.*noise_scale_multiple=0",
        ),
        (
            dict(schedule={0: 2}, noise_scale_multiple=2.0),
            ValueError,
            r"`noise_scale_multiple` is for.*noise_scale_multiple=2.0",
        ),
        (
            dict(schedule={0: 2}, learning_rate_rule="sqrt", tuned_batch=0),
            ValueError,
            r"`tuned_batch` must be a positive integer.*tuned_batch=0",
        ),
        (
            dict(schedule={0: 2}, learning_rate_rule="cube"),
            ValueError,
            r"`learning_rate_rule` must be one of.*learning_rate_rule='cube'",
        ),
        (
            dict(schedule="noise_scale", max_accum_steps=8, min_accum_steps=16),
            ValueError,
            r"`min_accum_steps`.*at most `max_accum_steps`.*min_accum_steps=16, max_accum_steps=8",
        ),
        (
            dict(schedule="noise_scale", max_accum_steps=8, min_accum_steps=0),
            ValueError,
            r"`min_accum_steps`.*min_accum_steps=0",
        ),
        (
            dict(schedule={0: 2}, min_accum_steps=1),
            ValueError,
            r"`min_accum_steps` is for.*min_accum_steps=1",
        ),
    ],
)
@pytest.mark.unit
def test_bad_decision_and_rule_arguments_are_refused_naming_them(kwargs, error, match):
    with pytest.raises(error, match=match):
        AccumScheduler(**kwargs)
