"""`+ngram`: a draft LM's chain and n-gram lookup's verified as one two-branch tree. Greedy
output equals generate() in float64 on every engine, for sequential and parallel drafts; the
tree shares the branches' common prefix; a step keeps whichever branch the target agrees with
further, so tau is at least each part's on copy-heavy text."""

from __future__ import annotations

import pytest
from engines import ENGINES, on_engine, ready
from tiny import greedy_reference, noisy_copy, tiny_lm

from drafttrain.decoding import DecodeSettings, Drafter, build_decoder
from drafttrain.decoding.drafters.hybrid import two_branch_tree

MASK = 9
# the second and third repeat themselves, as code re-emitting its prompt does
PROMPTS = [[5, 9, 13, 7, 5, 9], [3, 4, 5, 6, 7, 8, 3, 4, 5, 6, 7, 8, 3, 4], [40, 41, 42, 40, 41, 42, 40]]


def test_two_branches_share_their_common_prefix():
    assert two_branch_tree([7, 8, 9], [7, 8, 5, 6]) == ([7, 8, 9, 5, 6], [-1, 0, 1, 2, 2, 4])
    assert two_branch_tree([7, 8], [1, 2]) == ([7, 8, 1, 2], [-1, 0, 1, 0, 3])
    assert two_branch_tree([7, 8], []) == ([7, 8], [-1, 0, 1])
    assert two_branch_tree([], [4]) == ([4], [-1, 0])
    assert two_branch_tree([7, 8], [7, 8]) == ([7, 8], [-1, 0, 1])


def drafter(kind, model, engine):
    info = {"pard_token": MASK, "parallel_tokens": 4} if kind == "parallel_draft" else {}
    return Drafter(kind, on_engine(model, engine), info)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("kind", ["draft", "parallel_draft"])
@pytest.mark.parametrize("k", [1, 3])
def test_greedy_equals_generate(engine, kind, k):
    target = tiny_lm(0)
    draft = noisy_copy(target) if kind == "draft" else tiny_lm(1)
    settings = DecodeSettings(num_draft_tokens=k, ngram_hybrid=True)
    decoder = ready(build_decoder(on_engine(target, engine), drafter(kind, draft, engine), settings), engine)
    assert decoder.num_tree_nodes == 2 * k + 1
    for prompt in PROMPTS:
        gen = decoder.generate(prompt, 25)
        assert gen.tokens == greedy_reference(target, prompt, 25)
        assert all(a <= k for a in gen.accepted_lengths)
    eos = greedy_reference(target, PROMPTS[0], 30)[7]
    with_eos = build_decoder(on_engine(target, engine), drafter(kind, draft, engine),
                             DecodeSettings(num_draft_tokens=k, ngram_hybrid=True, eos_token_ids=frozenset({eos})))
    assert with_eos.generate(PROMPTS[0], 30).tokens == greedy_reference(target, PROMPTS[0], 30, eos=eos)


def test_the_hybrid_accepts_at_least_what_each_part_does():
    """Greedy: the hybrid's tree holds each part's chain, so per step it accepts the longer of the
    two; over a generation its tau is at least either part's alone (here on self-repeating text)."""
    target = tiny_lm(0)
    draft = noisy_copy(target, scale=0.6)
    taus = {}
    for name, kind, hybrid in (("draft", "draft", False), ("ngram", "ngram", False), ("hybrid", "draft", True)):
        model = None if kind == "ngram" else draft
        decoder = build_decoder(target, Drafter(kind, model), DecodeSettings(num_draft_tokens=3, ngram_hybrid=hybrid))
        gens = [decoder.generate(p, 40) for p in PROMPTS]
        taus[name] = sum(len(g.tokens) for g in gens) / sum(len(g.accepted_lengths) for g in gens)
    assert taus["hybrid"] >= max(taus["draft"], taus["ngram"]) - 1e-9, taus
    assert taus["hybrid"] > min(taus["draft"], taus["ngram"]), taus


def test_hybrids_refuse_what_they_cannot_verify():
    target = tiny_lm(0)
    with pytest.raises(ValueError, match="greedy"):
        build_decoder(target, Drafter("draft", noisy_copy(target)),
                      DecodeSettings(ngram_hybrid=True, temperature=0.5))
    with pytest.raises(ValueError, match="ngram"):
        build_decoder(target, Drafter("ngram"), DecodeSettings(ngram_hybrid=True))
