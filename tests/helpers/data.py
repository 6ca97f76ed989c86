"""The datasets the tests train on, each made from a seed."""

import numpy as np

# make_data: features and classes of the small MLPs (models.functional).
FEATURES, CLASSES = 6, 3


def make_data(n=100, seed=0):
    """`n` samples of FEATURES normal features and a class in 0..CLASSES-1."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, FEATURES)).astype("float32")
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).astype("int64") + (x[:, 2] > 1)
    return x, y


# -- BatchNormalization ---------------------------------------------------------

# bn_data's input shape per kind (models.bn_net takes the same kinds).
BN_SHAPES = {"rank2": (6,), "rank4": (4, 3, 5), "masked": (5, 3)}


def bn_data(n, kind="rank2", seed=0):
    """Inputs whose channels have their own means and spreads, far from a new
    BatchNormalization's moving statistics (0 and 1); "masked" pads each
    sequence with zeros past a random length."""
    rng = np.random.default_rng(seed)
    shape = BN_SHAPES[kind]
    x = (rng.normal(size=(n, *shape)) * np.arange(1, shape[-1] + 1) + 3).astype("float32")
    if kind == "masked":
        lengths = rng.integers(1, shape[0] + 1, size=n)
        x[np.arange(shape[0])[None, :] >= lengths[:, None]] = 0.0
    y = rng.integers(0, 3, size=n)
    return x, y


# -- token ids for embeddings (sparse gradients) -----------------------------------

# A window's tokens (32 samples x 6) stay under models.text_net's table rows
# (TEXT_VOCAB): its gradient is kept as slices. Tokens come from a small
# range (TEXT_TOKENS) so that they repeat within every batch.
TEXT_VOCAB, TEXT_LENGTH, TEXT_TOKENS = 500, 6, 30


def token_data(n=76, seed=7, low=0):
    """`n` rows of TEXT_LENGTH token ids in low..TEXT_TOKENS-1, and a class."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(low, TEXT_TOKENS, size=(n, TEXT_LENGTH)).astype("int32")
    return tokens, (tokens.sum(axis=1) % 3).astype("int64")


# -- padded sequences with per-token tags (models.tagger) ---------------------------

SEQ_VOCAB, SEQ_LENGTH, SEQ_TAGS = 30, 12, 5


def sequences(n=40, seed=0):
    """Padded sequences whose lengths make micro-batches very unequal.

    Sorted by length, so one micro-batch holds sequences of 1-2 tokens and
    another of 11-12: per-micro-batch means would weight their tokens very
    differently from the big batch's per-token mean.
    """
    rng = np.random.default_rng(seed)
    lengths = np.sort(rng.integers(1, SEQ_LENGTH + 1, size=n))
    tokens = np.zeros((n, SEQ_LENGTH), "int32")
    tags = np.zeros((n, SEQ_LENGTH), "int64")
    for i, length in enumerate(lengths):
        tokens[i, :length] = rng.integers(1, SEQ_VOCAB, size=length)
        tags[i, :length] = tokens[i, :length] % SEQ_TAGS
    return tokens, tags


def small_table_data(n=92, seed=3, tables=(2, 7, 60), length=10):
    """`n` samples of `length` tokens for each table of `tables` rows, and a
    class that depends on them (so that every table learns)."""
    rng = np.random.default_rng(seed)
    x = np.stack([rng.integers(0, rows, size=(n, length)) for rows in tables], axis=1).astype(
        "int32"
    )
    y = ((x[:, 0].sum(1) + x[:, 1].sum(1) % 3) % 3).astype("int64")
    return x, y
