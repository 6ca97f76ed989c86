"""What the traced step holds per variable: nothing that runs every
micro-batch grows with the model beyond the gradient buffers' own adds.

A conditional is lowered into the step's graph, so the executor visits its
nodes at every micro-batch, also when the branch is not taken (the window
is applied at one micro-batch in N). A conditional per variable in the
window's update made step mode 1.2x Keras's built-in accumulation on a
model with 98 variables (benchmarks/step_mode_ops.md).
"""

import keras
import numpy as np
import tensorflow as tf
from helpers.models import loss

from keras_accum import AccumModel

FEATURES, N = 4, 4


def _conditionals(graph):
    # In the step's graph and every function it holds (conditional branches).
    nodes = [*graph.as_graph_def().node]
    for function in graph.as_graph_def().library.function:
        nodes.extend(function.node_def)
    return sum(node.op in ("If", "StatelessIf") for node in nodes)


def _step_conditionals(depth):
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
    return _conditionals(step.graph)


def test_the_step_has_no_conditional_per_variable():
    assert _step_conditionals(1) == _step_conditionals(6)
