"""A model drafter plus n-gram lookup (`+ngram`): the lookup's continuation verified as one more
branch of the model's tree, in the SAME target pass.

Each step the model drafts as it would alone (a draft LM's chain, sequential or parallel; an
EAGLE-3 draft's chain, static tree or EAGLE-2 dynamic tree; Medusa heads' static tree) and the
n-gram continuation of the text so far (`ngram_lookup`, as deep as the step may go) is hung from
the root, sharing the model's nodes where it agrees with them (`merge_chain`). So a step verifies
at most K nodes more than the model alone, and none where the lookup finds nothing (most steps of
fresh text) or copies what the model drafted. The target accepts the longest path it agrees
with, so a step keeps whichever branch goes further: the model's where text is new, the n-gram's
where the output copies its context (HumanEval re-emits its prompt), deep positions included.
Greedy only: the tree verdict is greedy (`decoding.tree`).

The merge keeps the model's nodes at their indices and numbers the lookup's after them, and the
model is committed with the path the target accepted, whichever branch it went through. That is
all a model needs: what it keeps between steps is made of the emitted tokens and the target's
hidden states along the accepted path (EAGLE-3's draft cache, Medusa's last hidden state, a draft
LM's cache up to its last accepted draft), never of nodes it did not draft. A chain `Proposer`
joins as a tree drafter through `ChainAsTree`.
"""

from __future__ import annotations

import torch

from ...trees import Tree, chain, tree_from_parents
from ..chain import ChainDecoder, Proposer
from ..engines import device_tensor
from ..tree import TreeDecoder, TreeDrafter
from .ngram import ngram_lookup


def merge_chain(tokens: list[int], parents: list[int], lookup: list[int]) -> tuple[list[int], list[int]]:
    """(tokens, parents) of a tree (node 0 the root, whose token is not read; parents precede
    children) with the chain `lookup` hung from the root: it walks down the tree while a child
    holds its next token, and its rest becomes a chain below the last node it shared. The tree's
    nodes keep their indices, the new ones come after them: the result is prefix-closed, its
    parents precede their children, and it holds every root-to-node path of both."""
    children: dict[tuple[int, int], int] = {}
    for node in range(1, len(parents)):
        children.setdefault((parents[node], tokens[node]), node)  # twin siblings: the first, as the verdict's ties
    node, shared = 0, 0
    while shared < len(lookup) and (node, lookup[shared]) in children:
        node = children[node, lookup[shared]]
        shared += 1
    tokens, parents = list(tokens), list(parents)
    for token in lookup[shared:]:
        tokens.append(token)
        parents.append(node)
        node = len(tokens) - 1
    return tokens, parents


class ChainAsTree(TreeDrafter):
    """A chain `Proposer` (greedy) as a tree drafter: its drafts are a chain below the root, draft
    i at node i, so the hybrid joins n-gram lookup to chains and trees alike."""

    name = "chain"

    def __init__(self, proposer: Proposer, k: int, device):
        self.proposer, self.device = proposer, torch.device(device)
        self.hidden_layers = tuple(proposer.hidden_layers)
        self.max_depth, self.max_nodes = k, k + 1
        self.sequence: list[int] = []  # what `propose` reads: the text so far
        self._nodes = 1                # nodes of the last draft, the root included
        self._chains: dict[int, Tree] = {}

    @property
    def forwards(self) -> int:
        return self.proposer.forwards

    def reset(self, prompt, hidden=None):
        self.sequence = list(prompt)
        self.proposer.reset(prompt, hidden=hidden)

    def warmup(self) -> float:
        return self.proposer.warmup()

    def draft(self, root, depth):
        drafts = self.proposer.propose(depth, self.sequence)[0] if depth else root.reshape(1)[:0]
        self._nodes = 1 + drafts.numel()
        if self._nodes not in self._chains:
            self._chains[self._nodes] = chain(self._nodes, self.device)
        return torch.cat([root.reshape(1), drafts]), self._chains[self._nodes]

    def commit(self, nodes, accepted, bonus, hidden=None):
        """The proposer keeps its drafts up to the path's last node below `_nodes` (its own: a tree
        it was merged into numbers other nodes after them); the rest reaches it as emitted tokens."""
        emitted = list(accepted) + [bonus]
        self.proposer.commit(sum(n < self._nodes for n in nodes) - 1, emitted, hidden=hidden)
        self.sequence += emitted


class HybridDrafter(TreeDrafter):
    """`model`'s tree (a `TreeDrafter`, or a chain through `ChainAsTree`) with n-gram lookup's
    continuation (suffixes of at most `max_ngram` tokens) merged in, each step."""

    name = "hybrid"

    def __init__(self, model: TreeDrafter, device, max_ngram: int = 3):
        self.model, self.device, self.max_ngram = model, torch.device(device), max_ngram
        self.hidden_layers = tuple(model.hidden_layers)
        # the lookup adds at most one chain, no deeper than a step of the model may go
        self.max_depth, self.max_nodes, self.paths = model.max_depth, model.max_nodes + model.max_depth, None
        self.sequence: list[int] = []
        self.last_lookup: list[int] = []  # the last step's n-gram continuation (before merging)
        self.lookup_nodes = 0             # nodes the lookup added beyond the model's own, all steps

    @property
    def forwards(self) -> int:
        return self.model.forwards

    def reset(self, prompt, hidden=None):
        self.sequence = list(prompt)
        self.model.reset(prompt, hidden)

    def warmup(self) -> float:
        return self.model.warmup()

    def candidates(self):
        """The model's own candidates; the lookup's chain is `last_lookup`."""
        return self.model.candidates()

    def draft(self, root, depth):
        tokens, tree = self.model.draft(root, depth)
        self.last_lookup = ngram_lookup(self.sequence, depth, self.max_ngram)
        if not self.last_lookup:  # the model's tree as it is, without reading its tokens (a host sync)
            return tokens, tree
        merged, parents = merge_chain(tokens.tolist(), tree.parents, self.last_lookup)
        added = len(merged) - tokens.numel()
        self.lookup_nodes += added
        if not added:
            return tokens, tree
        return (torch.cat([tokens, device_tensor(merged[-added:], self.device)]),
                tree_from_parents(parents, self.device))

    def commit(self, nodes, accepted, bonus, hidden=None):
        self.model.commit(nodes, accepted, bonus, hidden=hidden)
        self.sequence += list(accepted) + [bonus]


def hybrid_decoder(decoder: ChainDecoder | TreeDecoder, max_ngram: int = 3) -> TreeDecoder:
    """A greedy decoder's drafter with n-gram lookup joined: a tree decoder on the same target,
    with the same EOS tokens and margin recording."""
    if isinstance(decoder, TreeDecoder):
        model = decoder.drafter
    else:
        model = ChainAsTree(decoder.proposer, decoder.num_draft_tokens, decoder.device)
    return TreeDecoder(decoder.target, HybridDrafter(model, decoder.device, max_ngram),
                       eos_token_ids=decoder.eos, record_margins=decoder.record_margins)


__all__ = ["ChainAsTree", "HybridDrafter", "hybrid_decoder", "merge_chain"]
