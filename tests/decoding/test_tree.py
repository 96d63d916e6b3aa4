"""Candidate trees: buffers against brute force, and one tree pass of a real (tiny) Llama, on
every engine, against running every root-to-node path as a plain sequence."""

from __future__ import annotations

import copy
import random

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from drafttrain.decoding import EagerLM, StaticLM
from drafttrain.kinds.medusa.decode import tree_candidates
from drafttrain.decoding.engines.eager import cache_argument, compact_cache, returned_cache, tree_attention_inputs
from drafttrain.decoding.verify import greedy_tree_verdict
from drafttrain.trees import DEFAULT_TREE, chain_tree, default_tree, static_tree, tree_from_parents

VOCAB = 96


def greedy_accept_tree(candidate_tokens, target_argmax, tree):
    """The accepted path from `greedy_tree_verdict`, on the host: (nodes, root first; their draft
    tokens; the bonus token), as the tree decoder reads it."""
    verdict = greedy_tree_verdict(target_argmax, candidate_tokens, tree).tolist()
    width = tree.max_depth + 1
    nodes = tree.path_to(verdict[0])
    assert verdict[1:1 + width] == nodes + nodes[-1:] * (width - len(nodes))  # the path, padded with best
    argmax = verdict[1 + width:]
    return nodes, [argmax[p] for p in nodes[:-1]], argmax[nodes[-1]]
# Transformers' eager attention takes its softmax in float32 even for a float64 model; SDPA (and
# the static engine) stays in float64. A wrong mask or position moves logits by ~1e-1, far above
# either tolerance.
ATOL = {"eager": 1e-6, "sdpa": 1e-10, "static": 1e-10, "static-bucket": 1e-10}
ENGINES = list(ATOL)


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
    b = static_tree(paths)
    N = len(paths) + 1
    assert b.num_nodes == N
    assert sorted(b.paths) == sorted(tuple(p) for p in paths)
    # Node order: root, then by (depth, path).
    assert b.paths == sorted(b.paths, key=lambda p: (len(p), p))
    for a in range(N):
        pa = path_of(b, a)
        assert b.depths[a] == len(pa)
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
        static_tree([(0,), (1, 0)])
    with pytest.raises(ValueError, match="unique"):
        static_tree([(0,), (0,)])
    with pytest.raises(ValueError, match="non-empty"):
        static_tree([()])
    with pytest.raises(ValueError, match="non-negative"):
        static_tree([(-1,)])


def test_default_and_chain_trees():
    for num_heads in (1, 2, 3, 4, 5):
        tree = default_tree(num_heads)
        b = static_tree(tree)  # prefix-closed, or this raises
        assert b.max_depth == min(num_heads, 4)
    assert 20 <= static_tree(DEFAULT_TREE).num_nodes <= 30
    b = static_tree(chain_tree(3))
    assert b.paths == [(0,), (0, 0), (0, 0, 0)]
    assert b.retrieve_indices.tolist() == [[0, 1, 2, 3]]
    assert torch.equal(b.attention_mask, torch.ones(4, 4, dtype=torch.bool).tril())
    assert static_tree([]).retrieve_indices.tolist() == [[0]]


def test_tree_candidates_brute_force():
    b = static_tree(DEFAULT_TREE)
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
    b = static_tree(paths)
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
    b = static_tree([(0,), (1,), (0, 0), (1, 0), (1, 0, 0)])
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
    b2 = static_tree([(0,), (1,)])
    assert greedy_accept_tree(torch.tensor([1, 5, 5]), torch.tensor([5, 8, 9]), b2) == ([0, 1], [5], 8)


# --- attention inputs ------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_tree_attention_inputs_values(dtype):
    b = static_tree(DEFAULT_TREE)
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


def cached(kind: str):
    """A tiny float64 Llama behind the cached-LM interface: eager with either attention kernel,
    static, or static with a 40-token bucket registered (tree passes are padded to it)."""
    if kind in ("eager", "sdpa"):
        return EagerLM(tiny_llama(kind))
    lm = StaticLM(tiny_llama("sdpa"), max_length=96, compile=False)
    if kind == "static-bucket":
        lm.warmup([40])
    return lm


def plain_logits(model, tokens):
    return model(torch.as_tensor(tokens)[None]).logits[0]


@pytest.mark.parametrize("kind", ENGINES)
def test_tree_pass_equals_brute_force(kind):
    lm = cached(kind)
    gen = torch.Generator().manual_seed(1)
    prefix = torch.randint(VOCAB, (9,), generator=gen)
    b = static_tree(DEFAULT_TREE)
    lm.reset()
    with torch.no_grad():
        lm.forward(prefix)
        tokens = tree_candidates(int(torch.randint(VOCAB, (1,), generator=gen)), distinct_topk(gen, 4, 4), b)
        tree_logits, hidden = lm.forward(tokens, tree=b, hidden_layers=(2,))
        assert lm.length == len(prefix) + b.num_nodes
        for n in range(b.num_nodes):
            path = path_of(b, n)
            nodes = [b.paths.index(path[:d]) + 1 if d else 0 for d in range(len(path) + 1)]
            seq = prefix.tolist() + tokens[nodes].tolist()
            ref = lm.model(torch.tensor([seq]), output_hidden_states=True)
            torch.testing.assert_close(tree_logits[n], ref.logits[0, -1], rtol=0, atol=ATOL[kind])
            torch.testing.assert_close(hidden[n], ref.hidden_states[2][0, -1], rtol=0, atol=ATOL[kind])


