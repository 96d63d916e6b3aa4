"""EAGLE-3 decoding is lossless: greedy output equals the target's own `generate()` (float64) for
chains, static trees and EAGLE-2's dynamic trees, on every engine; sampled output follows the
target's exact distribution with a reduced draft vocabulary; the dynamic tree is the one a
brute-force EAGLE-2 expansion builds."""

from __future__ import annotations

import copy
import json
import math
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from eagle3_helpers import draft_decoder, target_hidden_states, tiny_draft
from engines import ENGINES, on_engine, ready
from sampling_reference import chi2_pvalue, exact_two_token_distribution

from drafttrain.kinds.eagle3.decode import Eagle3Runtime, Eagle3TreeDrafter, draft_step, prefill
from drafttrain.kinds.features import DraftKVCache
from drafttrain.decoding.verify import Sampled
from drafttrain.planning import accepted_within
from drafttrain.trees import resolve_tree, tree_from_parents
from tiny import greedy_reference, tiny_causal_lm

EOS = 2
PROMPTS = [[5, 9, 13, 7, 5, 9], [40, 41], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 3, 4, 5]]
STATIC_TREE = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 1, 0), (0, 0, 0, 0)]
TREES = {"chain": "chain", "static": STATIC_TREE, "dynamic": "dynamic"}
TREE_FILE = Path(tempfile.mkdtemp()) / "tree.json"


@pytest.mark.slow
@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("tree", list(TREES))
@pytest.mark.parametrize("k", [1, 3, 4])
def test_greedy_equals_generate(trained_pair, tree, engine, k):
    target, draft = trained_pair
    decoder = ready(draft_decoder(on_engine(target, engine), draft, num_draft_tokens=k, tree=TREES[tree],
                                  tree_nodes=12, tree_topk=3), engine)
    runtime = (decoder.proposer if tree == "chain" else decoder.drafter).runtime
    assert runtime.engine == ("eager" if engine == "eager" else "static")  # the draft follows the target
    accepted = 0
    for prompt in PROMPTS:
        for eos in (None, EOS):
            ref = greedy_reference(target, prompt, 20, eos=eos)
            decoder.eos = {eos} if eos is not None else set()
            gen = decoder.generate(prompt, 20)
            assert gen.tokens == ref
            assert sum(gen.step_tokens) == len(gen.tokens)
            assert all(0 <= a <= m <= k for a, m in zip(gen.accepted_lengths, gen.proposed_lengths))
            accepted += sum(gen.accepted_lengths)
    assert accepted > 0  # drafts were really accepted: the accept/commit paths ran


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("tree", list(TREES))
def test_greedy_equals_generate_on_gemma3(tree, engine):
    """A Gemma-3 target (sliding and global layers, a 4-token window the prompts run past): the
    aux hidden states come from its own layers on every engine, and verification stays exact."""
    from eagle3_helpers import trained_pair

    target, draft = trained_pair("gemma3")
    decoder = ready(draft_decoder(on_engine(target, engine), draft, num_draft_tokens=3, tree=TREES[tree],
                                  tree_nodes=12, tree_topk=3), engine)
    accepted = []
    for prompt in PROMPTS:
        gen = decoder.generate(prompt, 24)
        assert gen.tokens == greedy_reference(target, prompt, 24)
        accepted += gen.accepted_lengths
    assert max(accepted) > 0


@pytest.mark.parametrize("tree", list(TREES))
def test_the_static_draft_engine_drafts_what_the_eager_one_does(trained_pair, tree):
    """Losslessness holds whatever the draft proposes, so it cannot show a wrong static draft cache
    or mask: the drafts themselves must be the eager engine's (float64), step for step."""
    target, draft = trained_pair
    accepted = {}
    for engine in ("eager", "static"):
        decoder = draft_decoder(on_engine(target, engine), draft, num_draft_tokens=4, tree=TREES[tree],
                                tree_nodes=12, tree_topk=3)
        accepted[engine] = [decoder.generate(prompt, 24).accepted_lengths for prompt in PROMPTS]
    assert accepted["static"] == accepted["eager"]
    assert len({a for run in accepted["eager"] for a in run}) >= 3  # several lengths: drafts were judged


