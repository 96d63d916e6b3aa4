"""`TeacherForcedLM`: a greedy decode against the target's own continuation and hidden states
takes every step the decode against the target takes. The reference is the real decode, on the
real target (float64): the same tokens, the same accepted and proposed lengths, and for tree
drafters the same recorded candidates and verdicts (`planning.TreeStep`), for every drafter kind
that reads the target (EAGLE-3 trees and chains, Medusa heads, DFlash blocks, a draft LM) and
hybrids."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from tiny import greedy_reference, noisy_copy, tiny_lm

from drafttrain.decoding import DecodeSettings, TreeDecoder
from drafttrain.decoding.engines.teacher import TeacherForcedLM, teacher_forced
from drafttrain.kinds.base import Drafter
from drafttrain.kinds.factory import build_decoder

KINDS_TESTS = Path(__file__).resolve().parents[2] / "kinds"
sys.path[:0] = [str(KINDS_TESTS / "eagle3"), str(KINDS_TESTS / "medusa"), str(KINDS_TESTS / "dflash")]
import dflash_helpers  # noqa: E402
from eagle3_helpers import EOS, trained_pair  # noqa: E402
from test_medusa_decoding import noisy_heads  # noqa: E402

PROMPTS = [[5, 9, 13, 7, 5, 9], [3, 4, 5, 6, 7, 8, 3, 4, 5, 6, 7, 8, 3, 4], [40, 41, 42, 40, 41, 42, 40]]
MAX_NEW = 20
CASES = {  # name -> (which target, drafter kind, settings)
    "eagle3 dynamic tree": ("eagle3", "eagle3", dict(num_draft_tokens=4, tree="dynamic", tree_nodes=12, tree_topk=3)),
    "eagle3 tree + ngram": ("eagle3", "eagle3", dict(num_draft_tokens=4, tree="dynamic", tree_nodes=6, tree_topk=2,
                                                     hybrid="ngram")),
    "eagle3 chain": ("eagle3", "eagle3", dict(num_draft_tokens=3, tree="chain")),
    "medusa tree": ("plain", "medusa", dict(num_draft_tokens=3, tree="default")),
    "draft LM chain": ("plain", "draft", dict(num_draft_tokens=3)),
    "dflash block": ("dflash", "dflash", dict(num_draft_tokens=3)),
    "dflash block + ngram": ("dflash", "dflash", dict(num_draft_tokens=3, hybrid="ngram")),
}


@pytest.fixture(scope="module")
def pairs():
    eagle3_target, draft = trained_pair()
    target = tiny_lm(0)
    dflash_target = dflash_helpers.tiny_target(seed=2)
    return {"eagle3": (eagle3_target, draft), "plain": (target, None),
            "dflash": (dflash_target, dflash_helpers.tiny_draft(dflash_target))}


def drafter_of(kind, target, draft):
    model = {"eagle3": draft, "dflash": draft, "medusa": noisy_heads(target, 3) if kind == "medusa" else None,
             "draft": noisy_copy(target, scale=0.6)}[kind]
    return Drafter(kind, model)


def decode(target, drafter, settings, prompt):
    decoder = build_decoder(target, drafter, settings)
    if isinstance(decoder, TreeDecoder):
        decoder.recorded = []
    gen = decoder.generate(prompt, MAX_NEW)
    return gen, getattr(decoder, "recorded", None)


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_teacher_forced_decode_takes_the_targets_own_steps(pairs, case):
    which, kind, flags = CASES[case]
    target, draft = pairs[which]
    drafter = drafter_of(kind, target, draft)
    settings = DecodeSettings(eos_token_ids=frozenset({EOS}), **flags)
    layers = tuple(build_decoder(target, drafter, settings).hidden_layers)
    for prompt in PROMPTS:
        real, recorded = decode(target, drafter, settings, prompt)
        assert real.tokens == greedy_reference(target, prompt, MAX_NEW, eos=EOS)
        replay = teacher_forced(target, prompt + real.tokens, layers)
        again, rerecorded = decode(replay, drafter, settings, prompt)
        assert again.tokens == real.tokens
        assert again.accepted_lengths == real.accepted_lengths and again.proposed_lengths == real.proposed_lengths
        assert rerecorded == recorded


def test_rows_off_the_sequence_are_never_accepted():
    """A tree whose second level leaves the sequence: its child holds the token the sequence has
    there, yet is not accepted (its parent was not), and the bonus is the sequence's next token."""
    from drafttrain.decoding.verify import greedy_tree_verdict
    from drafttrain.trees import tree_from_parents

    target = tiny_lm(0)
    sequence = [5, 9, 13, 7, 11, 12]
    lm = TeacherForcedLM(target, sequence)
    lm.length = 2  # 5 9 cached; pending 13
    tree = tree_from_parents([-1, 0, 0, 2])  # 13 -> 7 (on it), 13 -> 8 (off it) -> 11
    tokens = torch.tensor([13, 7, 8, 11])
    logits, _ = lm.forward(tokens, tree=tree)
    verdict = greedy_tree_verdict(logits.argmax(dim=-1), tokens, tree)
    assert int(verdict[0]) == 1 and int(logits.argmax()[1]) == 11  # 7 accepted, bonus 11
    assert lm.length == 6
    lm.compact(2, [0, 1])
    assert lm.length == 4


def test_a_continuation_ended_by_eos_gives_a_token_past_its_end(pairs):
    """A decode whose continuation ends with EOS accepts the EOS and is handed a bonus token past
    the sequence: a real token (the drafter is fed it before the loop stops), and the decode against
    the continuation still takes the target's own steps."""
    target, draft = pairs["eagle3"]
    drafter = Drafter("eagle3", draft)
    settings = DecodeSettings(eos_token_ids=frozenset({EOS}), num_draft_tokens=4, tree="dynamic", tree_nodes=12,
                              tree_topk=3)
    layers = tuple(build_decoder(target, drafter, settings).hidden_layers)
    ended = 0
    for start in range(3, 40):
        prompt = [start, start + 1, start + 2]
        real, recorded = decode(target, drafter, settings, prompt)
        if not real.tokens or real.tokens[-1] != EOS:
            continue
        ended += 1
        again, rerecorded = decode(teacher_forced(target, prompt + real.tokens, layers), drafter, settings, prompt)
        assert again.tokens == real.tokens and again.accepted_lengths == real.accepted_lengths
    assert ended, "no prompt's continuation ended with EOS: pick others"
    lm = TeacherForcedLM(target, [5, 9, EOS])
    lm.length = 1
    assert lm.forward(torch.tensor([9, EOS]))[0].argmax().tolist() == [EOS, EOS]
