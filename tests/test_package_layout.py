"""The package's layout holds: one owner of `train_function`, imports that
flow down its layers, no module touching another's private attributes
(README, "Development", has the map)."""

import ast
from pathlib import Path

import pytest

import keras_accum

PACKAGE = Path(keras_accum.__file__).parent
MODULES = sorted(PACKAGE.rglob("*.py"))


def _tree(path):
    return ast.parse(path.read_text())


@pytest.mark.unit
def test_only_the_train_function_owner_assigns_train_function():
    assigned = []
    for path in MODULES:
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                targets = [node.target]
            else:
                continue
            assigned += [
                f"{path.relative_to(PACKAGE)}:{node.lineno}"
                for target in targets
                if isinstance(target, ast.Attribute) and target.attr == "train_function"
            ]
    assert assigned, "the owner no longer assigns it either: is this test still looking?"
    assert all(where.startswith("engine/functions.py:") for where in assigned), assigned


# -- the package's layers ---------------------------------------------------------

# Each module's layer (a package is one module here): a module imports only
# modules of a lower layer or of its own, so each layer can be read, tested
# and changed with only the layers below it in mind.
LAYER = {
    # the ways in, and the growth wing that drives fits from a callback
    "__init__": 5,
    "model": 5,
    "wrap": 5,
    "backup": 5,
    "growth": 5,
    # the engine: the step, its functions, fit and files; the optimizer way in
    "engine": 4,
    "optimizer": 4,
    # the split wing: micro-batches inside the step, "auto", coupled losses
    "split": 3,
    # the accumulation window
    "window": 2,
    # the arguments and the arithmetic
    "arguments": 1,
    "scaling": 1,
    "normaliser": 1,
    # every reach into Keras and TensorFlow
    "_internals": 0,
}
# Imports that still go up a layer: each one to be cut, and then removed here
# (the test fails on an entry that no longer occurs, so this only shrinks).
EDGES_LEFT = set()


def _layer_key(path):
    """The LAYER key of a module of the package: its top-level name."""
    return path.relative_to(PACKAGE).parts[0].removesuffix(".py")


def _layer_of(module):
    """The LAYER key of a dotted `keras_accum` module name, else None."""
    parts = module.split(".")
    if parts[0] != "keras_accum":
        return None
    return parts[1] if len(parts) > 1 else "__init__"


def _is_module(module):
    path = PACKAGE.parent.joinpath(*module.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _imports(path):
    """(line, module) of every import in `path`, in functions too, relative
    imports made absolute: `from a import b` imports module `a.b` when there
    is one, else (a name of it) module `a`."""
    # What `from . import` starts from: the module's package, an __init__'s own.
    package = list(path.relative_to(PACKAGE.parent).parts[:-1])
    imports = []
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.Import):
            imports += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            imports += [
                (node.lineno, f"{module}.{alias.name}")
                if _is_module(f"{module}.{alias.name}")
                else (node.lineno, module)
                for alias in node.names
            ]
    return imports


@pytest.mark.unit
def test_imports_flow_down():
    assert {_layer_key(p) for p in MODULES} == set(LAYER), "a layer for each module, no more"
    edges = {}
    for path in MODULES:
        importer = _layer_key(path)
        for line, module in _imports(path):
            imported = _layer_of(module)
            if imported is not None:
                edges.setdefault((importer, imported), f"{path.relative_to(PACKAGE)}:{line}")
    assert ("engine", "window") in edges, "is this test still reading the imports?"
    upward = [
        f"{where}: {a} (layer {LAYER[a]}) imports {b} (layer {LAYER[b]})"
        for (a, b), where in sorted(edges.items())
        if LAYER[b] > LAYER[a] and (a, b) not in EDGES_LEFT
    ]
    assert not upward, upward
    assert all(LAYER[b] > LAYER[a] for a, b in EDGES_LEFT), "EDGES_LEFT: upward edges only"
    gone = sorted(EDGES_LEFT - set(edges))
    assert not gone, f"cut: remove {gone} from EDGES_LEFT"


# -- private attributes ----------------------------------------------------------

# Private by spelling only: the namedtuple API.
NAMEDTUPLE_API = {"_replace", "_asdict", "_fields", "_make"}
_BY_NAME = {"getattr", "setattr", "hasattr", "delattr"}


