"""Drafter kinds are declared once (`kinds/<name>/kind.py`, listed in `kinds.registry.KINDS`):
the factory, the planner and evaluation read the registry and never name a kind themselves.
Read from the source with `ast`: a kind's name, flag or vLLM method as a string, an attribute of a
kind's flag (`cfg.heads`), or an import of a kind's module is a module naming a kind. Each kind is a
`DrafterKind` subclass of typed methods, no table of lambdas."""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import pytest

from drafttrain.kinds.registry import LOOKUPS, REGISTRY, Drafter, DrafterKind

PACKAGE = Path(__file__).resolve().parents[2] / "drafttrain"
KIND_FOLDERS = {p.parent.name for p in (PACKAGE / "kinds").glob("*/__init__.py")}
# What reads the registry and must not name a kind: the factory, the kinds' base, the planner, evaluation.
# (`kinds/registry.py` is the one list of kinds' folders.)
READERS = [PACKAGE / "kinds" / "factory.py", PACKAGE / "kinds" / "base.py", PACKAGE / "planning.py",
           *sorted((PACKAGE / "evaluation").glob("*.py"))]
# The shared code, whose identifiers and strings name no kind: the readers, the feature-reading drafts' run time,
# the decoders and bench.
SHARED = [*READERS, PACKAGE / "kinds" / "__init__.py", PACKAGE / "kinds" / "features.py",
          *sorted((PACKAGE / "decoding").rglob("*.py")), *sorted((PACKAGE / "bench").rglob("*.py"))]


def kind_words() -> set[str]:
    """What names a kind: its name or its flag (but `none`, the word for the target alone in
    every choice list; `draft` and `suffix` are checked as strings only: a draft token, Path.suffix)."""
    words = {k.name for k in REGISTRY} | {k.flag for k in REGISTRY if k.flag}
    return words - {"none"}


def namings(path: Path) -> list[str]:
    words, found = kind_words(), []
    for node in ast.walk(ast.parse(path.read_text())):
        where = f"{path.relative_to(PACKAGE)}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in words:
            found.append(f"{where} the string {node.value!r}")
        elif isinstance(node, ast.Attribute) and node.attr in words - {"draft", "suffix"}:  # Path.suffix
            found.append(f"{where} the attribute .{node.attr}")
        elif isinstance(node, ast.ImportFrom) and (kind := kind_imported(node)):
            found.append(f"{where} an import of kinds/{kind}/")
    return found


def kind_imported(node: ast.ImportFrom) -> str | None:
    """The kind folder `node` imports from (`from ..kinds.medusa.kind import x`, `from ..kinds import medusa`)."""
    parts = (node.module or "").removeprefix("drafttrain.").split(".")
    inside = [parts[1]] if len(parts) > 1 else [a.name for a in node.names]
    return next((name for name in inside if name in KIND_FOLDERS), None) if parts[0] == "kinds" else None


def test_no_module_reading_the_registry_names_a_kind():
    found = [f for path in READERS for f in namings(path)]
    assert not found, "\n".join(found)


