"""The one owner of a model's `train_function`, and one traced function per
step setting (`accum_steps`, micro-batch size), reused while it is valid.

Several things change the function `fit` calls: a new `accum_steps` (the
setter, `fit(accum_steps=)`, `AccumScheduler`), a new `micro_batch_size`,
`compile()`, a load that leaves a window the traced step cannot continue,
and BackupAndRestore, which makes the first steps of a resumed epoch take
their batches without training. Each used to swap the attribute itself,
so the last one won: a scheduler's retrace replaced the skipping and the
skipped batches were trained again. Here they compose: `TrainFunctions`
holds the step made for the current settings (`function`, None until it
is made) and, apart from it, the batches still to skip. The model's
`train_function` reads `current()`: the skipping while batches remain to
skip, then the step current at that moment, made then if a change left
none. Assigning `train_function` (Keras does, `compile()` sets None)
replaces the step and leaves the skipping alone.
"""


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


class TrainFunctions:
    """What a model's `train_function` is: the current step, under any skipping.

    `cache` keeps the steps traced for each setting.

    Example:

    ```python
    owner = TrainFunctions()
    owner.assign(step)        # model.train_function = step
    owner.skip(3, model)      # the next 3 batches are taken, not trained
    owner.current()           # what fit calls: the skipping, then the step
    ```
    """

    def __init__(self):
        self.cache = TrainFunctionCache()
        self.function = None
        self._skipping = None

    def current(self):
        """The function `fit` calls next (None: none made yet)."""
        return self.function if self._skipping is None else self._skipping

    def assign(self, value):
        """`model.train_function = value`: the step, not the skipping."""
        if self._skipping is not None and value is self._skipping:
            return  # put back by whoever read it (Keras's export does)
        self.function = value

    def skip(self, batches, model):
        """Makes the next `batches` batches be taken from `fit`'s iterator
        without training, whatever step is made or assigned meanwhile.

        After the last of them, the step for the settings in force then is
        the one `fit` calls (made at once by `model.make_train_function()`
        if there is none, so a setting that cannot go on with a restored
        window raises its error here, before any batch trains).
        """
        remaining = [batches]

        def skipping(iterator):
            for _ in range(min(model.steps_per_execution, remaining[0])):
                next(iterator)
                remaining[0] -= 1
            if not remaining[0]:
                self._skipping = None
                if self.function is None:
                    model.make_train_function()
            return {}

        self._skipping = skipping if batches else None

    def skipping(self):
        return self._skipping is not None

    def stop_skipping(self):
        self._skipping = None

    def clear(self):
        """Forgets every traced step (they hold gradient buffers now gone)."""
        self.cache.clear()

    def __len__(self):
        return len(self.cache)


def owner_of(model):
    """The `TrainFunctions` of a keras_accum model, else None (a plain model)."""
    owner = getattr(model, "_train_functions", None)
    return owner if isinstance(owner, TrainFunctions) else None


def skip_batches(model, batches):
    """Makes `model`'s coming `batches` train steps take their data only.

    A keras_accum model's owner keeps the skipping through any retrace; a
    plain Keras model (whose function nothing retraces during `fit`) gets
    its current function wrapped.
    """
    owner = owner_of(model)
    if owner is not None:
        owner.skip(batches, model)
        return
    train_function = model.train_function
    remaining = [batches]

    def skipping(iterator):
        for _ in range(min(model.steps_per_execution, remaining[0])):
            next(iterator)
            remaining[0] -= 1
        if not remaining[0]:
            model.train_function = train_function
        return {}

    skipping.train_function = train_function
    model.train_function = skipping


def stop_skipping(model):
    """Ends a skipping left by a `fit` interrupted while it skipped."""
    owner = owner_of(model)
    if owner is not None:
        owner.stop_skipping()
        return
    original = getattr(model.train_function, "train_function", None)
    if original is not None:
        model.train_function = original
