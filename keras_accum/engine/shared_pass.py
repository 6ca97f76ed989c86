"""The micro-batches of a split step run one traced pass, called once each.

Unrolled, each micro-batch was its own copy of the forward and backward
pass in the step's graph: the step took as many times as long to trace (the
first `fit` of the transformer's 16 micro-batches: 91 s of CPU, 26 s
shared), and each copy's kernels held their own constants, about a quarter
of a megabyte per micro-batch there (docs/benchmarks/transformer.md,
"Memory"). Here one `tf.function` is traced at the first micro-batch (and
once more for a last one of another shape, or, without a static batch size,
for the stand-ins past a short batch's end) and called for every one; TensorFlow
keeps the calls calls (`internals.not_inlined`), so its kernels and their
constants exist once. The order is the unrolled step's: each call's inputs
wait for the sum before it (split/microbatch.py's `after`), and the step's
writes for every call.

Not under XLA: XLA compiles the step as one program and would inline the
call, so the micro-batches stay unrolled there, each waiting by data
(microbatch.py). Not under a `tf.distribute` strategy: a forward pass may
synchronise the replicas (a synchronized BatchNormalization's `merge_call`),
which TensorFlow refuses inside a nested function.
"""

from keras import tree

from keras_accum import _internals as internals
from keras_accum.window import MicroBatch
from keras_accum.window.batchnorm import BatchNormRecord


def micro_batch_pass(gradients, model, state, variables, shared):
    """`run(x, y, sample_weight, records, live=None)`: `gradients` (the step's
    `micro_batch_gradients`) of one micro-batch, a `MicroBatch`, its
    BatchNorm moments appended to `records`. `shared`: through one traced
    function (`SharedPass`), else each call traced where it is made.

    Example:
        run = micro_batch_pass(micro_batch_gradients, model, state, variables, True)
        parts = [run(*micro_batch, records) for micro_batch in micro_batches]
    """

    def run(x, y, sample_weight, records, live=None):
        return gradients(model, state, x, y, sample_weight, variables, records, live=live)

    return SharedPass(run) if shared else run


class SharedPass:
    """`run` (one micro-batch's pass, as `micro_batch_pass` makes it) as one
    function, called per micro-batch of a split step (made per trace of the
    step).

    What a trace learns that is not a tensor (the loss's normalisation,
    which layers record moments, where predictions have masks) is taken to
    be the same at every shape it is traced at: none of it reads a shape.
    It is kept from the latest trace as `_learnt`, which is the one the
    call being made traced or reused (calls come in order: full micro-batches
    first, then the other shape).

    Example:
        shared = SharedPass(run)
        first = shared(x[:8], y[:8], None, records)
        second = shared(x[8:], y[8:], None, records)  # the same function, called again
    """

    def __init__(self, run):
        self._run = run
        self._learnt = None
        # Made per trace of the step and called from its graph only: a
        # function of the same code traced anew each time the step is.
        self._function = internals.without_retracing_warning(internals.not_inlined(self._traced))

    def __call__(self, x, y, sample_weight, records, live=None):
        outputs = self._function(x, y, sample_weight, live)
        grads, grad_scale, weight, loss, num_samples, y_pred, masks, moments = outputs
        normalise, windows = self._learnt
        records.extend(BatchNormRecord(w, *m) for w, m in zip(windows, moments))
        # A prediction's mask is an attribute of its tensor: it crosses the
        # call as an output of its own.
        y_pred = tree.map_structure(_with_mask, y_pred, masks)
        return MicroBatch(grads, grad_scale, weight, normalise, loss, num_samples, y_pred)

    def _traced(self, x, y, sample_weight, live):
        records = []
        batch = self._run(x, y, sample_weight, records, live=live)
        self._learnt = (batch.normalise, [record.window for record in records])
        masks = tree.map_structure(_mask_of, batch.y_pred)
        moments = [(record.count, record.mean, record.variance) for record in records]
        return (
            batch.grads,
            batch.grad_scale,
            batch.weight,
            batch.loss,
            batch.num_samples,
            batch.y_pred,
            masks,
            moments,
        )


def _mask_of(t):
    return None if t is None else internals.get_keras_mask(t)


def _with_mask(t, mask):
    if t is not None and mask is not None:
        internals.set_keras_mask(t, mask)
    return t
