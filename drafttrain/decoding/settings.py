"""What every decoder of a run shares, whatever its drafter (`DecodeSettings`): K, the acceptance
rule's temperature and top-p, EOS, the tree chosen, a lookup joined, and the kinds' own settings by
name (each kind declares its own in `kinds/<name>/kind.py`)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from .dynamic_tree import DYNAMIC_TREE_NODES, DYNAMIC_TREE_TOPK
from .verify import acceptance_rule

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
    lookup_first: bool = False        # a hybrid verifies the lookup's chain alone where it finds one, the
                                      # drafter's only where it finds nothing (`decoding.hybrid`)
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
        return replace(self, hybrid=None, lookup_first=False)
