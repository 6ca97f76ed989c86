"""The package's layout holds: one owner of `train_function`, modules and
classes readable in one sitting (README, "Development", has the map)."""

import ast
from pathlib import Path

import keras_accum

PACKAGE = Path(keras_accum.__file__).parent
MODULES = sorted(PACKAGE.rglob("*.py"))
MAX_MODULE_LINES, MAX_CLASS_LINES = 450, 350


def _tree(path):
    return ast.parse(path.read_text())


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
