"""Replicas inside the test process: two logical CPU devices stand in for
two GPUs.

`configure()` runs once, from tests/conftest.py, before TensorFlow starts
its runtime (as Keras's own distribute tests do); then `mirrored(2)` is a
two-replica `MirroredStrategy` in this very process, and `mirrored(1)`
the one-replica strategy that `MirroredStrategy()` is on a machine
without GPUs. Everything else runs on CPU:0 as before.

A bare `MirroredStrategy()` takes every logical CPU here (two replicas):
tests ask `mirrored(1)` for the CPU-only machine's one replica.
"""

import functools
import os

import tensorflow as tf

DEVICES = 2


def configure(workers=1):
    """Splits the CPU into `DEVICES` logical devices and, when `workers`
    test processes share the machine (pytest-xdist), gives each its share
    of the cores: several processes each running TensorFlow's default
    pools (a thread per core, twice) oversubscribe the machine."""
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * DEVICES
    )
    if workers > 1:
        threads = max(1, (os.cpu_count() or 1) // workers)
        tf.config.threading.set_intra_op_parallelism_threads(threads)
        tf.config.threading.set_inter_op_parallelism_threads(threads)
        # The processes a test starts (pages as pasted, cluster workers)
        # inherit the share: with TensorFlow's default pools each spun
        # threads on cores the other workers were using (6% of the CPU time
        # of a subset of those tests, paired).
        for pool in ("TF_NUM_INTRAOP_THREADS", "TF_NUM_INTEROP_THREADS"):
            os.environ.setdefault(pool, str(threads))


@functools.cache
def mirrored(replicas):
    """The MirroredStrategy of `replicas` replicas on this process's CPUs,
    one per process for each count.

    With 1, the strategy a CPU-only machine's `MirroredStrategy()` is (its
    one CPU), the commonest way multi-GPU code is first run: the strategy
    path of the step with one replica, where a one-replica bug hides.

    One strategy for every test: strategies made one after another in a
    process reuse collective instance keys, and a collective of one
    model's step then meets another's (a shape mismatch in TensorFlow).
    """
    return new_mirrored(replicas)


def new_mirrored(replicas, **kwargs):
    """A MirroredStrategy of its own (`cross_device_ops=...` in `kwargs`),
    for a test that must not share `mirrored(replicas)`."""
    devices = [f"/cpu:{i}" for i in range(replicas)]
    strategy = tf.distribute.MirroredStrategy(devices, **kwargs)
    assert strategy.num_replicas_in_sync == replicas
    return strategy
