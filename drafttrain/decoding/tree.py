"""Candidate trees: verify many continuations in ONE target forward pass.

`Tree` is what the cached LM needs to run a tree pass and what greedy acceptance needs to pick a
path: each node's parent (node 0 is the root; a parent always precedes its children), its depth
(its position is `past_len + depth`) and the [N, N] ancestor-or-self mask. Any drafter can build
one per step (EAGLE-2's dynamic trees) or reuse a static one (Medusa's `TreeBuffers`).

Medusa's trees are lists of paths (see `heads.tree`): each path is a tuple of top-k choice
indices, one per depth, e.g. (0, 1) = "head 0's top-1 token, then head 1's top-2 token". Node
order is Medusa's: root, then paths sorted by (depth, path), so siblings never precede their
parent, and node n's KV sits at cache slot `past_len + n` during the pass.

Mask convention of the eager path (transformers 5.x, Llama and friends): a 4-D `attention_mask`
is handed to the attention kernel as-is; the eager kernel ADDS it and SDPA accepts it too, so it is
an additive float mask in the model's dtype, [1, 1, N, past_len + N]: 0 = may attend,
`finfo(dtype).min` = blocked. flash_attention_* ignore custom masks: use "sdpa" or "eager" there.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from ..heads.tree import Path, check_paths


@dataclass
class Tree:
    """The structure of one verification pass's N candidate tokens; node 0 is the root."""

    parents: list[int]              # host: parent node, -1 for the root; parents[n] < n
    parent: torch.Tensor            # [N] long: the same on the device (-1 for the root)
    depths: torch.Tensor            # [N] long: root 0; node n sits at position past_len + depths[n]
    attention_mask: torch.Tensor    # [N, N] bool: node attends to itself and its ancestors

    @property
    def num_nodes(self) -> int:
        return len(self.parents)

    @property
    def max_depth(self) -> int:
        """Draft positions the tree covers (root excluded)."""
        depths: list[int] = []
        for p in self.parents:
            depths.append(0 if p < 0 else depths[p] + 1)
        return max(depths, default=0)

    def path_to(self, node: int) -> list[int]:
        """Root-to-node node indices."""
        path = [node]
        while self.parents[path[-1]] >= 0:
            path.append(self.parents[path[-1]])
        return path[::-1]

    def to(self, device) -> "Tree":
        moved = {f.name: getattr(self, f.name) for f in fields(self)}
        for name, value in moved.items():
            if isinstance(value, torch.Tensor):
                moved[name] = value.to(device)
        return type(self)(**moved)


def tree_from_parents(parents: list[int], device=None) -> Tree:
    """A `Tree` from parent indices (-1 for node 0, the root; each parent precedes its child)."""
    if not parents or parents[0] != -1 or any(not 0 <= p < n for n, p in enumerate(parents) if n):
        raise ValueError(f"parents {parents} must start with -1 (the root) and name an earlier node for "
                         "every other node")
    n_nodes = len(parents)
    depths = [0] * n_nodes
    mask = torch.eye(n_nodes, dtype=torch.bool)
    for n in range(1, n_nodes):
        depths[n] = depths[parents[n]] + 1
        mask[n] |= mask[parents[n]]
    return Tree(parents=list(parents), parent=torch.tensor(parents, dtype=torch.long, device=device),
                depths=torch.tensor(depths, dtype=torch.long, device=device), attention_mask=mask.to(device))


def chain(n: int, device=None) -> Tree:
    """n tokens in a row as a tree: plain causal decoding."""
    return tree_from_parents([-1] + list(range(n - 1)), device)


@dataclass
class TreeBuffers(Tree):
    """A static Medusa tree: `Tree` plus which head and which top-k rank fills each node.
    Build with `build_tree_buffers`."""

    paths: list[Path] = None               # sorted; node n >= 1 is paths[n - 1]
    head_index: torch.Tensor = None        # [N] long: which head gives the node's token (depth - 1), -1 root
    topk_index: torch.Tensor = None        # [N] long: which of that head's top-k tokens, -1 root
    retrieve_indices: torch.Tensor = None  # [num_leaves, max_depth + 1] long: root-to-leaf node paths, -1 pad

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


