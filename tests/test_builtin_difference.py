"""The README's claims about `optimizer(gradient_accumulation_steps=N)`.

Each test trains three models from the same weights: the plain big-batch
reference, Keras's built-in accumulation and AccumModel, and shows where the
built-in departs from the reference while AccumModel does not.
"""

import keras
import numpy as np

from helpers.assertions import assert_weights_close
from helpers.data import make_data
from helpers.models import functional, loss
from keras_accum import AccumModel

MICRO, N = 8, 4


def three_runs(make_optimizer, n, epochs=1):
    x, y = make_data(n)
    fit = dict(epochs=epochs, shuffle=False, verbose=0)
    plain = functional()
    plain.compile(make_optimizer(), loss())
    plain.fit(x, y, batch_size=MICRO * N, **fit)
    builtin = functional()
    builtin.compile(make_optimizer(gradient_accumulation_steps=N), loss())
    builtin.fit(x, y, batch_size=MICRO, **fit)
    ours = functional(AccumModel, accum_steps=N)
    ours.compile(make_optimizer(), loss())
    ours.fit(x, y, batch_size=MICRO, **fit)
    return plain, builtin, ours


def max_difference(a, b):
    return max(np.abs(u - v).max() for u, v in zip(a.get_weights(), b.get_weights()))


def sgd(**kwargs):
    return keras.optimizers.SGD(0.5, **kwargs)


def test_builtin_counts_schedule_steps_in_micro_batches():
    schedule = keras.optimizers.schedules.ExponentialDecay(0.5, 1, 0.5)
    plain, builtin, ours = three_runs(lambda **kw: keras.optimizers.SGD(schedule, **kw), n=64)
    # Two updates: the reference's schedule is at step 2 ...
    assert float(plain.optimizer.learning_rate) == 0.5 * 0.5**2
    assert float(ours.optimizer.learning_rate) == 0.5 * 0.5**2
    # ... the built-in's at step 8, one per micro-batch.
    assert float(builtin.optimizer.learning_rate) == 0.5 * 0.5**8
    assert max_difference(plain, builtin) > 1e-3
    assert_weights_close(plain, ours)


def test_builtin_divides_an_uneven_window_by_n():
    # 28 samples: micro-batches of 8, 8, 8 and 4 make one window. The big
    # batch averages 28 samples; the built-in averages 4 batch means, giving
    # the 4 samples of the last micro-batch twice their weight.
    plain, builtin, ours = three_runs(sgd, n=28)
    assert int(plain.optimizer.iterations) == int(builtin.optimizer.iterations) == 1
    assert max_difference(plain, builtin) > 1e-3
    assert_weights_close(plain, ours)


def test_builtin_drops_the_partial_window_at_the_end_of_training():
    # 40 samples: one full window and one micro-batch left over.
    x, y = make_data(40)
    plain, builtin, ours = three_runs(sgd, n=40)
    assert int(plain.optimizer.iterations) == int(ours.optimizer.iterations) == 2
    assert int(builtin.optimizer.iterations) == 1
    # The built-in trained exactly as if the last 8 samples did not exist.
    first_32_only = functional()
    first_32_only.compile(sgd(), loss())
    first_32_only.fit(x[:32], y[:32], batch_size=32, shuffle=False, verbose=0)
    assert_weights_close(first_32_only, builtin)
    assert_weights_close(plain, ours)


def test_builtin_carries_a_partial_window_into_the_next_epoch():
    # 40 samples, 2 epochs: the built-in's second window mixes epoch 1's last
    # micro-batch with epoch 2's first three, and was taken before the
    # epoch-1 leftover was ever applied.
    plain, builtin, ours = three_runs(sgd, n=40, epochs=2)
    assert int(plain.optimizer.iterations) == int(ours.optimizer.iterations) == 4
    assert int(builtin.optimizer.iterations) == 2
    assert max_difference(plain, builtin) > 1e-3
    assert_weights_close(plain, ours)


def test_builtin_ignores_a_change_of_gradient_accumulation_steps_between_epochs():
    # Its window length is traced into the step: set between two fit calls,
    # it changes nothing (AccumScheduler retraces; tests/test_schedule.py).
    x, y = make_data(64)
    runs = []
    for change in (False, True):
        builtin = functional()
        builtin.compile(sgd(gradient_accumulation_steps=N), loss())
        builtin.fit(x, y, batch_size=MICRO, shuffle=False, verbose=0)
        if change:
            builtin.optimizer.gradient_accumulation_steps = 2
        builtin.fit(x, y, batch_size=MICRO, shuffle=False, verbose=0)
        runs.append(builtin)
    assert_weights_close(runs[0], runs[1], rtol=0, atol=0)


def test_builtin_applies_a_window_with_a_nan_gradient():
    # float32, one NaN sample: the built-in's update makes every weight NaN;
    # AccumModel(skip_nonfinite=True) skips that window (tests/test_nonfinite.py).
    x, y = make_data(64)
    x[40, 0] = np.nan
    builtin = functional()
    builtin.compile(sgd(gradient_accumulation_steps=N), loss())
    builtin.fit(x, y, batch_size=MICRO, shuffle=False, verbose=0)
    assert all(np.isnan(w).all() for w in builtin.get_weights())
    ours = functional(AccumModel, accum_steps=N, skip_nonfinite=True)
    ours.compile(sgd(), loss())
    ours.fit(x, y, batch_size=MICRO, shuffle=False, verbose=0)
    assert all(np.isfinite(w).all() for w in ours.get_weights())
    assert ours.skipped_windows == 1
