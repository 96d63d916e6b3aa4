"""The one decoder factory: every decoder of eval, compare, replay, bench and the recipes is built here.

A drafter kind declares how its decoder is built, which tree it verifies and what it needs in its
own folder (`kinds/<name>/kind.py`, a `DrafterKind`), listed once in `kinds.registry.KINDS`; this
module reads that list and names no kind. What every decoder shares is `decoding.DecodeSettings`. Trees are chosen once per kind, by its `tree` (over
`trees.resolve_tree`); the acceptance rule is the settings' `rule()` (`verify.py`).
"""

from __future__ import annotations

from ..decoding.engines import as_cached_lm
from ..decoding.hybrid import hybrid_decoder
from ..decoding.loop import Decoder
from ..decoding.settings import DecodeSettings
from .base import Drafter
from .registry import REGISTRY, kind_of


def tree_choice(drafter: Drafter, s: DecodeSettings) -> tuple[str, list | str] | None:
    """(the tree's name for reports, paths or "dynamic") a tree drafter verifies, or None for a
    chain: the drafter's kind decides (`DrafterKind.tree`)."""
    return kind_of(drafter.kind).tree(drafter, s)


def tree_name(drafter: Drafter, s: DecodeSettings) -> str | None:
    """The report's name of the tree or chain a tree-capable drafter (or any hybrid) verifies;
    None for chain drafters."""
    if s.lookup:
        model = tree_name(drafter, s.alone()) or "model chain"
        lookup = f"{kind_of(s.lookup).label} chain (up to {s.num_draft_tokens} nodes)"
        return f"{lookup}, else {model}" if s.lookup_first else f"{model} + {lookup}"
    tree = tree_choice(drafter, s)
    if tree is not None:
        return tree[0]
    if kind_of(drafter.kind).supports("tree"):  # a tree kind drafting a chain
        return "chain" if s.temperature == 0 else "chain (sampling)"
    return None


def max_step_tokens(drafter: Drafter, s: DecodeSettings) -> int:
    """The most tokens one verification step adds to the target's cache: K + 1, or a tree's nodes;
    a hybrid adds at most K more (the lookup's chain)."""
    lookup = s.num_draft_tokens if s.lookup and not s.lookup_first else 0  # lookup first: one chain or the other
    tree = tree_choice(drafter, s)
    paths = [] if tree is None or tree[1] == "dynamic" else tree[1]
    if kind_of(drafter.kind).grows_trees:  # any tree the draft may grow: its cache is sized once per run
        return max(s.num_draft_tokens, s.dynamic_nodes - 1, len(paths)) + 1 + lookup
    return max(s.num_draft_tokens, len(paths)) + 1 + lookup


def build_decoder(target, drafter: Drafter, settings: DecodeSettings) -> Decoder:
    """The decoder of `drafter` verifying with `target` (a cached LM, or an HF model on the eager
    engine). Its `tree_name` says which tree it verifies (None for a chain). With a lookup joined
    (+ngram) the drafter's own decoder is built first and its drafter joined to the lookup
    (`hybrid_decoder`)."""
    kind = kind_of(drafter.kind)
    lookup = settings.lookup
    if lookup and (not kind.takes_lookup or settings.temperature > 0):
        joined = ", ".join(k.name for k in REGISTRY if k.takes_lookup)
        raise ValueError(f"+{lookup} joins {lookup} lookup to a model drafter ({joined}) in one tree, greedy only; "
                         f"not {drafter.kind} at temperature {settings.temperature}")
    decoder = kind.build(as_cached_lm(target), drafter, settings)
    if lookup:
        decoder = hybrid_decoder(decoder, kind_of(lookup).lookup(settings), settings.num_draft_tokens,
                                 settings.lookup_first)
    decoder.tree_name = tree_name(drafter, settings)
    return decoder
