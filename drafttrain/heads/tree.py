"""Static candidate trees: verify many Medusa continuations in ONE target forward pass.

A tree is a list of paths, Medusa style: each path is a tuple of top-k choice indices, one per
depth, e.g. (0, 1) = "head 0's top-1 token, then head 1's top-2 token". Every prefix of a path
must be in the tree too. Node 0 is the root: the target's own next token (already verified).
A node at depth d takes its token from head d-1, so the tree needs `max_depth` heads.

Node order is Medusa's: root, then paths sorted by (depth, path). Siblings therefore never
precede their parent, and the tree's node n sits at cache position `past_len + n` while
attending only to the prefix and its own ancestors (`tree_attention_inputs`).

Mask convention (transformers 5.x, Llama and friends): a 4-D `attention_mask` tensor is handed
to the attention kernel as-is (`masking_utils._preprocess_mask_arguments` returns early). The
eager kernel ADDS it to the scores and SDPA accepts it too, so it must be an additive float
mask in the model's dtype, shape [batch, 1, q_len, past_len + q_len]: 0 = may attend,
`torch.finfo(dtype).min` = blocked. A bool mask would be added as 0/1 by the eager kernel, so
it is not used here. flash_attention_* ignore custom masks: use "sdpa" or "eager".
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

Path = tuple[int, ...]

# 22 paths (23 nodes) for 4 heads, biased to top-1 choices. Built in the spirit of Medusa's
# `mc_sim_7b_63`: wide where the heads are reliable (depth 1-2), a thin top-1 spine deeper down.
DEFAULT_TREE: list[Path] = [
    (0,), (1,), (2,), (3,),
    (0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 1), (2, 0), (3, 0),
    (0, 0, 0), (0, 0, 1), (0, 0, 2), (0, 1, 0), (1, 0, 0), (0, 2, 0),
    (0, 0, 0, 0), (0, 0, 0, 1), (0, 0, 1, 0), (0, 1, 0, 0),
]


def default_tree(num_heads: int = 4) -> list[Path]:
    """DEFAULT_TREE cut to the depth `num_heads` heads can fill (cutting keeps it prefix-closed)."""
    return [p for p in DEFAULT_TREE if len(p) <= num_heads]


def tree_from_accuracies(accuracy, num_paths: int) -> list[Path]:
    """The `num_paths` paths with the largest expected acceptance, from measured head accuracies.

    accuracy[i][j]: how often head i's j-th most likely token is the target's token (measured on
    held-out text). If heads were independent, a path's chance of being accepted whole is the
    product of its choices' accuracies, and the tree that maximises the expected accepted length
    with a fixed node budget is simply the top-`num_paths` paths by that product (Medusa's
    tree construction). A child's product never exceeds its parent's, so the best-first search
    below only ever picks paths whose parent is already in: the tree is prefix-closed.
    """
    import heapq

    acc = [[float(a) for a in row] for row in accuracy]
    if not acc or not all(acc):
        raise ValueError("accuracy needs at least one head with at least one top-k entry")
    if num_paths < 1:
        raise ValueError(f"num_paths must be >= 1, got {num_paths}")
    frontier = [(-acc[0][j], (j,)) for j in range(len(acc[0]))]
    heapq.heapify(frontier)
    chosen: list[Path] = []
    while frontier and len(chosen) < num_paths:
        neg, path = heapq.heappop(frontier)
        chosen.append(path)
        if len(path) < len(acc):
            for j, a in enumerate(acc[len(path)]):
                heapq.heappush(frontier, (neg * a, path + (j,)))
    return chosen


def expected_accepted_length(paths: list[Path], accuracy) -> float:
    """Expected number of head tokens a tree accepts per step under the independence model of
    `tree_from_accuracies`: the sum over nodes of the chance that the node's path is accepted."""
    total = 0.0
    for path in paths:
        prob = 1.0
        for depth, j in enumerate(path):
            prob *= float(accuracy[depth][j])
        total += prob
    return total


