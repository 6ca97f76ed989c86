"""Models the tests build, each from a seed, and their plain twins.

Every exactness test trains a plain `keras.Model` on the big batch and an
accumulating model on micro-batches from the same initial weights: a maker
here takes `cls` (keras.Model or keras_accum.AccumModel) and gives both the
same weights by seed. Also the optimizers and losses the reference tests
run.
"""

import keras
import numpy as np
import tensorflow as tf
from keras import ops

import keras_accum
from helpers.data import (
    BN_SHAPES,
    CLASSES,
    FEATURES,
    SEQ_LENGTH,
    SEQ_TAGS,
    SEQ_VOCAB,
    TEXT_LENGTH,
    TEXT_VOCAB,
)


def _keras_optimizer(name, **kwargs):
    """`keras.optimizers.<name>(**kwargs)`, made fresh per call; the test
    skips on a Keras without it."""
    import pytest

    def make():
        cls = getattr(keras.optimizers, name, None)
        if cls is None:
            pytest.skip(f"keras.optimizers.{name} is not in Keras {keras.__version__}")
        return cls(**kwargs)

    return make


def built_before_fit(optimizer):
    """Whether a plain reference must build `optimizer` before `fit`.

    Keras's own `fit` without a strategy builds the optimizer inside the
    first traced step; `ScheduleFreeAdamW.build` copies the weights into its
    momentum there, and the copy is lost (momentum starts at zero and the
    weights collapse towards it). keras_accum builds it eagerly, as the
    algorithm says; the fair plain reference builds it before `fit` too
    (docs/schedules-and-skipping.md).
    """
    return type(optimizer).__name__ == "ScheduleFreeAdamW"


# The optimizers the reference tests run, each made fresh per model.
OPTIMIZERS = {
    "schedule_free_adamw": _keras_optimizer("ScheduleFreeAdamW", learning_rate=0.01),
    "sgd_momentum": lambda: keras.optimizers.SGD(0.1, momentum=0.9),
    "sgd_nesterov": lambda: keras.optimizers.SGD(0.1, momentum=0.9, nesterov=True),
    "adam": lambda: keras.optimizers.Adam(0.01),
    "adamw": lambda: keras.optimizers.AdamW(0.01, weight_decay=0.1),
    "rmsprop": lambda: keras.optimizers.RMSprop(0.01, momentum=0.5),
    "adam_ema": lambda: keras.optimizers.Adam(0.01, use_ema=True, ema_momentum=0.5),
    "sgd_clipnorm": lambda: keras.optimizers.SGD(0.5, clipnorm=0.05),
    "adam_global_clipnorm": lambda: keras.optimizers.Adam(0.01, global_clipnorm=0.05),
    "sgd_clipvalue": lambda: keras.optimizers.SGD(0.5, clipvalue=0.005),
    "adam_exponential_decay": lambda: keras.optimizers.Adam(
        keras.optimizers.schedules.ExponentialDecay(0.02, 2, 0.5)
    ),
    "sgd_piecewise": lambda: keras.optimizers.SGD(
        keras.optimizers.schedules.PiecewiseConstantDecay([2, 5], [0.3, 0.1, 0.01]),
        momentum=0.9,
    ),
}


def loss():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def token_loss(**kwargs):
    """The classification loss with other arguments (`reduction=...`)."""
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True, **kwargs)


# -- the small MLP, every way in ---------------------------------------------------


class Gate(keras.layers.Layer):
    """A learnt scalar times its input (a ReZero or gating weight)."""

    def build(self, input_shape):
        self.alpha = self.add_weight(shape=(), initializer="ones", name="alpha")

    def call(self, inputs):
        return inputs * self.alpha


