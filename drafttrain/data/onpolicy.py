"""On-policy batches (GKD, Agarwal et al. 2024): the batch's prompts continued by the current draft.

A draft trained only on the target's text never sees its own mistakes; on-policy batches let
the target score the text the draft actually proposes. Which optimizer steps are on-policy is a
seeded draw per step, so every rank and every process count agrees, and a resumed run makes the
same draws.
"""

from __future__ import annotations

import random

import torch

from ..tokens import cut_at_eos, left_pad
from .collate import TrainingCollator


def onpolicy_step(fraction: float, seed: int, step: int) -> bool:
    """One draw per optimizer step, the same on every rank and for any process count."""
    return fraction > 0 and random.Random(seed * 1_000_003 + step).random() < fraction


@torch.no_grad()
def onpolicy_batch(draft, batch: dict, collator: TrainingCollator, *, temperature: float, max_new_tokens: int,
                   eos_ids: list[int], pad_id: int, seed: int, synced_gpus: bool = False) -> dict:
    """The batch's prompts, each continued by `draft` (sampled, or greedy at temperature 0).

    A prompt ends where its loss mask starts: `loss_mask[t]` is first True at t = len(prompt) - 1
    (pad tokens before it, if the collator aligned prompts, are dropped by the attention mask).
    """
    from transformers import GenerationConfig

    device = batch["input_ids"].device
    starts = batch["loss_mask"].int().argmax(dim=1).tolist()
    prompts = [batch["input_ids"][i, :s + 1][batch["attention_mask"][i, :s + 1].bool()].tolist()
               for i, s in enumerate(starts)]
    input_ids, attention_mask = left_pad(prompts, pad_id, device)
    sampling = temperature > 0
    gen_cfg = GenerationConfig(do_sample=sampling, max_new_tokens=max_new_tokens, eos_token_id=eos_ids,
                               pad_token_id=pad_id, **(dict(temperature=temperature, top_k=0, top_p=1.0)
                                                       if sampling else {}))
    was_training = draft.training
    draft.eval()
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(seed)
            out = draft.generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=gen_cfg,
                                 synced_gpus=synced_gpus)
    finally:
        draft.train(was_training)
    new = out[:, input_ids.shape[1]:].tolist()
    rows = [{"prompt_ids": p, "response_ids": cut_at_eos(r, eos_ids)} for p, r in zip(prompts, new)]
    return {k: v.to(device) for k, v in collator(rows).items()}


__all__ = ["onpolicy_batch", "onpolicy_step"]