@pytest.mark.parametrize("tree", ["chain", "sampled", "dynamic"])
def test_draft_forwards_count_every_draft_layer_pass(trained_pair, tree):
    """draft_forwards (SPEC: the drafter's forward passes, prefill included): the prompt's feed,
    then per step the feed of the kept positions plus the drafting passes: K - 1 for a greedy
    chain (drafted K long, one shape, then cut), m - 1 for a sampled chain of m drafts, depth - 1
    levels for a dynamic tree; none when the step drafts nothing (a one-token budget, or a
    one-token prompt's first step: no feature yet, and no prompt feed either)."""
    target, draft = trained_pair
    k = 3
    rule = Sampled(1.0, generator=torch.Generator().manual_seed(0)) if tree == "sampled" else None
    decoder = draft_decoder(target, draft, num_draft_tokens=k, tree="dynamic" if tree == "dynamic" else "chain",
                            tree_nodes=8, tree_topk=2, rule=rule)
    for prompt in (PROMPTS[0], [7]):
        gen = decoder.generate(prompt, 13)
        drafted = [m for m in gen.proposed_lengths if m]
        per_step = {"chain": [k - 1] * len(drafted), "sampled": [m - 1 for m in drafted],
                    "dynamic": [k - 1] * len(drafted)}[tree]
        assert drafted and (len(prompt) > 1 or gen.proposed_lengths[0] == 0)
        # a tree asked for no depth (the last step's one-token budget) defers its feed: nothing reads it
        unfed = int(tree == "dynamic" and len(gen.proposed_lengths) > 1 and gen.proposed_lengths[-1] == 0)
        assert gen.draft_forwards == (len(prompt) > 1) + len(gen.proposed_lengths) - unfed + sum(per_step)


@pytest.mark.parametrize("depth,topk,nodes", [(2, 1, 2), (3, 2, 3), (4, 4, 3), (3, 1, 3)])
def test_a_dynamic_tree_of_fewer_nodes_than_its_depth_decodes(trained_pair, depth, topk, nodes):
    """`nodes` nodes reach at most nodes - 1 deep: such a tree (a plan may pick one) is grown that
    deep only and decodes the target's text (it once verified a path wider than the tree)."""
    target, draft = trained_pair
    decoder = draft_decoder(target, draft, num_draft_tokens=depth, tree="dynamic", tree_nodes=nodes, tree_topk=topk)
    assert decoder.num_draft_tokens == nodes - 1 and decoder.num_tree_nodes == nodes
    for prompt in PROMPTS:
        gen = decoder.generate(prompt, 12)
        assert gen.tokens == greedy_reference(target, prompt, 12)
        assert max(gen.proposed_lengths) == nodes - 1


def test_one_token_prompt_drafts_nothing_first(trained_pair):
    target, draft = trained_pair
    for tree in TREES.values():
        gen = draft_decoder(target, draft, num_draft_tokens=3, tree=tree, tree_nodes=8, tree_topk=2).generate([7], 9)
        assert gen.tokens == greedy_reference(target, [7], 9)
        assert gen.proposed_lengths[0] == 0


def brute_force_dynamic_tree(target, draft, sequence: list[int], depth: int, topk: int, nodes: int):
    """EAGLE-2 by hand: each candidate's draft distribution from its own fresh chain decode (no
    tree masks), the expansion rule applied literally, then the `nodes - 1` most likely
    candidates. Returns {token path: cumulative log-prob}."""
    features = draft.target_features(target_hidden_states(target, torch.tensor([sequence[:-1]])))
    c = len(sequence)

    def logprobs(path: tuple[int, ...]) -> torch.Tensor:
        cache = DraftKVCache()
        out = prefill(draft, cache, features, torch.tensor([sequence[1:]]), torch.arange(c - 1)[None])
        for j, token in enumerate(path):
            out = draft_step(draft, cache, out.hidden[:, -1:], torch.tensor([[token]]), torch.tensor([[c - 1 + j]]))
        return draft.to_target_logits(out.logits[0, -1]).log_softmax(-1)

    candidates: dict[tuple[int, ...], float] = {}
    frontier = [((), 0.0)]
    for d in range(1, depth + 1):
        children = []
        for path, score in frontier:
            top = logprobs(path).topk(topk)
            for value, token in zip(top.values.tolist(), top.indices.tolist()):
                children.append((path + (token,), score + value))
        candidates.update(children)
        frontier = sorted(children, key=lambda item: -item[1])[:topk]
    best = sorted(candidates.items(), key=lambda item: (-item[1], len(item[0])))[:nodes - 1]
    return dict(best)


