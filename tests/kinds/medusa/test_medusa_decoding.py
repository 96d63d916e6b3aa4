"""Medusa decoding: greedy must reproduce the target's own `generate()` exactly, with acceptance
exactly as a brute-force simulation of planted heads predicts; sampling must follow the target's
distribution, however far the heads are from it."""

from __future__ import annotations

import random

import pytest
import torch
from engines import ENGINES, on_engine, ready
from sampling_reference import V, chi2_pvalue, exact_two_token_distribution
from tiny import greedy_reference, tiny_causal_lm, tiny_gemma3, tiny_lm

from drafttrain.decoding import DecodeSettings
from drafttrain.kinds.base import Drafter
from drafttrain.kinds.factory import build_decoder
from drafttrain.kinds.medusa.decode import medusa_decoder
from drafttrain.planning import accepted_within
from drafttrain.decoding.verify import Sampled, probabilities
from drafttrain.errors import UserError
from drafttrain.kinds.medusa.model import MedusaConfig, MedusaHeads
from drafttrain.trees import DEFAULT_TREE, chain_tree, default_tree, static_tree

PROMPTS = [[5, 9, 13, 7, 5, 9], [40], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 3, 4, 5]]
MAX_NEW = 25


@pytest.fixture(scope="module")
def target():
    return tiny_lm(0)


reference = greedy_reference


def noisy_heads(target, num_heads, scale=2.0, seed=0):
    """Real heads (the trained kind's weights): the target's lm_head behind perturbed blocks."""
    heads = MedusaHeads.from_target(target, num_heads)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for block in heads.blocks:
            for layer in block.layers:
                layer.weight.add_(scale * torch.randn(layer.weight.shape, generator=g, dtype=layer.weight.dtype)
                                  / layer.weight.shape[1] ** 0.5)
    return heads


class PlantedHeads(MedusaHeads):
    """Heads that know the target's greedy text: at the hidden state of text position t, head i
    puts text[t + 2 + i] at rank `ranks[t][i]` of its logits (None: below every other token), the
    other tokens in a random order. The decoder must accept exactly what `simulate` predicts."""

    def __init__(self, target, num_heads, text, ranks, seed=0):
        weight = target.get_output_embeddings().weight.detach()
        super().__init__(MedusaConfig(weight.shape[1], weight.shape[0], num_heads), weight)
        with torch.no_grad():
            self.states = target(torch.tensor([text]), output_hidden_states=True).hidden_states[-1][0]
        self.text, self.ranks = text, ranks
        self.rng = random.Random(seed)
        self.looked_up = []  # text positions the heads were asked about, in order

    def forward_head(self, i, hidden):
        gap = (self.states - hidden).abs().amax(dim=-1)
        t = int(gap.argmin())
        assert gap[t] < 1e-5, "the heads were fed a hidden state that is not on the greedy text"
        if i == 0:
            self.looked_up.append(t)
        vocab = self.config.vocab_size
        truth = self.text[t + 2 + i] if t + 2 + i < len(self.text) else None
        order = [x for x in range(vocab) if x != truth]
        self.rng.shuffle(order)
        rank = self.ranks[t][i]
        if truth is not None:
            order.insert(len(order) if rank is None else rank, truth)
        logits = torch.empty(vocab, dtype=hidden.dtype)
        logits[torch.tensor(order)] = -torch.arange(vocab, dtype=hidden.dtype)
        return logits


def planted_ranks(length, num_heads, seed, perfect):
    rng = random.Random(seed)
    choices = [0] * 11 + [1] * 4 + [2] * 2 + [3, None, None]
    return [[0 if perfect else rng.choice(choices) for _ in range(num_heads)] for _ in range(length)]


def simulate(prompt_len, max_new, tree, ranks):
    """Brute-force Medusa bookkeeping: per step the drafts accepted and the text positions the
    heads read. Head i's token is on the greedy text at rank ranks[t][i]; the target accepts the
    longest tree path that follows those ranks (never deeper than the token budget allows)."""
    paths, depth = set(map(tuple, tree)), max((len(p) for p in tree), default=0)
    last, emitted, accepted, looked = prompt_len - 1, 0, [], []  # `last`: position of the pending token
    while emitted < max_new:
        d_max = 0 if last == 0 else min(depth, max_new - emitted - 1)
        n = 0
        if d_max:
            t = last - 1  # the heads read the hidden state of the last cached token
            looked.append(t)
            while n < d_max and ranks[t][n] is not None and tuple(ranks[t][:n + 1]) in paths:
                n += 1
        accepted.append(n)
        emitted += n + 1
        last += n + 1
    return accepted, looked


