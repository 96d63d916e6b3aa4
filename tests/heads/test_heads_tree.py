"""Candidate trees: buffers against brute force, and one tree pass of a real (tiny) Llama against
running every root-to-node path as a plain sequence."""

from __future__ import annotations

import copy
import random

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from drafttrain.heads.tree import (
    DEFAULT_TREE,
    build_tree_buffers,
    chain_tree,
    compact_cache,
    default_tree,
    greedy_accept_tree,
    tree_attention_inputs,
    tree_candidates,
    expected_accepted_length,
    tree_from_accuracies,
)

VOCAB = 96
# Transformers' eager attention takes its softmax in float32 even for a float64 model; SDPA stays
# in float64. A wrong mask or position moves logits by ~1e-1, far above either tolerance.
ATOL = {"eager": 1e-6, "sdpa": 1e-10}


def tiny_llama(attn: str) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      attn_implementation=attn)
    return LlamaForCausalLM(cfg).to(torch.float64).eval()


def random_tree(rng: random.Random, size: int, depth: int, width: int) -> list[tuple[int, ...]]:
    """A random prefix-closed tree, listed in random order."""
    paths = set()
    while len(paths) < size:
        p = ()
        while len(p) < depth and (p == () or rng.random() < 0.7):
            p = p + (rng.randrange(width),)
            paths.add(p)
            if len(paths) == size:
                break
    # A path only enters after its parent, so `paths` is prefix-closed.
    out = list(paths)
    rng.shuffle(out)
    return out


def path_of(buffers, n):
    return () if n == 0 else buffers.paths[n - 1]


def distinct_topk(gen: torch.Generator, num_heads: int, k: int) -> torch.Tensor:
    """Top-k token ids per head: distinct within a head, as real top-k tokens are."""
    return torch.stack([torch.randperm(VOCAB, generator=gen)[:k] for _ in range(num_heads)])


# --- buffers ---------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(5))
def test_buffers_match_brute_force(seed):
    rng = random.Random(seed)
    paths = DEFAULT_TREE if seed == 0 else random_tree(rng, size=rng.randrange(1, 30), depth=4, width=5)
    b = build_tree_buffers(paths)
    N = len(paths) + 1
    assert b.num_nodes == N
    assert sorted(b.paths) == sorted(tuple(p) for p in paths)
    # Node order: root, then by (depth, path).
    assert b.paths == sorted(b.paths, key=lambda p: (len(p), p))
    for a in range(N):
        pa = path_of(b, a)
        assert b.depths[a] == len(pa) == b.position_offsets[a]
        assert b.parent[a] == (-1 if a == 0 else [n for n in range(N) if path_of(b, n) == pa[:-1]][0])
        assert b.head_index[a] == len(pa) - 1
        assert b.topk_index[a] == (pa[-1] if pa else -1)
        for c in range(N):
            pc = path_of(b, c)
            assert bool(b.attention_mask[a, c]) == (pa[: len(pc)] == pc), (pa, pc)
    # retrieve_indices: one row per leaf, successive prefixes, -1 padded to max depth + 1.
    leaves = {p for p in [(), *b.paths] if not any(q[:-1] == p for q in b.paths)}
    assert b.retrieve_indices.shape == (len(leaves), b.max_depth + 1)
    seen = set()
    for row in b.retrieve_indices.tolist():
        nodes = [n for n in row if n >= 0]
        assert row == nodes + [-1] * (len(row) - len(nodes))
        leaf = path_of(b, nodes[-1])
        assert [path_of(b, n) for n in nodes] == [leaf[:d] for d in range(len(leaf) + 1)]
        seen.add(leaf)
    assert seen == leaves


def test_tree_validation():
    with pytest.raises(ValueError, match="parent"):
        build_tree_buffers([(0,), (1, 0)])
    with pytest.raises(ValueError, match="unique"):
        build_tree_buffers([(0,), (0,)])
    with pytest.raises(ValueError, match="non-empty"):
        build_tree_buffers([()])
    with pytest.raises(ValueError, match="non-negative"):
        build_tree_buffers([(-1,)])


def test_default_and_chain_trees():
    for num_heads in (1, 2, 3, 4, 5):
        tree = default_tree(num_heads)
        b = build_tree_buffers(tree)  # prefix-closed, or this raises
        assert b.max_depth == min(num_heads, 4)
    assert 20 <= build_tree_buffers(DEFAULT_TREE).num_nodes <= 30
    b = build_tree_buffers(chain_tree(3))
    assert b.paths == [(0,), (0, 0), (0, 0, 0)]
    assert b.retrieve_indices.tolist() == [[0, 1, 2, 3]]
    assert torch.equal(b.attention_mask, torch.ones(4, 4, dtype=torch.bool).tril())
    assert build_tree_buffers([]).retrieve_indices.tolist() == [[0]]


