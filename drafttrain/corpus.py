"""Code-completion prompts from the Python standard library's own source.

HumanEval's prompts are a signature plus a docstring, and the model writes the body. The stdlib
is full of exactly that shape, under a permissive licence, on every machine that runs Python: a
training prompt set for code drafters that never touches HumanEval (held out by construction).
"""

from __future__ import annotations

import ast
import random
import sysconfig
from pathlib import Path

from .errors import UserError
from .fileio import atomic_write_jsonl

SKIP_PARTS = {"test", "tests", "idlelib", "lib2to3", "site-packages", "turtledemo", "__pycache__"}


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def function_prompts(source: str, max_chars: int = 700) -> list[str]:
    """`def ...:` + docstring of every documented top-level or method function, as a prompt."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    lines = source.splitlines(keepends=True)
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        doc = ast.get_docstring(node)
        body = node.body
        if not doc or len(doc) < 30 or len(body) < 2 or node.decorator_list:
            continue  # need a real docstring and a body to write after it
        start, end = node.lineno - 1, body[0].end_lineno
        text = "".join(lines[start:end])
        indent = len(lines[start]) - len(lines[start].lstrip())
        text = "".join(line[indent:] if line[:indent].isspace() else line for line in text.splitlines(True))
        if len(text) <= max_chars:
            out.append(text if text.endswith("\n") else text + "\n")
    return out


def stdlib_prompts(num: int, seed: int = 0, root: Path | None = None) -> list[dict]:
    root = root or stdlib_dir()
    files = sorted(p for p in root.rglob("*.py") if not SKIP_PARTS & set(p.relative_to(root).parts))
    seen, prompts = set(), []
    for path in files:
        try:
            source = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        for text in function_prompts(source):
            if text not in seen:
                seen.add(text)
                prompts.append({"id": f"{path.relative_to(root)}:{len(prompts)}", "prompt": text,
                                "category": "stdlib"})
    if not prompts:
        raise UserError(f"no documented functions found under {root}; pass a directory of Python sources")
    random.Random(seed).shuffle(prompts)
    return prompts[:num]


def write_stdlib_prompts(out: Path, num: int = 2000, seed: int = 0, root: Path | None = None) -> int:
    rows = stdlib_prompts(num, seed, root)
    atomic_write_jsonl(out, rows)
    return len(rows)
