"""A DFlash draft's training loss: cross-entropy of every mask slot against the target's own token
there, over anchors drawn in each answer, each slot weighted less the later it is.

Anchors. A block starts at an anchor a (its last token is the token at a, the one the target just
emitted) and its slot j drafts the token at a + j. An anchor is eligible where the token after it is a
response token (`loss_mask[a + 1]`), so the last prompt token is one (the first answer token's draft);
`sample_anchors` draws up to `count` distinct eligible anchors per sequence, uniformly, with a generator
seeded from the batch itself, so a resumed run draws the same anchors for the same batch.

Weights. Slot j's weight is exp(-(j - 1) / gamma) (DFlash's choice): slot j counts only when slots 1 ..
j-1 were all accepted, so its gradient buys less speedup; gamma = `decay_length` (default: block_size
/ 2). A slot is trained where its token is a response token inside the sequence; a token outside the
draft vocabulary is trained as unreachable (dropped from the loss, counted as a miss in accuracy), as
EAGLE-3's loss does.

On the target's own greedy answers (the demo's data) the token at a + j is the target's top token
there, so cross-entropy to it is distillation on the target's argmax.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def sample_anchors(loss_mask: torch.Tensor, count: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to `count` distinct anchors per row [B, count] (indices a with loss_mask[a + 1]) and which of
    them are real [B, count] (a short answer has fewer: the rest repeat index 0, unused)."""
    B, T = loss_mask.shape
    eligible = torch.zeros_like(loss_mask, dtype=torch.bool)
    eligible[:, :-1] = loss_mask[:, 1:].bool()
    generator = torch.Generator().manual_seed(seed)
    keys = torch.rand(B, T, generator=generator).to(loss_mask.device).masked_fill(~eligible, 2.0)
    order = keys.argsort(dim=1)[:, :count]
    real = eligible.gather(1, order)
    anchors = order.masked_fill(~real, 0)
    if anchors.shape[1] < count:  # fewer positions than anchors asked for
        pad = count - anchors.shape[1]
        anchors = torch.cat([anchors, anchors.new_zeros(B, pad)], dim=1)
        real = torch.cat([real, real.new_zeros(B, pad)], dim=1)
    return anchors, real


def batch_seed(seed: int, input_ids: torch.Tensor) -> int:
    """A seed from the run's seed and the batch's tokens: the same batch draws the same anchors."""
    return (seed * 1_000_003 + int(input_ids.sum()) * 31 + input_ids.numel()) % (2 ** 63)


def slot_targets(input_ids: torch.Tensor, loss_mask: torch.Tensor, anchors: torch.Tensor, real: torch.Tensor,
                 block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The token each mask slot drafts [B, A, block_size - 1] (the token at a + j) and whether it is
    trained (a real anchor, inside the sequence, a response token)."""
    T = input_ids.shape[1]
    index = anchors[:, :, None] + torch.arange(1, block_size, device=anchors.device)
    inside = index < T
    index = index.clamp(max=T - 1)
    tokens = input_ids.gather(1, index.flatten(1)).view_as(index)
    trained = loss_mask.bool().gather(1, index.flatten(1)).view_as(index) & inside & real[:, :, None]
    return tokens, trained


def slot_weights(block_size: int, decay_length: float | None = None) -> torch.Tensor:
    """exp(-(j - 1) / gamma) for slots j = 1 .. block_size - 1 (gamma default block_size / 2)."""
    gamma = decay_length or block_size / 2
    return torch.tensor([math.exp(-j / gamma) for j in range(block_size - 1)])


@dataclass
class DFlashLoss:
    loss: torch.Tensor           # the weighted mean cross-entropy
    slot_accuracy: torch.Tensor  # [block_size - 1]: top-1 equals the target's token, per slot (nan: none)
    coverage: torch.Tensor       # trained slots whose token is in the draft vocabulary


def dflash_loss(logits: torch.Tensor, tokens: torch.Tensor, trained: torch.Tensor, t2d: torch.Tensor,
                weights: torch.Tensor) -> DFlashLoss:
    """`logits` [B, A, S, Vd] (S = block_size - 1 slots), `tokens` [B, A, S] target ids, `trained` [B, A, S];
    `t2d` bool [V]: which target ids the draft vocabulary holds (draft ids ascend with target ids)."""
    draft_id = (t2d.long().cumsum(0) - 1).clamp_min(0)
    reachable = t2d[tokens]
    labels = draft_id[tokens]
    counted = trained & reachable
    logp = torch.log_softmax(logits.float(), dim=-1)
    nll = -logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    w = weights.to(logits.device)[None, None, :] * counted
    loss = (nll * w).sum() / w.sum().clamp_min(1e-9)
    hit = (logits.argmax(-1) == labels) & reachable & trained
    per_slot = trained.flatten(0, 1).sum(0)
    accuracy = hit.flatten(0, 1).sum(0) / per_slot.clamp_min(1)
    accuracy = accuracy.masked_fill(per_slot == 0, float("nan"))
    coverage = counted.sum() / trained.sum().clamp_min(1)
    return DFlashLoss(loss, accuracy, coverage)
