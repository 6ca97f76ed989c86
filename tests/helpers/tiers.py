"""Wide matrices: every case in the slow tier (or before a release, where
CI runs a case that covers it), a representative few in the integration tier.

A matrix over every way in or every optimizer runs in CI's slow tier
(`-m "slow and not release"`, once) and whole before a release; the README's test command (the
unit and integration tiers, the inner loop) runs the cases most likely to
break: the ways in that `fit` builds lazily or that wrap another model
(functional models are every other test's model), and the optimizers that
read a gradient most differently.

    @pytest.mark.parametrize("way", wide(sorted(WAYS_IN), WAYS))
    @pytest.mark.parametrize("mode, where", wide(list(product(MODES, WHERE)), KEEP))
"""

import pytest

# The ways in the integration tier keeps of a matrix over every way in.
WAYS = ("subclass", "wrap_subclassed")


def wide(values, keep, rest=pytest.mark.slow):
    """`values` as parameters, those not in `keep` marked `rest` (slow, or
    `release` where CI runs a case that covers them). A tuple is one case of
    several parameters (`"a, b"` in `parametrize`)."""
    assert set(keep) <= set(values), (keep, values)
    return [
        v if v in keep else pytest.param(*(v if isinstance(v, tuple) else (v,)), marks=rest)
        for v in values
    ]


def each_once(first, second, pairs):
    """The product of `first` and `second` as parameters (`"a, b"`), the
    `pairs` kept (each value of each once, say) and the rest marked slow:
    every combination in CI, each value in the inner loop."""
    return wide([(a, b) for a in first for b in second], pairs)


def each_way_once(values):
    """Every way in (never built before fit) x `values`, each way in `WAYS`
    paired with one value of `values` in turn for the inner loop
    (`each_once`)."""
    from helpers.models import WAYS_IN

    return each_once(sorted(WAYS_IN), values, list(zip(WAYS, values)))
