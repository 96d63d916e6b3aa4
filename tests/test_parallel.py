"""The parallel-draft training layout against its definition: every mask row's logits equal a plain
causal forward over [the real tokens it may see, then b masks] (float64), for a padded batch."""

from __future__ import annotations

import pytest
import torch
from tiny import tiny_lm, tiny_tokenizer

from drafttrain.data.collate import collate, pack_example
from drafttrain.errors import UserError
from drafttrain.parallel import mask_token_id, parallel_info, mark_parallel, parallel_layout

MASK = 9


def batch_of(examples):
    packed = [pack_example(p, r, 64) for p, r in examples]
    return collate(packed, pad_id=2, align_prompts=True)


def plain_logits(model, tokens: list[int]) -> torch.Tensor:
    return model(input_ids=torch.tensor([tokens])).logits[0, -1]


@pytest.mark.parametrize("depth", [2, 4])
def test_every_row_sees_exactly_what_decoding_sees(depth):
    model = tiny_lm(seed=1)
    batch = batch_of([([5, 6, 7, 8, 10, 11], [12, 13, 14, 15, 16]), ([20, 21], [22, 23, 24, 25, 26, 27, 28])])
    start = int(batch["loss_mask"].int().argmax(dim=1).min())
    layout = parallel_layout(batch["input_ids"], batch["attention_mask"], batch["position_ids"], start=start,
                             depth=depth, mask_id=MASK)
    with torch.no_grad():
        logits = model(input_ids=layout.input_ids, position_ids=layout.position_ids,
                       attention_mask=layout.additive_mask(torch.float64), logits_to_keep=layout.logits_to_keep).logits
    student = layout.student(logits)
    trained = layout.trained(batch["loss_mask"], batch["attention_mask"])
    window = layout.length - start
    checked = 0
    for row in range(2):
        real = batch["input_ids"][row][batch["attention_mask"][row].bool()].tolist()
        pad = int((batch["attention_mask"][row] == 0).int().argmin())  # left padding before the prompt
        for b in range(depth):
            for w in range(window):
                p = start + w
                if not trained[row, b * window + w]:
                    continue
                last = p - b - pad  # the last real token's index in the unpadded sequence
                expected = plain_logits(model, real[:last + 1] + [MASK] * b)
                torch.testing.assert_close(student[row, b * window + w], expected, rtol=1e-9, atol=1e-9)
                checked += 1
    # every trained position at every depth whose last real token exists was checked
    assert checked == int(trained.sum()) and checked > depth * 5


def test_rows_without_a_real_token_behind_them_carry_no_loss():
    batch = batch_of([([5], [12, 13, 14])])
    layout = parallel_layout(batch["input_ids"], batch["attention_mask"], batch["position_ids"], start=0,
                             depth=3, mask_id=MASK)
    trained = layout.trained(batch["loss_mask"], batch["attention_mask"]).view(3, -1)
    # position 0 predicts token 1 from x_0; depth b needs x_{-b}: none for p < b
    assert trained[0].tolist()[:3] == [True, True, True]
    assert trained[1].tolist()[:3] == [False, True, True] and trained[2].tolist()[:3] == [False, False, True]


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
