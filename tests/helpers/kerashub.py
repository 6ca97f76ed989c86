"""KerasHub models from small configs with random weights, and their data.

Nothing is downloaded: the backbones are built from their constructors, not
from presets. Dropout is 0 so that training is deterministic (keras_accum's
micro-batches draw other dropout masks than one big batch would).
"""

import keras
import numpy as np

VOCAB, LENGTH, N = 64, 12, 92  # 92 samples: uneven windows at b=8, N=4


def gpt2(seed=0):
    import keras_hub

    keras.utils.set_random_seed(seed)
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=VOCAB,
        num_layers=1,
        num_heads=2,
        hidden_dim=8,
        intermediate_dim=16,
        max_sequence_length=LENGTH,
        dropout=0.0,
    )
    return keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)


def gpt2_data(n=N, seed=0):
    """Token ids with padding, next-token targets, the padding mask as weights."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, VOCAB, (n, LENGTH + 1)).astype("int32")
    lengths = rng.integers(4, LENGTH + 1, n)
    mask = np.arange(LENGTH)[None, :] < lengths[:, None]
    x = {"token_ids": np.where(mask, tokens[:, :-1], 0), "padding_mask": mask}
    y = np.where(mask, tokens[:, 1:], 0)
    return x, y, mask.astype("float32")


def bert(seed=0, **kwargs):
    """`kwargs` (`activation=...`) go to the classifier."""
    import keras_hub

    keras.utils.set_random_seed(seed)
    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=VOCAB,
        num_layers=1,
        num_heads=2,
        hidden_dim=8,
        intermediate_dim=16,
        max_sequence_length=LENGTH,
        dropout=0.0,
    )
    return keras_hub.models.BertTextClassifier(
        backbone=backbone, num_classes=3, preprocessor=None, dropout=0.0, **kwargs
    )


def bert_text(n=N, seed=0):
    """Raw text (words of a 5-word vocabulary) and a class per sample: the
    data a task with a preprocessor (`bert_preprocessor`) is fitted on."""
    rng = np.random.default_rng(seed)
    words = np.array(WORDS)
    texts = [" ".join(rng.choice(words, rng.integers(2, LENGTH - 1))) for _ in range(n)]
    return np.array(texts), rng.integers(0, 3, n).astype("int32")


WORDS = ["the", "cat", "sat", "on", "mat"]


def bert_preprocessor():
    """A BERT classifier's preprocessor over `WORDS`, built from its vocabulary."""
    import keras_hub

    tokenizer = keras_hub.tokenizers.BertTokenizer(
        vocabulary=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]
    )
    return keras_hub.models.BertTextClassifierPreprocessor(tokenizer, sequence_length=LENGTH)


def gemma(seed=0):
    """A Gemma causal LM: its `compile` samples greedily unless told."""
    import keras_hub

    keras.utils.set_random_seed(seed)
    backbone = keras_hub.models.GemmaBackbone(
        vocabulary_size=VOCAB,
        num_layers=1,
        num_query_heads=2,
        num_key_value_heads=1,
        hidden_dim=8,
        intermediate_dim=16,
        head_dim=4,
        dropout=0.0,
    )
    return keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=None)


def bert_data(n=N, seed=0):
    """Two-segment inputs with padding and a class per sample."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(4, LENGTH + 1, n)
    mask = np.arange(LENGTH)[None, :] < lengths[:, None]
    split = (lengths // 2)[:, None]
    x = {
        "token_ids": np.where(mask, rng.integers(1, VOCAB, (n, LENGTH)), 0).astype("int32"),
        "segment_ids": np.where(mask & (np.arange(LENGTH)[None, :] >= split), 1, 0).astype("int32"),
        "padding_mask": mask,
    }
    y = (x["token_ids"][:, 0] % 3).astype("int32")
    return x, y, None


def take(data, start, stop):
    """Samples `start:stop` of `(x, y, sample_weight)`."""
    x, y, weights = data
    x = {key: value[start:stop] for key, value in x.items()}
    return x, y[start:stop], None if weights is None else weights[start:stop]


def loss():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def gpt2_lora(seed=0, dropout=0.0, rank=2):
    """`gpt2`'s task at `dropout`, with LoRA on (`rank` None: off), as
    docs/fine-tuning.md has it: `backbone.enable_lora(rank)` freezes every
    weight and adds trainable adapters (`lora_kernel_a`, `lora_kernel_b`) to
    the attention's query and value, whose biases stay trainable too."""
    import keras_hub

    keras.utils.set_random_seed(seed)
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=VOCAB,
        num_layers=1,
        num_heads=2,
        hidden_dim=8,
        intermediate_dim=16,
        max_sequence_length=LENGTH,
        dropout=dropout,
    )
    lm = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)
    if rank is not None:
        backbone.enable_lora(rank)
    return lm


def adapters(model):
    """The LoRA adapters' variables of `model`, in order."""
    return [v for v in model.weights if "lora" in v.path]


def lora_checkpoint(model, seeds=True):
    """The checkpoint docs/fine-tuning.md resumes a LoRA run from: the model
    (adapters apart from the frozen weights, the open window) and its
    optimizer, and with `seeds` Dropout's random state."""
    import tensorflow as tf

    extra = {}
    if seeds:
        extra["seeds"] = [v for v in model.variables if "seed_generator_state" in v.path]
    return tf.train.Checkpoint(model=model, optimizer=model.optimizer, **extra)