def functional(cls=keras.Model, seed=0, regularizer=None, **kwargs):
    """A small MLP; `cls` is keras.Model or AccumModel, same weights by seed."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((FEATURES,), name="x")
    h = keras.layers.Dense(16, activation="tanh", kernel_regularizer=regularizer, name="hidden")(
        inputs
    )
    outputs = keras.layers.Dense(CLASSES, name="logits")(h)
    return cls(inputs, outputs, name="net", **kwargs)


class NetBody:
    """Body of the subclassed test model, mixed into either base class."""

    def __init__(self, **kwargs):
        kwargs.setdefault("name", "net")
        super().__init__(**kwargs)
        self.hidden = keras.layers.Dense(16, activation="tanh", name="hidden")
        self.logits = keras.layers.Dense(CLASSES, name="logits")

    def call(self, x):
        return self.logits(self.hidden(x))


@keras.saving.register_keras_serializable(package="keras_accum_tests")
class PlainNet(NetBody, keras.Model):
    pass


@keras.saving.register_keras_serializable(package="keras_accum_tests")
class AccumNet(NetBody, keras_accum.AccumModel):
    pass


def subclassed(cls=keras.Model, seed=0, **kwargs):
    """The subclassed MLP (PlainNet or AccumNet), built."""
    keras.utils.set_random_seed(seed)
    model = (AccumNet if cls is keras_accum.AccumModel else PlainNet)(**kwargs)
    model(np.zeros((1, FEATURES), "float32"))
    return model


def _sequential_without_input():
    return keras.Sequential(
        [
            keras.layers.Dense(16, activation="tanh", name="hidden"),
            keras.layers.Dense(CLASSES, name="logits"),
        ],
        name="net",
    )


def _seeded(make):
    def seeded():
        keras.utils.set_random_seed(0)
        return make()

    return seeded


def ways_in(functional, plain_class, accum_class, **more):
    """Every way into keras_accum for one model family, as users take it:
    `{name: (**settings) -> (make_accum, make_plain)}`, both makers from the
    same seed, neither model built nor called (unless the way in starts from
    a built model). `functional(cls=keras.Model, **kwargs)` makes the
    family's functional model; `more` adds ways of its own."""
    return {
        "functional": lambda **kw: (lambda: functional(keras_accum.AccumModel, **kw), functional),
        "subclass": lambda **kw: (_seeded(lambda: accum_class(**kw)), _seeded(plain_class)),
        "wrap_functional": lambda **kw: (lambda: keras_accum.wrap(functional(), **kw), functional),
        "wrap_subclassed": lambda **kw: (
            _seeded(lambda: keras_accum.wrap(plain_class(), **kw)),
            _seeded(plain_class),
        ),
        **more,
    }


# The small MLP's ways in: `WAYS_IN[name](**settings)` gives the pair's two
# makers; the settings (accum_steps=..., ...) go to the accumulating one.
WAYS_IN = ways_in(
    functional,
    PlainNet,
    AccumNet,
    wrap_built_subclassed=lambda **kw: (
        lambda: keras_accum.wrap(subclassed(), **kw),
        subclassed,
    ),
    wrap_sequential_without_input=lambda **kw: (
        _seeded(lambda: keras_accum.wrap(_sequential_without_input(), **kw)),
        _seeded(_sequential_without_input),
    ),
)


def initial_weights(make, x):
    """The initial weights `make()` gives, for `assert_trained` (built here on
    purpose: a throwaway copy, never the model under test)."""
    model = make()
    model(x[:1])
    return model.get_weights()


def mlp(cls=keras.Model, seed=0, **kwargs):
    """An MLP whose output is float32, as Keras's mixed-precision guide
    recommends; for the mixed-precision tests."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((FEATURES,))
    h = keras.layers.Dense(16, activation="tanh")(inputs)
    logits = keras.layers.Dense(3)(h)
    outputs = keras.layers.Activation("linear", dtype="float32")(logits)
    return cls(inputs, outputs, **kwargs)


def per_sample_model(cls=keras.Model, regularizer=None, **kwargs):
    """An MLP with one loss term per sample (for weighted and summed losses)."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((FEATURES,))
    h = keras.layers.Dense(8, activation="tanh", kernel_regularizer=regularizer)(inputs)
    return cls(inputs, keras.layers.Dense(3)(h), **kwargs)


# -- BatchNormalization ----------------------------------------------------------

# Large steps: every update's weight in the moving statistics is visible.
BN_MOMENTUM = 0.6


def bn_layer(**kwargs):
    return keras.layers.BatchNormalization(momentum=BN_MOMENTUM, name="bn", **kwargs)


def _bn_body(inputs, kind, bn):
    h = inputs
    if kind == "masked":
        h = keras.layers.Masking(0.0)(h)
    h = bn(h)
    h = keras.layers.Dense(4, activation="relu")(h)
    h = keras.layers.GlobalAveragePooling1D()(h) if kind == "masked" else keras.layers.Flatten()(h)
    return keras.layers.Dense(3)(h)


