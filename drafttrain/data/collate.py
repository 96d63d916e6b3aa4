"""Training batches: prompt + response in one sequence, loss only where the next token is a response token.

Conventions (the training loop relies on them):
- `loss_mask[t]` is True iff the prediction made AT position t (of token t+1) targets a response token,
  i.e. t in [len(prompt) - 1, len(sequence) - 2].
- `labels` are ALREADY SHIFTED: `labels[t] = input_ids[t + 1]` where `loss_mask[t]`, else -100. Use
  `cross_entropy(logits[:, t], labels[:, t])` directly; do not pass them to a Hugging Face model's
  `labels=` (which shifts again).
- `topk_ids` / `topk_logprobs` are aligned the same way: row t is the target's top-k at position t.
  Rows outside `loss_mask` are zeros and must be ignored.
- With `prompt_positions`, `prompt_mask[t]` is True at the prompt's own positions t in
  [0, len(prompt) - 2] (predicting prompt tokens), disjoint from `loss_mask`; `labels` and the
  top-k rows are filled there too (the top-k from the rows' `prompt_topk_*` columns).
- `position_ids` count real tokens only (pad tokens sit at position 0, masked); pass them to the model.
- With `align_prompts`, each prompt is left-padded to the batch's longest prompt, so every response
  starts in the same column: the trained positions form one block at the end of the batch, and
  the LM head (on a 50k vocabulary, as costly as a small draft's layers) runs over that block only.
"""

from __future__ import annotations

from typing import Sequence

import torch

IGNORE_INDEX = -100


def pack_example(
    prompt_ids: Sequence[int],
    response_ids: Sequence[int],
    max_seq_len: int,
    topk_ids: Sequence[Sequence[int]] | None = None,
    topk_logprobs: Sequence[Sequence[float]] | None = None,
    prompt_topk_ids: Sequence[Sequence[int]] | None = None,
    prompt_topk_logprobs: Sequence[Sequence[float]] | None = None,
    prompt_positions: bool = False,
) -> dict:
    """One sequence of at most `max_seq_len` tokens. The response is truncated first. A prompt that
    leaves no room keeps only its last `max_seq_len - 1` tokens (those nearest the answer matter most)
    plus the first response token, so every example with a response still trains on something.
    `prompt_positions` adds `prompt_mask` (see the module docstring); with top-k given it needs the
    prompt's top-k rows too."""
    if max_seq_len < 2:
        raise ValueError(f"max_seq_len must be >= 2, got {max_seq_len}")
    prompt, response = list(prompt_ids), list(response_ids)
    if not prompt:
        raise ValueError("an example needs at least one prompt token")
    full_prompt_len = len(prompt)
    if response and len(prompt) >= max_seq_len:
        prompt = prompt[len(prompt) - (max_seq_len - 1):]
    elif len(prompt) > max_seq_len:  # no response at all: nothing to learn, just keep the shape valid
        prompt = prompt[len(prompt) - max_seq_len:]
    response = response[: max_seq_len - len(prompt)]
    n_prompt, n_resp = len(prompt), len(response)
    seq_len = n_prompt + n_resp
    loss_mask = [False] * seq_len
    for t in range(n_prompt - 1, seq_len - 1):
        loss_mask[t] = True
    example = {"input_ids": prompt + response, "loss_mask": loss_mask}
    cut = full_prompt_len - n_prompt  # prompt tokens dropped from the front
    if prompt_positions:
        example["prompt_mask"] = [t < n_prompt - 1 for t in range(seq_len)]
    if topk_ids is not None and topk_logprobs is not None:
        k = len(topk_ids[0]) if len(topk_ids) else 0
        ids = [[0] * k for _ in range(seq_len)]
        logprobs = [[0.0] * k for _ in range(seq_len)]
        # Response token j (at position n_prompt + j) is predicted at position n_prompt - 1 + j.
        for j in range(n_resp):
            ids[n_prompt - 1 + j] = list(topk_ids[j])
            logprobs[n_prompt - 1 + j] = list(topk_logprobs[j])
        if prompt_positions:
            if prompt_topk_ids is None or prompt_topk_logprobs is None:
                raise ValueError("prompt positions with a stored top-k teacher need the prompt's top-k rows "
                                 "(prompt_topk_ids / prompt_topk_logprobs); regenerate the data with "
                                 "prompt_loss_weight > 0")
            # Position t of the kept prompt is position cut + t of the whole one.
            for t in range(n_prompt - 1):
                ids[t] = list(prompt_topk_ids[cut + t])
                logprobs[t] = list(prompt_topk_logprobs[cut + t])
        example |= {"topk_ids": ids, "topk_logprobs": logprobs}
    return example


