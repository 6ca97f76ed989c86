"""What the traced step holds per variable: nothing that runs every
micro-batch grows with the model beyond the gradient buffers' own adds.

A conditional is lowered into the step's graph, so the executor visits its
nodes at every micro-batch, also when the branch is not taken (the window
is applied at one micro-batch in N). A conditional per variable in the
window's update made step mode 1.2x Keras's built-in accumulation on a
model with 98 variables (benchmarks/step_mode_ops.md).
"""

import re

import keras
import numpy as np
import pytest
import tensorflow as tf

from helpers.data import make_data
from helpers.internals import graphs_as_run
from helpers.models import functional, loss
from keras_accum import AccumModel

FEATURES, N = 4, 4


def _conditionals(graph):
    # In the step's graph and every function it holds (conditional branches).
    nodes = [*graph.as_graph_def().node]
    for function in graph.as_graph_def().library.function:
        nodes.extend(function.node_def)
    return sum(node.op in ("If", "StatelessIf") for node in nodes)


def _outer_adds(graph):
    # Outside every conditional: what runs at every micro-batch in sequence.
    return sum(node.op == "AssignAddVariableOp" for node in graph.as_graph_def().node)


def _step_graph(depth):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((FEATURES,))
    h = inputs
    for _ in range(depth):
        h = keras.layers.Dense(3, activation="relu")(h)
    model = AccumModel(inputs, keras.layers.Dense(2)(h), accum_steps=N)
    model.compile(keras.optimizers.Adam(), loss())
    model.make_train_function()  # binds the window, as fit does
    x, y = np.zeros((8, FEATURES), "float32"), np.zeros((8,), "int64")
    model.train_on_batch(x, y)
    step = tf.function(model.train_step).get_concrete_function(
        (tf.TensorSpec((None, FEATURES)), tf.TensorSpec((None,), tf.int64))
    )
    return step.graph


def test_the_step_has_no_conditional_per_variable():
    assert _conditionals(_step_graph(1)) == _conditionals(_step_graph(6))


def test_the_micro_batch_that_fills_the_window_goes_straight_into_the_update():
    # On one device, a buffer is added to only in the branch that does not
    # update: adding the last gradient and then reading it back in the
    # update serialised the two and cost the update micro-batch 1.12x
    # Keras's (benchmarks/redesign_before_after.md). Counted as a function
    # of depth: the loss tracker's and metrics' adds do not grow with it.
    assert _outer_adds(_step_graph(1)) == _outer_adds(_step_graph(6))


def test_micro_batch_gradients_are_summed_one_at_a_time():
    # Summed after the last micro-batch, the gradients made one chain of
    # adds, which TensorFlow's graph optimiser rewrote into AddNs of several
    # micro-batches' gradients, held at once: 1.56 GB against the big
    # batch's 0.70 on benchmarks/contrastive.md's MLP. Each micro-batch
    # now waits for the sum before it, and no add is rewritten.
    keras.utils.set_random_seed(0)
    inputs = keras.Input((FEATURES,))
    hidden = keras.layers.Dense(8, activation="relu")(inputs)
    model = AccumModel(inputs, keras.layers.Dense(2)(hidden), micro_batch_size=2)
    model.compile(keras.optimizers.SGD(), loss())
    x, y = np.zeros((8, FEATURES), "float32"), np.zeros((8,), "int64")
    model.train_on_batch(x, y)  # traced
    batches = iter(tf.data.Dataset.from_tensors((x, y)).repeat())
    rewritten = [
        node.name
        for graph in graphs_as_run(model.train_function, batches)
        for node in graph.node
        if "AddOpsRewrite" in node.name
    ]
    assert not rewritten, rewritten


def _as_run(samples):
    # One step of micro-batches of 2 as TensorFlow ran it: the functions the
    # step's graphs call, and the products they hold themselves.
    keras.utils.set_random_seed(0)
    inputs = keras.Input((FEATURES,))
    hidden = keras.layers.Dense(8, activation="relu")(inputs)
    model = AccumModel(inputs, keras.layers.Dense(2)(hidden), micro_batch_size=2)
    model.compile(keras.optimizers.SGD(), loss())
    x, y = np.zeros((samples, FEATURES), "float32"), np.zeros((samples,), "int64")
    model.train_on_batch(x, y)  # traced
    batches = iter(tf.data.Dataset.from_tensors((x, y)).repeat())
    graphs = graphs_as_run(model.train_function, batches)  # the step's, in several views
    calls = [[n.attr["f"].func.name for n in g.node if "PartitionedCall" in n.op] for g in graphs]
    products = [sum("MatMul" in n.op for n in g.node) for g in graphs]
    return [c for c in calls if c], sum(products)


def test_a_split_steps_micro_batches_run_one_pass_not_a_copy_each():
    # Unrolled, each micro-batch was a copy of the forward and backward pass:
    # tracing grew with their number, and each copy's kernels held their own
    # constants (the transformer's 16 micro-batches: 91 s of CPU to trace
    # against 26 s, 25.9 MB peak against 22.0; engine/shared_pass.py). As
    # run (after Grappler, which inlines calls it may): one function, called
    # once per micro-batch, and no product of the pass in the step itself.
    for samples in (8, 16):
        calls, products = _as_run(samples)
        assert calls, "no graph calls a function"
        for called in calls:
            assert len(called) == samples // 2 and len(set(called)) == 1, called
        assert products == 0


