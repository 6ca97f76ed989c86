"""What several test files (and the scripts in tests/scripts/) share.

No test module imports from another; what two of them need lives here:

- `data`: the datasets, made from a seed.
- `models`: models (each with its plain twin from the same seed), the
  optimizers and losses the reference tests run, `WAYS_IN`.
- `assertions`: the reference tolerances and comparisons.
- `training`: plain big-batch references and the interrupting callback.
- `oom`: a real out-of-memory error on demand (for `micro_batch_size="auto"`).
- `processes`: fresh Python processes and worker clusters on localhost, and
  where the subprocess scripts are.
- `project`: the repository's own files (README, docs pages, noxfile).
- `kerashub`: small KerasHub models and their data.
- `internals`: the only place tests reach past keras_accum's public API,
  for what no public API can observe.
"""
