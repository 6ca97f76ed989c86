"""One traced train function per step setting (`accum_steps`, micro-batch size),
reused while it is valid."""


class TrainFunctionCache:
    """Keeps a model's train functions by `accum_steps` (and micro-batch split).

    The window length and the micro-batch split are Python constants in the
    traced step, so each setting needs its own function; keeping them means a schedule of k distinct
    values, or repeated `fit(accum_steps=k)`, traces k functions in all.
    An entry is reused only while what its trace captured is unchanged: the
    compiled state (`compile()` makes a new optimizer and loss tracker) and
    the trainable variables. `clear()` when the gradient buffers are rebuilt.

    Example:

    ```python
    cache = TrainFunctionCache()
    function = cache.get(model)
    if function is None:
        function = make(model)
        cache.put(model, function)
    ```
    """

    def __init__(self):
        self._functions = {}

    def get(self, model):
        entry = self._functions.get(_key(model))
        if entry is None or not _same(entry[0], _captured(model)):
            return None
        return entry[1]

    def put(self, model, function):
        captured = _captured(model)
        # Entries of an earlier compile would never be used again, yet hold
        # on to its optimizer and traced graphs.
        self._functions = {
            steps: entry
            for steps, entry in self._functions.items()
            if _same(entry[0], captured)
        }
        self._functions[_key(model)] = (captured, function)

    def clear(self):
        self._functions.clear()

    def __len__(self):
        return len(self._functions)


def _key(model):
    # What the step reads as Python constants when traced.
    settings = getattr(model, "_step_settings", None)
    return settings() if settings is not None else model.accum_steps


def _captured(model):
    # Objects compared by identity (kept alive here, so ids are not reused),
    # then plain settings compared by value.
    objects = (
        model.optimizer,
        getattr(model, "_loss_tracker", None),
        *model.trainable_variables,
    )
    settings = (model.jit_compile, model.run_eagerly, model.steps_per_execution)
    return objects, settings


def _same(a, b):
    (objects_a, settings_a), (objects_b, settings_b) = a, b
    return (
        settings_a == settings_b
        and len(objects_a) == len(objects_b)
        and all(x is y for x, y in zip(objects_a, objects_b))
    )