def test_under_xla_each_micro_batch_is_done_before_the_next_starts():
    # XLA schedules without control dependencies: with them only, it ran
    # every micro-batch's forward pass first and held them all (the order
    # below was FFFFBBBB; on the contrastive benchmark's towers 284 MiB
    # against the big batch's 346, 56 since). Read in the order XLA
    # scheduled the step: the hidden layer's forward product (F) and its
    # kernel's gradient (B), micro-batch by micro-batch.
    keras.utils.set_random_seed(0)
    inputs = keras.Input((FEATURES,))
    hidden = keras.layers.Dense(16, activation="relu", name="hidden")(inputs)
    model = AccumModel(inputs, keras.layers.Dense(3)(hidden), micro_batch_size=8)
    model.compile(keras.optimizers.Adam(), loss(), jit_compile=True)
    x, y = np.ones((32, FEATURES), "float32"), np.zeros((32,), "int64")
    model.train_on_batch(x, y)
    step = tf.function(model.train_step, jit_compile=True)
    hlo = step.experimental_get_compiler_ir((tf.constant(x), tf.constant(y)))(stage="optimized_hlo")
    assert "is_scheduled=true" in hlo  # printed in the order it runs
    # A product is a `dot` or, in newer XLA, a fusion around one: either
    # keeps TensorFlow's op type in its metadata.
    shapes = {"f32[8,16]": "F", f"f32[{FEATURES},16]": "B"}
    order = "".join(
        shapes.get(line.split("=", 1)[1].split()[0].split("{")[0], "?")
        for line in hlo[hlo.index("ENTRY") :].splitlines()
        if 'op_type="MatMul"' in line
        and re.search(r"/hidden(_\d+)?/MatMul", line)
        # A bitcast of a product keeps its metadata and moves nothing.
        and " bitcast(" not in line
    )
    assert order == "FB" * 4, order


def test_under_xla_the_update_runs_once_per_window_not_at_every_micro_batch():
    # XLA's conditional simplifier turns a conditional whose branches do
    # only elementwise work (Adam's update) into both branches and a
    # select: the update ran at every micro-batch and was thrown away at
    # all but the last (an MLP's step mode took the built-in's 1.33x of a
    # plain step per micro-batch; benchmarks/xla.md). The compiled step
    # keeps the window's close a conditional.
    keras.utils.set_random_seed(0)
    model = functional(AccumModel, accum_steps=4)
    model.compile(keras.optimizers.Adam(), loss(), jit_compile=True)
    x, y = make_data(8)
    model.train_on_batch(x, y)
    step = tf.function(model.train_step, jit_compile=True)
    hlo = step.experimental_get_compiler_ir((tf.constant(x), tf.constant(y)))(stage="optimized_hlo")
    entry = hlo[hlo.index("ENTRY") :]
    assert " conditional(" in entry


@pytest.mark.slow  # two fresh processes
def test_under_xla_micro_batches_do_not_each_hold_a_gradient():
    # Each micro-batch waited on one element of the sum before it; XLA
    # copies an elementwise add into each reader of a part of it, so it put
    # off every add to the end and held every micro-batch's gradient: a
    # 1.6M-weight MLP's step held 67 MB of tensors at 8 micro-batches, 134
    # at 16. Each now waits on the whole sum: what a step holds does not
    # grow with its micro-batches (10.7 MB at 4 and 16 on TensorFlow 2.21;
    # 33.5 on 2.18, whose XLA holds more, but as much at 16 as at 4). Read
    # from TensorFlow's allocator, which keeps statistics only in a process
    # started with TF_CPU_ALLOCATOR_USE_BFC=true: one per count, both at once.
    import json
    from concurrent.futures import ThreadPoolExecutor

    from helpers.processes import run_python, script

    def held(micro_batches):
        done = run_python(
            script("xla_split_memory.py"), str(micro_batches), TF_CPU_ALLOCATOR_USE_BFC="true"
        )
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    with ThreadPoolExecutor(2) as pool:
        four, sixteen = pool.map(held, (4, 16))
    assert sixteen["held"] - four["held"] < 2 * four["gradient"], (four, sixteen)


def _float_constants(graphs):
    # Every float32 constant TensorFlow's kernels hold for the step, as run.
    for graph in graphs:
        for node in graph.node:
            if node.op == "Const" and node.attr["dtype"].type == tf.float32.as_datatype_enum:
                shape = [d.size for d in node.attr["value"].tensor.tensor_shape.dim]
                yield node.name, int(np.prod(shape))


def test_the_step_holds_no_zeros_the_size_of_a_buffer():
    # Zeros for the window's reset and a sparse window's padding were made by
    # `zeros_like`, which Grappler folds into constants the step's function
    # holds while it lives: one per buffer shape (0.43 MB and 0.26 MB on the
    # transformer benchmark, at its peak beside the buffers).
    keras.utils.set_random_seed(0)
    tokens = keras.Input((3,), dtype="int32")
    hidden = keras.layers.Flatten()(keras.layers.Embedding(40, 8)(tokens))
    hidden = keras.layers.Dense(16, activation="relu")(hidden)
    model = AccumModel(tokens, keras.layers.Dense(2)(hidden), accum_steps=N)
    model.compile(keras.optimizers.Adam(), loss())
    x, y = np.zeros((8, 3), "int32"), np.zeros((8,), "int64")
    model.train_on_batch(x, y)  # traced
    batches = iter(tf.data.Dataset.from_tensors((x, y)).repeat())
    smallest = min(int(np.prod(v.shape)) for v in model.trainable_variables if len(v.shape) > 1)
    held = [
        (name, size)
        for name, size in _float_constants(graphs_as_run(model.train_function, batches))
        if size >= smallest
    ]
    assert not held, held