@pytest.mark.parametrize("depth,topk,nodes", [(3, 2, 7), (4, 3, 16), (2, 4, 20)])
def test_dynamic_tree_is_eagle2s_choice(trained_pair, depth, topk, nodes):
    target, draft = trained_pair
    sequence = PROMPTS[2]
    drafter = Eagle3TreeDrafter(Eagle3Runtime(draft), "cpu", depth=depth, topk=topk, nodes=nodes)
    hidden = target_hidden_states(target, torch.tensor([sequence[:-1]]))
    drafter.reset(sequence, draft.target_features(hidden)[0])
    with torch.no_grad():
        tokens, tree = drafter.draft(torch.tensor([sequence[-1]]), depth)
    expected = brute_force_dynamic_tree(target, draft, sequence, depth, topk, nodes)
    paths = {tuple(int(tokens[n]) for n in tree.path_to(i)[1:]) for i in range(1, tree.num_nodes)}
    assert tree.num_nodes == min(nodes, 1 + topk + (depth - 1) * topk * topk)
    assert paths == set(expected)
    assert all(p[:-1] in paths or len(p) == 1 for p in paths)  # prefix-closed
    # The draft's cache: the committed prefix plus one entry per expanded node (the next commit drops them).
    assert drafter.runtime.cache.length == len(sequence) - 1 + topk * (depth - 1)


def host_dynamic_tree(target, draft, sequence, depth, topk, nodes):
    """The tree EAGLE-2 verifies, built node by node on the host as drafttrain did before the
    device tree: (tokens, parents) in its node order, the root first, then by depth and, within a
    depth, by creation (frontier nodes in creation order, each one's children by rank)."""
    features = draft.target_features(target_hidden_states(target, torch.tensor([sequence[:-1]])))
    c = len(sequence)

    def logprobs(path):
        cache = DraftKVCache()
        out = prefill(draft, cache, features, torch.tensor([sequence[1:]]), torch.arange(c - 1)[None])
        for j, token in enumerate(path):
            out = draft_step(draft, cache, out.hidden[:, -1:], torch.tensor([[token]]), torch.tensor([[c - 1 + j]]))
        return draft.to_target_logits(out.logits[0, -1]).log_softmax(-1)

    made = []  # (path, ranks, score) in creation order
    frontier = [((), (), 0.0)]
    for d in range(1, depth + 1):
        children = []
        for path, ranks, score in frontier:
            top = logprobs(path).topk(topk)
            children += [(path + (t,), ranks + (r,), score + v)
                         for r, (v, t) in enumerate(zip(top.values.tolist(), top.indices.tolist()))]
        made += children
        frontier = sorted(sorted(children, key=lambda c: -c[2])[:topk], key=lambda c: c[1])
    chosen = sorted(made, key=lambda c: -c[2])[:nodes - 1]  # stable: ties keep creation order
    chosen = sorted(chosen, key=lambda c: (len(c[0]), c[1]))
    index = {(): 0, **{c[0]: i + 1 for i, c in enumerate(chosen)}}
    return [sequence[-1]] + [c[0][-1] for c in chosen], [-1] + [index[c[0][:-1]] for c in chosen]


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("depth,topk,nodes", [(3, 2, 7), (4, 3, 16)])
def test_the_device_tree_is_the_host_tree_node_for_node(trained_pair, engine, depth, topk, nodes):
    """Same tokens, same parents, same node order as the tree built node by node on the host,
    on either engine (the static one grows it as one fixed-shape step)."""
    target, draft = trained_pair
    sequence = PROMPTS[2]
    decoder = draft_decoder(on_engine(target, engine), draft, num_draft_tokens=depth, tree="dynamic",
                            tree_nodes=nodes, tree_topk=topk)
    drafter = decoder.drafter
    hidden = target_hidden_states(target, torch.tensor([sequence[:-1]]))
    drafter.reset(sequence, draft.target_features(hidden)[0])
    with torch.no_grad():
        tokens, tree = drafter.draft(torch.tensor([sequence[-1]]), depth)
    want_tokens, want_parents = host_dynamic_tree(target, draft, sequence, depth, topk, nodes)
    assert tokens.tolist() == want_tokens and tree.parent.tolist() == want_parents
    reference = tree_from_parents(want_parents)
    assert torch.equal(tree.depths, reference.depths) and torch.equal(tree.attention_mask, reference.attention_mask)


# -- sampling -------------------------------------------------------------------------------------

V = 6


