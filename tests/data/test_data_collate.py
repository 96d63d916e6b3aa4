from __future__ import annotations

import pytest
import torch

from drafttrain.data.collate import IGNORE_INDEX, TrainingCollator, collate, pack_example

X = IGNORE_INDEX


def test_pack_marks_positions_that_predict_response_tokens():
    ex = pack_example([10, 11, 12], [20, 21, 3], max_seq_len=100)
    assert ex["input_ids"] == [10, 11, 12, 20, 21, 3]
    # position 2 (12) predicts 20, 3 predicts 21, 4 predicts 3; the last position predicts nothing
    assert ex["loss_mask"] == [False, False, True, True, True, False]


def test_pack_truncates_the_response_first():
    ex = pack_example([10, 11, 12], [20, 21, 3], max_seq_len=5)
    assert ex["input_ids"] == [10, 11, 12, 20, 21]
    assert ex["loss_mask"] == [False, False, True, True, False]


def test_pack_keeps_the_end_of_a_prompt_that_fills_the_budget():
    ex = pack_example([1, 2, 3, 4, 5, 6], [20, 21], max_seq_len=4)
    assert ex["input_ids"] == [4, 5, 6, 20]
    assert ex["loss_mask"] == [False, False, True, False]


def test_pack_without_response_trains_on_nothing():
    ex = pack_example([1, 2, 3], [], max_seq_len=8)
    assert ex["input_ids"] == [1, 2, 3] and not any(ex["loss_mask"])
    with pytest.raises(ValueError):
        pack_example([], [1], max_seq_len=8)


def test_pack_aligns_topk_with_the_predicting_position():
    ids = [[20, 7], [21, 8], [3, 9]]
    lps = [[-0.1, -2.0], [-0.2, -3.0], [-0.3, -4.0]]
    ex = pack_example([10, 11, 12], [20, 21, 3], max_seq_len=5, topk_ids=ids, topk_logprobs=lps)
    assert ex["topk_ids"] == [[0, 0], [0, 0], [20, 7], [21, 8], [0, 0]]
    assert ex["topk_logprobs"] == [[0.0, 0.0], [0.0, 0.0], [-0.1, -2.0], [-0.2, -3.0], [0.0, 0.0]]


def test_collate_right_pads_and_shifts_labels():
    batch = [pack_example([10, 11, 12], [20, 21, 3], 100), pack_example([30], [40], 100)]
    out = collate(batch, pad_id=0)
    assert out["input_ids"].tolist() == [[10, 11, 12, 20, 21, 3], [30, 40, 0, 0, 0, 0]]
    assert out["attention_mask"].tolist() == [[1, 1, 1, 1, 1, 1], [1, 1, 0, 0, 0, 0]]
    assert out["loss_mask"].tolist() == [[False, False, True, True, True, False],
                                         [True, False, False, False, False, False]]
    assert out["labels"].tolist() == [[X, X, 20, 21, 3, X], [40, X, X, X, X, X]]
    assert out["loss_mask"].dtype == torch.bool and out["input_ids"].dtype == torch.long
    assert "topk_ids" not in out


def test_collate_pads_to_a_multiple_and_carries_topk():
    ids, lps = [[20, 7], [3, 9]], [[-0.1, -2.0], [-0.3, -4.0]]
    batch = [pack_example([10, 11], [20, 3], 100, ids, lps), pack_example([30], [3], 100, [[3, 1]], [[-0.5, -1.5]])]
    out = collate(batch, pad_id=0, pad_to_multiple_of=8)
    assert out["input_ids"].shape == (2, 8)
    assert out["topk_ids"].shape == (2, 8, 2) and out["topk_logprobs"].dtype == torch.float32
    assert out["topk_ids"][0, :4].tolist() == [[0, 0], [20, 7], [3, 9], [0, 0]]
    assert out["topk_ids"][1, :2].tolist() == [[3, 1], [0, 0]]
    assert torch.allclose(out["topk_logprobs"][1, 0], torch.tensor([-0.5, -1.5]))
    assert not out["loss_mask"][:, 4:].any() and (out["labels"][:, 4:] == X).all()


