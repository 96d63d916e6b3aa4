"""The parallel-draft training layout against its definition: every mask row's logits equal a plain
causal forward over [the real tokens it may see, then b masks] (float64), for a padded batch."""

from __future__ import annotations

import pytest
import torch
from tiny import tiny_lm, tiny_tokenizer

from drafttrain.data.collate import collate, pack_example
from drafttrain.errors import UserError
from drafttrain.losses import distill_loss
from drafttrain.kinds.parallel_lm.model import depth_balanced, parallel_info, mark_parallel, parallel_layout
from drafttrain.tokens import mask_token_id

MASK = 9


def batch_of(examples):
    packed = [pack_example(p, r, 64) for p, r in examples]
    return collate(packed, pad_id=2, align_prompts=True)


def plain_logits(model, tokens: list[int]) -> torch.Tensor:
    return model(input_ids=torch.tensor([tokens])).logits[0, -1]


@pytest.mark.parametrize("depth, keep", [(2, 1.0), (4, 1.0), (4, 0.6)])
def test_every_row_sees_exactly_what_decoding_sees(depth, keep):
    """keep < 1: PARD's conditional drop, whose deeper blocks hold a random subset of positions."""
    model = tiny_lm(seed=1)
    batch = batch_of([([5, 6, 7, 8, 10, 11], [12, 13, 14, 15, 16]), ([20, 21], [22, 23, 24, 25, 26, 27, 28])])
    start = int(batch["loss_mask"].int().argmax(dim=1).min())
    layout = parallel_layout(batch["input_ids"], batch["attention_mask"], batch["position_ids"], start=start,
                             depth=depth, mask_id=MASK, keep=keep, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        logits = model(input_ids=layout.input_ids, position_ids=layout.position_ids,
                       attention_mask=layout.additive_mask(torch.float64), logits_to_keep=layout.logits_to_keep).logits
    student = logits
    trained = layout.trained(batch["loss_mask"], batch["attention_mask"])
    rows = layout.rows()
    assert student.shape[1] == trained.shape[1] == len(rows)
    checked = 0
    for row in range(2):
        real = batch["input_ids"][row][batch["attention_mask"][row].bool()].tolist()
        pad = int((batch["attention_mask"][row] == 0).int().argmin())  # left padding before the prompt
        for i, (b, p) in enumerate(rows):
            if not trained[row, i]:
                continue
            last = p - b - pad  # the last real token's index in the unpadded sequence
            expected = plain_logits(model, real[:last + 1] + [MASK] * b)
            torch.testing.assert_close(student[row, i], expected, rtol=1e-9, atol=1e-9)
            checked += 1
    assert checked == int(trained.sum()) and checked > depth * 3
    if keep < 1:  # the deeper blocks are thinner, and each kept mask's chain predecessor is kept
        sizes = [len(p) for p in layout.positions[1:]]
        assert sizes == sorted(sizes, reverse=True) and sizes[-1] < sizes[0]
        for shallow, deep in zip(layout.positions[1:], layout.positions[2:]):
            assert set((deep - 1).tolist()) <= set(shallow.tolist())


def test_rows_without_a_real_token_behind_them_carry_no_loss():
    batch = batch_of([([5], [12, 13, 14])])
    layout = parallel_layout(batch["input_ids"], batch["attention_mask"], batch["position_ids"], start=0,
                             depth=3, mask_id=MASK)
    trained = layout.trained(batch["loss_mask"], batch["attention_mask"])[0].tolist()
    rows = [(b, int(p)) for b, ps in enumerate(layout.positions) for p in ps]
    # position p at depth b drafts from x_{p-b}: none for p < b
    assert {row: t for row, t in zip(rows, trained) if row[1] <= 2} == {(b, p): p >= b for b, p in rows if p <= 2}


def test_mask_token_choice_and_config():
    tokenizer = tiny_tokenizer()
    assert mask_token_id(tokenizer, 17) == 17
    with pytest.raises(UserError, match="draft.mask_token"):
        mask_token_id(tokenizer, 10_000)
    model = tiny_lm()
    assert parallel_info(model.config) is None
    mark_parallel(model, 17, 4)
    assert parallel_info(model.config) == {"pard_token": 17, "parallel_tokens": 4}
    assert model.config.to_dict()["pard_token"] == 17 and model.config.to_dict()["spd_type"] == "pard"


def test_a_depth_balanced_loss_is_the_mean_of_each_depths_mean_row_loss():
    """`depth_balanced` against the per-row losses, summed by hand: with the conditional drop the
    depths have different row counts, so it differs from the plain mean over rows."""
    student, teacher = tiny_lm(seed=1), tiny_lm(seed=2)
    batch = batch_of([([5, 6, 7, 8, 10, 11], [12, 13, 14, 15, 16, 17, 18]), ([20, 21], [22, 23, 24, 25, 26, 27])])
    start = int(batch["loss_mask"].int().argmax(dim=1).min())
    layout = parallel_layout(batch["input_ids"], batch["attention_mask"], batch["position_ids"], start=start,
                             depth=4, mask_id=MASK, keep=0.5, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = student(input_ids=layout.input_ids, position_ids=layout.position_ids,
                         attention_mask=layout.additive_mask(torch.float64), logits_to_keep=layout.logits_to_keep).logits
        window = teacher(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                         position_ids=batch["position_ids"]).logits[:, start:]
    target = layout.repeat(window)
    mask = layout.trained(batch["loss_mask"], batch["attention_mask"])
    depths = layout.row_depths()
    assert depths.tolist() == [b for b, _ in layout.rows()]

    def loss_over(m):
        return distill_loss(logits, target, m, kind="forward_kl")

    by_depth = {}
    for row in range(mask.shape[0]):
        for i in range(mask.shape[1]):
            if mask[row, i]:
                p, q = target[row, i].log_softmax(-1), logits[row, i].log_softmax(-1)
                by_depth.setdefault(int(depths[i]), []).append(float((p.exp() * (p - q)).sum()))
    counts = [len(v) for v in by_depth.values()]
    assert len(by_depth) == 4 and len(set(counts)) > 1
    expected = sum(sum(v) / len(v) for v in by_depth.values()) / len(by_depth)
    assert float(depth_balanced(loss_over, mask, depths)) == pytest.approx(expected, rel=1e-9)
    plain = sum(sum(v) for v in by_depth.values()) / sum(counts)
    assert float(loss_over(mask)) == pytest.approx(plain, rel=1e-9) and abs(plain - expected) > 1e-6
