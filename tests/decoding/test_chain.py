"""Greedy speculative decoding must reproduce the target's own greedy `generate()` exactly, on
every engine."""


import pytest
import torch
from engines import ENGINES, on_engine, ready
from tiny import greedy_reference, noisy_copy, tiny_gemma3, tiny_lm

from drafttrain.kinds.draft_lm.decode import DraftModelProposer
from drafttrain.kinds.ngram.decode import NgramProposer
from drafttrain.decoding import NoProposer, ChainDecoder
from drafttrain.decoding import Proposer, StaticLM
from drafttrain.errors import UserError

CPU = torch.device("cpu")
PROMPTS = [[5, 9, 13, 7, 5, 9], [40], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 3, 4, 5]]



@pytest.fixture(scope="module")
def target():
    return tiny_lm(0)


reference = greedy_reference


def proposers(target, engine="eager"):
    """Draft models run on the target's engine."""
    return {
        "none": lambda: NoProposer(CPU),
        "ngram": lambda: NgramProposer(CPU),
        "random-draft": lambda: DraftModelProposer(on_engine(tiny_lm(1), engine), 64),
        "noisy-draft": lambda: DraftModelProposer(on_engine(noisy_copy(target, scale=0.08), engine), 64),
        "self-draft": lambda: DraftModelProposer(on_engine(target, engine), 64),
    }


def decoder_for(target, kind, k, engine, **kwargs):
    return ready(ChainDecoder(on_engine(target, engine), proposers(target, engine)[kind](), num_draft_tokens=k,
                                    **kwargs), engine)


@pytest.mark.slow
@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("k", [1, 2, 4, 7])
@pytest.mark.parametrize("kind", ["none", "ngram", "random-draft", "noisy-draft", "self-draft"])
def test_greedy_equals_generate_at_length_limit(target, kind, k, engine):
    decoder = decoder_for(target, kind, k, engine)
    for prompt in PROMPTS:
        ref = reference(target, prompt, 25)
        gen = decoder.generate(prompt, 25)
        assert gen.tokens == ref
        assert len(gen.accepted_lengths) == len(gen.proposed_lengths) == len(gen.step_tokens)
        assert sum(gen.step_tokens) == len(gen.tokens)
        assert all(0 <= a <= m <= k for a, m in zip(gen.accepted_lengths, gen.proposed_lengths))


@pytest.mark.slow
@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("kind", ["none", "ngram", "noisy-draft", "self-draft"])
def test_greedy_stops_at_eos_like_generate(target, kind, k, engine):
    for prompt in PROMPTS:
        free = reference(target, prompt, 30)
        for eos in {free[3], free[11]}:  # an EOS reached early, and one inside a later step
            ref = reference(target, prompt, 30, eos=eos)
            assert ref[-1] == eos and eos not in ref[:-1]
            decoder = decoder_for(target, kind, k, engine, eos_token_ids={eos})
            assert decoder.generate(prompt, 30).tokens == ref


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("kind", ["none", "ngram", "noisy-draft"])
def test_greedy_equals_generate_on_gemma3(kind, engine):
    """A Gemma-3 target and draft (sliding and global layers, a 4-token window every prompt runs
    past): rollbacks of every size across the window stay exact."""
    target = tiny_gemma3(0)
    decoder = decoder_for(target, kind, 3, engine)
    accepted = []
    for prompt in PROMPTS:
        gen = decoder.generate(prompt, 30)
        assert gen.tokens == reference(target, prompt, 30)
        accepted += gen.accepted_lengths
    if kind == "noisy-draft":
        assert {0, 3} <= set(accepted) and any(0 < a < 3 for a in accepted)


@pytest.mark.parametrize("engine", ENGINES)
def test_self_draft_accepts_everything(target, engine):
    decoder = decoder_for(target, "self-draft", 4, engine)
    gen = decoder.generate(PROMPTS[0], 21)  # 4 full steps of 5 tokens, then a last step of 1
    assert gen.accepted_lengths == [4, 4, 4, 4, 0]
    assert gen.proposed_lengths == [4, 4, 4, 4, 0]


@pytest.mark.parametrize("engine", ENGINES)
def test_plain_decoding_is_one_token_per_forward(target, engine):
    gen = decoder_for(target, "none", 5, engine).generate(PROMPTS[0], 12)
    assert gen.step_tokens == [1] * 12 and gen.accepted_lengths == [0] * 12


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_static_float32_and_float64_equal_generate(dtype):
    """Greedy on the static engine equals `generate()` in the model's own dtype."""
    model = tiny_lm(0, dtype=dtype)
    for kind, k in [("none", 0), ("ngram", 3), ("noisy-draft", 4)]:
        decoder = decoder_for(model, kind, k, "static-bucket")
        for prompt in PROMPTS:
            assert decoder.generate(prompt, 25).tokens == reference(model, prompt, 25)