def check_bookkeeping(gen, k):
    assert len(gen.accepted_lengths) == len(gen.proposed_lengths) == len(gen.step_tokens) == len(gen.step_seconds)
    assert sum(gen.step_tokens) == len(gen.tokens)
    assert all(0 <= a <= m <= k for a, m in zip(gen.accepted_lengths, gen.proposed_lengths))
    assert all(s == a + 1 for s, a in zip(gen.step_tokens[:-1], gen.accepted_lengths))


TREES = {
    "default": lambda n: None,
    "chain": lambda n: chain_tree(n),
    "wide": lambda n: [(i,) for i in range(4)] + [(0, j) for j in range(4)][: 4 * (n > 1)],
}


@pytest.mark.slow
@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("num_heads", [1, 2, 4])
@pytest.mark.parametrize("tree", list(TREES))
@pytest.mark.parametrize("heads_kind", ["noisy", "planted", "perfect"])
def test_greedy_equals_generate_at_length_limit(target, heads_kind, tree, num_heads, engine):
    check_greedy(target, heads_kind, tree, num_heads, engine)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("heads_kind", ["noisy", "planted"])
def test_greedy_equals_generate_on_gemma3(heads_kind, engine):
    """Tree passes on a Gemma-3 target past its 4-token window: each branch sees its own window,
    and planted heads are accepted exactly as the simulation says."""
    check_greedy(tiny_gemma3(0), heads_kind, "default", 4, engine)


def check_greedy(target, heads_kind, tree, num_heads, engine):
    """Greedy Medusa decoding of every prompt equals `generate()`; planted heads' acceptance
    equals `simulate`'s."""
    total_accepted = 0
    for p, prompt in enumerate(PROMPTS):
        ref = reference(target, prompt, MAX_NEW)
        paths = TREES[tree](num_heads)
        if heads_kind == "noisy":
            heads = noisy_heads(target, num_heads)
        else:
            text = prompt + reference(target, prompt, MAX_NEW + 8)
            ranks = planted_ranks(len(text), num_heads, seed=p, perfect=heads_kind == "perfect")
            heads = PlantedHeads(target, num_heads, text, ranks)
        decoder = ready(medusa_decoder(on_engine(target, engine), heads, tree=paths), engine)
        k = decoder.num_draft_tokens
        assert k == min(num_heads, 4 if tree == "default" else 2 if tree == "wide" else num_heads)
        gen = decoder.generate(prompt, MAX_NEW)
        assert gen.tokens == ref
        check_bookkeeping(gen, k)
        if heads_kind != "noisy":
            expected, looked = simulate(len(prompt), MAX_NEW, decoder.tree, ranks)
            assert gen.accepted_lengths == expected
            assert heads.looked_up == looked
        total_accepted += sum(gen.accepted_lengths)
    if heads_kind != "noisy":
        assert total_accepted > 0


@pytest.mark.parametrize("engine", ENGINES)
def test_perfect_heads_accept_full_depth(target, engine):
    prompt = PROMPTS[0]
    text = prompt + reference(target, prompt, 40)
    heads = PlantedHeads(target, 4, text, planted_ranks(len(text), 4, 0, perfect=True))
    gen = ready(medusa_decoder(on_engine(target, engine), heads), engine).generate(prompt, 21)  # 4 steps of 5, then 1
    assert gen.accepted_lengths == [4, 4, 4, 4, 0]
    assert gen.proposed_lengths == [4, 4, 4, 4, 0]
    assert gen.step_tokens == [5, 5, 5, 5, 1]
    # tau = new tokens / target forwards (prefill excluded)
    assert len(gen.tokens) / len(gen.accepted_lengths) == 21 / 5


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("tree", ["default", "chain"])
@pytest.mark.parametrize("heads_kind", ["noisy", "perfect"])
def test_greedy_stops_at_eos_like_generate(target, heads_kind, tree, engine):
    for p, prompt in enumerate(PROMPTS):
        free = reference(target, prompt, 30)
        for eos in {free[3], free[11]}:  # an EOS reached early, and one inside a later step
            ref = reference(target, prompt, 30, eos=eos)
            assert ref[-1] == eos and eos not in ref[:-1]
            if heads_kind == "noisy":
                heads = noisy_heads(target, 4)
            else:
                text = prompt + reference(target, prompt, 38)
                heads = PlantedHeads(target, 4, text, planted_ranks(len(text), 4, p, perfect=True))
            decoder = ready(medusa_decoder(on_engine(target, engine), heads, tree=TREES[tree](4), eos_token_ids={eos}),
                            engine)
            gen = decoder.generate(prompt, 30)
            assert gen.tokens == ref
            check_bookkeeping(gen, 4)


