"""The benchmarked workloads, and the implementations that train them.

Every workload is a functional model plus synthetic numpy data, in two sizes:
full (each epoch takes a second or more on 2 CPU cores) and quick (tiny, for
the smoke test). Keras is imported inside the functions that need it, so that
the driver, which only needs the names below, never loads TensorFlow.
"""

import dataclasses
from collections.abc import Callable

import numpy as np

ACCUM_STEPS = 8  # N: micro-batches per optimizer update
MICRO_BATCH = 32  # b: samples per micro-batch
LEARNING_RATE = 1e-3
SEED = 1234

IMPLEMENTATIONS = ("plain", "builtin", "gradient-accumulator", "AccumModel")
IMPLEMENTATION_NOTES = {
    "plain": "keras.Model, micro-batch b, no accumulation (one update per micro-batch)",
    "builtin": "keras.Model, Adam(gradient_accumulation_steps=N), micro-batch b",
    "gradient-accumulator": "PyPI gradient-accumulator's GradientAccumulateModel(accum_steps=N), micro-batch b",
    "AccumModel": "keras_accum.AccumModel(accum_steps=N), micro-batch b",
}
# The implementations that must work; the others are reported as unavailable
# when they cannot be imported or fail, and the run goes on without them.
REQUIRED = ("plain", "AccumModel")

TIMING_WORKLOADS = ("mlp", "cnn", "embedding")
# Selectable in every timing benchmark (`--workloads transformer`), not in
# their defaults: the committed runs of the three above are reproduced by
# the commands that made them.
ALL_WORKLOADS = (*TIMING_WORKLOADS, "transformer")
MEMORY_CONFIGS = (
    "plain N*b",
    "plain b",
    "AccumModel b x N",
    "plain b, input in N*b batches",
    "micro_batch_size b of N*b",
)

# The price of the memory saved: every mode below makes the same updates, of
# PRICE_ACCUM_STEPS * MICRO_BATCH samples, as the plain model trained with
# that big batch itself, whose time they are divided by.
PRICE_ACCUM_STEPS = 4
PRICE_MODES = (
    "big batch",
    "step mode",
    "step mode, steps_per_execution=N",
    "micro_batch_size=b",
    "micro_batch_size='auto'",
)
PRICE_NOTES = {
    "big batch": "keras.Model, batch N*b: the training the others stand in for",
    "step mode": "keras_accum.AccumModel(accum_steps=N), batch b",
    "step mode, steps_per_execution=N": "the same, compiled with steps_per_execution=N",
    "micro_batch_size=b": "keras_accum.AccumModel(micro_batch_size=b), batch N*b split inside the step",
    "micro_batch_size='auto'": "keras_accum.AccumModel(micro_batch_size='auto'), batch N*b "
    "(it never runs out of memory here, so this is the cost of being ready to)",
}


@dataclasses.dataclass(frozen=True)
class Workload:
    """A model architecture and its synthetic data.

    Attributes:
        name: short name used on the command line and in the report.
        description: one line for the report.
        build: returns `(inputs, outputs)` of a fresh functional graph; call it
            after seeding, so that every implementation starts from the same
            initial weights.
        data: maps a numpy `Generator` to `(x, y)`.
        samples: number of training samples (a multiple of N*b, so every
            accumulation window is full and no implementation has a partial
            window to deal with).
    """

    name: str
    description: str
    build: Callable[[], tuple]
    data: Callable[[np.random.Generator], tuple]
    samples: int


def _samples(windows):
    return windows * ACCUM_STEPS * MICRO_BATCH


def _labels(rng, samples, classes=10):
    return rng.integers(0, classes, size=samples).astype("int32")


def mlp(quick=False):
    """Optimizer-heavy: two 1024-wide hidden layers, so Adam's per-update work
    (several passes over ~1.6M parameters) is large next to the forward and
    backward pass of one 32-sample micro-batch."""
    features, width = (32, 64) if quick else (512, 1024)
    samples = _samples(2 if quick else 12)

    def build():
        import keras

        inputs = keras.Input((features,))
        x = keras.layers.Dense(width, activation="relu")(inputs)
        x = keras.layers.Dense(width, activation="relu")(x)
        return inputs, keras.layers.Dense(10)(x)

    def data(rng):
        x = rng.standard_normal((samples, features), dtype=np.float32)
        return x, _labels(rng, samples)

    return Workload(
        "mlp",
        f"MLP {features}-{width}-{width}-10, Adam, {samples} samples",
        build,
        data,
        samples,
    )


def cnn(quick=False):
    """Compute-heavy: a small CNN whose convolutions dominate the step."""
    size, channels = (8, 4) if quick else (32, 32)
    samples = _samples(2 if quick else 4)

    def build():
        import keras

        layers = keras.layers
        inputs = keras.Input((size, size, 3))
        x = layers.Conv2D(channels, 3, padding="same", activation="relu")(inputs)
        x = layers.Conv2D(channels, 3, padding="same", activation="relu")(x)
        x = layers.MaxPooling2D()(x)
        x = layers.Conv2D(2 * channels, 3, padding="same", activation="relu")(x)
        x = layers.MaxPooling2D()(x)
        x = layers.Flatten()(x)
        x = layers.Dense(128, activation="relu")(x)
        return inputs, layers.Dense(10)(x)

    def data(rng):
        x = rng.random((samples, size, size, 3), dtype=np.float32)
        return x, _labels(rng, samples)

    return Workload(
        "cnn",
        f"CNN on {size}x{size}x3 images, 3 conv layers ({channels}/{channels}/"
        f"{2 * channels} channels) + Dense 128, Adam, {samples} samples",
        build,
        data,
        samples,
    )


