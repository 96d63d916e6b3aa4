"""The EAGLE-3 loss against a brute-force float64 loop over (row, index, step)."""

from __future__ import annotations

import math

import pytest
import torch

from drafttrain.data.collate import TrainingCollator
from drafttrain.kinds.eagle3.loss import (eagle3_loss, first_trained_index, next_tokens, teacher_logits_from_hidden, teacher_logits_from_topk)
from eagle3_helpers import target_hidden_states, tiny_draft, tiny_target

STEPS = 3
DECAY = 0.7


@pytest.fixture(scope="module")
def setup():
    target = tiny_target()
    draft = tiny_draft(target, draft_vocab_size=40)
    rows = [{"prompt_ids": [5, 9, 13, 21, 30], "response_ids": [40, 41, 7, 63, 33, 8, 2, 61]},
            {"prompt_ids": [11, 3], "response_ids": [17, 25, 62, 44, 50, 2]},
            {"prompt_ids": [1, 4, 7, 10], "response_ids": [60, 13]}]
    batch = TrainingCollator(max_seq_len=64, pad_id=2, align_prompts=True)(rows)
    hs = target_hidden_states(target, batch["input_ids"], batch["attention_mask"], batch["position_ids"])
    return target, draft, batch, hs


def brute_force(target, draft, batch, hs, step_logits, start, target_ids):
    """Per step: mean KL over trained positions, accuracy over response positions."""
    with torch.no_grad():
        full_logits = target.lm_head(hs[-1])  # the target's whole head, float64
    ids = draft.draft_target_ids
    B, T = batch["input_ids"].shape
    kls = [[] for _ in range(STEPS)]
    hits = [[] for _ in range(STEPS)]
    for b in range(B):
        for p in range(start, T):
            for j in range(STEPS):
                nxt = p + 1 + j
                if nxt >= T or not batch["loss_mask"][b, nxt] or not batch["attention_mask"][b, p]:
                    continue
                top = int(target_ids[b, nxt - start])
                q = torch.softmax(step_logits[j, b, p - start], -1)
                guess = int(ids[int(q.argmax())])
                hits[j].append(guess == top)
                if not draft.t2d[top]:
                    continue
                pt = torch.softmax(full_logits[b, nxt][ids], -1)
                kls[j].append(sum(float(pt[v] * math.log(pt[v] / q[v])) for v in range(len(ids))))
    return kls, hits


def test_loss_and_accuracy_equal_a_brute_force_loop(setup):
    target, draft, batch, hs = setup
    start = first_trained_index(batch["loss_mask"], STEPS)
    assert start == int(batch["loss_mask"].any(0).nonzero()[0]) - STEPS
    logits = draft(draft.target_features(hs), batch["input_ids"], attention_mask=batch["attention_mask"],
                   position_ids=batch["position_ids"], num_steps=STEPS, logits_from=start)
    teacher = teacher_logits_from_hidden(hs[-1][:, start:], target.lm_head.weight, draft.draft_target_ids)
    rows = target.lm_head.weight[draft.draft_target_ids]  # the recipe picks the rows once per run
    assert torch.equal(teacher_logits_from_hidden(hs[-1][:, start:], rows), teacher)
    target_ids = next_tokens(batch["input_ids"], start)
    out = eagle3_loss(logits, teacher, batch["loss_mask"][:, start:], batch["attention_mask"][:, start:],
                      target_ids, draft.d2t, draft.t2d, decay=DECAY)
    kls, hits = brute_force(target, draft, batch, hs, logits.detach(), start, target_ids)
    assert [len(k) for k in kls] == out.step_positions.tolist()
    assert all(len(k) > 3 for k in kls) and any(len(h) > len(k) for h, k in zip(hits, kls))  # some masked out
    means = [sum(k) / len(k) for k in kls]
    torch.testing.assert_close(out.step_kl, torch.tensor(means), rtol=1e-9, atol=1e-12)
    expected = sum(DECAY ** j * m for j, m in enumerate(means)) / sum(DECAY ** j for j in range(STEPS))
    assert float(out.loss.detach()) == pytest.approx(expected, rel=1e-9)
    assert out.step_accuracy.tolist() == pytest.approx([sum(h) / len(h) for h in hits])
    responses = int(batch["loss_mask"].sum())
    assert out.coverage == pytest.approx(len(kls[0]) / len(hits[0])) and len(hits[0]) == responses
    out.loss.backward()
    grads = [p.grad for p in draft.parameters() if p.requires_grad]
    assert all(g is not None and torch.isfinite(g).all() for g in grads) and draft.fc.weight.grad.abs().sum() > 0