def test_eager_attention_tree(target):
    import copy

    eager = copy.deepcopy(target)
    eager.config._attn_implementation = "eager"
    prompt = PROMPTS[2]
    text = prompt + reference(target, prompt, MAX_NEW + 8)
    ranks = planted_ranks(len(text), 4, seed=5, perfect=False)
    gen = medusa_decoder(eager, PlantedHeads(eager, 4, text, ranks)).generate(prompt, MAX_NEW)
    assert gen.tokens == text[len(prompt):len(prompt) + MAX_NEW]
    assert gen.accepted_lengths == simulate(len(prompt), MAX_NEW, DEFAULT_TREE, ranks)[0]


def test_rejects_bad_trees_and_heads(target):
    heads = MedusaHeads.from_target(target, 2)
    with pytest.raises(UserError, match="depth <= 2"):
        medusa_decoder(target, heads, tree=chain_tree(3))
    assert medusa_decoder(target, heads).tree == static_tree(default_tree(2)).paths
    other = MedusaHeads.from_target(tiny_lm(1, vocab_size=80), 2)
    with pytest.raises(UserError, match="vocab 80"):
        medusa_decoder(target, other)


@pytest.mark.parametrize("engine", ["eager", "static"])
def test_tree_margins_are_the_targets_top2_gap(target, engine):
    """Each emitted token's margin equals top-1 minus top-2 of a full forward over its prefix."""
    prompt = PROMPTS[2]
    decoder = medusa_decoder(on_engine(target, engine), noisy_heads(target, 4), record_margins=True)
    gen = decoder.generate(prompt, 14)
    assert len(gen.margins) == len(gen.tokens) == 14 and sum(gen.accepted_lengths) > 0
    for i in range(len(gen.tokens)):
        with torch.no_grad():
            top2 = target(torch.tensor([prompt + gen.tokens[:i]])).logits[0, -1].topk(2).values
        assert gen.margins[i] == pytest.approx(float(top2[0] - top2[1]), abs=1e-9)
    with pytest.raises(ValueError, match="greedy"):
        medusa_decoder(target, noisy_heads(target, 2), rule=Sampled(1.0), record_margins=True)


@pytest.mark.slow
@pytest.mark.parametrize("tree", list(TREES))
def test_compiled_keep_makes_the_next_draft_in_one_graph(target, tree, monkeypatch):
    """On a compiled static target (dynamo's eager backend) each step after a verification is one
    more graph (`keep_and_draft`: the accepted path's entries moved, the heads, the next tree's
    tokens): the output is `generate()`'s and every step drafts and accepts exactly what the
    uncompiled decoder does (the same candidates, best first), EOS, a one-token prompt and trees
    cut shallower by the budget included; nothing compiles after warm-up."""
    import torch._dynamo

    from drafttrain.decoding import StaticLM

    monkeypatch.setenv("DRAFTTRAIN_COMPILE_BACKEND", "eager")
    heads = noisy_heads(target, 4)
    paths = TREES[tree](4)
    compiled = medusa_decoder(StaticLM(target, max_length=96, compile=True), heads, tree=paths, eos_token_ids={22})
    compiled.warmup()
    assert compiled.drafter._keep is not None
    plain = medusa_decoder(on_engine(target, "static"), heads, tree=paths, eos_token_ids={22})
    accepted = 0
    with torch._dynamo.config.patch(error_on_recompile=True):
        for prompt in PROMPTS:
            for max_new in (MAX_NEW, 3):
                compiled.recorded, plain.recorded = [], []
                gen, ref = compiled.generate(prompt, max_new), plain.generate(prompt, max_new)
                assert gen.tokens == ref.tokens == reference(target, prompt, max_new, eos=22)
                assert gen.accepted_lengths == ref.accepted_lengths
                assert gen.proposed_lengths == ref.proposed_lengths
                assert gen.draft_forwards == ref.draft_forwards
                assert compiled.recorded == plain.recorded
                check_bookkeeping(gen, compiled.num_draft_tokens)
                accepted += sum(gen.accepted_lengths)
    assert accepted > 0


# --- sampling --------------------------------------------------------------------------------


def far_heads(target, num_heads, seed=3):
    """Heads whose distributions have nothing to do with the target's."""
    heads = MedusaHeads.from_target(target, num_heads)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for head in heads.lm_heads:
            head.weight.copy_(torch.randn(head.weight.shape, generator=g, dtype=head.weight.dtype) * 4.0)
    return heads


