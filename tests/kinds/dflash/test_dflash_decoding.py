"""DFlash decoding is lossless (greedy: the target's own greedy output in float64, on every engine and
with its lookup hybrids; sampled: the target's distribution, chi-square against the exact one with a
power check), its decode path computes what its training forward computes, and its block sees what
DFlash says it sees."""

from __future__ import annotations

import math

import pytest
import torch
from dflash_helpers import EOS, target_hidden_states, tiny_draft, tiny_target
from engines import ENGINES, on_engine, ready
from sampling_reference import chi2_pvalue, exact_two_token_distribution

from drafttrain.decoding import DecodeSettings
from drafttrain.kinds.base import Drafter
from drafttrain.kinds.dflash.decode import DFlashRuntime, block_logits
from drafttrain.kinds.factory import build_decoder
from tiny import greedy_reference, tiny_causal_lm

PROMPTS = [[5, 9, 13, 7, 5, 9], [40, 41], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 3, 4, 5]]


def decoder_of(target, draft, engine: str, k: int, **settings):
    return ready(build_decoder(on_engine(target, engine), Drafter("dflash", draft),
                               DecodeSettings(num_draft_tokens=k, **settings)), engine)


def assert_greedy_equal(target, decoder, k: int) -> int:
    """Every prompt's output equals the target's greedy one, with and without EOS; returns drafts accepted."""
    accepted = 0
    for prompt in PROMPTS:
        for eos in (None, EOS):
            decoder.eos = {eos} if eos is not None else set()
            gen = decoder.generate(prompt, 20)
            assert gen.tokens == greedy_reference(target, prompt, 20, eos=eos)
            assert sum(gen.step_tokens) == len(gen.tokens)
            assert all(0 <= a <= m <= k for a, m in zip(gen.accepted_lengths, gen.proposed_lengths))
            accepted += sum(gen.accepted_lengths)
    return accepted


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("k", [1, 4])
def test_greedy_equals_generate(trained_pair, engine, k):
    target, draft = trained_pair
    decoder = decoder_of(target, draft, engine, k)
    assert decoder.proposer.runtime.engine == ("eager" if engine == "eager" else "static")  # it follows the target
    assert assert_greedy_equal(target, decoder, k) > 0  # drafts were really accepted: accept/commit paths ran


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("lookup", ["ngram", "suffix"])
@pytest.mark.parametrize("lookup_first", [False, True])
def test_greedy_hybrids_equal_generate(trained_pair, engine, lookup, lookup_first):
    target, draft = trained_pair
    decoder = decoder_of(target, draft, engine, 3, hybrid=lookup, lookup_first=lookup_first)
    assert assert_greedy_equal(target, decoder, 3 if lookup_first else 2 * 3) > 0


@pytest.mark.parametrize("engine", ENGINES)
def test_greedy_equals_generate_on_gemma3(engine):
    target = tiny_target(seed=5, arch="gemma3")
    assert_greedy_equal(target, decoder_of(target, tiny_draft(target, scale=0.5), engine, 3), 3)


def test_the_static_engine_drafts_what_the_eager_one_does(trained_pair):
    target, draft = trained_pair
    runs = {engine: decoder_of(target, draft, engine, 4).generate(PROMPTS[2], 24) for engine in ("eager", "static")}
    assert runs["eager"].accepted_lengths == runs["static"].accepted_lengths


def test_one_token_prompt_drafts_nothing_first(trained_pair):
    target, draft = trained_pair
    gen = decoder_of(target, draft, "eager", 3).generate([7], 8)
    assert gen.tokens == greedy_reference(target, [7], 8) and gen.proposed_lengths[0] == 0


def test_the_decode_path_computes_the_training_forward(trained_pair):
    """The cache path (context fed entry by entry, the block drafted after it) against the training
    forward's block at the same anchor, with a block of K + 1 slots as decoding runs it."""
    target, draft = trained_pair
    ids = torch.tensor([[5, 9, 13, 7, 5, 9, 21, 30, 11]])
    hs = target_hidden_states(target, ids)
    features = draft.target_features(hs)
    for anchor, k in ((4, 3), (8, 2), (1, 4)):
        trained = draft(features, ids, torch.tensor([[anchor]]), position_ids=torch.arange(9)[None],
                        attention_mask=torch.ones_like(ids), size=k + 1)[0, 0]
        runtime = DFlashRuntime(draft)
        runtime.feed(features[0, :anchor], ids[0, 1:anchor + 1].tolist(), 0)
        decoded = block_logits(draft, runtime.cache, ids[0, anchor:anchor + 1], anchor, k)
        torch.testing.assert_close(decoded, trained)


def test_a_block_sees_the_context_before_its_anchor_and_its_whole_block(trained_pair):
    """Changing the features at or after the anchor changes nothing; changing one before it does; a
    non-causal block's first slot reads the slots after it, a causal one's does not."""
    target, draft = trained_pair
    ids = torch.tensor([[5, 9, 13, 7, 5, 9, 21, 30]])
    features = draft.target_features(target_hidden_states(target, ids))
    anchor = torch.tensor([[5]])
    kw = dict(position_ids=torch.arange(8)[None], attention_mask=torch.ones_like(ids))
    base = draft(features, ids, anchor, **kw)
    later, earlier = features.clone(), features.clone()
    later[0, 5:] += 3.0
    earlier[0, 2] += 3.0
    torch.testing.assert_close(draft(later, ids, anchor, **kw), base)
    assert not torch.allclose(draft(earlier, ids, anchor, **kw), base)
    try:
        for causal in (False, True):
            draft.config.causal = causal
            full, shorter = draft(features, ids, anchor, **kw), draft(features, ids, anchor, size=2, **kw)
            assert torch.allclose(shorter[0, 0, 0], full[0, 0, 0]) == causal  # slot 1 without the slots after it
    finally:
        draft.config.causal = False


# -- sampling -------------------------------------------------------------------------------------

V = 6


@pytest.mark.slow
@pytest.mark.parametrize("temperature,top_p,arch", [(1.0, 1.0, "llama"), (0.8, 0.9, "gemma3")])
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
    decoder = build_decoder(target, Drafter("dflash", draft),
                            DecodeSettings(num_draft_tokens=3, temperature=temperature, top_p=top_p, generator=g))
    n, counts, accepted = 2000, {}, 0
    for _ in range(n):
        gen = decoder.generate(prompt, 3)
        key = tuple(gen.tokens[:2])
        counts[key] = counts.get(key, 0) + 1
        accepted += sum(gen.accepted_lengths)
    assert chi2_pvalue(counts, exact, n) > 1e-3
    assert accepted > 0
    # Power check: the draft never proposes `outside` tokens, so a decoder that let its drafts through
    # unjudged would never emit them first; this one emits them as often as the target does.
    first = {x: sum(c for (a, _), c in counts.items() if a == x) for x in range(V)}
    assert sum(first[x] for x in outside) / n == pytest.approx(sum(p for (x, _), p in exact.items() if x in outside),
                                                               abs=4 / math.sqrt(n))
