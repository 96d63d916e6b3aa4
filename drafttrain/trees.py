"""Candidate trees, the one home of the concept: which continuations a step verifies, and their shape.

A tree is chosen as a list of paths, Medusa style: each path is a tuple of top-k choice indices,
one per depth, e.g. (0, 1) = "the first drafter position's top-1 token, then the second's top-2
token". Every prefix of a path must be in the tree too. This module chooses trees (the default,
a chain, one calibrated from measured head accuracies, a JSON file: `resolve_tree`), and turns
them into the structure a verification pass runs (`Tree`: parents, depths and the
ancestor-or-self mask, built in one place, `tree_from_parents`; `StaticTree` adds which drafter
position and rank fills each node). Running a tree (masks for an engine, acceptance, cache
compaction) is the decoder's job (`drafttrain.decoding`).

Node order is Medusa's: root, then paths sorted by (depth, path), so siblings never precede their
parent, and node n's KV sits at cache slot `past_len + n` during the pass. Any drafter can build a
`Tree` per step (EAGLE-2's dynamic trees) or reuse a static one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path as FilePath

import torch

from .errors import UserError

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


def check_paths(paths) -> list[Path]:
    """Validate a tree (non-empty tuples of non-negative ints, unique, prefix-closed) and return
    its paths in Medusa's node order: sorted by (depth, path)."""
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
    return sorted(paths, key=lambda p: (len(p), p))


def widest_choice(paths) -> int:
    """The largest top-k choice index in a tree: a step takes the top-(index + 1) tokens of some
    drafter position, so the tree needs a vocabulary of more than this many tokens."""
    return max((i for p in paths for i in p), default=-1)


@dataclass
class Tree:
    """The structure of one verification pass's N candidate tokens; node 0 is the root.

    Everything a pass reads is on the device. `parents` is the same structure on the host where
    the tree was built there (static trees, merges); a tree drafted on the device (EAGLE-2's)
    has None: reading it would cost the step a host sync, and the decoder reads the accepted
    path from the verdict instead (`path_nodes`)."""

    parent: torch.Tensor            # [N] long: parent node, -1 for the root (parent[n] < n)
    depths: torch.Tensor            # [N] long: root 0; node n sits at position past_len + depths[n]
    attention_mask: torch.Tensor    # [N, N] bool: node attends to itself and its ancestors
    max_depth: int                  # draft positions the tree covers (root excluded)
    parents: list[int] | None = None  # host copy of `parent`, where known

    @property
    def num_nodes(self) -> int:
        return self.parent.shape[0]

    def path_to(self, node: int) -> list[int]:
        """Root-to-node node indices (a device tree's parents are read: a host sync, outside decoding)."""
        parents = self.parents if self.parents is not None else self.parent.tolist()
        path = [node]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        return path[::-1]

    def to(self, device) -> "Tree":
        moved = {f.name: getattr(self, f.name) for f in fields(self)}
        for name, value in moved.items():
            if isinstance(value, torch.Tensor):
                moved[name] = value.to(device)
        return type(self)(**moved)


def path_nodes(tree: Tree, node: torch.Tensor) -> torch.Tensor:
    """The root-to-`node` path (`node` 0-d, on the device) as node indices [max_depth + 1],
    padded by repeating `node`: fixed-size gathers, no host sync. Parents precede their children,
    so a path's indices ascend with its depth."""
    n, width = tree.num_nodes, tree.max_depth + 1
    order = torch.arange(n, device=node.device)
    row = tree.attention_mask.index_select(0, node.view(1))[0]  # indexing by a 0-d tensor would read it
    keys = torch.where(row, order, n)
    if n < width:  # a dynamic tree may declare more depth than it has nodes
        keys = torch.cat([keys, keys.new_full((width - n,), n)])
    on_path = keys.sort().values[:width]
    return torch.where(on_path < n, on_path, node)


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
    return Tree(parent=torch.tensor(parents, dtype=torch.long, device=device),
                depths=torch.tensor(depths, dtype=torch.long, device=device), attention_mask=mask.to(device),
                max_depth=max(depths), parents=list(parents))


def chain(n: int, device=None) -> Tree:
    """n tokens in a row as a tree: plain causal decoding."""
    return tree_from_parents([-1] + list(range(n - 1)), device)


