"""Fine-tune a causal language model with the batch its recipe calls for.

The job most users of keras_accum arrive with: a KerasHub language model
(GPT-2 here), LoRA, and a recipe whose batch does not fit in the GPU. This
script runs that pipeline end to end, scaled down so that it needs no
download and finishes on two CPU cores:

* a `GPT2CausalLM` from a small `GPT2Backbone` config with random weights
  (on a GPU: `GPT2CausalLM.from_preset("gpt2_base_en")`), LoRA on;
* text that ships with Python (the Zen of Python and standard-library
  docstrings), tokenised by hand into bytes, padded, the padding masked
  out of the loss (`sample_weight`);
* the recipe's batch of 32 sequences reached by `accum_steps=4` over
  batches of 8, which `micro_batch_size="auto"` splits further where they
  do not fit; AdamW with a warm-up and a cosine decay counted in updates;
* `mixed_bfloat16` where the hardware has it (decided at run time; on a
  CPU it stays float32), `noise_scale=True` to see whether the batch pays;
* a checkpoint each epoch, from which a new model resumes exactly, then
  `generate`.

    python examples/fine_tune_lm.py           # 12 epochs: 1-1.5 minutes on two CPU cores
    python examples/fine_tune_lm.py --quick   # 3 epochs: under a minute

Needs keras-hub (`pip install keras-hub`). The guide is docs/fine-tuning.md.
"""

import argparse
import contextlib
import importlib
import io
import os
import tempfile
import time
import warnings

STARTED = time.time()  # the wall-clock time reported at the end counts imports too

# TensorFlow's C++ log level, read when TensorFlow loads: set before anything
# (keras included) imports it.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


def _import_tensorflow_quietly():
    """Imports TensorFlow without its start-up lines on stderr (TensorFlow
    2.20 and later log a few before their log level applies); an import
    error is still raised as usual."""
    stderr = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        import tensorflow  # noqa: F401
    finally:
        os.dup2(stderr, 2)
        os.close(stderr)
        os.close(devnull)


_import_tensorflow_quietly()

import keras  # noqa: E402
import keras_hub  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import keras_accum  # noqa: E402

# The recipe, scaled down. On a GPU with gpt2_base_en: sequences of 512-1024
# tokens, a peak rate of about 2e-4 (docs/fine-tuning.md).
SEQUENCE_LENGTH = 64  # bytes per sequence
BATCH = 32  # sequences per update: the recipe's batch
ACCUM_STEPS = 4  # fit draws BATCH // ACCUM_STEPS = 8 sequences a step
LORA_RANK = 4
PEAK_LEARNING_RATE = 2e-2  # a tiny model from random weights takes a large rate
WARMUP = 0.1  # the share of the updates spent warming up
DROPOUT = 0.1  # GPT-2's own

PAD, END = 0, 1  # token ids; byte b is token b + 2
VOCABULARY = 258
MODULES = (
    "json",
    "re",
    "statistics",
    "argparse",
    "csv",
    "heapq",
    "itertools",
    "random",
    "unittest",
    "typing",
    "os",
    "sqlite3",
    "tempfile",
    "collections",
    "string",
)


def zen_of_python():
    """`import this` prints it; the module holds it in ROT13."""
    with contextlib.redirect_stdout(io.StringIO()):
        import this
    return "".join(this.d.get(c, c) for c in this.s)


def corpus():
    """Sequences of whole lines, each at most SEQUENCE_LENGTH - 1 bytes, from
    the Zen of Python and the docstrings of MODULES."""
    texts = [zen_of_python()] + [importlib.import_module(m).__doc__ for m in MODULES]
    sequences = []
    for text in texts:
        current = b""
        for line in text.encode().splitlines():
            line = line.rstrip()[: SEQUENCE_LENGTH - 1]
            if current and len(current) + 1 + len(line) > SEQUENCE_LENGTH - 1:
                sequences.append(current)
                current = b""
            current = current + b"\n" + line if current else line
        if current:
            sequences.append(current)
    return [s for s in sequences if s.strip()]


def tokenise(sequences):
    """Byte-level tokens: END, the bytes, END, padded with PAD. Returns the
    model's inputs, the next-token targets and the targets' weights (the
    padding mask: padding adds nothing to the loss)."""
    tokens = np.full((len(sequences), SEQUENCE_LENGTH + 1), PAD, "int32")
    for i, sequence in enumerate(sequences):
        ids = [END, *(b + 2 for b in sequence), END]
        tokens[i, : len(ids)] = ids
    x = {"token_ids": tokens[:, :-1], "padding_mask": tokens[:, :-1] != PAD}
    y = tokens[:, 1:]
    return x, y, (y != PAD).astype("float32")


def detokenise(ids):
    return bytes(int(t) - 2 for t in ids if t > END).decode("utf-8", errors="replace")


