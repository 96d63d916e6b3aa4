"""Suffix lookup (`drafters/suffix.py`): the trie's continuation, and lossless decoding with it:
the target's own greedy output in float64 on every engine, alone and hung from a draft LM's
chain (+suffix), and the target's sampling distribution exactly (chi-square)."""

import pytest
import torch
from engines import ENGINES, on_engine, ready
from sampling_reference import V, chi2_pvalue, exact_two_token_distribution, sample_first_two
from tiny import greedy_reference, noisy_copy, tiny_lm

from drafttrain.decoding import DecodeSettings
from drafttrain.kinds.base import Drafter
from drafttrain.kinds.factory import build_decoder
from drafttrain.kinds.suffix.decode import SuffixProposer, SuffixTrie

# the second and third repeat themselves, as code re-emitting its prompt does
PROMPTS = [[5, 9, 13, 7, 5, 9], [3, 4, 5, 6, 7, 8, 3, 4, 5, 6, 7, 8, 3, 4], [40]]


def trie(tokens, depth=24):
    t = SuffixTrie(depth)
    t.extend(tokens)
    return t


def test_the_most_frequent_continuation_of_the_longest_match_wins():
    # after (1, 2): 3 twice, 4 once; the latest is 4, but 3 is more frequent
    assert trie([1, 2, 3, 9, 1, 2, 3, 8, 1, 2, 4, 7, 1, 2]).lookup(1) == [3]
    # (7, 1, 2) matched once: its continuation 4 beats the frequent 3 of the shorter match (1, 2)
    assert trie([1, 2, 3, 9, 1, 2, 3, 8, 7, 1, 2, 4, 6, 6, 7, 1, 2]).lookup(1) == [4]


def test_drafts_at_most_the_matched_length_and_k_and_stop_at_improbable_tokens():
    text = [1, 2, 3, 4, 5, 6, 7, 8, 1, 2]
    assert trie(text).lookup(8) == [3, 4]              # spec factor 1: two tokens matched, two drafted
    assert trie(text).lookup(1) == [3]
    assert trie(text).lookup(8, spec_factor=3.0) == [3, 4, 5, 6, 7, 8]
    assert trie(text).lookup(8, spec_factor=3.0, min_prob=0.6) == []  # a match seen once before: p = 1/2
    assert trie([1, 2, 3]).lookup(4) == [] and trie([]).lookup(4) == []


def test_a_trie_grown_token_by_token_equals_one_built_at_once():
    text = [t % 5 for t in range(0, 60, 3)] * 2
    proposer = SuffixProposer("cpu", max_depth=4)
    proposer.reset(text[:5])
    for n in range(5, len(text)):
        assert proposer.lookup(3, text[:n]) == trie(text[:n], depth=4).lookup(3)
    proposer.lookup(3, [1, 2])  # a shorter text: another sequence, started anew
    assert proposer.trie.length == 2


@pytest.fixture(scope="module")
def target():
    return tiny_lm(0)


def check_greedy(target, decoder, k):
    for prompt in PROMPTS:
        gen = decoder.generate(prompt, 30)
        assert gen.tokens == greedy_reference(target, prompt, 30)
        assert all(0 <= a <= m <= k for a, m in zip(gen.accepted_lengths, gen.proposed_lengths))
    return gen


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("k", [1, 3, 6])
def test_greedy_equals_generate(target, engine, k):
    decoder = ready(build_decoder(on_engine(target, engine), Drafter("suffix"), DecodeSettings(num_draft_tokens=k)),
                    engine)
    check_greedy(target, decoder, k)
    assert decoder.tree_name is None


@pytest.mark.parametrize("engine", ENGINES)
def test_greedy_stops_at_eos_like_generate(target, engine):
    for prompt in PROMPTS[:2]:
        eos = greedy_reference(target, prompt, 30)[9]
        decoder = build_decoder(on_engine(target, engine), Drafter("suffix"),
                                DecodeSettings(num_draft_tokens=3, eos_token_ids=frozenset({eos})))
        assert decoder.generate(prompt, 30).tokens == greedy_reference(target, prompt, 30, eos=eos)


def test_suffix_lookup_drafts_what_the_text_repeats(target):
    gens = [build_decoder(target, Drafter("suffix"), DecodeSettings(num_draft_tokens=4)).generate(p, 40)
            for p in PROMPTS]
    assert sum(sum(g.accepted_lengths) for g in gens) > 0


@pytest.mark.parametrize("engine", ENGINES)
def test_suffix_hung_from_a_draft_lm_equals_generate(target, engine):
    draft = Drafter("draft", on_engine(noisy_copy(target, scale=0.6), engine))
    decoder = build_decoder(on_engine(target, engine), draft, DecodeSettings(num_draft_tokens=3, hybrid="suffix"))
    check_greedy(target, ready(decoder, engine), 3)
    assert decoder.tree_name == "model chain + suffix chain (up to 3 nodes)"
    assert decoder.drafter.lookup_nodes > 0


def test_suffix_is_no_model_drafter_to_hang_a_lookup_from(target):
    with pytest.raises(ValueError, match="greedy only"):
        build_decoder(target, Drafter("suffix"), DecodeSettings(hybrid="ngram"))


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["eager", "static"])
def test_sampled_text_follows_target_distribution(engine):
    target = tiny_lm(0, vocab_size=V, sharpness=2.0)
    prompt = [1, 3, 1, 3, 1]  # repetitive, so suffix lookup proposes too
    exact = exact_two_token_distribution(target, prompt, 1.0, 1.0, V)
    g = torch.Generator().manual_seed(1234)
    decoder = build_decoder(on_engine(target, engine), Drafter("suffix"),
                            DecodeSettings(num_draft_tokens=3, temperature=1.0, generator=g))
    n = 2000
    counts, accepted = sample_first_two(decoder, prompt, n)
    assert chi2_pvalue(counts, exact, n) > 1e-3
    assert accepted > 0  # drafts were really accepted, so the rule was exercised