def build_tree_buffers(paths) -> TreeBuffers:
    paths = check_paths(paths)  # validated, sorted by (depth, path)
    node_of = {p: n for n, p in enumerate(paths, start=1)}
    node_of[()] = 0
    N = len(paths) + 1

    parents = [-1] * N
    depths = torch.zeros(N, dtype=torch.long)
    head_index = torch.full((N,), -1, dtype=torch.long)
    topk_index = torch.full((N,), -1, dtype=torch.long)
    mask = torch.eye(N, dtype=torch.bool)
    mask[:, 0] = True
    for p, n in node_of.items():
        if not p:
            continue
        parents[n] = node_of[p[:-1]]
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

    return TreeBuffers(parents=parents, parent=torch.tensor(parents, dtype=torch.long), depths=depths,
                       attention_mask=mask, paths=paths, head_index=head_index,
                       topk_index=topk_index, retrieve_indices=retrieve)


def tree_candidates(root_token, head_topk_tokens: torch.Tensor, buffers: TreeBuffers) -> torch.Tensor:
    """The token of every node, LongTensor [N]: the root token, then head_topk_tokens[depth-1, k]."""
    num_heads, k = head_topk_tokens.shape
    if num_heads < buffers.max_depth or k < buffers.topk:
        raise ValueError(f"the tree needs top-{buffers.topk} tokens from {buffers.max_depth} heads, "
                         f"got top-{k} from {num_heads}")
    heads = buffers.head_index.to(head_topk_tokens.device)
    ranks = buffers.topk_index.to(head_topk_tokens.device)
    root = torch.as_tensor(root_token, device=head_topk_tokens.device).reshape(1)
    return torch.cat([root, head_topk_tokens[heads[1:], ranks[1:]]])


def greedy_tree_verdict(target_argmax: torch.Tensor, candidate_tokens: torch.Tensor, tree: Tree) -> torch.Tensor:
    """Greedy acceptance on the device: [best, argmax_0, ..., argmax_{N-1}] (read `best` first).

    A node is accepted when its token equals the target's argmax at its parent and its parent is
    accepted; `best` is the deepest accepted node (ties: the lowest index, i.e. the first path in
    depth-first order for Medusa's node order). The accepted drafts are the argmax at `best`'s
    ancestors, the bonus token is the argmax at `best`: nothing else needs to leave the device.
    """
    device = target_argmax.device
    n = candidate_tokens.shape[0]
    ok = candidate_tokens == target_argmax[tree.parent.to(device).clamp(min=0)]
    ok[0] = True
    accepted = ~(tree.attention_mask.to(device) & ~ok[None, :]).any(dim=1)  # every ancestor (and self) matched
    order = torch.arange(n, device=device)
    score = torch.where(accepted, tree.depths.to(device) * n + (n - 1 - order), -1)
    best = score.argmax()
    return torch.cat([best.view(1), target_argmax])


def greedy_accept_tree(candidate_tokens: torch.Tensor, target_argmax: torch.Tensor,
                       tree: Tree) -> tuple[list[int], list[int], int]:
    """Longest root-to-node path the target agrees with, on the host: (accepted nodes, root
    first; their draft tokens, root excluded; the bonus token, the argmax at the last node)."""
    verdict = greedy_tree_verdict(target_argmax, candidate_tokens, tree).tolist()
    nodes = tree.path_to(verdict[0])
    argmax = verdict[1:]
    return nodes, [argmax[p] for p in nodes[:-1]], argmax[nodes[-1]]


def tree_attention_inputs(tree: Tree, past_len: int, device=None,
                          dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Additive mask [1, 1, N, past_len + N] and position ids [1, N] for an eager tree pass.

    Node n sees every cached position and its tree ancestors, and sits at position
    past_len + depth(n) (siblings share a position, exactly as if each path were decoded alone).
    """
    N = tree.num_nodes
    allowed = torch.cat([torch.ones(N, past_len, dtype=torch.bool), tree.attention_mask.cpu()], dim=1)
    mask = torch.zeros(N, past_len + N, dtype=dtype)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    position_ids = (tree.depths.cpu() + past_len).unsqueeze(0)
    return mask[None, None].to(device), position_ids.to(device)


def compact_cache(cache, past_len: int, keep_node_indices) -> None:
    """DynamicCache version of `CachedLM.keep`: keep the prefix and the kept nodes' entries, in
    place, in the given order (`EagerLM.keep` calls this; nothing else touches a cache)."""
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