# A one-token prompt leaves nothing for the heads to read: its first token is sampled plainly.
@pytest.mark.slow
@pytest.mark.parametrize("engine", ["eager", "static"])
@pytest.mark.parametrize("temperature,top_p,prompt", [(1.0, 1.0, [1, 3, 1, 3, 1]), (0.8, 0.9, [3])])
def test_sampled_text_follows_target_distribution(temperature, top_p, prompt, engine, arch="llama"):
    target = tiny_causal_lm(arch, 0, vocab_size=V, sharpness=2.0)
    heads = far_heads(target, 2)
    exact = exact_two_token_distribution(target, prompt, temperature, top_p, V)
    g = torch.Generator().manual_seed(1234)
    decoder = medusa_decoder(on_engine(target, engine), heads, rule=Sampled(temperature, top_p, g))
    assert decoder.num_draft_tokens == 2
    n, counts, accepted, forwards = 2000, {}, 0, 0
    for _ in range(n):  # one seeded generator: repeated prompts must give independent samples
        gen = decoder.generate(prompt, 3)
        counts[tuple(gen.tokens[:2])] = counts.get(tuple(gen.tokens[:2]), 0) + 1
        accepted += sum(gen.accepted_lengths)
        forwards += len(gen.accepted_lengths)
        check_bookkeeping(gen, 2)
    assert chi2_pvalue(counts, exact, n) > 1e-3
    assert 0 < accepted < 2 * forwards  # some drafts accepted, some rejected: the rule was exercised
    if len(prompt) == 1:
        return
    # Power check: the first two tokens the heads draft (from the hidden state before the last
    # prompt token) are far from the target's law, so a leak of q would have failed above.
    with torch.no_grad():
        hidden = target(torch.tensor([prompt[:-1]]), output_hidden_states=True).hidden_states[-1][0, -1]
        q = probabilities(heads(hidden), temperature, top_p)
    leak = {(x, y): float(q[0, x] * q[1, y]) for x in range(V) for y in range(V) if q[0, x] * q[1, y] > 0}
    assert chi2_pvalue(counts, leak, n) < 1e-6


@pytest.mark.slow
def test_sampled_text_on_gemma3_follows_target_distribution():
    """Past a tiny Gemma-3's sliding window, on the static engine (its Gemma-3 code is drafttrain's own)."""
    test_sampled_text_follows_target_distribution(1.0, 1.0, [1, 3, 1, 3, 1], "static", arch="gemma3")


@pytest.mark.parametrize("engine", ["eager", "static"])
def test_sampling_same_seed_same_samples(engine):
    target = tiny_lm(0, vocab_size=V, sharpness=2.0)
    heads = far_heads(target, 3)

    def run():
        g = torch.Generator().manual_seed(5)
        dec = medusa_decoder(on_engine(target, engine), heads, rule=Sampled(1.0, generator=g))
        return [dec.generate([1, 2, 3], 12).tokens for _ in range(6)]

    first, second = run(), run()
    assert first == second
    assert len({tuple(t) for t in first}) > 1
    assert all(len(t) == 12 for t in first)


def test_the_recorded_steps_tell_what_a_smaller_tree_accepts(target):
    """Decoded with the whole calibrated tree, each step records its nodes best first (the tree's
    own order); the first step of the tree cut to fewer nodes or depths (the same state: right
    after prefill) accepts exactly what `accepted_within` reads off the first record."""
    calibrated = [(0,), (0, 0), (1,), (0, 0, 0), (0, 1), (2,), (1, 0), (0, 0, 1), (3,), (0, 2)]  # best first
    checked = 0
    for seed, prompt in enumerate(PROMPTS):
        text = prompt + reference(target, prompt, 12)
        heads = PlantedHeads(target, 3, text, planted_ranks(len(text), 3, seed, perfect=False), seed=seed)
        drafter = Drafter("medusa", heads, {"tree": [list(p) for p in calibrated]})
        big = build_decoder(target, drafter, DecodeSettings(num_draft_tokens=3))
        big.recorded = []
        gen = big.generate(prompt, 12)
        for step, accepted in list(zip(big.recorded, gen.accepted_lengths))[:-1]:
            assert accepted_within(step, 3, len(calibrated) + 1) == accepted
        for depth, nodes in [(1, 2), (2, 3), (3, 4), (2, 6), (3, 8)]:
            small = build_decoder(target, drafter, DecodeSettings(num_draft_tokens=depth, tree_nodes=nodes))
            assert small.drafter.max_nodes == 1 + len([p for p in calibrated if len(p) <= depth][:nodes - 1])
            first = small.generate(prompt, 12).accepted_lengths[0]
            assert first == accepted_within(big.recorded[0], depth, nodes), (prompt, depth, nodes)
            checked += first > 0
    assert checked
