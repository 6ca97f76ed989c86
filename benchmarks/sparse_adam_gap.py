"""How far AccumModel's embeddings are from Keras's own big batch under Adam.

    python -m benchmarks.sparse_adam_gap             # writes sparse_adam_gap.md
    python -m benchmarks.sparse_adam_gap --out DIR

Keras's Adam (and RMSprop, Adagrad) applies an `Embedding`'s sparse
gradient occurrence by occurrence: a token seen k times in a batch adds the
square of each occurrence's gradient to the second moment. AccumModel keeps
a window's sparse gradient as slices (all of the window's occurrences, the
big batch's gradient) while they fit in the table-sized buffer, `window
tokens <= table rows`, and as per-row moments beyond (the sums of each
row's occurrences and of their squares, which is all Adam reads of them).
This measures both on small text models, as a share of how far the big
batch moved the weights, beside the window summed densely (Keras's
`gradient_accumulation_steps`, and keras_accum before moments), for a
5,000-row table (2,560 window tokens: slices), a 1,000-row one and, as a
segment or day-of-week table, 7 and 2 rows (moments).
"""

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_accum  # noqa: E402

HERE = Path(__file__).resolve().parent
VOCABS, WIDTH, LENGTH, SAMPLES, MICRO, N, EPOCHS = (5000, 1000, 7, 2), 32, 20, 512, 16, 8, 3


def _body(kind, inputs, vocab):
    h = keras.layers.Embedding(vocab, WIDTH, name="embedding")(inputs)
    if kind == "gru":
        h = keras.layers.GRU(32)(h)
    elif kind == "lstm":
        h = keras.layers.LSTM(32)(h)
    else:
        h = keras.layers.MultiHeadAttention(2, 16)(h, h)
        h = keras.layers.GlobalAveragePooling1D()(h)
    return keras.layers.Dense(2)(h)


class DenseGradientModel(keras.Model):
    """The window summed densely: the optimizer sees one occurrence per row."""

    def train_step(self, data):
        import tensorflow as tf

        x, y, _ = keras.utils.unpack_x_y_sample_weight(data)
        with tf.GradientTape() as tape:
            value = self.compute_loss(x, y, self(x, training=True))
        grads = tape.gradient(value, self.trainable_variables)
        self.optimizer.apply([tf.convert_to_tensor(g) for g in grads], self.trainable_variables)
        return {"loss": value}


def build(kind, vocab, cls=keras.Model, **kwargs):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((LENGTH,), dtype="int32")
    return cls(inputs, _body(kind, inputs, vocab), **kwargs)


def data(vocab):
    # Zipf-like token frequencies, as in text: frequent tokens repeat within
    # every window.
    rng = np.random.default_rng(0)
    p = 1.0 / np.arange(1, vocab + 1)
    x = rng.choice(vocab, size=(SAMPLES, LENGTH), p=p / p.sum()).astype("int32")
    y = (x[:, :5].sum(axis=1) % 2).astype("int64")
    return x, y


def measure(kind, vocab):
    x, y = data(vocab)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    plain = build(kind, vocab)
    initial = plain.get_layer("embedding").get_weights()[0]
    plain.compile(keras.optimizers.Adam(0.01), loss)
    plain.fit(x, y, batch_size=MICRO * N, epochs=EPOCHS, shuffle=False, verbose=0)
    accum = build(kind, vocab, keras_accum.AccumModel, accum_steps=N)
    accum.compile(keras.optimizers.Adam(0.01), loss)
    accum.fit(x, y, batch_size=MICRO, epochs=EPOCHS, shuffle=False, verbose=0)
    dense = build(kind, vocab, DenseGradientModel)
    dense.compile(keras.optimizers.Adam(0.01), loss)
    dense.fit(x, y, batch_size=MICRO * N, epochs=EPOCHS, shuffle=False, verbose=0)
    big = plain.get_layer("embedding").get_weights()[0]
    moved = float(np.abs(big - initial).max())

    def share(model):
        table = model.get_layer("embedding").get_weights()[0]
        return (
            float(np.abs(table - big).max()),
            float(np.linalg.norm(table - big) / np.linalg.norm(big - initial)),
        )

    return share(accum), share(dense), moved


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(HERE))
    args = parser.parse_args(argv)
    rows = []
    for vocab in VOCABS:
        kept = "slices" if MICRO * N * LENGTH <= vocab else "moments"
        for kind in ("gru", "lstm", "attention"):
            (gap, share), (dense_gap, dense_share), moved = measure(kind, vocab)
            rows.append(
                f"| Embedding({vocab}, {WIDTH}) + {kind} | {kept} | {gap:.2g} | "
                f"{share:.2g} | {dense_gap:.2g} | {dense_share:.2g} | {moved:.3f} |"
            )
            print(rows[-1], flush=True)
    text = "\n".join(
        [
            "# Embeddings under Adam: AccumModel against Keras's big batch",
            "",
            f"Keras {keras.__version__}; sequences of {LENGTH} Zipf-distributed "
            f"tokens, {SAMPLES} samples, micro-batch {MICRO} x accum_steps {N} "
            f"({MICRO * N * LENGTH} tokens per window) against a plain "
            f"keras.Model with batch {MICRO * N}, Adam(0.01), {EPOCHS} epochs. "
            "A window is kept as slices while they fit in the table-sized "
            "buffer (window tokens <= table rows), else as per-row moments. "
            "Beside it, the same window summed densely (Keras's "
            "`gradient_accumulation_steps`; keras_accum before moments). "
            "Differences are from the big batch's embedding table; "
            '"/ change" divides norms by the norm of the big batch\'s own '
            "change of the table. Produced by "
            "`python -m benchmarks.sparse_adam_gap`.",
            "",
            "| model | window kept as | AccumModel: largest difference | AccumModel: / change | summed densely: largest difference | summed densely: / change | largest change the big batch made |",
            "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
            *rows,
            "",
        ]
    )
    Path(args.out, "sparse_adam_gap.md").write_text(text)


if __name__ == "__main__":
    sys.exit(main())