def embedding(quick=False):
    """Embedding-heavy: a 200,000 x 64 table (12.8M parameters) of which each
    micro-batch touches at most b*length rows: gradients are sparse, and any
    dense per-micro-batch work on the table is expensive."""
    vocabulary, length = (2_000, 8) if quick else (200_000, 32)
    samples = _samples(2 if quick else 3)

    def build():
        import keras

        inputs = keras.Input((length,), dtype="int32")
        x = keras.layers.Embedding(vocabulary, 64)(inputs)
        x = keras.layers.GlobalAveragePooling1D()(x)
        x = keras.layers.Dense(64, activation="relu")(x)
        return inputs, keras.layers.Dense(10)(x)

    def data(rng):
        x = rng.integers(0, vocabulary, size=(samples, length)).astype("int32")
        return x, _labels(rng, samples)

    return Workload(
        "embedding",
        f"Embedding({vocabulary:,}, 64) on sequences of {length} + average "
        f"pooling + Dense 64, Adam, {samples} samples",
        build,
        data,
        samples,
    )


def memory_cnn(quick=False):
    """Activation-heavy: wide feature maps at full resolution and few weights,
    so that memory during training is mostly activations, which grow with the
    batch; weights (and the accumulation buffers, one float32 copy of them)
    are small."""
    size, channels = (16, 8) if quick else (96, 64)
    samples = _samples(2)  # two updates' worth, for every configuration

    def build():
        import keras

        layers = keras.layers
        inputs = keras.Input((size, size, 3))
        x = layers.Conv2D(channels, 3, padding="same", activation="relu")(inputs)
        x = layers.MaxPooling2D()(x)
        x = layers.Conv2D(channels, 3, padding="same", activation="relu")(x)
        x = layers.MaxPooling2D()(x)
        x = layers.Conv2D(2 * channels, 3, padding="same", activation="relu")(x)
        x = layers.GlobalAveragePooling2D()(x)
        return inputs, layers.Dense(10)(x)

    def data(rng):
        x = rng.random((samples, size, size, 3), dtype=np.float32)
        return x, _labels(rng, samples)

    return Workload(
        "memory-cnn",
        f"CNN on {size}x{size}x3 images, 3 conv layers ({channels}/{channels}/"
        f"{2 * channels} channels, pooling between) + Dense 10, Adam, "
        f"{samples} samples",
        build,
        data,
        samples,
    )


# The transformer's shape, full and quick: (vocabulary, length, width,
# heads, blocks). 8 blocks of 16 variables each, the two embeddings, a final
# LayerNormalization and the output layer: 134 trainable variables.
TRANSFORMER_SIZES = {"full": (1_000, 32, 64, 4, 8), "quick": (64, 8, 16, 2, 2)}