def test_the_length_limit_is_a_clear_error(target):
    prompt = PROMPTS[2]  # 13 tokens: 12 prefilled, then 25 steps of up to 4 tokens
    fits = ChainDecoder(StaticLM(target, max_length=len(prompt) + 25 + 3 + 1), NgramProposer(CPU),
                              num_draft_tokens=3)
    assert fits.generate(prompt, 25).tokens == reference(target, prompt, 25)
    short = ChainDecoder(StaticLM(target, max_length=30), NgramProposer(CPU), num_draft_tokens=3)
    with pytest.raises(UserError, match="holds at most 30 tokens.*larger max_length"):
        short.generate(prompt, 25)


def test_padded_draft_vocabulary(target):
    """A draft with extra (never used) embedding rows still decodes losslessly."""
    draft = noisy_copy(target, scale=0.08)
    draft.resize_token_embeddings(80)
    with torch.no_grad():
        draft.lm_head.weight[64:] = 100.0  # would win every argmax if not masked off
    decoder = ChainDecoder(target, DraftModelProposer(draft, 64), num_draft_tokens=3)
    gen = decoder.generate(PROMPTS[0], 20)
    assert gen.tokens == reference(target, PROMPTS[0], 20)
    assert sum(gen.accepted_lengths) > 0


def test_ngram_lookup_continues_latest_match():
    from drafttrain.kinds.ngram.decode import ngram_lookup

    seq = [1, 2, 3, 9, 1, 2, 3, 4, 5, 1, 2, 3]
    assert ngram_lookup(seq, 3, max_ngram=3) == [4, 5, 1]  # latest occurrence of (1,2,3)
    assert ngram_lookup([7, 8, 9], 2) == []
    assert ngram_lookup([5, 6, 5], 2, max_ngram=3) == [6, 5]
    assert ngram_lookup(seq, 0) == []


@pytest.mark.parametrize("engine", ["eager", "static"])
@pytest.mark.parametrize("k", [2, 4])
def test_self_draft_acceptance_is_one_when_eos_ends_the_text(target, k, engine):
    """Drafts proposed past the EOS that ended the generation are not counted as proposed."""
    prompt = PROMPTS[0]
    free = reference(target, prompt, 30)
    for eos in {free[2], free[6], free[9]}:
        decoder = decoder_for(target, "self-draft", k, engine, eos_token_ids={eos})
        gen = decoder.generate(prompt, 30)
        assert gen.tokens == reference(target, prompt, 30, eos=eos)
        assert sum(gen.accepted_lengths) == sum(gen.proposed_lengths)


def test_counted_proposals_by_hand():
    from drafttrain.decoding.loop import counted_proposals

    eos = {9}
    assert counted_proposals(4, [1, 2, 3, 4, 5], eos) == 4  # no EOS: all count
    assert counted_proposals(4, [1, 9], eos) == 2            # EOS accepted as draft 2: drafts 3, 4 past the end
    assert counted_proposals(4, [9], eos) == 1               # the target's EOS rejected draft 1
    assert counted_proposals(0, [9], eos) == 0               # plain decoding proposes nothing


@pytest.mark.parametrize("engine", ENGINES)
def test_recorded_margins_are_the_targets_top2_gap(target, engine):
    """Each emitted token's margin equals top-1 minus top-2 of a full forward over its prefix."""
    prompt = PROMPTS[2]
    decoder = decoder_for(target, "ngram", 3, engine, record_margins=True)
    gen = decoder.generate(prompt, 14)
    assert len(gen.margins) == len(gen.tokens) == 14
    for i in range(len(gen.tokens)):
        with torch.no_grad():
            logits = target(torch.tensor([prompt + gen.tokens[:i]])).logits[0, -1]
        top2 = logits.topk(2).values
        assert gen.margins[i] == pytest.approx(float(top2[0] - top2[1]), abs=1e-9)
    assert ChainDecoder(target, NoProposer(CPU), num_draft_tokens=3).generate(prompt, 4).margins is None


class RecordingProposer(Proposer):
    """N-gram drafts, and a record of the target hidden states the decoder hands over."""

    name = "recording"

    def __init__(self, layers):
        self.hidden_layers = tuple(layers)
        self.rows = []

    def reset(self, prompt, hidden=None):
        self.rows = [] if hidden is None else [hidden]

    def propose(self, k, sequence):
        return NgramProposer(CPU).propose(k, sequence)

    def commit(self, n_accepted, emitted, hidden=None):
        assert hidden.shape[0] == n_accepted + 1
        self.rows.append(hidden)


@pytest.mark.parametrize("engine", ["eager", "static"])
@pytest.mark.parametrize("layers", [(2,), (0, 1, 2)])
def test_hidden_states_reach_the_proposer(target, engine, layers):
    """Over a generation the proposer receives the target's hidden states of every cached
    position exactly once, in order: those of a full forward over the final text."""
    for prompt in PROMPTS:
        proposer = RecordingProposer(layers)
        gen = ChainDecoder(on_engine(target, engine), proposer, num_draft_tokens=3).generate(prompt, 20)
        text = prompt + gen.tokens
        got = torch.cat(proposer.rows) if proposer.rows else torch.empty(0)
        with torch.no_grad():
            states = target(torch.tensor([text]), output_hidden_states=True).hidden_states
        want = torch.cat([states[i][0, :len(text) - 1] for i in layers], dim=-1)  # the last token is never cached
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=0, atol=1e-10)
