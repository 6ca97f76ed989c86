"""The repository's own files: where they are, the docs' code blocks, the
tested TensorFlow/Keras pairs of noxfile.py."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
# Every page whose code blocks the tests run or check.
PAGES = [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]

_BLOCK = re.compile(
    r"^(?:<!-- docs-test: (?P<marker>[\w-]+) -->\n)?```(?P<lang>[^\n]*)\n(?P<code>.*?)^```",
    flags=re.S | re.M,
)


class Block:
    """A fenced code block: its `docs-test` marker (or None), language, code."""

    def __init__(self, match):
        self.marker, self.lang, self.code = match["marker"], match["lang"].strip(), match["code"]


def blocks(text):
    """The fenced code blocks of a page's text, in order."""
    return [Block(m) for m in _BLOCK.finditer(text)]


def nox_constant(name):
    """A constant of noxfile.py (`PAIRS`, `CORE`), read without nox."""
    tree = ast.parse((ROOT / "noxfile.py").read_text())
    node = next(
        n
        for n in tree.body
        if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", None) == name
    )
    return ast.literal_eval(node.value)


def nox_pairs():
    """noxfile.py's `PAIRS`: name -> (TensorFlow, Keras)."""
    return nox_constant("PAIRS")