def test_the_check_finds_a_kind_named(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text('from ..kinds.medusa.kind import x\nfrom ..kinds import eagle3\nfrom ..kinds.registry import REGISTRY\n'
                   'if cfg.heads or kind == "eagle3":\n    pass\n')
    assert len(namings_at(bad)) == 4


def namings_at(path: Path) -> list[str]:
    global PACKAGE
    saved, PACKAGE = PACKAGE, path.parent
    try:
        return namings(path)
    finally:
        PACKAGE = saved


# Issue 37: no kind's name inside the shared code's identifiers or strings, only in its prose.
KIND_WORD = r"ngram|eagle3|medusa|suffix|parallel_|dflash"
PYTHONS_OWN = {"suffix", "suffixes", "removesuffix", "with_suffix"}  # Path.suffix, str.removesuffix, mkstemp(suffix=)


def docstrings(tree: ast.AST) -> set[int]:
    """The ids of the string constants that are docstrings (a module's, class's or function's first statement)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                found.add(id(first.value))
    return found


def kind_words_in(path: Path, root: Path = PACKAGE) -> list[str]:
    """Where `path`'s code names a kind (KIND_WORD). Identifiers, any case: a name, an attribute, a function's,
    class's or argument's name, a keyword argument, an imported name; but Python's own attributes and keywords
    (PYTHONS_OWN). Strings, as written (the issue's `git grep`): every string literal, f-strings' text included,
    but docstrings. Comments are no code: never looked at."""
    tree = ast.parse(path.read_text())
    prose, found = docstrings(tree), []
    for node in ast.walk(tree):
        where = f"{path.relative_to(root)}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            if id(node) not in prose and re.search(KIND_WORD, node.value):
                found.append(f"{where} the string {node.value!r}")
            continue
        own = node.attr if isinstance(node, ast.Attribute) else node.arg if isinstance(node, ast.keyword) else None
        if own in PYTHONS_OWN:
            continue
        names = {ast.Name: ("id",), ast.Attribute: ("attr",), ast.FunctionDef: ("name",),
                 ast.AsyncFunctionDef: ("name",), ast.ClassDef: ("name",), ast.arg: ("arg",), ast.keyword: ("arg",),
                 ast.alias: ("name", "asname"), ast.ImportFrom: ("module",)}.get(type(node), ())
        for name in filter(None, (getattr(node, a) for a in names)):
            if re.search(KIND_WORD, name, re.IGNORECASE):
                found.append(f"{where} the identifier {name}")
    return found


def test_no_identifier_or_string_of_the_shared_code_names_a_kind():
    found = [f for path in SHARED for f in kind_words_in(path)]
    assert not found, "\n".join(found)


def test_the_identifier_check_finds_a_kind_named_and_spares_prose(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text('"""ngram: the module docstring."""\n'
                   "def f(ngram_max=3):  # ngram in a comment\n"
                   '    """eagle3 in a docstring."""\n'
                   "    x = s.ngram_hybrid or Eagle3Kind(tree=f'{medusa}') or g(parallel_info=1)\n"
                   "    return f'+ngram' if path.suffix else x.removesuffix('.bin')\n")
    found = kind_words_in(bad, tmp_path)
    assert sorted(f.partition(" the ")[2] for f in found) == sorted([
        "identifier ngram_max", "identifier ngram_hybrid", "identifier Eagle3Kind", "identifier medusa",
        "identifier parallel_info", "string '+ngram'"])


def test_every_kind_is_registered_once_with_a_builder():
    names = [k.name for k in REGISTRY]
    assert len(names) == len(set(names)) and all(callable(k.build) for k in REGISTRY)
    assert "suffix" in names


def kind_methods(kind) -> dict:
    """The methods a kind's class (or a base between it and `DrafterKind`) defines, by name."""
    return {name: value for cls in type(kind).__mro__[:-2] for name, value in vars(cls).items()
            if callable(value) and not name.startswith("__")}


def test_every_kind_is_its_own_subclass_declaring_only_what_the_base_knows():
    assert len({type(k) for k in REGISTRY}) == len(REGISTRY)
    for kind in REGISTRY:
        assert isinstance(kind, DrafterKind) and type(kind) is not DrafterKind and kind.name, kind
        own = {n for n in vars(type(kind)) if not n.startswith("_")}
        assert own <= set(dir(DrafterKind)), f"{kind.name}: unknown {sorted(own - set(dir(DrafterKind)))}"
        assert "build" in kind_methods(kind), kind.name


def test_no_kind_is_a_table_of_lambdas():
    for kind in REGISTRY:
        assert "lambda" not in inspect.getsource(type(kind)), kind.name
        for name, method in kind_methods(kind).items():
            assert inspect.isfunction(method) and method.__name__ == name, f"{kind.name}.{name}"


def typed_methods() -> list:
    """Every method of the base and of each kind, but `__dunder__`s."""
    return [(cls.__name__, name, value) for cls in {DrafterKind, *map(type, REGISTRY)}
            for name, value in vars(cls).items() if inspect.isfunction(value) and not name.startswith("__")]


def test_every_method_is_typed_and_says_what_it_returns():
    for owner, name, method in typed_methods():
        params = list(inspect.signature(method).parameters.values())[1:]  # but self
        where = f"{owner}.{name}"
        assert all(p.annotation is not inspect.Parameter.empty for p in params), where
        assert inspect.signature(method).return_annotation is not inspect.Signature.empty, where
        assert (method.__doc__ or "").strip(), where


def test_supports_tells_a_kind_with_its_own_method_from_the_default():
    served = {k.name for k in REGISTRY if k.supports("vllm")}
    assert served == {"draft", "parallel_draft", "ngram", "suffix", "medusa", "eagle3", "dflash"}
    assert {k.name for k in REGISTRY if k.supports("lookup")} == set(LOOKUPS) == {"ngram", "suffix"}
    assert {k.name for k in REGISTRY if k.supports("tree")} == {"medusa", "eagle3"}
    for kind in REGISTRY:  # what the base returns for a kind without its own
        if not kind.supports("vllm"):
            drafter = Drafter(kind.name)
            assert kind.vllm(None, 4, drafter, None) is None and kind.vllm_forwards(4, drafter) == 0
    for bad in ("build", "supports", "name", "nothing"):
        with pytest.raises(AttributeError):
            REGISTRY[0].supports(bad)