def bn_net(cls=keras.Model, kind="rank2", seed=0, bn_kwargs=None, **kwargs):
    """A BatchNormalization on the raw input (data.bn_data of `kind`), whose
    moving statistics are the big batch's exactly, then Dense layers."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input(BN_SHAPES[kind])
    return cls(inputs, _bn_body(inputs, kind, bn_layer(**(bn_kwargs or {}))), **kwargs)


class _BNNet:
    def __init__(self, bn_kwargs=None, **kwargs):
        super().__init__(**kwargs)
        self.bn = bn_layer(**(bn_kwargs or {}))
        self.hidden = keras.layers.Dense(4, activation="relu")
        self.flatten = keras.layers.Flatten()
        self.logits = keras.layers.Dense(3)

    def call(self, x, training=None):
        return self.logits(self.flatten(self.hidden(self.bn(x, training=training))))


class PlainBNNet(_BNNet, keras.Model):
    pass


class AccumBNNet(_BNNet, keras_accum.AccumModel):
    pass


def subclassed_bn_net(cls=keras.Model, kind="rank2", seed=0, bn_kwargs=None, **kwargs):
    """The BatchNormalization model subclassed (PlainBNNet or AccumBNNet),
    unbuilt; `kind` must be a shape bn_net takes other than "masked"."""
    assert kind != "masked"
    keras.utils.set_random_seed(seed)
    if cls is keras_accum.AccumModel:
        return AccumBNNet(bn_kwargs=bn_kwargs, **kwargs)
    return PlainBNNet(bn_kwargs=bn_kwargs)


def _layers(layer):
    # The layer and every layer it holds, through nested and wrapped models.
    yield layer
    for inner in getattr(layer, "layers", ()):
        yield from _layers(inner)


def bn_of(model):
    """The model's one BatchNormalization layer, however deeply nested."""
    found = {
        id(layer): layer
        for layer in _layers(model)
        if isinstance(layer, keras.layers.BatchNormalization)
    }
    (layer,) = found.values()
    return layer


def moving(model):
    """The moving mean and variance of the model's one BatchNormalization."""
    layer = bn_of(model)
    return layer.moving_mean.numpy(), layer.moving_variance.numpy()


# -- embeddings ---------------------------------------------------------------------


def _text_body(inputs, vocab, mask_zero, tied):
    embedding = keras.layers.Embedding(vocab, 8, mask_zero=mask_zero, name="embedding")
    h = keras.layers.GlobalAveragePooling1D()(embedding(inputs))
    if tied:
        # The same table read twice: its gradient is both reads' slices.
        reversed_ = keras.layers.Lambda(lambda t: keras.ops.flip(t, axis=1))(inputs)
        other = keras.layers.GlobalAveragePooling1D()(embedding(reversed_))
        h = keras.layers.Concatenate()([h, keras.layers.Dense(8)(other)])
    # float32 outputs, as Keras's mixed-precision guide recommends.
    logits = keras.layers.Dense(3)(h)
    return keras.layers.Activation("linear", dtype="float32")(logits)


def text_net(cls=keras.Model, vocab=TEXT_VOCAB, mask_zero=False, tied=False, **kwargs):
    """An Embedding (sparse gradients) of data.token_data, pooled, then Dense."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((TEXT_LENGTH,), dtype="int32")
    return cls(inputs, _text_body(inputs, vocab, mask_zero, tied), **kwargs)


def tagger(cls=keras.Model, **kwargs):
    """Per-token tags of data.sequences; the embedding's mask reaches the loss."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((SEQ_LENGTH,), dtype="int32")
    h = keras.layers.Embedding(SEQ_VOCAB, 8, mask_zero=True)(inputs)
    h = keras.layers.Dense(16, activation="tanh")(h)
    outputs = keras.layers.Dense(SEQ_TAGS)(h)  # the mask rides along to the loss
    return cls(inputs, outputs, **kwargs)


# -- a language model whose table is shared across a nested model -------------------

TIED_VOCAB, TIED_WIDTH, TIED_LENGTH = 20, 4, 5


