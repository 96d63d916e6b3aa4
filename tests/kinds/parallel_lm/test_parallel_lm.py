"""Parallel draft LMs on every engine: each step's drafts equal a plain forward over [sequence,
masks] (the cache keeps real tokens only), one draft forward per step, greedy output equal to
generate() in float64, sampled output following the target's law (chi-square, with power)."""

from __future__ import annotations

import pytest
import torch
from engines import ENGINES, on_engine, ready
from sampling_reference import V, chi2_pvalue, exact_two_token_distribution
from tiny import greedy_reference, tiny_causal_lm, tiny_lm

from drafttrain.decoding import ChainDecoder, DecodeSettings
from drafttrain.kinds.base import Drafter
from drafttrain.kinds.factory import build_decoder
from drafttrain.kinds.parallel_lm.decode import ParallelDraftProposer
from drafttrain.decoding.verify import Sampled

MASK = 9
PROMPTS = [[5, 9, 13, 7, 5, 9], [40], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 3, 4, 5]]


def parallel(model, engine, k=4, vocab=64):
    return ParallelDraftProposer(on_engine(model, engine), vocab, MASK, parallel_tokens=k)


@pytest.mark.parametrize("engine", ENGINES)
def test_each_step_drafts_what_a_plain_forward_over_sequence_and_masks_gives(engine):
    """The cache must hold the real tokens only: masks rolled back, drafts never fed as tokens."""
    draft = tiny_lm(1)
    proposer = parallel(draft, engine)
    proposer.lm.warmup(list(range(4, 8))) if engine == "static-bucket" else None
    sequence = list(PROMPTS[0])
    proposer.reset(sequence)
    for emitted in ([21, 22], [23], [24, 25, 26, 27], [28]):
        drafts, q = proposer.propose(4, sequence)
        with torch.no_grad():
            ref = draft(input_ids=torch.tensor([sequence + [MASK] * 3])).logits[0, -4:].argmax(-1)
        assert drafts.tolist() == ref.tolist() and q is None
        proposer.commit(len(emitted) - 1, emitted)
        sequence += emitted
    assert proposer.forwards == 4


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("k", [2, 3, 4])
def test_greedy_equals_generate(engine, k):
    target, draft = tiny_lm(0), tiny_lm(1)
    decoder = ready(ChainDecoder(on_engine(target, engine), parallel(draft, engine, k), num_draft_tokens=k), engine)
    for prompt in PROMPTS:
        gen = decoder.generate(prompt, 25)
        assert gen.tokens == greedy_reference(target, prompt, 25)
        # one draft forward per step that drafts (a step with one token left drafts nothing)
        left = [25 - sum(gen.step_tokens[:i]) for i in range(len(gen.step_tokens))]
        assert gen.draft_forwards == sum(n >= 2 for n in left)
        free = greedy_reference(target, prompt, 30)
        eos = free[7]
        decoder_eos = ChainDecoder(on_engine(target, engine), parallel(draft, engine, k), num_draft_tokens=k,
                                   eos_token_ids={eos})
        assert decoder_eos.generate(prompt, 30).tokens == greedy_reference(target, prompt, 30, eos=eos)


def test_the_factory_builds_it_from_the_drafter_info():
    target, draft = tiny_lm(0), tiny_lm(1)
    decoder = build_decoder(target, Drafter("parallel_draft", draft, {"pard_token": MASK, "parallel_tokens": 3}),
                            DecodeSettings(num_draft_tokens=3))
    assert isinstance(decoder.proposer, ParallelDraftProposer) and decoder.proposer.mask_id == MASK
    assert decoder.generate(PROMPTS[2], 12).tokens == greedy_reference(target, PROMPTS[2], 12)


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["eager", "static"])
def test_sampled_text_follows_target_distribution(engine, arch="llama"):
    target = tiny_causal_lm(arch, 0, vocab_size=V, sharpness=2.0)
    far_draft = tiny_causal_lm(arch, 3, vocab_size=V, sharpness=6.0)
    prompt = [1, 3, 1, 3, 1]
    exact = exact_two_token_distribution(target, prompt, 1.0, 1.0, V)
    g = torch.Generator().manual_seed(99)
    rule = Sampled(1.0, 1.0, g)
    proposer = ParallelDraftProposer(on_engine(far_draft, engine), V, 5, rule, parallel_tokens=3)
    decoder = ChainDecoder(on_engine(target, engine), proposer, num_draft_tokens=3, rule=rule)
    n, counts, accepted = 2000, {}, 0
    for _ in range(n):
        gen = decoder.generate(prompt, 3)
        counts[tuple(gen.tokens[:2])] = counts.get(tuple(gen.tokens[:2]), 0) + 1
        accepted += sum(gen.accepted_lengths)
    assert chi2_pvalue(counts, exact, n) > 1e-3
    assert accepted > 0
    # Power: the draft's first-position law is far from the target's, so a leak would be caught.
    leak = exact_two_token_distribution(far_draft, prompt, 1.0, 1.0, V)
    assert chi2_pvalue(counts, leak, n) < 1e-6


@pytest.mark.slow
def test_sampled_text_on_gemma3_follows_target_distribution():
    """Past a tiny Gemma-3's sliding window, on the static engine (its Gemma-3 code is drafttrain's own)."""
    test_sampled_text_follows_target_distribution("static", arch="gemma3")
