"""What the step being traced adds to a window's buffers, for the apply
traced in the same graph.

Example:

```python
trace = StepTrace()
trace.record(dense_indices, {i: occurrences_bound})   # GradientAccumulator.add
trace.holds(i), trace.capacity(i)                     # window_gradients
```
"""

from keras_accum import _internals as internals


class StepTrace:
    """What the graph being traced adds to the buffers.

    Recorded by `GradientAccumulator.add` when traced; a window applied in
    that graph (or a branch inside it) reads the buffers given dense
    gradients as dense sums, and hands a sparse buffer's row sums over in
    the static size recorded for it (XLA). Out of sight of `tf.Module`
    tracking; the graph by weak reference, so a window does not keep a
    traced function's graph alive.
    """

    __slots__ = ("graph", "indices", "capacities")

    def __init__(self):
        self.graph = None
        self.indices = frozenset()
        self.capacities = {}

    def record(self, indices, capacities):
        self.indices = frozenset(indices)
        self.capacities = capacities
        self.graph = internals.current_graph()

    def _in_traced(self):
        return internals.tracing_inside(self.graph)

    def holds(self, i):
        """Whether buffer `i` was given a dense gradient in the graph being traced."""
        return i in self.indices and self._in_traced()

    def capacity(self, i):
        """The occurrences a window of buffer `i` can hold at most, as
        recorded in the graph being traced; None if not recorded there."""
        return self.capacities.get(i) if self._in_traced() else None
