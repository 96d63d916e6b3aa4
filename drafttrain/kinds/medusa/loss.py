"""The Medusa heads' training objective, and the two modules a Medusa recipe trains.

Head i (0-based) reads the target's LAST hidden state at position t (post-norm: the state its
LM head reads) and learns the token at t + 2 + i:

    teacher (kind="kl")  the target's logits at t + 1 + i (its distribution for that token)
    label   (kind="ce")  input_ids[t + 2 + i] = the collator's shifted labels[t + 1 + i]
    counted iff          loss_mask[t + 1 + i] (that token is a response token, in the sequence)

so every per-head quantity is the collator's tensor shifted left by 1 + i, and the hidden state
is cut to the same length. `medusa_heads_loss` is that alignment; an off-by-one there would
silently train head i to predict the wrong token, so the tests check it against a brute-force
loop over prefixes.

(A loss-level module: it builds on `drafttrain.losses`; the heads' model and export, which
decoding reads, do not import it.)
"""

from __future__ import annotations

import torch
from torch import nn

from ...losses import distill_loss
from .model import MedusaHeads


def medusa_heads_loss(heads: MedusaHeads, hidden: torch.Tensor, loss_mask: torch.Tensor, labels: torch.Tensor, *,
                      kind: str, decay: float, teacher_logits: torch.Tensor | None = None,
                      chunk_size: int = 1024) -> tuple[torch.Tensor, dict]:
    """Weighted mean over heads of each head's mean loss over the tokens it can learn.

    hidden [B, T, H]: the target's last (post-norm) hidden states; loss_mask, labels [B, T]: the
    collator's (labels already shifted: labels[s] = input_ids[s + 1]); teacher_logits [B, T, V]:
    the target's logits (kind "kl" only). Head i at t is compared with row t + 1 + i of those
    (see the module docstring), and only the rows that count are pushed through the head.
    Head i weighs decay^i (its token is only used when every earlier head's was accepted).
    Logs per head: its loss and its top-1 agreement with the target's token.
    """
    if kind not in ("kl", "ce"):
        raise ValueError(f"unknown heads loss {kind!r}; use kl or ce")
    if kind == "kl" and teacher_logits is None:
        raise ValueError("the kl heads loss needs the target's logits")
    T = hidden.shape[1]
    dtype = heads.lm_heads[0].weight.dtype
    weights = [decay ** i for i in range(heads.config.num_heads)]
    total, logs = 0.0, {}
    for i, w in enumerate(weights):
        L = max(T - 1 - i, 0)                   # positions t whose token t + 2 + i can exist
        mask = loss_mask[:, 1 + i:1 + i + L].bool()
        rows = hidden[:, :L][mask].to(dtype)    # [N, H]
        logits = heads.forward_head(i, rows)    # [N, V]
        ones = torch.ones(rows.shape[0], dtype=torch.bool, device=rows.device)
        tokens = labels[:, 1 + i:1 + i + L][mask]
        if kind == "kl":
            teacher = teacher_logits[:, 1 + i:1 + i + L][mask]
            loss_i = distill_loss(logits, teacher, ones, kind="forward_kl", chunk_size=chunk_size)
        else:
            loss_i = distill_loss(logits, None, ones, kind="ce", labels=tokens, chunk_size=chunk_size)
        total = total + w * loss_i
        logs[f"head{i}_loss"] = loss_i.detach()
        with torch.no_grad():
            logs[f"head{i}_top1"] = (logits.argmax(-1) == tokens).float().mean() if len(tokens) else 0.0
    return total / sum(weights), logs


class HeadsObjective(nn.Module):
    """Medusa-1's trained module: the heads alone. The frozen target's outputs are its inputs, so
    the target can stay outside (no DDP wrapper, no optimizer state, no checkpoint copies)."""

    def __init__(self, heads: MedusaHeads, *, kind: str, decay: float, chunk_size: int = 1024):
        super().__init__()
        self.heads = heads
        self.kind, self.decay, self.chunk_size = kind, decay, chunk_size

    def forward(self, hidden, loss_mask, labels, teacher_logits=None):
        return medusa_heads_loss(self.heads, hidden, loss_mask, labels, kind=self.kind, decay=self.decay,
                                 teacher_logits=teacher_logits, chunk_size=self.chunk_size)


class JointObjective(nn.Module):
    """Medusa-2's trained module (Cai et al. 2024, section 2.3.2): the LoRA-adapted target (a peft
    model) and the heads.

    loss = heads loss (on the adapted target's hidden states, so it trains the adapters too)
         + lm_loss_weight * lm loss (KL(original || adapted), or CE on the target's tokens).
    With kind="kl" the heads' teacher is the ORIGINAL target's distribution (the same
    adapters-off forward the lm loss uses): a fixed teacher the adapted target is held close to.
    """

    def __init__(self, target, heads: MedusaHeads, *, kind: str, decay: float, lm_loss: str,
                 lm_loss_weight: float, chunk_size: int = 1024):
        super().__init__()
        self.target = target
        self.heads = heads
        self.kind, self.decay, self.chunk_size = kind, decay, chunk_size
        self.lm_loss, self.lm_loss_weight = lm_loss, lm_loss_weight

    def forward(self, input_ids, attention_mask, loss_mask, labels, heads_reach_target: bool = True,
                position_ids=None):
        out = self.target(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                          output_hidden_states=True, use_cache=False)
        hidden = out.hidden_states[-1]
        if not heads_reach_target:  # same values, zero gradient: the graph (and DDP) still see every parameter
            hidden = hidden.detach() + 0.0 * hidden
        original = None
        if self.kind == "kl" or self.lm_loss == "kl":
            with torch.no_grad(), self.target.disable_adapter():
                original = self.target(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                       use_cache=False).logits
        heads_loss, logs = medusa_heads_loss(self.heads, hidden, loss_mask, labels, kind=self.kind, decay=self.decay,
                                             teacher_logits=original, chunk_size=self.chunk_size)
        if self.lm_loss == "kl":
            lm = distill_loss(out.logits, original, loss_mask, kind="forward_kl", chunk_size=self.chunk_size)
        else:
            lm = distill_loss(out.logits, None, loss_mask, kind="ce", labels=labels, chunk_size=self.chunk_size)
        logs |= {"heads_loss": heads_loss.detach(), "lm_loss": lm.detach()}
        return heads_loss + self.lm_loss_weight * lm, logs


__all__ = ["HeadsObjective", "JointObjective", "medusa_heads_loss"]
