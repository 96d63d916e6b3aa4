"""Medusa trees as data: the calibrated tree is the best tree of its size, path validation."""

from __future__ import annotations

import random

import pytest
import torch

from drafttrain.trees import (
    DEFAULT_TREE,
    chain_tree,
    check_paths,
    default_tree,
    expected_accepted_length,
    path_nodes,
    tree_from_accuracies,
    tree_from_parents,
)


# ----------------------------------------------------------------------------- calibrated trees


def _product(path, acc):
    p = 1.0
    for depth, j in enumerate(path):
        p *= acc[depth][j]
    return p


@pytest.mark.parametrize("seed", range(4))
def test_calibrated_tree_is_the_top_paths_by_product(seed):
    import itertools

    rng = random.Random(seed)
    depth, k = 3, 4
    acc = [sorted((rng.uniform(0.01, 0.9) for _ in range(k)), reverse=True) for _ in range(depth)]
    every = [p for d in range(1, depth + 1) for p in itertools.product(range(k), repeat=d)]
    for n in (1, 5, 17, len(every)):
        tree = tree_from_accuracies(acc, n)
        best = sorted(every, key=lambda p: -_product(p, acc))[:n]
        assert set(tree) == set(best)
        check_paths(tree)  # prefix-closed, unique
        # No other prefix-closed tree of the same size expects more (random competitors grown node by node).
        for _ in range(20):
            other: list = []
            while len(other) < n:
                frontier = [p for p in every if p not in other and (len(p) == 1 or p[:-1] in other)]
                other.append(rng.choice(frontier))
            assert expected_accepted_length(other, acc) <= expected_accepted_length(tree, acc) + 1e-12
    assert tree_from_accuracies(acc, 10_000) == sorted(tree_from_accuracies(acc, 10_000), key=lambda p: -_product(p, acc))


def test_expected_accepted_length_hand_computed():
    acc = [[0.5, 0.2], [0.4, 0.1]]
    # (0,): .5, (1,): .2, (0, 0): .5 * .4 = .2, (0, 1): .5 * .1 = .05
    assert expected_accepted_length([(0,), (1,), (0, 0), (0, 1)], acc) == pytest.approx(0.95)
    assert tree_from_accuracies(acc, 3) in ([(0,), (1,), (0, 0)], [(0,), (0, 0), (1,)])
    with pytest.raises(ValueError):
        tree_from_accuracies([], 3)


def test_path_validation_and_order():
    with pytest.raises(ValueError, match="parent"):
        check_paths([(0,), (1, 0)])
    with pytest.raises(ValueError, match="unique"):
        check_paths([(0,), (0,)])
    with pytest.raises(ValueError, match="non-empty"):
        check_paths([()])
    with pytest.raises(ValueError, match="non-negative"):
        check_paths([(-1,)])
    with pytest.raises(ValueError, match="non-negative"):
        check_paths([(True,)])
    assert check_paths([(1, 0), (0,), (1,), (0, 0)]) == [(0,), (1,), (0, 0), (1, 0)]  # by (depth, path)


def test_default_and_chain_trees():
    for num_heads in (1, 2, 3, 4, 5):
        tree = default_tree(num_heads)
        check_paths(tree)  # prefix-closed, or this raises
        assert max(len(p) for p in tree) == min(num_heads, 4)
    assert 20 <= len(DEFAULT_TREE) + 1 <= 30
    assert chain_tree(3) == [(0,), (0, 0), (0, 0, 0)]
    assert chain_tree(0) == []


# ----------------------------------------------------------------------------- accepted paths


def test_path_nodes_is_the_host_path_padded_to_the_tree_depth():
    tree = tree_from_parents([-1, 0, 0, 1, 3, 2])
    for node in range(tree.num_nodes):
        path = tree.path_to(node)
        expected = path + [node] * (tree.max_depth + 1 - len(path))
        assert path_nodes(tree, torch.tensor(node)).tolist() == expected


def test_path_nodes_keeps_its_width_when_the_tree_has_fewer_nodes_than_its_depth():
    """A dynamic tree declares its drafting depth; with as few nodes as that, the path still has
    max_depth + 1 entries (fixed-size gathers downstream)."""
    small = tree_from_parents([-1, 0])
    deep = type(small)(parent=small.parent, depths=small.depths, attention_mask=small.attention_mask, max_depth=3)
    assert path_nodes(deep, torch.tensor(1)).tolist() == [0, 1, 1, 1]
    assert path_nodes(deep, torch.tensor(0)).tolist() == [0, 0, 0, 0]
