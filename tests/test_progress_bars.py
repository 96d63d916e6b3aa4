"""Every progress bar is opened as a context manager, so it is closed however its loop ends.

A bar left open by an interrupted loop is closed by its `__del__` at interpreter exit, when modules
are half torn down: a Ctrl-C then ends in the recipe's one line *and* an "Exception ignored in
tqdm.__del__" traceback (seen on a loaded machine in tests/training/test_launch.py). Read from the
source with `ast`, so a new bar cannot slip past."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "drafttrain"


def bars_outside_with(path: Path) -> list[int]:
    """Lines of `tqdm(...)` calls in `path` that are not the context expression of a `with` item."""
    tree = ast.parse(path.read_text())
    in_with = {id(item.context_expr) for node in ast.walk(tree) if isinstance(node, (ast.With, ast.AsyncWith))
               for item in node.items}
    return [node.lineno for node in ast.walk(tree)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "tqdm"
            and id(node) not in in_with]


def test_every_progress_bar_is_a_with_block():
    found = {str(p.relative_to(PACKAGE)): lines for p in PACKAGE.rglob("*.py") if (lines := bars_outside_with(p))}
    assert found == {}, f"open these bars with `with tqdm(...) as bar:` (file: lines): {found}"


def test_the_check_sees_a_bar_left_open(tmp_path):
    leaky = tmp_path / "leaky.py"
    leaky.write_text("from tqdm import tqdm\nbar = tqdm(total=3)\nfor x in tqdm(range(3)):\n    pass\n"
                     "with tqdm(total=2) as ok:\n    pass\n")
    assert bars_outside_with(leaky) == [2, 3]