def _is_private(name):
    return name.startswith("_") and not name.startswith("__") and name not in NAMEDTUPLE_API


def _is_self(node):
    return isinstance(node, ast.Name) and node.id in ("self", "cls")


def _own_private_names(tree):
    """The names the module's classes define: bound in a class body, or
    assigned to an attribute of `self` or `cls`."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    names.add(item.name)
                elif isinstance(item, ast.Assign):
                    names |= {t.id for t in item.targets if isinstance(t, ast.Name)}
                elif isinstance(item, (ast.AnnAssign, ast.AugAssign)):
                    names |= {item.target.id} if isinstance(item.target, ast.Name) else set()
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names |= {node.attr} if _is_self(node.value) else set()
    return names


def _reaches(tree):
    """`(line, name)` of each reach in a module's `tree` into another's
    private attribute: `x._name` (x not self, cls or super()), `self._name`
    where no class of the module defines it, `getattr(x, "_name")` and the
    like, and `x.__dict__`."""
    own = _own_private_names(tree)
    reaches = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            if node.attr == "__dict__":
                reaches.append((node.lineno, "__dict__"))
                continue
            owner, name = node.value, node.attr
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "id", None) in _BY_NAME
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
        ):
            owner, name = node.args[0], node.args[1].value
        else:
            continue
        if not _is_private(name):
            continue
        if isinstance(owner, ast.Call) and getattr(owner.func, "id", None) == "super":
            continue
        if _is_self(owner) and name in own:
            continue
        reaches.append((node.lineno, name))
    return reaches


_EXAMPLE = """
class A:
    _kept = None
    def f(self, model, t):
        self._own = 1
        self._own, self._kept, super()._base, t._replace(), self.__class__
        model._window, self._hosts, getattr(model, "_x", None), model.__dict__
"""


@pytest.mark.unit
def test_no_module_touches_another_classes_private_attributes():
    assert sorted(_reaches(ast.parse(_EXAMPLE))) == [
        (7, "__dict__"),
        (7, "_hosts"),
        (7, "_window"),
        (7, "_x"),
    ], "is this test still reading the attributes?"
    found = []
    for path in MODULES:
        module = path.relative_to(PACKAGE).as_posix()
        if module.startswith("_internals/"):
            continue  # every reach into Keras, and the hooks it gives the model
        found += [f"{module}:{line}: {name}" for line, name in sorted(_reaches(_tree(path)))]
    assert not found, (
        "a private attribute of another module's class is touched; give that "
        f"class a method, or pass the value in: {found}"
    )


# -- the tests' own layout -------------------------------------------------------

TESTS = Path(__file__).parent
# The one file that reaches past keras_accum's (and Keras's) public API, and
# the script that writes file fixtures with a past release's keras_accum
# (whose window it reads as that release kept it).
MAY_REACH = {TESTS / "helpers" / "internals.py", TESTS / "scripts" / "make_file_fixtures.py"}


def _private_reaches(path):
    """`obj._name` where obj is not self, cls or super(): a reach into
    another object's private attribute."""
    reaches = []
    for node in ast.walk(_tree(path)):
        if not isinstance(node, ast.Attribute):
            continue
        name, owner = node.attr, node.value
        if not name.startswith("_") or name.startswith("__"):
            continue
        if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
            continue
        if isinstance(owner, ast.Call) and getattr(owner.func, "id", None) == "super":
            continue
        reaches.append(f"{path.relative_to(TESTS)}:{node.lineno}: .{name}")
    return reaches


@pytest.mark.unit
def test_tests_reach_private_attributes_only_through_helpers_internals():
    files = [p for p in sorted(TESTS.rglob("*.py")) if p not in MAY_REACH]
    assert len(files) > 30, "is this test still looking at the tests?"
    reaches = [reach for path in files for reach in _private_reaches(path)]
    assert not reaches, reaches


@pytest.mark.unit
def test_no_test_module_imports_another():
    modules = {p.stem for p in TESTS.glob("test_*.py")} | {"conftest"}
    imports = []
    for path in sorted(TESTS.rglob("*.py")):
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            imports += [
                f"{path.relative_to(TESTS)}:{node.lineno}: {name}"
                for name in names
                if name.split(".")[0] in modules
            ]
    assert not imports, imports