@dataclass
class StaticTree(Tree):
    """A tree chosen as paths and reused every step: `Tree` plus which drafter position (head) and
    which top-k rank fills each node. Build with `static_tree`."""

    paths: list[Path] = None               # sorted; node n >= 1 is paths[n - 1]
    head_index: torch.Tensor = None        # [N] long: which position gives the node's token (depth - 1), -1 root
    topk_index: torch.Tensor = None        # [N] long: which of that position's top-k tokens, -1 root
    retrieve_indices: torch.Tensor = None  # [num_leaves, max_depth + 1] long: root-to-leaf node paths, -1 pad

    @property
    def topk(self) -> int:
        """How many top-k tokens per position the tree reads."""
        return max((i + 1 for p in self.paths for i in p), default=0)


def static_tree(paths) -> StaticTree:
    """The `StaticTree` of validated `paths` (any order; they are sorted into node order)."""
    paths = check_paths(paths)
    node_of = {(): 0, **{p: n for n, p in enumerate(paths, start=1)}}
    tree = tree_from_parents([-1] + [node_of[p[:-1]] for p in paths])
    head_index = torch.tensor([-1] + [len(p) - 1 for p in paths], dtype=torch.long)
    topk_index = torch.tensor([-1] + [p[-1] for p in paths], dtype=torch.long)
    # Root-to-leaf paths in lexicographic (depth-first) order: [0, n1, n2, ..., -1 padding].
    is_parent = set(p[:-1] for p in paths)
    leaves = sorted(p for p in [(), *paths] if p not in is_parent)
    retrieve = torch.full((len(leaves), tree.max_depth + 1), -1, dtype=torch.long)
    for row, leaf in enumerate(leaves):
        for d in range(len(leaf) + 1):
            retrieve[row, d] = node_of[leaf[:d]]
    return StaticTree(**{f.name: getattr(tree, f.name) for f in fields(Tree)}, paths=paths, head_index=head_index,
                      topk_index=topk_index, retrieve_indices=retrieve)


# ------------------------------------------------------------------------------ choosing a tree

TREE_CHOICES = ("auto", "default", "chain", "dynamic")


def read_tree_file(path: str) -> list[Path]:
    """A tree as JSON: a list of paths, each a list of top-k choice indices, e.g. [[0], [1], [0, 0]]."""
    try:
        paths = check_paths(tuple(p) for p in json.loads(FilePath(path).read_text()))
    except OSError as e:
        raise UserError(f"--tree {path}: cannot read it ({e.strerror}); use auto, default, chain or a JSON file of "
                        "paths like [[0], [1], [0, 0]]") from e
    except (TypeError, ValueError) as e:
        raise UserError(f"--tree {path}: not a valid tree ({e}); write a JSON list of paths like [[0], [1], [0, 0]]"
                        ) from e
    if not paths:  # an empty tree would verify no draft at all: plain decoding under a drafter's name
        raise UserError(f"--tree {path}: the tree is empty; write at least one path, like [[0], [1], [0, 0]]")
    return paths


def best_first(paths) -> list[Path]:
    """`paths` in the order listed (best first, as a calibrated tree lists them), each moved after
    its ancestors if it came before one: every prefix of the result is a tree, the one a budget of
    that many nodes keeps."""
    place = {tuple(p): i for i, p in enumerate(paths)}
    return sorted(place, key=lambda p: (max(place[p[:i]] for i in range(1, len(p) + 1)), len(p)))


def resolve_tree(choice: str, depth: int, *, auto: list | str | None = None,
                 nodes: int | None = None) -> tuple[str, list[Path] | str]:
    """(the tree's name for reports, what a decoder takes) for `--tree CHOICE`, cut to `depth`
    draft positions and, for a static tree with `nodes`, to its first `nodes` - 1 paths best
    first (pending is the other node): paths, or "dynamic" (EAGLE-2's tree, grown each step).

    `auto` is what auto means for the drafter: its stored calibrated paths (Medusa heads trained
    by drafttrain), "dynamic" (EAGLE-3), or None (the default tree)."""
    if choice == "dynamic" or (choice == "auto" and auto == "dynamic"):
        return "dynamic", "dynamic"
    if choice == "auto" and auto:
        name, paths = "calibrated", [tuple(p) for p in auto]
    elif choice in ("auto", "default"):
        name, paths = "default", DEFAULT_TREE
    elif choice == "chain":
        name, paths = "chain", chain_tree(depth)
    else:
        name, paths = choice, read_tree_file(choice)
    paths = best_first(p for p in paths if len(p) <= depth)
    if nodes is not None and nodes - 1 < len(paths):
        name, paths = f"{name}, its first {nodes} nodes", paths[:nodes - 1]
    return name, paths
