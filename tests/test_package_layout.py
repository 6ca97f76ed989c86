"""The package's layout holds: one owner of `train_function`, modules and
classes readable in one sitting (README, "Development", has the map)."""

import ast
from pathlib import Path

import pytest

import keras_accum

PACKAGE = Path(keras_accum.__file__).parent
MODULES = sorted(PACKAGE.rglob("*.py"))
MAX_MODULE_LINES, MAX_CLASS_LINES = 450, 350


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
    assert all(where.startswith("train_functions.py:") for where in assigned), assigned


@pytest.mark.unit
def test_modules_and_classes_are_readable_in_one_sitting():
    too_long = []
    for path in MODULES:
        lines = len(path.read_text().splitlines())
        if lines > MAX_MODULE_LINES:
            too_long.append(f"{path.relative_to(PACKAGE)}: {lines} lines")
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.ClassDef):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_CLASS_LINES:
                    too_long.append(f"{path.relative_to(PACKAGE)}:{node.name}: {length} lines")
    assert not too_long, too_long


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
