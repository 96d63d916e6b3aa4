"""The one decoder factory: every decoder of eval, compare, replay, bench and the recipes is built here.

A drafter kind declares how its decoder is built, which tree it verifies and what it needs in its
own file under `drafters/` (`DrafterKind`), listed once in `drafters.REGISTRY`; this module reads
that list and names no kind. Trees are chosen once per kind, by its `tree` (over
`trees.resolve_tree`); the acceptance rule is the settings' `rule()` (`verify.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from .drafters import DYNAMIC_TREE_NODES, DYNAMIC_TREE_TOPK, REGISTRY, kind_of
from .drafters.hybrid import hybrid_decoder
from .drafters.kind import Drafter
from .engines import as_cached_lm
from .loop import Decoder
from .verify import acceptance_rule

DRAFTERS = {kind.name: kind.build for kind in REGISTRY}  # kind name -> its decoder's builder
NUM_DRAFT_TOKENS = 4  # K, the default of every entry point that decodes (eval, compare, replay, bench, recipes)


@dataclass(frozen=True)
class DecodeSettings:
    """What every decoder of a run shares, whatever its drafter."""

    num_draft_tokens: int = NUM_DRAFT_TOKENS
    temperature: float = 0.0
    top_p: float = 1.0
    eos_token_ids: frozenset = frozenset()
    generator: torch.Generator | None = None
    record_margins: bool = False      # greedy: keep the target's top-1 minus top-2 logit per token
    tree: str = "auto"                # --tree: auto, default, chain, dynamic or a JSON file of paths
    tree_nodes: int | None = None     # nodes per step, pending included: the dynamic tree's (None: 32),
                                      # a static tree's first ones best first (None: all)
    tree_topk: int = DYNAMIC_TREE_TOPK  # a dynamic tree: nodes expanded per depth
    hybrid: str | None = None         # +LOOKUP: the lookup kind joined, its chain one more branch of the
                                      # drafter's chain or tree (None: none)
    kind_settings: dict = field(default_factory=dict, hash=False)  # the kinds' own settings by name
                                      # (`DrafterKind.settings`, e.g. --ngram-max); unset: their defaults

    @property
    def dynamic_nodes(self) -> int:
        """The nodes of EAGLE-2's dynamic tree."""
        return self.tree_nodes or DYNAMIC_TREE_NODES

    @property
    def lookup(self) -> str | None:
        """The lookup kind hung from the drafter's tree (+LOOKUP), or None."""
        return self.hybrid

    def rule(self):
        """The acceptance rule of these settings (`verify.Greedy` or `verify.Sampled`)."""
        return acceptance_rule(self.temperature, self.top_p, self.generator)

    def alone(self) -> DecodeSettings:
        """The same settings with no lookup joined."""
        return replace(self, hybrid=None)


def tree_choice(drafter: Drafter, s: DecodeSettings) -> tuple[str, list | str] | None:
    """(the tree's name for reports, paths or "dynamic") a tree drafter verifies, or None for a
    chain: the drafter's kind decides (`DrafterKind.tree`)."""
    return kind_of(drafter.kind).tree(drafter, s)


def tree_name(drafter: Drafter, s: DecodeSettings) -> str | None:
    """The report's name of the tree or chain a tree-capable drafter (or any hybrid) verifies;
    None for chain drafters."""
    if s.lookup:
        model = tree_name(drafter, s.alone()) or "model chain"
        return f"{model} + {kind_of(s.lookup).label} chain (up to {s.num_draft_tokens} nodes)"
    tree = tree_choice(drafter, s)
    if tree is not None:
        return tree[0]
    if kind_of(drafter.kind).supports("tree"):  # a tree kind drafting a chain
        return "chain" if s.temperature == 0 else "chain (sampling)"
    return None


def max_step_tokens(drafter: Drafter, s: DecodeSettings) -> int:
    """The most tokens one verification step adds to the target's cache: K + 1, or a tree's nodes;
    a hybrid adds at most K more (the lookup's chain)."""
    lookup = s.num_draft_tokens if s.lookup else 0
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
        decoder = hybrid_decoder(decoder, kind_of(lookup).lookup(settings), settings.num_draft_tokens)
    decoder.tree_name = tree_name(drafter, settings)
    return decoder
