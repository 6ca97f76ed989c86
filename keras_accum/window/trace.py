"""What the step being traced adds to a window's buffers, read by the update
traced in the same graph."""

from keras_accum import _internals as internals


class StepTrace:
    """What the graph being traced adds to the buffers, recorded by `add`: dense
    sums to read as such, sparse sizes for XLA. The graph is held by weak
    reference: a window keeps no traced function's graph alive."""

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