@pytest.mark.slow
@pytest.mark.parametrize("temperature,top_p,arch", [(1.0, 1.0, "llama"), (0.8, 0.9, "llama"), (0.8, 0.9, "gemma3")])
def test_sampled_text_follows_target_distribution_with_a_reduced_vocabulary(temperature, top_p, arch):
    """The draft knows 4 of the 6 tokens: q is 0 on the other two, and they must still come out
    exactly as often as the target says (through the residual distribution)."""
    target = tiny_causal_lm(arch, 0, vocab_size=V, layers=7, sharpness=2.0)
    draft = tiny_draft(target, draft_vocab_size=4, vocab_size=V, scale=0.6)
    outside = set(range(V)) - set(draft.draft_target_ids.tolist())
    prompt = [1, 3, 1, 3, 1]
    exact = exact_two_token_distribution(target, prompt, temperature, top_p, V)
    assert sum(p for (x, _), p in exact.items() if x in outside) > 0.05  # the test can see a leak
    g = torch.Generator().manual_seed(1234)
    decoder = draft_decoder(target, draft, num_draft_tokens=3, rule=Sampled(temperature, top_p, g))
    n, counts, accepted = 2000, {}, 0
    for _ in range(n):
        gen = decoder.generate(prompt, 3)
        key = tuple(gen.tokens[:2])
        counts[key] = counts.get(key, 0) + 1
        accepted += sum(gen.accepted_lengths)
    assert chi2_pvalue(counts, exact, n) > 1e-3
    assert accepted > 0
    # Power check: what the decoder would emit if it let the draft's first token through unjudged
    # (the draft never proposes `outside` tokens) is far from what it emitted.
    first = {x: sum(c for (a, _), c in counts.items() if a == x) for x in range(V)}
    assert sum(first[x] for x in outside) / n == pytest.approx(sum(p for (x, _), p in exact.items() if x in outside),
                                                               abs=4 / math.sqrt(n))


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                    reason="inductor needs a C++ compiler to build CPU kernels")
@pytest.mark.slow
def test_compiled_draft_steps_equal_generate_without_recompiling(trained_pair):
    """The static draft engine compiled (inductor on CPU; CUDA graphs on CUDA): warm-up compiles
    the chain's one-token step and each level of a dynamic and a static tree once, and decoding
    prompts of other lengths, with rollbacks, never recompiles; the output stays the target's."""
    import torch._dynamo

    from drafttrain.decoding import cached_lm

    target64, draft64 = trained_pair
    target, draft = copy.deepcopy(target64).float(), copy.deepcopy(draft64).float()
    draft.attach_embeddings(target.get_input_embeddings())
    lm = cached_lm(target, "static", max_length=64, compile=True)
    for tree in ("chain", "dynamic", STATIC_TREE):
        decoder = draft_decoder(lm, draft, num_draft_tokens=3, tree=tree, tree_nodes=10, tree_topk=2)
        engine = (decoder.proposer if tree == "chain" else decoder.drafter).runtime
        assert engine.compile and engine.cache.capacity >= lm.capacity and engine.cache.capacity % 256 == 0
        assert decoder.warmup() > 0 and engine.compile_seconds > 0
        accepted = []
        with torch._dynamo.config.patch(error_on_recompile=True):
            for prompt in PROMPTS:
                gen = decoder.generate(prompt, 18)
                assert gen.tokens == greedy_reference(target, prompt, 18)
                accepted += gen.accepted_lengths
        assert sum(accepted) > 0 and any(a < 3 for a in accepted)  # drafts accepted, and rolled back


# -- planning: what the largest tree's recorded steps say a smaller tree accepts -------------------


@pytest.mark.parametrize("tree", ["dynamic", "static"])
def test_the_recorded_steps_tell_what_a_smaller_tree_accepts(trained_pair, tree):
    """A decode with the largest tree records each step's ranked candidates; a smaller tree's first
    step (the same state: right after prefill) accepts exactly what `accepted_within` reads off the
    largest tree's first record, and every recorded step agrees with what the decoder accepted."""
    target, draft = trained_pair
    shape = "dynamic" if tree == "dynamic" else STATIC_TREE

    def decoder(depth, nodes):
        paths = shape if tree == "dynamic" else resolve_tree(str(TREE_FILE), depth, nodes=nodes)[1]
        return draft_decoder(target, draft, num_draft_tokens=depth, tree="dynamic" if tree == "dynamic" else paths,
                             tree_nodes=nodes, tree_topk=3)

    TREE_FILE.write_text(json.dumps([list(p) for p in STATIC_TREE]))
    checked = 0
    for prompt in PROMPTS:
        big = decoder(4, 24)
        big.recorded = []
        gen = big.generate(prompt, 16)
        assert len(big.recorded) == len(gen.accepted_lengths)
        for step, accepted in list(zip(big.recorded, gen.accepted_lengths))[:-1]:  # the last may stop at EOS
            assert accepted_within(step, 4, 24) == accepted
        for depth, nodes in [(1, 2), (2, 4), (3, 6), (4, 9), (2, 24)]:
            first = decoder(depth, nodes).generate(prompt, 16).accepted_lengths[0]
            assert first == accepted_within(big.recorded[0], depth, nodes), (prompt, depth, nodes)
            checked += first > 0
    assert checked  # some first steps accepted drafts: the check saw more than empty paths


