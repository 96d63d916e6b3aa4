"""The one list of drafter kinds (`KINDS`: one line per kind, its folder under `kinds/`), which
the factory, eval/compare/replay, the planner, the reports, `bench` and the vLLM backend read. Each
folder's `kind.py` declares its kind once: a `DrafterKind` subclass (`base.py`) and its one instance
`KIND`, whose class attributes name its flag and help and whose typed methods say how it loads and
binds to an engine, builds its decoder, its tree, its costs, how vLLM serves it, how `replay` scores
it and its own settings (`supports(name)` says which of the optional ones it has).

- `plain`: the target alone (K = 0), the baseline;
- `draft_lm`: a small same-family LM drafting K tokens in a row on its own cached LM;
- `parallel_lm`: a parallel draft LM (PARD), K drafts from one forward (a draft LM whose config
  names a `pard_token` loads as one);
- `ngram`: prompt lookup, no model;
- `suffix`: suffix lookup, no model: the most frequent continuation of the longest suffix match;
- `oracle`: the target's own continuation, corrupted at a set rate (measures the engine; bench);
- `medusa`: Medusa heads on the target, a static tree (greedy) or a sampled chain;
- `eagle3`: an EAGLE-3 draft layer reading the target's features, chain or EAGLE-2 tree.

Any model drafter that `takes_lookup` may have a lookup's chain joined to its chain or tree
(`+ngram`, `decoding/hybrid.py`), verified in the same target pass.
"""

from __future__ import annotations

from importlib import import_module

from .base import Drafter, DrafterKind

KINDS = (  # one line per kind: its folder under kinds/, whose kind.py declares its KIND
    "plain",
    "draft_lm",
    "parallel_lm",
    "ngram",
    "suffix",
    "oracle",
    "medusa",
    "eagle3",
    "dflash",
)
REGISTRY: list[DrafterKind] = [import_module(f"{__package__}.{name}.kind").KIND for name in KINDS]

BY_NAME = {kind.name: kind for kind in REGISTRY}
LOOKUPS = [kind.name for kind in REGISTRY if kind.supports("lookup")]  # +NAME hybrids, --ngram's first


def kind_of(name: str) -> DrafterKind:
    """The kind named `name`, or a ValueError listing the known ones."""
    if name not in BY_NAME:
        raise ValueError(f"unknown drafter kind {name!r}; known: {', '.join(BY_NAME)}")
    return BY_NAME[name]


def flagged() -> list[DrafterKind]:
    """Kinds loaded from an export, each with its own flag (--draft DIR): compare's NAME=flag:DIR."""
    return [kind for kind in REGISTRY if kind.flag]


def methods() -> list[DrafterKind]:
    """Kinds without weights, chosen by --method NAME (compare's NAME=NAME)."""
    return [kind for kind in REGISTRY if kind.method]


def target_alone() -> Drafter:
    """The drafter of plain decoding: every baseline, and a plan of K = 0."""
    return Drafter(REGISTRY[0].name)


def exported_drafter(kind: str, config: dict) -> Drafter:
    """The drafter an export's config.json describes, without its weights (what serving reads): a
    draft LM's parallel choice, Medusa heads' count."""
    from types import SimpleNamespace

    return kind_of(kind).drafter(SimpleNamespace(config=SimpleNamespace(**config)))


def trained_drafter(*, parallel: dict | None = None, **by_flag) -> Drafter:
    """The drafter a recipe just trained, as it names it: the model under its kind's flag (`draft=`,
    `eagle3=`, `heads=`); a draft LM's `parallel=` its `parallel_info`."""
    (flag, model), = by_flag.items()
    return next(k for k in flagged() if k.flag == flag).drafter(model, parallel or {})


__all__ = ["BY_NAME", "Drafter", "DrafterKind", "KINDS", "LOOKUPS", "REGISTRY", "exported_drafter", "flagged",
           "kind_of", "methods", "target_alone", "trained_drafter"]
