"""Graph, XLA and several steps per execution: variants of one case.

Keras traces `fit`'s step into a graph on a CPU, compiles it with XLA by
default on one GPU (`jit_compile="auto"`: our users' default path), and
runs several steps in one call with `steps_per_execution`. Every feature's
comparison with the plain big batch runs here in each variant, as optax's
tests run each case jitted and not (chex's variants): one case per
feature, one plain reference per case, trained once per test process in
Keras's default graph mode (helpers/references.py), and the accumulating
model trained in every variant against it. A new feature adds a case; a
new execution mode adds a variant.
"""

import dataclasses
from collections.abc import Callable

import keras
import pytest

from helpers import references
from helpers.assertions import (
    FLOAT16_ATOL,
    FLOAT16_RTOL,
    assert_history_close,
    assert_moved,
    assert_moving_close,
    assert_trained,
    assert_weights_close,
)
from helpers.data import bn_data, make_data, small_table_data, token_data
from helpers.models import (
    OPTIMIZERS,
    WAYS_IN,
    bn_net,
    functional,
    initial_weights,
    loss,
    mlp,
    small_tables_net,
    subclassed_bn_net,
    text_net,
)
from keras_accum import AccumModel

# Execution modes (compile arguments), each against the graph reference.
VARIANTS = {
    "xla": {"jit_compile": True},
    "steps_per_execution_3": {"steps_per_execution": 3},
    "xla_steps_per_execution_5": {"steps_per_execution": 5, "jit_compile": True},
}


@dataclasses.dataclass(frozen=True)
class Case:
    """One feature's comparison: the accumulating model on micro-batches of
    `micro` against the plain one on batches of `batch`, both made unbuilt
    from the same seed, `epochs` epochs of `data()`."""

    data: Callable
    plain: Callable
    accum: Callable
    batch: int = 32
    micro: int = 8
    optimizer: Callable = OPTIMIZERS["adam"]
    epochs: int = 2
    policy: str = "float32"
    metrics: tuple = ("accuracy",)
    # (plain, accum, plain history, accum history) -> asserts.
    compare: Callable = None
    # Variants beyond VARIANTS this case also runs.
    more: tuple = ()


def _same_training(plain, acc, hp, ha):
    assert_weights_close(plain, acc)
    assert int(acc.optimizer.iterations) == int(plain.optimizer.iterations)
    assert_history_close(hp, ha)


def _same_moving_statistics(plain, acc, hp, ha):
    # The raw input's moving statistics, exactly the big batch's (weights
    # differ: the big batch normalises by its own moments).
    assert_moved(plain)
    assert_moving_close(plain, acc)


def _same_weights(plain, acc, hp, ha):
    assert_weights_close(plain, acc)


def _within_float16(plain, acc, hp, ha):
    # The loss scale is checked and updated once per window, as the big
    # batch's once per batch; float16 rounding differs between the two.
    assert_weights_close(plain, acc, FLOAT16_RTOL, FLOAT16_ATOL)
    assert float(acc.optimizer.dynamic_scale) == float(plain.optimizer.dynamic_scale)


