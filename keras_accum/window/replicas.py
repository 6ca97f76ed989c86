"""Window variables under a `tf.distribute` strategy: sync-on-read (one replica
included), so each replica accumulates locally until the window is applied.
Saving and loading touch only this process's replicas: a cross-replica read is
a collective, which would tie every save to a dead peer.
"""

import contextlib

import numpy as np
import tensorflow as tf

from keras_accum import _internals as internals

# How a per-replica variable reads across replicas.
SUMMED = tf.VariableAggregation.SUM
AVERAGED = tf.VariableAggregation.MEAN
FIRST_REPLICAS = tf.VariableAggregation.ONLY_FIRST_REPLICA


def variable_arguments(strategy, aggregation):
    """`tf.Variable` keyword arguments for a window variable under `strategy`:
    none on one device, else sync-on-read with `aggregation`."""
    if not internals.replicated(strategy):
        return {}
    return {
        "synchronization": tf.VariableSynchronization.ON_READ,
        "aggregation": aggregation,
    }


def scope_of(strategy):
    """The scope window variables are made in: the strategy's, if replicated."""
    if internals.replicated(strategy):
        return strategy.scope()
    return contextlib.nullcontext()


def in_cross_replica_context(make):
    """`make()` in cross-replica context (through `merge_call` from inside a
    replica), where a strategy's variables can be made."""
    context = tf.distribute.get_replica_context()
    if tf.distribute.has_strategy() and context is not None:
        return context.merge_call(lambda _: make())
    return make()


def local(strategy, variable):
    """`variable`'s components on this process's replicas (no collective)."""
    if strategy is None:
        return (variable,)
    return strategy.experimental_local_results(variable)


def replicas(strategy):
    """Replicas in sync: 1 without a strategy."""
    return 1 if strategy is None else strategy.num_replicas_in_sync


def shares(strategy):
    """How many processes hold a part of the window: 1 unless multi-worker."""
    if replicas(strategy) == 1:
        return 1
    return strategy.num_replicas_in_sync // len(strategy.extended.worker_devices)


def local_sum(components):
    """The sum of this process's components, as numpy."""
    total = components[0].numpy()
    for c in components[1:]:
        total = total + c.numpy()
    return total


def assign_share(components, value):
    """The whole share on the first local replica, zeros on the others: sums
    over replicas then give back exactly the saved value."""
    components[0].assign(value)
    for c in components[1:]:
        c.assign(np.zeros_like(value))


def assign_all(components, value):
    """`value` on every local replica (counters, flags)."""
    for c in components:
        c.assign(value)
