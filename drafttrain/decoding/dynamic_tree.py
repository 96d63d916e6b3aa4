"""EAGLE-2's dynamic tree (Li et al. 2024) grown on the device, in fixed shapes.

Each depth expands the `topk` most likely nodes of the depth before (by the draft's cumulative
log-probability) in one draft forward, and every expanded node proposes its `topk` most likely
children; the tree verified is the `nodes - 1` most likely of everything proposed. A child is
never more likely than its parent, so that set is prefix-closed: a tree.

Everything is a tensor of a size fixed by (depth, topk, nodes): top-k over the draft's own
vocabulary for all frontier nodes at once (ids mapped to the target's after selection), the
frontier chosen by a stable top-k over cumulative scores, parents, depths and the ancestor mask
built by gathers, the final selection on the device. So the whole tree is one compiled graph and
costs the step no host sync: the decoder learns which path the target accepted from its verdict.

Ties are broken as a host implementation ranking by (-score, depth, creation order) would:
candidates are created depth by depth, and every sort is stable.

A planner's recording grows the trees of several top-ks at once (`grow_dynamic_forest`), on the
eager engine only: which of their nodes are one is told on the host.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

DYNAMIC_TREE_NODES = 32  # EAGLE-2's dynamic tree when no node count is given (the root included)
DYNAMIC_TREE_TOPK = 4    # nodes it expands per depth, and children drafted per node, unless told


class DynamicTree(NamedTuple):
    """The tree a step verifies (node 0 = the pending token), and every candidate drafted, for a
    planner that asks what a smaller tree would have accepted (`TreeDrafter.candidates`)."""

    tokens: torch.Tensor        # [N] target ids
    parent: torch.Tensor        # [N] parent node, -1 for the root
    depths: torch.Tensor        # [N]
    mask: torch.Tensor          # [N, N] bool: ancestors and self
    ranked: torch.Tensor        # [T - 1] candidate ids, best first (the root, 0, excluded)
    cand_tokens: torch.Tensor   # [T] every candidate's target id (0: the root)
    cand_parent: torch.Tensor   # [T]
    cand_depths: torch.Tensor   # [T]


def candidate_count(depth: int, topk: int) -> int:
    """Candidates a full-depth tree drafts, the root included: topk at depth 1, topk² below."""
    return 1 + topk + (depth - 1) * topk * topk


Level = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def grow_dynamic_tree(draft, level: Level, logits: torch.Tensor, hidden: torch.Tensor, root: torch.Tensor, *,
                      depth: int, topk: int, nodes: int) -> DynamicTree:
    """The tree below `root` [1] from the draft's output at the last committed entry (`logits`
    [1, Vd] over its own vocabulary, `hidden` [1, H]), `depth` deep, with min(nodes, T) nodes.

    `level(d, hidden [1, k, H], tokens [1, k], mask [k, d·k])` runs the draft over the k frontier
    nodes of depth d (each reading its parent's output hidden state; mask: which of the expanded
    nodes so far, these last, each one sees) and returns their (logits, hidden) [1, k, ...]."""
    return grow_dynamic_forest(draft, level, logits, hidden, root, depth=depth, topks=(topk,), nodes=nodes)[0]


def grow_dynamic_forest(draft, level: Level, logits: torch.Tensor, hidden: torch.Tensor, root: torch.Tensor, *,
                        depth: int, topks: tuple[int, ...], nodes: int) -> list[DynamicTree]:
    """`grow_dynamic_tree` for every top-k of `topks` below the same root, each level of all of them
    ONE `level` call over the distinct nodes their frontiers expand (`_SharedLevels`). What a
    planner records (`evaluation.calibration`): the trees of top-1, 2, 4 and 8 mostly expand the
    same paths (a top-k tree's first level is the top-8's first k nodes), and a node is a path of
    tokens, whose draft output is the same in whichever tree it sits; each level's rows cost the
    draft's 16k-row head on a CPU (Gemma-3's EAGLE-3, 2 cores: a top-1 tree 11 ms, a top-8 one 25,
    the four side by side 45, their distinct nodes 33). Each tree equals the one `grow_dynamic_tree`
    grows alone, up to the rounding of a wider matmul. Eager caches only: the distinct rows are
    counted on the host."""
    growths = [_Growth(draft, logits, hidden, root, k, depth) for k in topks]
    if len(growths) == 1:  # one tree: its own mask, shapes fixed by (depth, topk): one compiled graph
        g = growths[0]
        for d in range(1, depth):
            h, tokens, mask = g.frontier(d)
            out_logits, out_hidden = level(d, h.unsqueeze(0), tokens.view(1, -1), mask)
            g.absorb(d, out_logits[0], out_hidden[0])
        return [g.select(min(nodes, candidate_count(depth, g.k)))]
    shared = _SharedLevels(root.device)
    for d in range(1, depth):
        fronts = [g.frontier(d) for g in growths]
        first, rows = shared.add([g.front_key() for g in growths])
        h = torch.cat([f[0] for f in fronts]).index_select(0, first)
        tokens = torch.cat([f[1] for f in fronts]).index_select(0, first)
        out_logits, out_hidden = level(d, h.unsqueeze(0), tokens.view(1, -1), shared.mask())
        for g, r in zip(growths, rows):
            g.absorb(d, out_logits[0].index_select(0, r), out_hidden[0].index_select(0, r), entries=shared.base + r)
    return [g.select(min(nodes, candidate_count(depth, g.k))) for g in growths]


class _SharedLevels:
    """The distinct nodes a forest's levels expand, as the draft's cache holds them (a level's new
    entries after the last's): each node is (its parent's entry, its token), so two trees' nodes of
    the same path are one entry; and which entries each sees (its ancestors' and its own)."""

    def __init__(self, device):
        self.device = device
        self.ancestors = torch.zeros(0, 0, dtype=torch.bool, device=device)  # [entries, entries]
        self.base = 0  # the first entry of the last level added

    def add(self, keys: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """A level's frontiers, each as (its nodes' parent entries (-1: the root), tokens): each
        distinct node's first row among them, and each tree's rows among the distinct nodes."""
        parents = torch.cat([p for p, _ in keys])
        tokens = torch.cat([t for _, t in keys])
        combined = (parents + 1) * (int(tokens.max()) + 1) + tokens
        distinct, inverse = torch.unique(combined, return_inverse=True)
        n = distinct.numel()
        order = torch.arange(inverse.numel(), device=self.device)
        first = torch.full((n,), inverse.numel(), device=self.device).scatter_reduce(0, inverse, order, "amin")
        old = self.ancestors.shape[0]
        new_parents = parents.index_select(0, first)
        rows = torch.zeros(n, old + n, dtype=torch.bool, device=self.device)
        has_parent = new_parents >= 0
        rows[has_parent, :old] = self.ancestors.index_select(0, new_parents[has_parent])
        rows[:, old:] = torch.eye(n, dtype=torch.bool, device=self.device)
        grown = torch.zeros(old + n, old + n, dtype=torch.bool, device=self.device)
        grown[:old, :old] = self.ancestors
        grown[old:] = rows
        self.ancestors, self.base = grown, old
        return first, list(inverse.split([t.numel() for _, t in keys]))

    def mask(self) -> torch.Tensor:
        """[n, entries]: which expanded entries the last level's n nodes see."""
        return self.ancestors[self.base:]


class _Growth:
    """One dynamic tree's bookkeeping while it grows: every candidate's score, token, parent, depth
    and ancestors, level after level, and the frontier the next level expands."""

    def __init__(self, draft, logits: torch.Tensor, hidden: torch.Tensor, root: torch.Tensor, k: int, depth: int):
        device = root.device
        self.draft, self.k = draft, k
        self.dtype = torch.promote_types(logits.dtype, torch.float32)
        self.eye = torch.eye(candidate_count(depth, k), dtype=torch.bool, device=device)
        score, token = self.children(logits, torch.zeros(1, dtype=self.dtype, device=device))
        self.scores = [torch.zeros(1, dtype=self.dtype, device=device), score]
        self.tokens = [root.view(1), token]
        self.parents = [torch.full((1,), -1, device=device), torch.zeros(k, dtype=torch.long, device=device)]
        self.depths = [torch.zeros(1, dtype=torch.long, device=device), torch.ones(k, dtype=torch.long, device=device)]
        self.ancestors = [self.eye[:1], self.eye[1:1 + k] | self.eye[:1]]
        self.level_ids, self.expanded, self.parent_hidden = torch.arange(1, 1 + k, device=device), [], hidden.expand(k, -1)
        self.entry = None  # in a forest: each candidate's entry in its shared levels once expanded (-1: not, the root)

    def children(self, rows: torch.Tensor, base: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        top = rows.to(self.dtype).log_softmax(-1).topk(self.k, dim=-1)
        return (base[:, None] + top.values).flatten(), self.draft.to_target_ids(top.indices).flatten()

    def frontier(self, d: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(hidden [k, H], tokens [k], mask [k, d·k]): the k most likely nodes of depth d, which
        this level expands, each reading its parent's output and seeing its expanded ancestors."""
        self.pick = self.scores[-1].sort(descending=True, stable=True).indices[:self.k].sort().values
        self.front = self.level_ids[self.pick]
        self.expanded.append(self.front)
        self.rows = torch.cat(self.ancestors).index_select(0, self.front)
        mask = self.rows.index_select(1, torch.cat(self.expanded))
        h = self.parent_hidden if d == 1 else self.parent_hidden.index_select(0, self.pick // self.k)
        return h, self.tokens[-1].index_select(0, self.pick), mask

    def front_key(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The frontier as a forest tells nodes apart: (each one's parent's entry, -1 for the root; its token)."""
        if self.entry is None:
            self.entry = torch.full((self.eye.shape[0],), -1, device=self.eye.device)
        parents = torch.cat(self.parents).index_select(0, self.front)
        return self.entry.index_select(0, parents), self.tokens[-1].index_select(0, self.pick)

    def absorb(self, d: int, logits: torch.Tensor, hidden: torch.Tensor, entries: torch.Tensor | None = None) -> None:
        """The level's output over the frontier ([k, Vd], [k, H]): its nodes' k children each;
        `entries`: the frontier's in a forest's shared levels."""
        k = self.k
        if entries is not None:
            self.entry[self.front] = entries
        self.parent_hidden = hidden
        score, token = self.children(logits, self.scores[-1].index_select(0, self.pick))
        start = 1 + k + (d - 1) * k * k
        self.level_ids = torch.arange(start, start + k * k, device=token.device)
        self.scores.append(score)
        self.tokens.append(token)
        self.parents.append(self.front.repeat_interleave(k))
        self.depths.append(torch.full((k * k,), d + 1, device=token.device))
        self.ancestors.append(self.rows.repeat_interleave(k, dim=0) | self.eye[start:start + k * k])

    def select(self, nodes: int) -> DynamicTree:
        return _select(torch.cat(self.scores), torch.cat(self.tokens), torch.cat(self.parents), torch.cat(self.depths),
                       torch.cat(self.ancestors), nodes)


def _select(scores, tokens, parents, depths, ancestors, nodes: int) -> DynamicTree:
    """The `nodes - 1` best candidates and the root, in creation order (parents first), as a tree."""
    device = tokens.device
    ranked = scores[1:].sort(descending=True, stable=True).indices + 1
    chosen = torch.cat([torch.zeros(1, dtype=torch.long, device=device), ranked[:nodes - 1].sort().values])
    order = torch.arange(nodes, device=device)
    place = torch.zeros(tokens.shape[0], dtype=torch.long, device=device).scatter(0, chosen, order)
    parent = torch.where(order == 0, -1, place.index_select(0, parents.index_select(0, chosen).clamp(min=0)))
    mask = ancestors.index_select(0, chosen).index_select(1, chosen)
    return DynamicTree(tokens.index_select(0, chosen), parent, depths.index_select(0, chosen), mask, ranked,
                       tokens, parents, depths)
