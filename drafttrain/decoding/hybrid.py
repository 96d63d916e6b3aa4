"""A model drafter plus a lookup (`+ngram`, `+suffix`: any kind with a `lookup`): the lookup's
continuation verified as one more branch of the model's tree, in the SAME target pass.

Each step the model drafts as it would alone (a draft LM's chain, sequential or parallel; an
EAGLE-3 draft's chain, static tree or EAGLE-2 dynamic tree; Medusa heads' static tree) and the
n-gram continuation of the text so far (`ngram_lookup`, as deep as the step may go) is hung from
the root, sharing the model's nodes where it agrees with them (`hang_lookup`, on the device). So a step verifies
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

Lookup first (`lookup_first`): where the lookup finds a continuation, the step verifies it alone and
the model does not draft; the model drafts only where the lookup finds nothing. Beside the lookup,
every model node costs a verified token, and on a CPU each costs about a fifth of a plain step
(Gemma-3 on 2 cores), where a GPU verifies them almost free; the plan weighs both from the measured
costs (`planning.plan_hybrid_chain`, `planning.lookup_first_seconds`). A model that skips a step loses nothing: what it keeps is fed
from the accepted path at every commit, whoever drafted it.
"""

from __future__ import annotations

import torch

from ..trees import Tree, chain, path_nodes
from .chain import ChainDecoder, Proposer
from .engines import device_tensor
from .tree import TreeDecoder, TreeDrafter


def hang_lookup(tokens: torch.Tensor, tree: Tree, lookup: list[int]) -> tuple[torch.Tensor, Tree, torch.Tensor]:
    """`tree` (its `tokens` [N] on the device, node 0 the root) with the chain `lookup` hung from
    the root, built on the device: no host sync, whatever the model drafted.

    The lookup walks down the tree while a node holds its next token (the deepest node whose path
    equals a prefix of the lookup; ties: the lowest index), and its rest becomes a chain below that
    node. A fixed L = len(lookup) nodes are appended after the tree's, which keep their indices:
    node N + i holds lookup[i] at depth i + 1, below the previous lookup node, or, where the walk
    shared that token, as a twin of the tree's own node (same parent, same token, no children).
    A twin is accepted exactly when its elder is, and the verdict prefers the lower index, so it is
    never the path kept: the merged tree verifies every path of both, each kept once. Returns the
    tokens [N + L], the tree, and how many nodes the lookup really added (0-d, L - shared)."""
    n, length, device = tokens.numel(), len(lookup), tokens.device
    if not length:
        return tokens, tree, torch.zeros((), dtype=torch.long, device=device)
    look = device_tensor(lookup, device)
    depths = tree.depths
    matches = (depths == 0) | ((depths <= length) & (tokens == look[(depths - 1).clamp(0, length - 1)]))
    walked = ~(tree.attention_mask & ~matches[None, :]).any(dim=1)
    order = torch.arange(n, device=device)
    shared = torch.where(walked, depths * n + (n - 1 - order), -1).argmax()
    path, depth = path_nodes(tree, shared), depths.index_select(0, shared.view(1))[0]  # no .item()
    i = torch.arange(length, device=device)
    parent = torch.where(i <= depth, path[i.clamp(max=tree.max_depth)], n + i - 1)
    above = tree.attention_mask.index_select(0, path[torch.minimum(i, depth).clamp(max=tree.max_depth)])
    own = (i[None, :] <= i[:, None]) & ((i[None, :] >= depth) | (i[None, :] == i[:, None]))
    mask = torch.cat([torch.cat([tree.attention_mask, own.new_zeros(n, length)], dim=1),
                      torch.cat([above, own], dim=1)])
    merged = Tree(parent=torch.cat([tree.parent, parent]), depths=torch.cat([depths, i + 1]), attention_mask=mask,
                  max_depth=max(tree.max_depth, length))
    return torch.cat([tokens, look]), merged, length - depth