def candidate_paths(listed, nodes: int) -> set[tuple[int, ...]]:
    """The token paths of the first `nodes - 1` candidates `TreeDrafter.candidates` lists (best first)."""
    tokens, parents, _ = listed
    paths: list[tuple[int, ...]] = []
    for token, parent in zip(tokens, parents):
        paths.append((paths[parent] if parent >= 0 else ()) + (token,))
    return set(paths[:nodes - 1])


def test_a_forest_grows_each_top_ks_tree_as_it_grows_alone(trained_pair):
    """The trees of other top-ks grown beside the verified one (`grow_beside`: one draft forward a
    level for all) are EAGLE-2's own choice for each top-k (the brute-force expansion), the verified
    tree unchanged, and the draft's cache holds one entry per distinct node expanded (the trees share some)."""
    target, draft = trained_pair
    sequence, depth, nodes = PROMPTS[2], 3, 9
    drafter = Eagle3TreeDrafter(Eagle3Runtime(draft), "cpu", depth=depth, topk=3, nodes=nodes)
    assert drafter.grow_beside((1, 2, 3, 4))
    hidden = target_hidden_states(target, torch.tensor([sequence[:-1]]))
    drafter.reset(sequence, draft.target_features(hidden)[0])
    with torch.no_grad():
        tokens, tree = drafter.draft(torch.tensor([sequence[-1]]), depth)
    grown = {tuple(int(tokens[n]) for n in tree.path_to(i)[1:]) for i in range(1, tree.num_nodes)}
    assert grown == set(brute_force_dynamic_tree(target, draft, sequence, depth, 3, nodes))
    beside = drafter.candidates_beside()
    assert sorted(beside) == [1, 2, 4]
    for topk, listed in beside.items():
        assert candidate_paths(listed, nodes) == set(brute_force_dynamic_tree(target, draft, sequence, depth, topk,
                                                                              nodes)), topk
    expanded = drafter.runtime.cache.length - (len(sequence) - 1)  # one entry a distinct node: top-4 holds the rest at depth 1
    assert 4 + 4 <= expanded < (1 + 2 + 3 + 4) * (depth - 1)


def test_trees_grown_beside_are_recorded_at_the_verified_trees_steps(trained_pair):
    """A replayed decode (`teacher_forced`) records, at each of its steps, the trees grown beside
    against the target's own continuation: each the tree EAGLE-2 grows for that top-k from that
    prefix (the draft's state a function of the text and the target's features along it), whose
    `accepted_within` is what the target accepts of it; the verified tree's records as before."""
    from drafttrain.decoding.engines.teacher import teacher_forced
    from drafttrain.planning import agreed

    target, draft = trained_pair
    depth, nodes, prompt, new = 3, 8, PROMPTS[0], 14
    continuation = greedy_reference(target, prompt, new)
    decoder = draft_decoder(target, draft, num_draft_tokens=depth, tree="dynamic", tree_nodes=nodes, tree_topk=4)
    layers = tuple(decoder.hidden_layers)
    replay = draft_decoder(teacher_forced(target, prompt + continuation, layers), draft, num_draft_tokens=depth,
                           tree="dynamic", tree_nodes=nodes, tree_topk=4)
    assert replay.drafter.grow_beside((1, 2, 4))
    replay.recorded, replay.recorded_beside = [], {}
    gen = replay.generate(prompt, new)
    assert gen.tokens == continuation
    assert sorted(replay.recorded_beside) == [1, 2]
    emitted = 0
    for i, step in enumerate(replay.recorded):
        ahead = continuation[emitted:emitted + depth + 1]
        assert step.continuation == tuple(ahead[:len(step.continuation)])
        for topk in (1, 2):
            beside = replay.recorded_beside[topk][i]
            assert beside.continuation == tuple(ahead) and beside.lookup == ()
            if i < 3:  # the brute force decodes a chain per candidate: a few steps suffice
                listed = (beside.tokens, beside.parents, beside.depths)
                sequence = prompt + continuation[:emitted]
                assert candidate_paths(listed, nodes) == set(brute_force_dynamic_tree(target, draft, sequence, depth,
                                                                                      topk, nodes)), (i, topk)
            longest = max((len(p) for p in candidate_paths((beside.tokens, beside.parents, beside.depths), nodes)
                           if agreed(list(p), ahead) == len(p)), default=0)
            assert accepted_within(beside, depth, nodes) == longest
        emitted += gen.accepted_lengths[i] + 1
