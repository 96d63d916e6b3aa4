"""Drafters, one file per kind: where a decoder's drafts come from. Each file declares its kind
once, a subclass of `DrafterKind` (`kind.py`) and its one instance `KIND`: class attributes for its
name, flag and help, and typed methods for how it loads and binds to an engine, how its decoder is
built, its tree, its costs for the planner, its vLLM method, how `replay` scores it and settings of
its own, each an eval/compare flag (`--ngram-max`); the base's defaults where it has none
(`supports(name)` says which it has). `REGISTRY` below is the one list of kinds that the factory,
eval/compare/replay, the planner, the reports and the vLLM backend read; a new kind is one file
here and one line in it.

- `plain`: the target alone (K = 0), the baseline;
- `draft_lm`: a small same-family LM drafting K tokens in a row on its own cached LM;
- `parallel_lm`: a parallel draft LM (PARD), K drafts from one forward (a draft LM whose config
  names a `pard_token` loads as one);
- `ngram`: prompt lookup, no model;
- `suffix`: suffix lookup, no model: the most frequent continuation of the longest suffix match;
- `oracle`: the target's own continuation, corrupted at a set rate (measures the engine; bench);
- `medusa`: Medusa heads on the target, a static tree (greedy) or a sampled chain;
- `eagle3`: an EAGLE-3 draft layer reading the target's features, chain or EAGLE-2 tree;
  `eagle3_cache`: its KV caches and the draft bound to one on an engine; `eagle3_tree`: EAGLE-2's
  dynamic tree grown on the device;
- `hybrid`: `+ngram`, any model drafter above with a lookup's chain merged into its chain or
  tree, verified in the same target pass.
"""

from __future__ import annotations

from . import draft_lm, eagle3, medusa, ngram, oracle, parallel_lm, plain, suffix
from .eagle3_tree import DYNAMIC_TREE_NODES, DYNAMIC_TREE_TOPK  # a dynamic tree's defaults, for DecodeSettings
from .kind import Drafter, DrafterKind

REGISTRY: list[DrafterKind] = [plain.KIND, draft_lm.KIND, parallel_lm.KIND, ngram.KIND, suffix.KIND, oracle.KIND,
                               medusa.KIND, eagle3.KIND]

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
    return Drafter(plain.KIND.name)


def exported_drafter(kind: str, config: dict) -> Drafter:
    """The drafter an export's config.json describes, without its weights (what serving reads): a
    draft LM's parallel choice, Medusa heads' count."""
    from types import SimpleNamespace

    if kind == draft_lm.KIND.name:
        return draft_lm.draft_lm_drafter(SimpleNamespace(config=SimpleNamespace(**config)))
    return Drafter(kind, SimpleNamespace(config=SimpleNamespace(**config)))


def trained_drafter(*, draft=None, parallel: dict | None = None, **by_flag) -> Drafter:
    """The drafter a recipe just trained, as it names it: `draft=` a draft LM (`parallel=` its
    `parallel_info`), or the model under its kind's flag (`eagle3=`, `heads=`)."""
    if draft is not None:
        return draft_lm.draft_lm_drafter(draft, parallel or {})
    (flag, model), = by_flag.items()
    return Drafter(next(k.name for k in flagged() if k.flag == flag), model)


__all__ = ["BY_NAME", "Drafter", "DrafterKind", "LOOKUPS", "REGISTRY", "exported_drafter", "flagged", "kind_of",
           "methods",
           "target_alone", "trained_drafter"]