def test_tree_candidates_brute_force():
    b = build_tree_buffers(DEFAULT_TREE)
    topk = distinct_topk(torch.Generator().manual_seed(0), num_heads=5, k=6)
    tokens = tree_candidates(7, topk, b)
    expected = [7] + [int(topk[len(p) - 1, p[-1]]) for p in b.paths]
    assert tokens.tolist() == expected
    assert torch.equal(tree_candidates(torch.tensor([7]), topk, b), tokens)
    with pytest.raises(ValueError, match="top-4 tokens from 4 heads"):
        tree_candidates(7, topk[:3], b)
    with pytest.raises(ValueError, match="top-4"):
        tree_candidates(7, topk[:, :3], b)


# --- greedy acceptance -----------------------------------------------------------------------


def brute_force_accept(paths_sorted, tokens, argmax):
    """Deepest node whose every step matches the target; ties: first in depth-first order."""
    node_of = {p: n for n, p in enumerate(paths_sorted, start=1)}
    node_of[()] = 0
    best = ()
    for p in sorted(node_of):  # lexicographic = depth-first order
        ok = all(tokens[node_of[p[: d + 1]]] == argmax[node_of[p[:d]]] for d in range(len(p)))
        if ok and len(p) > len(best):
            best = p
    nodes = [node_of[best[:d]] for d in range(len(best) + 1)]
    return nodes, [tokens[n] for n in nodes[1:]], argmax[nodes[-1]]


@pytest.mark.parametrize("seed", range(40))
def test_greedy_accept_matches_brute_force(seed):
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    paths = DEFAULT_TREE if seed % 2 else random_tree(rng, size=rng.randrange(1, 25), depth=4, width=4)
    b = build_tree_buffers(paths)
    topk = distinct_topk(gen, num_heads=4, k=4)
    tokens = tree_candidates(rng.randrange(VOCAB), topk, b)
    # Make the target agree often: argmax at a node = the token of a random child (or noise).
    argmax = torch.randint(VOCAB, (b.num_nodes,), generator=gen)
    for n in range(b.num_nodes):
        children = (b.parent == n).nonzero().flatten().tolist()
        if children and rng.random() < 0.8:
            argmax[n] = tokens[rng.choice(children)]
    got = greedy_accept_tree(tokens, argmax, b)
    assert got == brute_force_accept(b.paths, tokens.tolist(), argmax.tolist())


def test_greedy_accept_hand_computed():
    # root=0; nodes: 1=(0,) 2=(1,) 3=(0,0) 4=(1,0) 5=(1,0,0)
    b = build_tree_buffers([(0,), (1,), (0, 0), (1, 0), (1, 0, 0)])
    tokens = torch.tensor([10, 11, 12, 13, 14, 15])
    # Target: after root -> 12 (node 2), after node 2 -> 14 (node 4), after node 4 -> 99 (not 15).
    argmax = torch.tensor([12, 50, 14, 51, 99, 52])
    assert greedy_accept_tree(tokens, argmax, b) == ([0, 2, 4], [12, 14], 99)
    # Nothing accepted: bonus is the target's token after the root.
    argmax = torch.tensor([77, 50, 14, 51, 99, 52])
    assert greedy_accept_tree(tokens, argmax, b) == ([0], [], 77)
    # Equal siblings (duplicate tokens): the longer path wins, then the first.
    tokens = torch.tensor([10, 11, 11, 13, 14, 15])
    argmax = torch.tensor([11, 60, 14, 61, 15, 62])
    assert greedy_accept_tree(tokens, argmax, b) == ([0, 2, 4, 5], [11, 14, 15], 62)
    b2 = build_tree_buffers([(0,), (1,)])
    assert greedy_accept_tree(torch.tensor([1, 5, 5]), torch.tensor([5, 8, 9]), b2) == ([0, 1], [5], 8)


# --- attention inputs ------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_tree_attention_inputs_values(dtype):
    b = build_tree_buffers(DEFAULT_TREE)
    past = 5
    mask, pos = tree_attention_inputs(b, past, "cpu", dtype)
    N = b.num_nodes
    assert mask.shape == (1, 1, N, past + N) and mask.dtype == dtype
    assert pos.shape == (1, N) and pos.dtype == torch.long
    assert pos[0].tolist() == [past + len(path_of(b, n)) for n in range(N)]
    allowed = mask[0, 0] == 0
    blocked = mask[0, 0] == torch.finfo(dtype).min
    assert torch.equal(allowed | blocked, torch.ones_like(allowed))
    assert allowed[:, :past].all()
    assert torch.equal(allowed[:, past:], b.attention_mask)


# --- one tree pass of a real model == every path run on its own ------------------------------


