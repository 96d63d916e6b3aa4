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
