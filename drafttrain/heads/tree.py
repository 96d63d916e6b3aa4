"""Medusa candidate trees as data: which top-k choices of which heads a step verifies.

A tree is a list of paths, Medusa style: each path is a tuple of top-k choice indices, one per
depth, e.g. (0, 1) = "head 0's top-1 token, then head 1's top-2 token". Every prefix of a path
must be in the tree too. A node at depth d takes its token from head d-1, so the tree needs
`max_depth` heads. This module chooses trees (the default, a chain, one calibrated from measured
head accuracies); running them (tree buffers, masks, acceptance, cache compaction) is the
decoder's job, in `drafttrain.decoding.tree`.
"""

from __future__ import annotations

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
    head, so the tree needs a vocabulary of more than this many tokens."""
    return max((i for p in paths for i in p), default=-1)