def test_steps_that_train_nothing_drop_out_of_the_weighting(setup):
    target, draft, _, _ = setup
    # Prompt of 2, answer of 2: step 0 trains 2 positions, step 1 one, step 2 none.
    batch = TrainingCollator(max_seq_len=64, pad_id=2)([{"prompt_ids": [5, 6], "response_ids": [41, 42]}])
    hs = target_hidden_states(target, batch["input_ids"])
    with torch.no_grad():
        logits = draft(draft.target_features(hs), batch["input_ids"], num_steps=STEPS)
    teacher = teacher_logits_from_hidden(hs[-1], target.lm_head.weight, draft.draft_target_ids)
    target_ids = next_tokens(batch["input_ids"], 0)
    out = eagle3_loss(logits, teacher, batch["loss_mask"], batch["attention_mask"], target_ids, draft.d2t, draft.t2d,
                      decay=DECAY)
    kls, _ = brute_force(target, draft, batch, hs, logits, 0, target_ids)
    assert out.step_positions.tolist() == [len(k) for k in kls] == [2, 1, 0] and math.isnan(out.step_kl[2])
    expected = (sum(kls[0]) / 2 + DECAY * kls[1][0]) / (1 + DECAY)
    assert float(out.loss) == pytest.approx(expected, rel=1e-9)


def test_a_draft_equal_to_the_teacher_has_zero_kl(setup):
    target, draft, batch, hs = setup
    start = first_trained_index(batch["loss_mask"], 1)
    teacher = teacher_logits_from_hidden(hs[-1][:, start:], target.lm_head.weight, draft.draft_target_ids)
    # Step 0 at row i learns the teacher's row i + 1: hand it exactly that.
    logits = torch.cat([teacher[:, 1:], teacher[:, -1:]], dim=1)[None]
    target_ids = next_tokens(batch["input_ids"], start)
    out = eagle3_loss(logits, teacher, batch["loss_mask"][:, start:], batch["attention_mask"][:, start:],
                      target_ids, draft.d2t, draft.t2d)
    assert float(out.loss) == pytest.approx(0.0, abs=1e-12)


def test_topk_teacher_is_the_renormalised_topk_on_the_draft_vocabulary(setup):
    target, draft, batch, hs = setup
    with torch.no_grad():
        logp = torch.log_softmax(target.lm_head(hs[-1]), -1)
    top = logp.topk(8, dim=-1)
    teacher = teacher_logits_from_topk(top.indices, top.values, draft.draft_target_ids, 64)
    probs = torch.softmax(teacher, -1)
    ids = draft.draft_target_ids.tolist()
    for b, t in [(0, 3), (1, 7), (2, 10)]:
        kept = {int(i): float(v) for i, v in zip(top.indices[b, t], top.values[b, t]) if draft.t2d[int(i)]}
        z = sum(math.exp(v) for v in kept.values())
        expected = torch.tensor([math.exp(kept[i]) / z if i in kept else 0.0 for i in ids], dtype=torch.float64)
        torch.testing.assert_close(probs[b, t], expected, rtol=1e-9, atol=1e-12)


def test_nothing_to_train_gives_a_zero_loss_that_still_backpropagates(setup):
    target, draft, batch, hs = setup
    logits = torch.randn(2, 3, 6, draft.config.draft_vocab_size, dtype=torch.float64, requires_grad=True)
    none = torch.zeros(3, 6, dtype=torch.bool)
    out = eagle3_loss(logits, torch.randn(3, 6, draft.config.draft_vocab_size, dtype=torch.float64), none,
                      torch.ones(3, 6, dtype=torch.bool), torch.zeros(3, 6, dtype=torch.long), draft.d2t, draft.t2d)
    out.loss.backward()
    assert float(out.loss.detach()) == 0.0 and logits.grad is not None and out.step_positions.tolist() == [0, 0]
