"""Splitting inside the step: a batch cut into micro-batches (microbatch.py),
`"auto"` retrying a step that ran out of memory (auto.py) and agreeing on
one size across replicas and workers (across_replicas.py), and a loss that
couples the whole batch (coupling.py)."""
