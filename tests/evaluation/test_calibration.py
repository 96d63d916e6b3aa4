"""The target's greedy continuations of the calibration prompts (`evaluation.calibration`): decoded
in one batch, all the prompts the run may calibrate on, each equal to the prompt decoded alone (a
float64 target); kept in the plan cache, where a later read decodes only what is missing; a target
the static engine cannot run decodes them one at a time, no further than asked, with the same text."""

from __future__ import annotations

import pytest
import torch
from tiny import tiny_lm

from drafttrain.decoding.batch import BatchGenerator
from drafttrain.evaluation import calibration as calibrating
from drafttrain.evaluation.calibration import (CALIBRATION_PROMPTS, LOOKUP_CALIBRATION_PROMPTS, Calibration,
                                               continuation_prompts)
from drafttrain.evaluation.config import EvalConfig
from drafttrain.evaluation.loading import LoadedModels
from drafttrain.evaluation.plan_cache import Measurer, Store, now
from drafttrain.prompts import EncodedPrompt
from drafttrain.tokens import cut_at_eos

EOS = 2
MAX_NEW = 14
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [14], [15, 16, 17], [40, 41, 42, 43], [20, 21, 20, 21, 20], [33, 9]]


@pytest.fixture(scope="module")
def target():
    model = tiny_lm(0, vocab_size=64)
    with torch.no_grad():
        model.lm_head.weight[EOS] *= 1.6  # EOS wins at some positions: some rows stop early
    return model


def calibration(target, needed: int = len(PROMPTS), store: Store | None = None) -> Calibration:
    cfg = EvalConfig(target="t", prompts=["p"], out="o", method="ngram", max_new_tokens=MAX_NEW, dtype="float64")
    models = LoadedModels(target=target, tokenizer=None, device=torch.device("cpu"), eos={EOS})
    prompts = [EncodedPrompt(i, "c", ids) for i, ids in enumerate(PROMPTS)]
    return Calibration(cfg, models, prompts, store or Store(None, {}, False), needed)


def alone(model, prompt: list[int]) -> list[int]:
    """The prompt's greedy continuation by transformers' `generate`, independent of drafttrain's decoders."""
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW, do_sample=False,
                         eos_token_id=EOS, pad_token_id=0)
    return cut_at_eos(out[0, len(prompt):].tolist(), [EOS])


@pytest.fixture
def batches(monkeypatch):
    """The row counts of every batch decoded."""
    sizes = []
    real = BatchGenerator.generate

    def counted(self, input_ids, *args, **kwargs):
        sizes.append(input_ids.shape[0])
        return real(self, input_ids, *args, **kwargs)

    monkeypatch.setattr(BatchGenerator, "generate", counted)
    return sizes


def test_the_batched_continuations_equal_each_prompt_decoded_alone(target, batches):
    cal = calibration(target)
    measurer = Measurer(now())
    got = cal.continuation(0, measurer)
    assert batches == [len(PROMPTS)]  # every prompt the run may read, in one batch, on the first read
    continuations = [cal.continuation(i, measurer) for i in range(len(PROMPTS))]
    assert batches == [len(PROMPTS)] and got == continuations[0]
    assert continuations == [alone(target, p) for p in PROMPTS]
    assert continuations == [cal._decode_alone(p, measurer) for p in PROMPTS]  # n-gram at K = 3, a prompt at a time
    assert any(c[-1] == EOS for c in continuations) and any(len(c) == MAX_NEW and EOS not in c for c in continuations)
    assert cal.store.get("continuations")[0] == continuations  # kept as before: one list, prompt by prompt


def test_a_later_read_decodes_only_what_is_missing(target, batches):
    """A run that calibrated fewer prompts (model drafters only) kept 3; one with a lookup reads
    further, and decodes the rest in one batch beside what the cache kept."""
    store = Store(None, {}, False)
    first = calibration(target, needed=3, store=store)
    assert first.continuation(1, Measurer(now())) == alone(target, PROMPTS[1]) and batches == [3]
    later = calibration(target, needed=len(PROMPTS), store=store)
    assert later.continuation(2, Measurer(now())) == alone(target, PROMPTS[2]) and batches == [3]  # kept
    assert later.continuation(5, Measurer(now())) == alone(target, PROMPTS[5])
    assert batches == [3, len(PROMPTS) - 3] and len(store.get("continuations")[0]) == len(PROMPTS)


def test_batches_are_capped(target, batches, monkeypatch):
    monkeypatch.setattr(calibrating, "CONTINUATION_BATCH", 3)
    cal = calibration(target)
    assert cal.continuation(0, Measurer(now())) == alone(target, PROMPTS[0])
    assert batches == [3, 3, 1]
    assert cal.store.get("continuations")[0] == [alone(target, p) for p in PROMPTS]


def test_a_target_the_static_engine_cannot_run_is_decoded_one_prompt_at_a_time(target, batches, monkeypatch):
    monkeypatch.setattr(calibrating, "static_support", lambda *a: "not a model the static engine runs")
    cal = calibration(target)
    assert cal.continuation(1, Measurer(now())) == alone(target, PROMPTS[1])
    assert len(cal.store.get("continuations")[0]) == 2  # no further than asked: a drafter may stop there
    assert [cal.continuation(i, Measurer(now())) for i in range(len(PROMPTS))] == [alone(target, p) for p in PROMPTS]
    assert batches == []