def precision():
    """`mixed_bfloat16` where the hardware computes in bfloat16 (a GPU of
    compute capability 8.0 or more, a TPU), else float32 (a CPU: TensorFlow's
    bfloat16 there is emulated or slower)."""
    for gpu in tf.config.list_physical_devices("GPU"):
        capability = tf.config.experimental.get_device_details(gpu).get("compute_capability")
        if capability and capability >= (8, 0):
            return "mixed_bfloat16", f"a GPU of compute capability {capability[0]}.{capability[1]}"
    if tf.config.list_logical_devices("TPU"):
        return "mixed_bfloat16", "a TPU"
    return "float32", "no GPU of compute capability 8.0+ or TPU here: no bfloat16 hardware"


def build(updates):
    """The task, LoRA on, wrapped and compiled: the same every call."""
    keras.utils.set_random_seed(0)
    # On a GPU: keras_hub.models.GPT2CausalLM.from_preset("gpt2_base_en",
    # preprocessor=None), and its preprocessor mapped over the dataset.
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=VOCABULARY,
        num_layers=2,
        num_heads=4,
        hidden_dim=128,
        intermediate_dim=512,
        max_sequence_length=SEQUENCE_LENGTH,
        dropout=DROPOUT,
    )
    lm = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)
    # Freezes every weight and adds trainable adapters to the attention's
    # query and value projections (KerasHub's default targets).
    backbone.enable_lora(LORA_RANK)
    # For random weights only: GPT-2 ties its token embedding to its output,
    # and frozen at its random start (a preset's is trained) it keeps every
    # logit near 0, so the loss could hardly leave ln 258 = 5.55.
    backbone.token_embedding.trainable = True

    model = keras_accum.wrap(lm, accum_steps=ACCUM_STEPS, micro_batch_size="auto", noise_scale=True)
    warmup = max(1, round(WARMUP * updates))
    schedule = keras.optimizers.schedules.CosineDecay(
        0.0,
        decay_steps=updates - warmup,
        alpha=0.1,
        warmup_target=PEAK_LEARNING_RATE,
        warmup_steps=warmup,
    )
    model.compile(
        optimizer=keras.optimizers.AdamW(schedule, weight_decay=0.01),
        # The mean over the real tokens: each window is divided by its own
        # token count, exactly as the batch of 32 would be.
        loss=keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, reduction="mean_with_sample_weight"
        ),
        sampler=keras_hub.samplers.TopKSampler(k=5, seed=0),  # reaches the task
    )
    return lm, model


def checkpoint(model):
    """What resumes a LoRA run exactly: tf.train.Checkpoint holds the
    adapters apart from the frozen weights, the optimizer's state and the
    open window; Dropout's random state is added by hand. (Weights files and
    .keras files hold the adapters merged into the weights: see
    docs/fine-tuning.md.)"""
    seeds = [v for v in model.variables if "seed_generator_state" in v.path]
    return tf.train.Checkpoint(model=model, optimizer=model.optimizer, seeds=seeds)


class EpochReport(keras.callbacks.Callback):
    """One line per epoch, and a checkpoint at its end."""

    def __init__(self, manager, epochs):
        super().__init__()
        self.manager, self.epochs = manager, epochs

    def on_epoch_end(self, epoch, logs=None):
        path = self.manager.save(checkpoint_number=epoch + 1)
        optimizer = self.model.optimizer
        rate = float(optimizer.learning_rate)  # the schedule at this update
        print(
            f"  epoch {epoch + 1}/{self.epochs}: loss {logs['loss']:.3f}, "
            f"validation loss {logs['val_loss']:.3f}, {int(optimizer.iterations)} updates, "
            f"learning rate {rate:.2e}, noise scale {logs['noise_scale']:.1f}; "
            f"saved {os.path.basename(path)}",
            flush=True,
        )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 epochs instead of 12")
    parser.add_argument(
        "--epochs", type=int, help="epochs to train (default 12, or 3 with --quick)"
    )
    parser.add_argument(
        "--output-dir",
        help="where the checkpoints and fine_tuned.keras go "
        "(default: a temporary directory, deleted at the end)",
    )
    args = parser.parse_args(argv)
    epochs = args.epochs or (3 if args.quick else 12)
    if args.output_dir:
        os.makedirs(args.output_dir, exist_ok=True)
        fine_tune(epochs, args.output_dir)
    else:
        with tempfile.TemporaryDirectory(prefix="fine_tune_lm-") as output:
            fine_tune(epochs, output)