def prefill(model, prefix):
    out = model(prefix[None], use_cache=True)
    return out.logits[0], out.past_key_values


def plain_logits(model, tokens):
    return model(torch.as_tensor(tokens)[None]).logits[0]


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_tree_pass_equals_brute_force(attn):
    model = tiny_llama(attn)
    gen = torch.Generator().manual_seed(1)
    prefix = torch.randint(VOCAB, (9,), generator=gen)
    b = build_tree_buffers(DEFAULT_TREE)
    with torch.no_grad():
        _, cache = prefill(model, prefix)
        tokens = tree_candidates(int(torch.randint(VOCAB, (1,), generator=gen)),
                                 distinct_topk(gen, 4, 4), b)
        mask, pos = tree_attention_inputs(b, len(prefix), "cpu", model.dtype)
        tree_logits = model(tokens[None], attention_mask=mask, position_ids=pos,
                            past_key_values=cache, use_cache=True).logits[0]
        assert cache.get_seq_length() == len(prefix) + b.num_nodes
        for n in range(b.num_nodes):
            path = path_of(b, n)
            nodes = [b.paths.index(path[:d]) + 1 if d else 0 for d in range(len(path) + 1)]
            seq = prefix.tolist() + tokens[nodes].tolist()
            ref = plain_logits(model, seq)[-1]
            torch.testing.assert_close(tree_logits[n], ref, rtol=0, atol=ATOL[attn])


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_verify_accept_compact_continue(attn):
    """Plant the target's true greedy continuation in the heads' top-k along path (0, 1, 0):
    acceptance must find exactly that path, and decoding on from the compacted cache must give
    the logits of the plain sequence run from scratch."""
    model = tiny_llama(attn)
    gen = torch.Generator().manual_seed(2)
    prefix = torch.randint(VOCAB, (6,), generator=gen)
    b = build_tree_buffers(DEFAULT_TREE)
    with torch.no_grad():
        logits, cache = prefill(model, prefix)
        root = int(logits[-1].argmax())
        # Plain greedy continuation after the root: g[0], g[1], ...
        seq, greedy = prefix.tolist() + [root], []
        for _ in range(4):
            greedy.append(int(plain_logits(model, seq + greedy)[-1].argmax()))
        plant = (0, 1, 0, 3)  # (0, 1, 0, 3) is not in the tree, so 3 tokens must be accepted
        topk = torch.empty(4, 4, dtype=torch.long)
        for d in range(4):
            others = [t for t in torch.randperm(VOCAB, generator=gen).tolist() if t != greedy[d]][:3]
            others.insert(plant[d], greedy[d])
            topk[d] = torch.tensor(others)
        tokens = tree_candidates(root, topk, b)
        past = len(prefix)
        mask, pos = tree_attention_inputs(b, past, "cpu", model.dtype)
        tree_logits = model(tokens[None], attention_mask=mask, position_ids=pos,
                            past_key_values=cache, use_cache=True).logits[0]
        nodes, accepted, bonus = greedy_accept_tree(tokens, tree_logits.argmax(-1), b)
        assert [path_of(b, n) for n in nodes] == [(), (0,), (0, 1), (0, 1, 0)]
        assert accepted == greedy[:3] and bonus == greedy[3]

        compact_cache(cache, past, nodes)
        assert cache.get_seq_length() == past + len(nodes)
        for layer in cache.layers:
            assert layer.keys.shape[-2] == layer.values.shape[-2] == past + len(nodes)
        # Continue with the bonus token plus two more tokens (a normal causal step, no tree).
        more = [bonus, 5, 17]
        cont = model(torch.tensor([more]), past_key_values=cache, use_cache=True).logits[0]
        ref = plain_logits(model, seq + accepted + more)[-len(more):]
        torch.testing.assert_close(cont, ref, rtol=0, atol=ATOL[attn])


def test_compact_cache_keeps_order_and_prefix():
    model = tiny_llama("eager")
    gen = torch.Generator().manual_seed(3)
    prefix = torch.randint(VOCAB, (4,), generator=gen)
    with torch.no_grad():
        _, cache = prefill(model, prefix)
        model(torch.randint(VOCAB, (1, 5), generator=gen), past_key_values=cache, use_cache=True)
    before = copy.deepcopy(cache)
    compact_cache(cache, 4, [0, 3, 1])
    for old, new in zip(before.layers, cache.layers):
        idx = torch.tensor([0, 1, 2, 3, 4, 7, 5])
        assert torch.equal(new.keys, old.keys[:, :, idx])
        assert torch.equal(new.values, old.values[:, :, idx])
    with pytest.raises(ValueError, match="out of range"):
        compact_cache(cache, 4, [0, 5])


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
        build_tree_buffers(tree)  # prefix-closed, unique
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
