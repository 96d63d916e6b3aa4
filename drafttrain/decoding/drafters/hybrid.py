"""A model drafter plus n-gram lookup (`+ngram`): both chains verified in the SAME target pass.

Each step the model's chain (a draft LM's, sequential or parallel) and the n-gram continuation
become two branches of one tree rooted at the pending token; where they agree they share nodes,
so the tree has at most 2K + 1 nodes and often far fewer (n-gram lookup finds nothing in most
steps of fresh text, and copies what the model would draft in others). The target accepts the
longest path it agrees with, so a step keeps whichever branch goes further: the model's where
text is new, the n-gram's where the output copies its context (HumanEval re-emits its prompt),
deep positions included. Greedy only: the tree verdict is greedy (`decoding.tree`).

The model drafter is told, as a chain proposer, how many of ITS drafts the emitted tokens
matched, so its cache keeps exactly those and the rest comes back as pending tokens.
"""

from __future__ import annotations

import torch

from ...trees import Tree, tree_from_parents
from ..chain import Proposer
from ..tree import TreeDrafter


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def two_branch_tree(first: list[int], second: list[int]) -> tuple[list[int], list[int]]:
    """(tokens after the root, parents incl. the root's -1) of two chains sharing their common prefix."""
    shared = common_prefix(first, second)
    tokens = first + second[shared:]
    parents = [-1] + list(range(len(first)))                   # the first chain: node i's parent is i - 1
    fork = shared                                              # the node the second chain's rest hangs off
    for j in range(len(second) - shared):
        parents.append(fork if j == 0 else len(parents) - 1)
    return tokens, parents


class HybridDrafter(TreeDrafter):
    """`model`: a chain `Proposer` (draft LM or parallel draft); `lookup`: n-gram lookup; `k`: the
    drafts each chain may propose."""

    name = "hybrid"

    def __init__(self, model: Proposer, lookup: Proposer, k: int, device: torch.device):
        self.model, self.lookup, self.device = model, lookup, torch.device(device)
        self.max_depth, self.max_nodes, self.paths = k, 2 * k + 1, None
        self.sequence: list[int] = []
        self._drafts: list[int] = []
        self.lookup_nodes = 0  # nodes the n-gram branch added beyond the model's chain, all steps

    @property
    def forwards(self) -> int:
        return self.model.forwards

    def reset(self, prompt, hidden=None):
        self.sequence = list(prompt)
        self.model.reset(prompt)
        self.lookup.reset(prompt)

    def warmup(self) -> float:
        return self.model.warmup()

    def draft(self, root: torch.Tensor, depth: int) -> tuple[torch.Tensor, Tree]:
        drafts = self.model.propose(depth, self.sequence)[0].tolist() if depth else []
        lookup = self.lookup.propose(depth, self.sequence)[0].tolist() if depth else []
        self._drafts = drafts
        tokens, parents = two_branch_tree(drafts, lookup)
        self.lookup_nodes += len(tokens) - len(drafts)
        candidates = torch.cat([root.view(1), torch.tensor(tokens, dtype=torch.long, device=self.device)])
        return candidates, tree_from_parents(parents, self.device)

    def commit(self, nodes, accepted, bonus, hidden=None):
        emitted = list(accepted) + [bonus]
        self.model.commit(common_prefix(self._drafts, list(accepted)), emitted)
        self.lookup.commit(len(accepted), emitted)
        self.sequence += emitted


__all__ = ["HybridDrafter", "common_prefix", "two_branch_tree"]