@pytest.mark.parametrize("kind", ENGINES)
def test_generic_tree_any_node_order(kind):
    """A tree from parent indices, siblings interleaved across depths (not Medusa's order):
    every node's logits are its own path's, and keeping a path leaves the plain sequence's cache."""
    lm = cached(kind)
    parents = [-1, 0, 0, 1, 2, 1, 3, 5]
    tree = tree_from_parents(parents)
    assert tree.max_depth == 3 and tree.path_to(7) == [0, 1, 5, 7]
    gen = torch.Generator().manual_seed(4)
    prefix = torch.randint(VOCAB, (5,), generator=gen).tolist()
    tokens = torch.randint(VOCAB, (len(parents),), generator=gen)
    lm.reset()
    with torch.no_grad():
        lm.forward(torch.tensor(prefix))
        logits, _ = lm.forward(tokens, tree=tree)
        for n in range(len(parents)):
            seq = prefix + tokens[tree.path_to(n)].tolist()
            torch.testing.assert_close(logits[n], plain_logits(lm.model, seq)[-1], rtol=0, atol=ATOL[kind])
        path = tree.path_to(6)  # [0, 1, 3, 6]
        lm.compact(len(prefix), path)
        assert lm.length == len(prefix) + len(path)
        more = [11, 12]
        cont, _ = lm.forward(torch.tensor(more))
        ref = plain_logits(lm.model, prefix + tokens[path].tolist() + more)[-2:]
        torch.testing.assert_close(cont, ref, rtol=0, atol=ATOL[kind])


def test_tree_from_parents_validation():
    for bad in ([], [0], [-1, 1], [-1, 0, 3], [-1, -1]):
        with pytest.raises(ValueError, match="parents"):
            tree_from_parents(bad)
    t = tree_from_parents([-1, 0, 0, 2])
    assert t.depths.tolist() == [0, 1, 1, 2]
    assert t.attention_mask.tolist() == [[True, False, False, False], [True, True, False, False],
                                         [True, False, True, False], [True, False, True, True]]


@pytest.mark.parametrize("seed", range(20))
def test_device_verdict_matches_brute_force_on_generic_trees(seed):
    """Greedy acceptance on any tree: deepest node whose whole path matches, ties to the lowest index."""
    rng = random.Random(seed)
    parents = [-1] + [rng.randrange(n) for n in range(1, rng.randrange(2, 20))]
    tree = tree_from_parents(parents)
    tokens = torch.tensor([rng.randrange(5) for _ in parents])  # a small vocabulary: duplicates happen
    argmax = torch.tensor([rng.randrange(5) for _ in parents])
    best, score = 0, (0, 0)
    for n in range(len(parents)):
        path = tree.path_to(n)
        if all(int(tokens[c]) == int(argmax[p]) for p, c in zip(path, path[1:])) and (len(path), -n) > score:
            best, score = n, (len(path), -n)
    verdict = greedy_tree_verdict(argmax, tokens, tree).tolist()
    assert verdict[0] == best and verdict[2 + tree.max_depth:] == argmax.tolist()


@pytest.mark.parametrize("kind", ENGINES)
def test_verify_accept_keep_continue(kind):
    """Plant the target's true greedy continuation in the heads' top-k along path (0, 1, 0):
    acceptance must find exactly that path, and decoding on from the kept cache must give the
    logits of the plain sequence run from scratch."""
    lm = cached(kind)
    model = lm.model
    gen = torch.Generator().manual_seed(2)
    prefix = torch.randint(VOCAB, (6,), generator=gen)
    b = static_tree(DEFAULT_TREE)
    lm.reset()
    with torch.no_grad():
        logits, _ = lm.forward(prefix)
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
        tree_logits, _ = lm.forward(tokens, tree=b)
        nodes, accepted, bonus = greedy_accept_tree(tokens, tree_logits.argmax(-1), b)
        assert [path_of(b, n) for n in nodes] == [(), (0,), (0, 1), (0, 1, 0)]
        assert accepted == greedy[:3] and bonus == greedy[3]

        lm.compact(past, nodes)
        assert lm.length == past + len(nodes)
        if kind in ("eager", "sdpa"):
            for layer in lm.cache.layers:
                assert layer.keys.shape[-2] == layer.values.shape[-2] == past + len(nodes)
        # Continue with the bonus token plus two more tokens (a normal causal step, no tree).
        more = [bonus, 5, 17]
        cont, _ = lm.forward(torch.tensor(more))
        ref = plain_logits(model, seq + accepted + more)[-len(more):]
        torch.testing.assert_close(cont, ref, rtol=0, atol=ATOL[kind])


def test_compact_cache_keeps_order_and_prefix():
    model = tiny_llama("eager")
    gen = torch.Generator().manual_seed(3)
    prefix = torch.randint(VOCAB, (4,), generator=gen)
    with torch.no_grad():
        cache = returned_cache(model(prefix[None], use_cache=True))
        model(torch.randint(VOCAB, (1, 5), generator=gen), use_cache=True, **{cache_argument(model): cache})
    before = copy.deepcopy(cache)
    compact_cache(cache, 4, [0, 3, 1])
    for old, new in zip(before.layers, cache.layers):
        idx = torch.tensor([0, 1, 2, 3, 4, 7, 5])
        assert torch.equal(new.keys, old.keys[:, :, idx])
        assert torch.equal(new.values, old.values[:, :, idx])
    with pytest.raises(ValueError, match="out of range"):
        compact_cache(cache, 4, [0, 5])


@pytest.mark.parametrize("kind", ["eager", "static"])
def test_keep_rejects_nodes_outside_the_last_pass(kind):
    lm = cached(kind)
    lm.reset()
    lm.forward(torch.arange(6))
    with pytest.raises(ValueError, match="out of range"):
        lm.compact(4, [0, 2])
    with pytest.raises(ValueError, match="out of range"):
        lm.compact(7, [0])
    lm.compact(4, [0, 1])  # a chain prefix: nothing moves
    assert lm.length == 6