def chain_tree(depth: int) -> list[Path]:
    """Plain top-1 speculation as a tree: (0,), (0, 0), ... `depth` draft tokens."""
    return [(0,) * d for d in range(1, depth + 1)]


@dataclass
class TreeBuffers:
    """Index tensors describing one tree; node 0 is the root. Build with `build_tree_buffers`."""

    paths: list[Path]               # sorted; node n >= 1 is paths[n - 1]
    attention_mask: torch.Tensor    # [N, N] bool: node attends to itself and its ancestors
    depths: torch.Tensor            # [N] long: root 0; also the position offset of each node
    parent: torch.Tensor            # [N] long: parent node index, -1 for the root
    head_index: torch.Tensor        # [N] long: which head gives the node's token (depth - 1), -1 root
    topk_index: torch.Tensor        # [N] long: which of that head's top-k tokens, -1 root
    retrieve_indices: torch.Tensor  # [num_leaves, max_depth + 1] long: root-to-leaf node paths, -1 pad

    @property
    def num_nodes(self) -> int:
        return len(self.paths) + 1

    @property
    def max_depth(self) -> int:
        """Number of heads the tree needs."""
        return max((len(p) for p in self.paths), default=0)

    @property
    def topk(self) -> int:
        """How many top-k tokens per head the tree reads."""
        return max((i + 1 for p in self.paths for i in p), default=0)

    @property
    def position_offsets(self) -> torch.Tensor:
        return self.depths

    def to(self, device: torch.device | str) -> "TreeBuffers":
        moved = {f.name: getattr(self, f.name) for f in fields(self)}
        for name, value in moved.items():
            if isinstance(value, torch.Tensor):
                moved[name] = value.to(device)
        return TreeBuffers(**moved)


def build_tree_buffers(paths) -> TreeBuffers:
    paths = [tuple(p) for p in paths]
    for p in paths:
        if not p or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in p):
            raise ValueError(f"tree path {p!r} must be a non-empty tuple of non-negative ints")
    if len(set(paths)) != len(paths):
        raise ValueError("tree paths must be unique")
    known = set(paths)
    for p in paths:
        if len(p) > 1 and p[:-1] not in known:
            raise ValueError(f"tree path {p!r} has no parent {p[:-1]!r} in the tree")

    paths = sorted(paths, key=lambda p: (len(p), p))
    node_of = {p: n for n, p in enumerate(paths, start=1)}
    node_of[()] = 0
    N = len(paths) + 1

    parent = torch.full((N,), -1, dtype=torch.long)
    depths = torch.zeros(N, dtype=torch.long)
    head_index = torch.full((N,), -1, dtype=torch.long)
    topk_index = torch.full((N,), -1, dtype=torch.long)
    mask = torch.eye(N, dtype=torch.bool)
    mask[:, 0] = True
    for p, n in node_of.items():
        if not p:
            continue
        parent[n] = node_of[p[:-1]]
        depths[n] = len(p)
        head_index[n] = len(p) - 1
        topk_index[n] = p[-1]
        for d in range(1, len(p)):
            mask[n, node_of[p[:d]]] = True

    # Root-to-leaf paths in lexicographic (depth-first) order: [0, n1, n2, ..., -1 padding].
    is_parent = set(p[:-1] for p in paths)
    leaves = sorted((p for p in [(), *paths] if p not in is_parent))
    width = max((len(p) for p in paths), default=0) + 1
    retrieve = torch.full((len(leaves), width), -1, dtype=torch.long)
    for row, leaf in enumerate(leaves):
        for d in range(len(leaf) + 1):
            retrieve[row, d] = node_of[leaf[:d]]

    return TreeBuffers(paths=paths, attention_mask=mask, depths=depths, parent=parent,
                       head_index=head_index, topk_index=topk_index, retrieve_indices=retrieve)