def test_labels_give_the_response_negative_log_likelihood():
    """Cross-entropy over `labels` equals a brute-force sum of -log p(response token | prefix)."""
    torch.manual_seed(0)
    examples = [([5, 6, 7], [8, 9, 1]), ([2], [3, 4]), ([7, 7, 7, 7], [1])]
    out = collate([pack_example(p, r, 6) for p, r in examples], pad_id=0)
    logits = torch.randn(*out["input_ids"].shape, 12, dtype=torch.float64)
    ce = torch.nn.functional.cross_entropy(logits.reshape(-1, 12), out["labels"].reshape(-1),
                                           ignore_index=X, reduction="sum")
    brute = 0.0
    for b, (prompt, response) in enumerate(examples):
        response = response[: 6 - len(prompt)]
        for j, tok in enumerate(response):
            brute -= logits[b, len(prompt) - 1 + j].log_softmax(-1)[tok].item()
    assert ce.item() == pytest.approx(brute, rel=1e-12)
    assert out["loss_mask"].sum().item() == sum(min(len(r), 6 - len(p)) for p, r in examples)


def test_distill_collator_packs_dataset_rows():
    rows = [{"prompt_ids": [10, 11, 12], "response_ids": [20, 21, 3]}, {"prompt_ids": [30], "response_ids": [40]}]
    out = TrainingCollator(max_seq_len=5, pad_id=0)(rows)
    expected = collate([pack_example(r["prompt_ids"], r["response_ids"], 5) for r in rows], pad_id=0)
    assert out.keys() == expected.keys()
    assert all(torch.equal(out[k], expected[k]) for k in out)
    assert out["input_ids"].shape == (2, 5)


def test_prompt_positions_mark_the_prompt_and_take_its_topk():
    ids, lps = [[20, 7], [21, 8]], [[-0.1, -2.0], [-0.2, -3.0]]
    # The prompt's own rows: position t predicts prompt token t + 1.
    p_ids, p_lps = [[11, 1], [12, 2], [13, 3]], [[-1.0, -1.5], [-2.0, -2.5], [-3.0, -3.5]]
    ex = pack_example([10, 11, 12, 13], [20, 21], max_seq_len=100, topk_ids=ids, topk_logprobs=lps,
                      prompt_topk_ids=p_ids, prompt_topk_logprobs=p_lps, prompt_positions=True)
    assert ex["prompt_mask"] == [True, True, True, False, False, False]
    assert ex["loss_mask"] == [False, False, False, True, True, False]
    assert ex["topk_ids"] == [[11, 1], [12, 2], [13, 3], [20, 7], [21, 8], [0, 0]]
    assert ex["topk_logprobs"][:3] == p_lps
    # A prompt cut to its last tokens keeps the rows of the positions it kept.
    cut = pack_example([10, 11, 12, 13], [20, 21], max_seq_len=3, topk_ids=ids, topk_logprobs=lps,
                       prompt_topk_ids=p_ids, prompt_topk_logprobs=p_lps, prompt_positions=True)
    assert cut["input_ids"] == [12, 13, 20]
    assert cut["prompt_mask"] == [True, False, False]
    assert cut["topk_ids"] == [[13, 3], [20, 7], [0, 0]]
    with pytest.raises(ValueError, match="prompt_loss_weight"):
        pack_example([10, 11], [20], 100, [[20, 1]], [[-0.1, -1.0]], prompt_positions=True)


def test_collate_with_prompt_positions_labels_the_prompt_too():
    batch = [pack_example([10, 11, 12], [20, 3], 100, prompt_positions=True),
             pack_example([30], [40], 100, prompt_positions=True)]
    out = collate(batch, pad_id=0, align_prompts=True)
    assert out["input_ids"].tolist() == [[10, 11, 12, 20, 3], [0, 0, 30, 40, 0]]
    assert out["prompt_mask"].tolist() == [[True, True, False, False, False], [False] * 5]
    assert not (out["prompt_mask"] & out["loss_mask"]).any()
    assert out["labels"].tolist() == [[11, 12, 20, 3, X], [X, X, 40, X, X]]
    assert "prompt_mask" not in collate([pack_example([10, 11], [20], 100)], pad_id=0)