def transformer_layers():
    """`(TokenAndPosition, DecoderBlock)`: plain-Keras layers of a GPT-style
    decoder (no keras_hub), defined when Keras is imported."""
    import keras

    class TokenAndPosition(keras.layers.Layer):
        """A token embedding (a sparse gradient) plus a learned position
        table, sliced to the sequence's length as KerasHub's
        `PositionEmbedding` does (a dense gradient). Not read through an
        `Embedding` of `arange(length)` (keras.io's miniature GPT): that
        table's gradient is an `IndexedSlices` of the same rows in every
        micro-batch, which keras_accum (as of this benchmark) joins as N
        occurrences each where the big batch has one (summed over its
        batch), so Adam's step on it differs from the big batch's (a full
        extra step of the learning rate on the first update); the built-in
        sums it densely and matches."""

        def __init__(self, vocabulary, length, width, **kwargs):
            super().__init__(**kwargs)
            self.tokens = keras.layers.Embedding(vocabulary, width)
            self.positions = self.add_weight(
                shape=(length, width), initializer="uniform", name="positions"
            )

        def call(self, inputs):
            length = keras.ops.shape(inputs)[-1]
            positions = keras.ops.slice(self.positions, (0, 0), (length, self.positions.shape[1]))
            return self.tokens(inputs) + keras.ops.expand_dims(positions, 0)

    class DecoderBlock(keras.layers.Layer):
        """Pre-norm: x + attention(norm x), causal; then x + MLP(norm x),
        the MLP 4x wider. 16 variables."""

        def __init__(self, width, heads, **kwargs):
            super().__init__(**kwargs)
            self.norm1 = keras.layers.LayerNormalization(epsilon=1e-5)
            self.attention = keras.layers.MultiHeadAttention(heads, width // heads)
            self.norm2 = keras.layers.LayerNormalization(epsilon=1e-5)
            self.up = keras.layers.Dense(4 * width, activation="gelu")
            self.down = keras.layers.Dense(width)

        def call(self, x):
            h = self.norm1(x)
            x = x + self.attention(h, h, use_causal_mask=True)
            return x + self.down(self.up(self.norm2(x)))

    return TokenAndPosition, DecoderBlock


def transformer(quick=False, samples=None):
    """Many variables: a GPT-style decoder (token + position embedding, 8
    causal self-attention blocks, a token loss over every position), 134
    trainable variables of all shapes, so any per-variable work of an
    accumulation is paid 134 times a step; the 1,000-row token table's
    gradient is sparse. `samples` (sequences) overrides the default two
    windows of N*b."""
    vocabulary, length, width, heads, blocks = TRANSFORMER_SIZES["quick" if quick else "full"]
    samples = samples or _samples(2)

    def build():
        import keras

        token_and_position, decoder_block = transformer_layers()
        inputs = keras.Input((length,), dtype="int32")
        x = token_and_position(vocabulary, length, width)(inputs)
        for _ in range(blocks):
            x = decoder_block(width, heads)(x)
        x = keras.layers.LayerNormalization(epsilon=1e-5)(x)
        return inputs, keras.layers.Dense(vocabulary)(x)  # next-token logits

    def data(rng):
        # Random token sequences; the target of each position is the next
        # token (the loss is the mean cross-entropy over every position).
        tokens = rng.integers(0, vocabulary, size=(samples, length + 1)).astype("int32")
        return tokens[:, :-1], tokens[:, 1:]

    return Workload(
        "transformer",
        f"decoder of {blocks} blocks (width {width}, {heads} heads, MLP {4 * width}, "
        f"causal self-attention) on sequences of {length} tokens, "
        f"Embedding({vocabulary:,}, {width}) + positions, next-token loss, Adam, "
        f"{samples} sequences",
        build,
        data,
        samples,
    )


def timing_workload(name, quick=False):
    return {
        "mlp": mlp,
        "cnn": cnn,
        "embedding": embedding,
        "transformer": transformer,
    }[name](quick)


def make_price_model(mode, workload, seed=SEED):
    """`(compiled model, batch_size)` of a `PRICE_MODES` mode of `workload`,
    compiled as `make_model` compiles."""
    import keras

    import keras_accum

    n, b = PRICE_ACCUM_STEPS, MICRO_BATCH
    keras.utils.set_random_seed(seed)
    inputs, outputs = workload.build()
    steps_per_execution = 1
    if mode == "big batch":
        model, batch_size = keras.Model(inputs, outputs), n * b
    elif mode == "step mode":
        model, batch_size = keras_accum.AccumModel(inputs, outputs, accum_steps=n), b
    elif mode == "step mode, steps_per_execution=N":
        model, batch_size = keras_accum.AccumModel(inputs, outputs, accum_steps=n), b
        steps_per_execution = n
    elif mode == "micro_batch_size=b":
        model = keras_accum.AccumModel(inputs, outputs, micro_batch_size=b)
        batch_size = n * b
    elif mode == "micro_batch_size='auto'":
        model = keras_accum.AccumModel(inputs, outputs, micro_batch_size="auto")
        batch_size = n * b
    else:
        raise ValueError(f"Unknown mode: {mode!r}")
    model.compile(
        optimizer=keras.optimizers.Adam(LEARNING_RATE),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        steps_per_execution=steps_per_execution,
    )
    return model, batch_size


def make_model(implementation, workload, accum_steps=ACCUM_STEPS, seed=SEED):
    """A compiled model of `workload` trained the way `implementation` trains.

    Seeded before the graph is built, so every implementation of a workload
    starts from the same initial weights. All use Adam with the same learning
    rate and a from-logits sparse cross-entropy, and no metrics (metrics add
    the same cost to every implementation and only blur the comparison).

    Raises:
        ImportError, or whatever the implementation raises, when it cannot be
        built (e.g. the `gradient-accumulator` package is not installed).
    """
    import keras

    keras.utils.set_random_seed(seed)
    inputs, outputs = workload.build()
    optimizer = keras.optimizers.Adam(LEARNING_RATE)
    if implementation == "plain":
        model = keras.Model(inputs, outputs)
    elif implementation == "builtin":
        model = keras.Model(inputs, outputs)
        optimizer = keras.optimizers.Adam(LEARNING_RATE, gradient_accumulation_steps=accum_steps)
    elif implementation == "gradient-accumulator":
        from gradient_accumulator import GradientAccumulateModel

        model = GradientAccumulateModel(accum_steps=accum_steps, inputs=inputs, outputs=outputs)
    elif implementation == "AccumModel":
        import keras_accum

        model = keras_accum.AccumModel(inputs, outputs, accum_steps=accum_steps)
    elif implementation == "micro_batch_size":
        import keras_accum

        model = keras_accum.AccumModel(inputs, outputs, micro_batch_size=MICRO_BATCH)
    else:
        raise ValueError(f"Unknown implementation: {implementation!r}")
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model