def tree_candidates(root_token, head_topk_tokens: torch.Tensor, buffers: TreeBuffers) -> torch.Tensor:
    """The token of every node, LongTensor [N]: the root token, then head_topk_tokens[depth-1, k]."""
    num_heads, k = head_topk_tokens.shape
    if num_heads < buffers.max_depth or k < buffers.topk:
        raise ValueError(f"the tree needs top-{buffers.topk} tokens from {buffers.max_depth} heads, "
                         f"got top-{k} from {num_heads}")
    heads = buffers.head_index.to(head_topk_tokens.device)
    ranks = buffers.topk_index.to(head_topk_tokens.device)
    tokens = torch.empty(buffers.num_nodes, dtype=torch.long, device=head_topk_tokens.device)
    tokens[0] = torch.as_tensor(root_token).reshape(())
    tokens[1:] = head_topk_tokens[heads[1:], ranks[1:]]
    return tokens


def greedy_accept_tree(candidate_tokens: torch.Tensor, target_argmax: torch.Tensor,
                       buffers: TreeBuffers) -> tuple[list[int], list[int], int]:
    """Longest root-to-leaf prefix the target agrees with.

    target_argmax[n] is the target's greedy token after the root..n path. A node is accepted when
    its token equals target_argmax[its parent] and its parent is accepted. Returns the accepted
    node indices (root first), their draft tokens (root excluded) and the bonus token, the
    target's argmax at the last accepted node. Equally long paths: the first in retrieve order.
    """
    idx = buffers.retrieve_indices.to(candidate_tokens.device)
    valid = idx >= 0
    safe = idx.clamp(min=0)
    cand = candidate_tokens[safe]                       # [P, D+1]
    pred = target_argmax.to(candidate_tokens.device)[safe]
    match = (cand[:, 1:] == pred[:, :-1]) & valid[:, 1:]
    accept_len = match.long().cumprod(dim=1).sum(dim=1)  # draft tokens accepted per path
    best = int(torch.argmax(accept_len))                 # first maximum
    n_acc = int(accept_len[best])
    nodes = idx[best, : n_acc + 1].tolist()
    tokens = candidate_tokens[nodes[1:]].tolist() if n_acc else []
    bonus = int(target_argmax[nodes[-1]])
    return nodes, tokens, bonus


def tree_attention_inputs(buffers: TreeBuffers, past_len: int, device=None,
                          dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Additive mask [1, 1, N, past_len + N] and position ids [1, N] for a tree forward pass.

    Node n sees every cached position and its tree ancestors, and sits at position
    past_len + depth(n) (siblings share a position, exactly as if each path were decoded alone).
    """
    N = buffers.num_nodes
    allowed = torch.cat([torch.ones(N, past_len, dtype=torch.bool), buffers.attention_mask.cpu()], dim=1)
    mask = torch.zeros(N, past_len + N, dtype=dtype)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    position_ids = (buffers.depths.cpu() + past_len).unsqueeze(0)
    return mask[None, None].to(device), position_ids.to(device)


def compact_cache(cache, past_len: int, keep_node_indices) -> None:
    """Keep the prefix and only the kept tree nodes' KV entries, in place, in the given order.

    After a tree pass the cache holds past_len + N entries; the accepted path's entries are at
    past_len + node. Gathering them makes the cache identical to one built by decoding the
    accepted tokens one after another (their positions are past_len + depth = past_len + i).
    """
    keep = torch.as_tensor(list(keep_node_indices), dtype=torch.long)
    for layer in cache.layers:
        if getattr(layer, "is_sliding", False) or hasattr(layer, "cumulative_length"):
            raise NotImplementedError("compact_cache supports full-attention DynamicCache layers only")
        if layer.keys is None or layer.keys.numel() == 0:
            continue  # uninitialised layer (e.g. KV sharing)
        if keep.numel() and (int(keep.min()) < 0 or past_len + int(keep.max()) >= layer.keys.shape[-2]):
            raise ValueError(f"node indices {keep.tolist()} out of range for a cache of "
                             f"{layer.keys.shape[-2]} entries with past_len={past_len}")
        index = torch.cat([torch.arange(past_len), past_len + keep]).to(layer.keys.device)
        layer.keys = layer.keys.index_select(-2, index)
        layer.values = layer.values.index_select(-2, index)