class ChainAsTree(TreeDrafter):
    """A chain `Proposer` (greedy) as a tree drafter: its drafts are a chain below the root, draft
    i at node i, so the hybrid joins n-gram lookup to chains and trees alike."""

    name = "chain"

    def __init__(self, proposer: Proposer, k: int, device):
        self.proposer, self.device = proposer, torch.device(device)
        self.wraps = proposer
        self.hidden_layers = tuple(proposer.hidden_layers)
        self.max_depth, self.max_nodes = k, k + 1
        self.sequence: list[int] = []  # what `propose` reads: the text so far
        self._nodes = 1                # nodes of the last draft, the root included
        self._chains = [chain(n, self.device) for n in range(1, k + 2)]  # built once: no copy in a step

    @property
    def forwards(self) -> int:
        return self.proposer.forwards

    def reset(self, prompt, hidden=None):
        self.sequence = list(prompt)
        self.proposer.reset(prompt, hidden=hidden)

    def draft(self, root, depth):
        drafts = self.proposer.propose(depth, self.sequence)[0] if depth else root.reshape(1)[:0]
        self._nodes = 1 + drafts.numel()
        return torch.cat([root.reshape(1), drafts]), self._chains[self._nodes - 1]

    def commit(self, nodes, accepted, bonus, hidden=None):
        """The proposer keeps its drafts up to the path's last node below `_nodes` (its own: a tree
        it was merged into numbers other nodes after them); the rest reaches it as emitted tokens."""
        emitted = list(accepted) + [bonus]
        self.proposer.commit(sum(n < self._nodes for n in nodes) - 1, emitted, hidden=hidden)
        self.sequence += emitted


class HybridDrafter(TreeDrafter):
    """`model`'s tree (a `TreeDrafter`, or a chain through `ChainAsTree`) with a lookup's
    continuation merged in, each step. `lookup`: a lookup proposer (`NgramProposer`,
    `SuffixProposer`): `reset(prompt)` and `lookup(k, sequence)`, on the host."""

    name = "hybrid"

    def __init__(self, model: TreeDrafter, device, lookup, depth: int, lookup_first: bool = False):
        self.model, self.device, self.lookup, self.lookup_first = model, torch.device(device), lookup, lookup_first
        self.wraps = model
        self.hidden_layers = tuple(model.hidden_layers)
        # The lookup adds at most one chain, `depth` deep (the run's K): as deep as the model's tree
        # or deeper, where a node budget keeps the model shallower than K (EAGLE-3's dynamic tree
        # of 2 nodes is 1 deep). Cut to the model's depth, such a hybrid verified one n-gram token
        # a step while its plan counted K (Gemma-3: planned 1.78x, measured 1.25x, below n-gram alone).
        depth = max(model.max_depth, depth)
        self.max_depth, self.paths = depth, None
        self.max_nodes = max(model.max_nodes, depth + 1) if lookup_first else model.max_nodes + depth
        self.sequence: list[int] = []
        self.last_lookup: list[int] = []  # the last step's n-gram continuation (before merging)
        self._added = torch.zeros((), dtype=torch.long, device=self.device)  # lookup nodes beyond the model's

    @property
    def lookup_nodes(self) -> int:
        """Nodes the lookup added beyond the model's own, all steps (read on the host: a sync)."""
        return int(self._added)

    @property
    def forwards(self) -> int:
        return self.model.forwards

    def reset(self, prompt, hidden=None):
        self.sequence = list(prompt)
        self.lookup.reset(prompt)
        self.model.reset(prompt, hidden)

    def candidates(self):
        """The model's own candidates; the lookup's chain is `last_lookup`."""
        return self.model.candidates()

    def draft(self, root, depth):
        self.last_lookup = self.lookup.lookup(depth, self.sequence)
        skip = self.lookup_first and bool(self.last_lookup)  # the lookup's chain alone: no draft forward
        tokens, tree = self.model.draft(root, 0 if skip else min(depth, self.model.max_depth))
        if not self.last_lookup:  # most steps of fresh text: the model's tree as it is
            return tokens, tree
        tokens, tree, added = hang_lookup(tokens, tree, self.last_lookup)
        self._added += added
        return tokens, tree

    def commit(self, nodes, accepted, bonus, hidden=None):
        self.model.commit(nodes, accepted, bonus, hidden=hidden)
        self.sequence += list(accepted) + [bonus]


def hybrid_decoder(decoder: ChainDecoder | TreeDecoder, lookup, depth: int, lookup_first: bool = False) -> TreeDecoder:
    """A greedy decoder's drafter with `lookup` (a lookup proposer, its chain up to `depth` deep:
    the run's K) joined, both verified each step or (`lookup_first`) the lookup alone where it finds
    a continuation: a tree decoder on the same target, with the same EOS tokens, rule and margin
    recording."""
    if isinstance(decoder, TreeDecoder):
        model = decoder.drafter
    else:
        model = ChainAsTree(decoder.proposer, decoder.num_draft_tokens, decoder.device)
    return TreeDecoder(decoder.target, HybridDrafter(model, decoder.device, lookup, depth, lookup_first),
                       eos_token_ids=decoder.eos, record_margins=decoder.record_margins, rule=decoder.rule)


__all__ = ["ChainAsTree", "HybridDrafter", "hang_lookup", "hybrid_decoder"]
