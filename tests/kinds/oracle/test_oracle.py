"""The oracle proposer gives i.i.d. per-token acceptance alpha: accepted lengths follow the
truncated geometric law behind Leviathan's formula, and the output is still plain greedy."""

from __future__ import annotations

import pytest
import torch
from engines import on_engine
from sampling_reference import chi2_pvalue
from tiny import greedy_reference, tiny_lm

from drafttrain.kinds.oracle.decode import OracleProposer
from drafttrain.decoding import ChainDecoder

K = 4
MAX_NEW = 240
PROMPTS = [[5, 9, 13, 7], [40], [3, 4, 5, 6, 7], [11, 2, 60], [8, 8, 8], [21, 33]]


def truncated_geometric(alpha: float, k: int) -> dict:
    """P(accepted = j) when each draft is accepted independently with probability alpha."""
    law = {(j,): alpha ** j * (1 - alpha) for j in range(k)}
    law[(k,)] = alpha ** k
    return law


@pytest.fixture(scope="module")
def target():
    return tiny_lm(0)


@pytest.fixture(scope="module")
def references(target):
    return {tuple(p): greedy_reference(target, p, MAX_NEW) for p in PROMPTS}


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["eager", "static"])
@pytest.mark.parametrize("alpha", [0.3, 0.8])
def test_acceptance_is_iid_alpha(target, references, alpha, engine):
    oracle = OracleProposer(references, alpha, vocab_size=64, device="cpu", seed=11)
    decoder = ChainDecoder(on_engine(target, engine, max_length=256), oracle, num_draft_tokens=K)
    counts, accepted, tried = {}, 0, 0
    for prompt in PROMPTS:
        gen = decoder.generate(prompt, MAX_NEW)
        assert gen.tokens == references[tuple(prompt)]  # still exactly plain greedy
        for a, m in zip(gen.accepted_lengths, gen.proposed_lengths):
            accepted += a
            tried += a + (a < m)  # drafts the target looked at: the accepted ones and the first rejected
            if m == K:
                counts[(a,)] = counts.get((a,), 0) + 1
    n = sum(counts.values())
    assert n > 350
    assert chi2_pvalue(counts, truncated_geometric(alpha, K), n) > 1e-3
    # Per-token acceptance: a binomial estimate of alpha.
    assert abs(accepted / tried - alpha) < 4 * (alpha * (1 - alpha) / tried) ** 0.5
    # Power: the same counts reject a law 0.1 away.
    assert chi2_pvalue(counts, truncated_geometric(alpha - 0.1, K), n) < 1e-4


def test_alpha_one_accepts_everything_and_zero_nothing(target, references):
    prompt = PROMPTS[0]
    full = ChainDecoder(target, OracleProposer(references, 1.0, 64, "cpu"), num_draft_tokens=K).generate(prompt, 21)
    assert full.accepted_lengths == [4, 4, 4, 4, 0]
    none = ChainDecoder(target, OracleProposer(references, 0.0, 64, "cpu"), num_draft_tokens=K).generate(prompt, 9)
    assert none.accepted_lengths == [0] * 9
    assert none.proposed_lengths == [min(K, 9 - i - 1) for i in range(9)]  # never drafting past the budget
    assert none.tokens == references[tuple(prompt)][:9]


def test_oracle_input_checks(references):
    with pytest.raises(ValueError, match="alpha"):
        OracleProposer(references, 1.5, 64, "cpu")
    with pytest.raises(ValueError, match="vocabulary"):
        OracleProposer(references, 0.5, 1, "cpu")
    with pytest.raises(KeyError, match="decode it plainly first"):
        OracleProposer(references, 0.5, 64, "cpu").reset([1, 2, 3, 4, 5, 6, 7])
    a = OracleProposer(references, 0.5, 64, "cpu", seed=3)
    b = OracleProposer(references, 0.5, 64, "cpu", seed=3)
    a.reset(PROMPTS[0])
    b.reset(PROMPTS[0])
    draft = a.propose(K, PROMPTS[0])[0]
    assert torch.equal(draft, b.propose(K, PROMPTS[0])[0])  # seeded