CASES = {
    # 100 samples, b=8, N=4: windows of 32, 32, 32 and 4, the last applied
    # at the epoch's end.
    "step": Case(
        lambda: make_data(100),
        functional,
        lambda: functional(AccumModel, accum_steps=4),
        compare=_same_training,
        more=("eager",),
    ),
    "subclass": Case(
        lambda: make_data(92),
        WAYS_IN["subclass"]()[1],
        WAYS_IN["subclass"](accum_steps=4)[0],
        compare=_same_training,
    ),
    # micro_batch_size=12 does not divide 32: micro-batches of 12, 12, 8.
    "micro_batch": Case(
        lambda: make_data(76),
        functional,
        lambda: functional(AccumModel, micro_batch_size=12),
        micro=32,
        compare=_same_training,
    ),
    "micro_batch_and_accum_steps": Case(
        lambda: make_data(76),
        functional,
        lambda: functional(AccumModel, micro_batch_size=12, accum_steps=2),
        micro=16,
        compare=_same_training,
    ),
    # The subclassed model is built inside the first (XLA) trace.
    "batchnorm": Case(
        lambda: bn_data(92),
        bn_net,
        lambda: bn_net(AccumModel, accum_steps=4),
        optimizer=lambda: keras.optimizers.SGD(0.1),
        metrics=(),
        compare=_same_moving_statistics,
    ),
    "batchnorm_subclass": Case(
        lambda: bn_data(92),
        subclassed_bn_net,
        lambda: subclassed_bn_net(AccumModel, accum_steps=4),
        optimizer=lambda: keras.optimizers.SGD(0.1),
        metrics=(),
        compare=_same_moving_statistics,
    ),
    # 60 samples: windows of 8+8+8+8 and 8+8+8+4, both applied in the
    # compiled step; the second leaves stale slices past its own.
    "sparse": Case(
        lambda: token_data(60),
        text_net,
        lambda: text_net(AccumModel, accum_steps=4),
        metrics=(),
        compare=_same_weights,
    ),
    # The last window (8+8+8+4) is applied in the compiled step at the short
    # batch: moments handed over in the static size of 4 full batches.
    "small_tables": Case(
        lambda: small_table_data(92),
        small_tables_net,
        lambda: small_tables_net(AccumModel, accum_steps=4),
        optimizer=lambda: keras.optimizers.Adam(learning_rate=0.01),
        metrics=(),
        compare=_same_weights,
    ),
    # mixed_float16's loss scale, once per window, in every alignment of
    # windows and executions.
    "mixed_float16": Case(
        lambda: make_data(100),
        mlp,
        lambda: mlp(AccumModel, accum_steps=4),
        policy="mixed_float16",
        compare=_within_float16,
        more=("steps_per_execution_2", "steps_per_execution_5", "xla_steps_per_execution_3"),
    ),
}

MORE = {
    "eager": {"run_eagerly": True},
    "steps_per_execution_2": {"steps_per_execution": 2},
    "steps_per_execution_5": {"steps_per_execution": 5},
    "xla_steps_per_execution_3": {"steps_per_execution": 3, "jit_compile": True},
}


def _fit(make, case, batch, **compile_kwargs):
    keras.mixed_precision.set_global_policy(case.policy)
    try:
        model = make()
        model.compile(case.optimizer(), loss(), metrics=list(case.metrics), **compile_kwargs)
        history = model.fit(
            *case.data(), batch_size=batch, epochs=case.epochs, shuffle=False, verbose=0
        )
    finally:
        keras.mixed_precision.set_global_policy("float32")
    return model, history


def reference(name):
    """The case's plain model on the big batch, in graph mode: trained once
    per test process, read by every variant."""

    def train():
        case = CASES[name]
        x, _ = case.data()
        initial = initial_weights(case.plain, x)
        plain, history = _fit(case.plain, case, case.batch)
        assert_trained(plain, initial)
        return plain, history

    return references.once(("variants", name), train)


# The inner loop runs XLA on the cases whose step differs most under it
# (the default on one GPU: step mode, micro-batches in a window, a sparse
# window), several steps per execution on step mode and on mixed_float16's
# loss scale, and XLA with several steps on step mode
# (mixed_float16's windows across executions are its steps_per_execution_3);
# every other variant runs in the slow tier, but XLA alone on the cases not
# in INNER_XLA: CI's slow tier runs each of them under XLA with five steps
# per execution (on the newest pair; the next and floor pairs run the
# inner loop's XLA cases only), XLA alone before a release.
INNER_XLA = {"step", "micro_batch_and_accum_steps", "sparse"}
INNER_STEPS = {"step", "mixed_float16"}


def _tier(name, variant):
    if variant == "eager" or (variant == "xla" and name in INNER_XLA):
        return None
    if variant == "xla":
        return pytest.mark.release
    if variant == "steps_per_execution_3" and name in INNER_STEPS:
        return None
    if (name, variant) == ("step", "xla_steps_per_execution_5"):
        return None
    return pytest.mark.slow


@pytest.mark.parametrize(
    "name, variant",
    [
        pytest.param(name, variant, marks=_tier(name, variant) or ())
        for name, case in CASES.items()
        for variant in [*VARIANTS, *case.more]
    ],
)
def test_every_variant_trains_as_the_big_batch(name, variant):
    case = CASES[name]
    plain, plain_history = reference(name)
    compile_kwargs = {**VARIANTS, **MORE}[variant]
    acc, acc_history = _fit(case.accum, case, case.micro, **compile_kwargs)
    assert acc.jit_compile == compile_kwargs.get("jit_compile", False)
    case.compare(plain, acc, plain_history, acc_history)