@keras.saving.register_keras_serializable(package="keras_accum_tests")
class TiedEmbedding(keras.layers.Embedding):
    """Embeds tokens, or with `reverse=True` projects onto the vocabulary
    with the same table (as KerasHub's ReversibleEmbedding)."""

    def call(self, inputs, reverse=False):
        if reverse:
            return ops.matmul(inputs, ops.transpose(self.embeddings))
        return super().call(inputs)

    def compute_output_spec(self, inputs, reverse=False):
        if reverse:
            return keras.KerasTensor((*inputs.shape[:-1], self.input_dim), self.compute_dtype)
        return super().compute_output_spec(inputs)


def _tied_encoder(embedding):
    tokens = keras.Input((TIED_LENGTH,), dtype="int32", name="tokens")
    hidden = keras.layers.Dense(TIED_WIDTH, activation="tanh", name="mix")(embedding(tokens))
    return keras.Model(tokens, hidden, name="encoder")


def tied_graph(seed=0):
    """Inputs and outputs of a language model whose table is held by a nested
    encoder and called again by the head: the shape of GPT2CausalLM."""
    keras.utils.set_random_seed(seed)
    embedding = TiedEmbedding(TIED_VOCAB, TIED_WIDTH, name="table")
    encoder = _tied_encoder(embedding)
    tokens = keras.Input((TIED_LENGTH,), dtype="int32", name="tokens")
    return tokens, embedding(encoder(tokens), reverse=True)


@keras.saving.register_keras_serializable(package="keras_accum_tests")
class TiedLM(keras.Model):
    """A functional subclass with a config of its own, as KerasHub tasks are."""

    def __init__(self, seed=0, **kwargs):
        tokens, logits = tied_graph(seed)
        super().__init__(tokens, logits, **kwargs)
        self.seed = seed

    def get_config(self):
        return {"seed": self.seed, "name": self.name}

    @classmethod
    def from_config(cls, config):
        return cls(**config)


class DenseGradientModel(keras.Model):
    """A plain model whose optimizer sees the summed (dense) embedding
    gradient, one occurrence per row: a window summed densely (Keras's
    `gradient_accumulation_steps`, and keras_accum before slices)."""

    def train_step(self, data):
        x, y, _ = keras.utils.unpack_x_y_sample_weight(data)
        with tf.GradientTape() as tape:
            value = self.compute_loss(x, y, self(x, training=True))
        grads = tape.gradient(value, self.trainable_variables)
        self.optimizer.apply([tf.convert_to_tensor(g) for g in grads], self.trainable_variables)
        return {"loss": value}


# -- small tables: more occurrences per window than rows ---------------------------

# A 2-row (segment), a 7-row (day of week) and a 60-row table, one column of
# tokens each: every window of 32 samples x SMALL_LENGTH tokens has many
# times more occurrences than the tables have rows.
SMALL_TABLES, SMALL_LENGTH = (2, 7, 60), 10


@keras.saving.register_keras_serializable(package="keras_accum_tests")
class TokenColumn(keras.layers.Layer):
    """Column `k` of a (batch, tables, length) batch of token ids, plus
    `shift` modulo `rows` when given (a second read of the same table)."""

    def __init__(self, k, shift=0, rows=None, **kwargs):
        super().__init__(**kwargs)
        self.k, self.shift, self.rows = k, shift, rows

    def call(self, tokens):
        column = tokens[:, self.k]
        return column if self.rows is None else (column + self.shift) % self.rows

    def get_config(self):
        return {**super().get_config(), "k": self.k, "shift": self.shift, "rows": self.rows}


def small_tables_net(cls=keras.Model, tables=SMALL_TABLES, mask_zero=False, tied=False, **kwargs):
    """Three Embedding tables (2, 7, 60 rows) over data.small_table_data,
    pooled, then Dense. `tied`: the 60-row table is read twice."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((len(tables), SMALL_LENGTH), dtype="int32")
    parts = []
    for k, rows in enumerate(tables):
        layer = keras.layers.Embedding(rows, 4, mask_zero=mask_zero, name=f"table_{rows}")
        h = layer(TokenColumn(k)(inputs))
        if tied and k == len(tables) - 1:
            h = h + layer(TokenColumn(0, shift=1, rows=rows)(inputs))
        parts.append(keras.layers.GlobalAveragePooling1D()(h))
    h = keras.layers.Dense(8, activation="tanh")(keras.layers.Concatenate()(parts))
    return cls(inputs, keras.layers.Dense(3)(h), **kwargs)