def fine_tune(epochs, output):
    policy, why = precision()
    keras.mixed_precision.set_global_policy(policy)
    print(f"precision: {policy} ({why})")

    sequences = corpus()
    order = np.random.default_rng(0).permutation(len(sequences))
    sequences = [sequences[i] for i in order]  # shuffled once: epochs replay in order
    validation = len(sequences) // 10
    x_val, y_val, w_val = tokenise(sequences[:validation])
    x, y, w = tokenise(sequences[validation:])
    print(
        f"text: {len(sequences)} sequences of at most {SEQUENCE_LENGTH} bytes from the Zen "
        f"of Python and {len(MODULES)} standard-library docstrings; {validation} held out; "
        f"{1 - w.mean():.0%} of the training tokens are padding, masked out of the loss"
    )

    updates_per_epoch = -(-len(y) // BATCH)
    lm, model = build(epochs * updates_per_epoch)
    trainable = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    print(
        f"model: GPT-2, 2 layers, hidden 128, {lm.count_params():,} weights, "
        f"{trainable:,} trainable (LoRA rank {LORA_RANK}, and the token embedding)"
    )
    print(
        f"batch: {BATCH} sequences per update = accum_steps {ACCUM_STEPS} x fit's batch "
        f"of {BATCH // ACCUM_STEPS}, split further by micro_batch_size='auto' if it runs "
        f"out of memory; {updates_per_epoch} updates per epoch"
    )

    before = model.evaluate(
        x_val, y_val, sample_weight=w_val, batch_size=BATCH, verbose=0, return_dict=True
    )["loss"]
    print(
        f"validation loss before training: {before:.3f} per token (ln {VOCABULARY} = "
        f"{np.log(VOCABULARY):.2f}: a uniform guess)"
    )

    manager = tf.train.CheckpointManager(
        checkpoint(model), os.path.join(output, "checkpoints"), max_to_keep=2
    )
    print(f"training {epochs} epochs (a checkpoint each epoch, in {output}):", flush=True)
    history = model.fit(
        x,
        y,
        sample_weight=w,
        batch_size=BATCH // ACCUM_STEPS,
        epochs=epochs,
        shuffle=False,
        validation_data=(x_val, y_val, w_val),
        callbacks=[EpochReport(manager, epochs)],
        verbose=0,
    ).history
    after = history["val_loss"][-1]
    print(f"validation loss: {before:.3f} before, {after:.3f} after training")
    chosen = model.chosen_micro_batch_size
    print(
        "micro_batch_size='auto': "
        + ("whole batches of 8 fitted" if chosen is None else f"micro-batches of {chosen}")
    )

    noise = [n for n in history["noise_scale"] if np.isfinite(n)]
    if noise:
        verdict = (
            f"below the batch of {BATCH}: a smaller batch would make about as much "
            "progress per update, for fewer samples"
            if noise[-1] < BATCH
            else f"above the batch of {BATCH}: a bigger batch would need about proportionally "
            "fewer updates (AccumScheduler('noise_scale') grows the batch towards it)"
        )
        print(
            f"noise scale (B_simple, in sequences) by epoch: "
            f"{' '.join(f'{n:.0f}' for n in noise)}; the last is {verdict}"
        )

    # Resume: a new model, restored from the checkpoint before the last epoch,
    # trains that epoch and ends where the uninterrupted run did.
    if epochs >= 2:
        _, resumed = build(epochs * updates_per_epoch)
        checkpoint(resumed).restore(manager.checkpoints[-2]).assert_existing_objects_matched()
        resumed.fit(
            x,
            y,
            sample_weight=w,
            batch_size=BATCH // ACCUM_STEPS,
            epochs=epochs,
            initial_epoch=epochs - 1,
            shuffle=False,
            verbose=0,
        )
        difference = max(
            float(np.abs(a - b).max()) for a, b in zip(model.get_weights(), resumed.get_weights())
        )
        print(
            f"resumed from {os.path.basename(manager.checkpoints[-2])} in a new model: "
            f"largest weight difference from the uninterrupted run after the last epoch: "
            f"{difference:.3g}"
        )

    # Handing it on: a .keras file of the task holds the adapters merged into
    # its weights, a plain GPT2CausalLM without LoRA (resume from the
    # checkpoint, not from it).
    lm.save(os.path.join(output, "fine_tuned.keras"))
    with warnings.catch_warnings():
        # Loading warns twice, as for any KerasHub task saved compiled: its
        # custom compile() is not called, and the optimizer's state is
        # skipped (it was the adapters'; the loaded task has no adapters).
        warnings.simplefilter("ignore", UserWarning)
        handed_on = keras.saving.load_model(os.path.join(output, "fine_tuned.keras"))
    same = np.allclose(
        handed_on.predict(x_val, verbose=0), lm.predict(x_val, verbose=0), rtol=1e-4, atol=1e-4
    )
    print(
        f"saved fine_tuned.keras: {len(handed_on.weights)} weights, all "
        f"{len(handed_on.trainable_weights)} trainable (the adapters merged in, "
        f"{'the same' if same else 'NOT the same'} predictions)"
    )

    prompts = [b"Beautiful is", b"Return the"]
    tokens = np.full((len(prompts), SEQUENCE_LENGTH), PAD, "int32")
    for i, prompt in enumerate(prompts):
        tokens[i, : len(prompt) + 1] = [END, *(b + 2 for b in prompt)]
    generated = lm.generate(
        {"token_ids": tokens, "padding_mask": tokens != PAD}, stop_token_ids=[END]
    )
    for prompt, ids in zip(prompts, generated["token_ids"]):
        print(f"generate({prompt.decode()!r}): {detokenise(ids)!r}")

    # process_time: this process's CPU time, on every core, since it started.
    print(f"finished in {time.time() - STARTED:.0f} s (process time {time.process_time():.0f} s)")


if __name__ == "__main__":
    main()
