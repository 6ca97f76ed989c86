"""Plain big-batch references, trained once per test process.

A reference is a plain `keras.Model` trained on the big batch: the same
one serves every test that compares against it (graph, XLA and several
steps per execution are variants of one case, each compared with one
reference). `once(key, train)` trains it the first time `key` is asked
for in this process and returns the same trained model after; `key` names
everything the training depends on. A reference is read, never trained
further: a test that would train it makes its own.
"""

_TRAINED = {}


def once(key, train):
    """`train()`'s result, computed on the first call with this `key`."""
    if key not in _TRAINED:
        _TRAINED[key] = train()
    return _TRAINED[key]