def _prompt_length(example: dict) -> int:
    mask = example["loss_mask"]
    return mask.index(True) + 1 if True in mask else len(mask)


def collate(batch: Sequence[dict], pad_id: int, pad_to_multiple_of: int | None = None,
            align_prompts: bool = False) -> dict[str, torch.Tensor]:
    """Pad packed examples into `input_ids`, `attention_mask`, `position_ids`, `loss_mask` (bool),
    `labels`, and `topk_ids` / `topk_logprobs` [B, T, k] when the examples carry them. Padding
    goes on the right, and with `align_prompts` also before each prompt (see the module docstring)."""
    prompt_width = max(_prompt_length(ex) for ex in batch) if align_prompts else 0
    offsets = [prompt_width - _prompt_length(ex) if align_prompts else 0 for ex in batch]
    width = max(off + len(ex["input_ids"]) for off, ex in zip(offsets, batch))
    if pad_to_multiple_of:
        width = -(-width // pad_to_multiple_of) * pad_to_multiple_of
    B = len(batch)
    input_ids = torch.full((B, width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((B, width), dtype=torch.long)
    loss_mask = torch.zeros((B, width), dtype=torch.bool)
    has_topk = "topk_ids" in batch[0]
    if has_topk:
        k = max((len(row) for ex in batch for row in ex["topk_ids"]), default=0)
        topk_ids = torch.zeros((B, width, k), dtype=torch.long)
        topk_logprobs = torch.zeros((B, width, k), dtype=torch.float32)
    position_ids = torch.zeros((B, width), dtype=torch.long)
    has_prompt_mask = "prompt_mask" in batch[0]
    prompt_mask = torch.zeros((B, width), dtype=torch.bool)
    for b, (o, ex) in enumerate(zip(offsets, batch)):
        n = len(ex["input_ids"])
        input_ids[b, o:o + n] = torch.as_tensor(ex["input_ids"], dtype=torch.long)
        attention_mask[b, o:o + n] = 1
        position_ids[b, o:o + n] = torch.arange(n)
        loss_mask[b, o:o + n] = torch.as_tensor(ex["loss_mask"], dtype=torch.bool)
        if has_prompt_mask:
            prompt_mask[b, o:o + n] = torch.as_tensor(ex["prompt_mask"], dtype=torch.bool)
        if has_topk and k:
            topk_ids[b, o:o + n] = torch.as_tensor(ex["topk_ids"], dtype=torch.long).reshape(n, k)
            topk_logprobs[b, o:o + n] = torch.as_tensor(ex["topk_logprobs"], dtype=torch.float32).reshape(n, k)
    labels = torch.full((B, width), IGNORE_INDEX, dtype=torch.long)
    trained = loss_mask | prompt_mask
    labels[:, :-1] = torch.where(trained[:, :-1], input_ids[:, 1:], IGNORE_INDEX)
    out = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids,
           "loss_mask": loss_mask, "labels": labels}
    if has_prompt_mask:
        out["prompt_mask"] = prompt_mask
    if has_topk:
        out |= {"topk_ids": topk_ids, "topk_logprobs": topk_logprobs}
    return out


def response_window(loss_mask: torch.Tensor) -> int:
    """Where the batch's first trained position is (0 if none): logits before it are never used,
    and on a 50k vocabulary the LM head over the prompt costs as much as the rest of the draft.
    With `align_prompts` every trained position lies at or after it."""
    rows = loss_mask.any(dim=1)
    if not bool(rows.any()):
        return 0
    return int(loss_mask.int().argmax(dim=1)[rows].min())


class TrainingCollator:
    """`collate_fn` for a DataLoader over `generate_responses` rows: packs, then pads."""

    def __init__(self, max_seq_len: int, pad_id: int, pad_to_multiple_of: int | None = None,
                 align_prompts: bool = False, prompt_positions: bool = False):
        self.max_seq_len, self.pad_id, self.pad_to_multiple_of = max_seq_len, pad_id, pad_to_multiple_of
        self.align_prompts, self.prompt_positions = align_prompts, prompt_positions

    def __call__(self, rows: Sequence[dict]) -> dict[str, torch.Tensor]:
        packed = [
            pack_example(r["prompt_ids"], r["response_ids"], self.max_seq_len,
                         r.get("topk_ids"), r.get("topk_logprobs"), r.get("prompt_topk_ids"),
                         r.get("prompt_topk_logprobs"), prompt_positions=self.prompt_positions)
            for r in rows
        ]
        batch = collate(packed, self.pad_id, self.pad_to_multiple_of, self.align_prompts)
        if rows and "example_index" in rows[0]:  # the key of a recipe's memo of each example's target features
            batch["example_index"] = torch.tensor([r["example_index"] for r in rows], dtype=torch.long)
        return batch