def test_a_teacher_reads_the_hidden_states_its_batch_kept(target, monkeypatch):
    """The first drafter to read hidden layers has them kept by the batch that decodes the
    continuations: its teacher-forced targets are built from them, with no forward of their own,
    and hold what a teacher-forced forward over prompt and continuation gives; other layers than
    the batch kept take that forward."""
    from drafttrain.decoding.engines.teacher import teacher_forced

    layers, forwards = (0, 2), []
    monkeypatch.setattr(calibrating, "teacher_forced", lambda *a: forwards.append(a[2]) or teacher_forced(*a))
    cal, measurer = calibration(target), Measurer(now())
    for i, prompt in enumerate(PROMPTS):
        kept = cal.teacher(i, layers, measurer)
        reference = teacher_forced(target, prompt + alone(target, prompt), layers)
        assert kept.sequence.tolist() == reference.sequence.tolist()
        torch.testing.assert_close(kept.hidden, reference.hidden, rtol=1e-9, atol=1e-9)
    assert forwards == []
    cal.teacher(0, (1,), measurer)
    assert forwards == [(1,)]


def test_the_progress_line_says_the_batch_is_decoded(target):
    shown = []

    class Bar:
        n, total = 0, 100

        def set_postfix_str(self, text, refresh=True):
            shown.append(text)

        def update(self, units):
            self.n += units

    bar = Bar()
    calibration(target).continuation(0, Measurer(now(), bar))
    assert shown == [f"the target's greedy continuations of {len(PROMPTS)} calibration prompts, in one batch"]
    assert bar.n == len(PROMPTS)


def test_a_run_planning_a_lookup_decodes_the_lookups_budget():
    def cfg(**drafter):
        return EvalConfig(target="t", prompts=["p"], out="o", num_draft_tokens="auto", **drafter)

    assert continuation_prompts([cfg(method="ngram"), cfg(draft="d")]) == LOOKUP_CALIBRATION_PROMPTS
    assert continuation_prompts([cfg(draft="d")]) == CALIBRATION_PROMPTS
    fixed = EvalConfig(target="t", prompts=["p"], out="o", method="ngram", num_draft_tokens=3)
    assert continuation_prompts([fixed, cfg(draft="d")]) == CALIBRATION_PROMPTS  # a lookup not planned reads none


@pytest.mark.parametrize("lookup_first", [False, True])
def test_a_hybrid_walk_takes_the_steps_the_hybrid_decoder_takes(lookup_first):
    """`planning.walk_hybrid` from the model's drafts at every position (`PositionDrafts`: a decode
    that verifies none of them) against the real hybrid decoder on a float64 target, every K, both
    modes: step after step the same tokens emitted, the same nodes verified, the model drafting at
    the same steps."""
    from tiny import noisy_copy

    from drafttrain.decoding import DecodeSettings
    from drafttrain.kinds.base import Drafter
    from drafttrain.kinds.factory import build_decoder
    from drafttrain.kinds.ngram.decode import ngram_lookup
    from drafttrain.planning import walk_hybrid

    model = tiny_lm(seed=3, vocab_size=24, sharpness=12.0)  # a small vocabulary: the text repeats itself
    draft = Drafter("draft", noisy_copy(model, scale=0.6))
    prompts = [[5, 6, 7, 8, 5, 6, 7, 9, 10], [11, 12, 13, 11, 12, 14], [3, 4, 3, 4, 3, 4, 15]]
    won = {"model": 0, "lookup": 0}
    for k in (1, 2, 3, 5):
        hybrid = build_decoder(model, draft, DecodeSettings(num_draft_tokens=k, hybrid="ngram", lookup_first=lookup_first))
        drafting, seen = hybrid.drafter.draft, []

        def spying(root, depth):
            forwards = hybrid.drafter.forwards
            tokens, tree = drafting(root, depth)
            seen.append((tokens.numel() - 1, hybrid.drafter.forwards > forwards))
            return tokens, tree

        hybrid.drafter.draft = spying
        for prompt in prompts:
            alone = build_decoder(model, draft, DecodeSettings(num_draft_tokens=6))
            continuation, drafts = calibrating.position_drafts(alone, prompt, 40)
            seen.clear()
            gen = hybrid.generate(prompt, 40)
            assert gen.tokens == continuation and len(drafts) == len(continuation)
            walked = walk_hybrid(prompt, continuation, lambda seq, n: ngram_lookup(seq, n, 3), drafts, k, 40,
                                 lookup_first)
            assert [s.tokens - 1 for s in walked] == gen.accepted_lengths
            assert [(s.nodes, s.model) for s in walked] == seen
            looked_up = [not s.model or s.nodes > k for s in walked]  # (both: its nodes beside the model's K)
            won["lookup"] += sum(found and s.tokens > 1 for found, s in zip(looked_up, walked))
            won["model"] += sum(not found and s.tokens > 1 for found, s in zip(looked_up, walked))
    assert won["model"] > 5 and won["lookup"] > 5  # both kinds of step accept drafts: the walk is checked where it matters
