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
    k, device = topk, root.device
    total = candidate_count(depth, k)
    eye = torch.eye(total, dtype=torch.bool, device=device)
    dtype = torch.promote_types(logits.dtype, torch.float32)

    def children(rows: torch.Tensor, base: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        top = rows.to(dtype).log_softmax(-1).topk(k, dim=-1)
        return (base[:, None] + top.values).flatten(), draft.to_target_ids(top.indices).flatten()

    score, token = children(logits, torch.zeros(1, dtype=dtype, device=device))
    scores, tokens = [torch.zeros(1, dtype=dtype, device=device), score], [root.view(1), token]
    parents = [torch.full((1,), -1, device=device), torch.zeros(k, dtype=torch.long, device=device)]
    depths = [torch.zeros(1, dtype=torch.long, device=device), torch.ones(k, dtype=torch.long, device=device)]
    ancestors = [eye[:1], eye[1:1 + k] | eye[:1]]
    level_ids, expanded, parent_hidden = torch.arange(1, 1 + k, device=device), [], hidden.expand(k, -1)
    for d in range(1, depth):
        pick = scores[-1].sort(descending=True, stable=True).indices[:k].sort().values
        frontier = level_ids[pick]
        expanded.append(frontier)
        rows = torch.cat(ancestors).index_select(0, frontier)
        mask = rows.index_select(1, torch.cat(expanded))
        h = parent_hidden if d == 1 else parent_hidden.index_select(0, pick // k)
        out_logits, out_hidden = level(d, h.unsqueeze(0), tokens[-1].index_select(0, pick).view(1, k), mask)
        parent_hidden = out_hidden[0]
        score, token = children(out_logits[0], scores[-1].index_select(0, pick))
        start = 1 + k + (d - 1) * k * k
        level_ids = torch.arange(start, start + k * k, device=device)
        scores.append(score)
        tokens.append(token)
        parents.append(frontier.repeat_interleave(k))
        depths.append(torch.full((k * k,), d + 1, device=device))
        ancestors.append(rows.repeat_interleave(k, dim=0) | eye[start:start + k * k])
    return _select(torch.cat(scores), torch.cat(tokens), torch.cat(parents), torch.cat(depths), torch.cat(ancestors),
                   min(nodes, total))


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
