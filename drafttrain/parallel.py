"""Parallel draft LMs (PARD): K drafts from ONE forward over [the sequence, K-1 mask tokens].

At decoding time a parallel draft reads `[x_0 .. x_t, m, m, ..., m]` (K-1 copies of one mask
token, positions t+1 .. t+K-1, plain causal attention): its logits at x_t propose token t+1, at
mask j token t+1+j. The mask token is an existing token id the data never uses (`mask_token_id`),
named in the exported config as `pard_token`, as PARD's checkpoints and vLLM's parallel drafting
read it.

Training sees every such view of a sequence at once (`ParallelLayout`): the real tokens, then
K-1 blocks of masks, block b standing for "depth b". The mask of block b at position p plays
mask b after the last real token t = p - b: it sits at position p, attends to the real tokens
x_0 .. x_{p-b} and to its own chain (block b' at position p - b + b', for b' = 1 .. b), never to
other chains, and real tokens never attend to masks. Its target is the target model's
distribution at position p (for token p + 1), exactly what a decoder drafting from x_t needs.
Mask blocks only span the trained window (plus K-1 positions of chain before it), so a sequence
whose loss covers a short answer after a long prompt costs little more than one forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import UserError


def mask_token_id(tokenizer, choice: int | str = "auto") -> int:
    """The token id a parallel draft uses as its mask: `choice` (an id or a token), or, for "auto",
    the last added token that is not one of the tokenizer's special tokens (e.g. SmolLM2's
    `<empty_output>`): an existing embedding row that ordinary text never produces."""
    if choice != "auto":
        ids = tokenizer.convert_tokens_to_ids(choice) if isinstance(choice, str) else choice
        if not isinstance(ids, int) or not 0 <= ids < len(tokenizer):
            raise UserError(f"draft.mask_token {choice!r} is not a token of the target's tokenizer; give a token id "
                            f"below {len(tokenizer)} or an added token such as a reserved special token")
        return ids
    special = set(tokenizer.all_special_ids)
    added = sorted(i for i in getattr(tokenizer, "added_tokens_decoder", {}) if i not in special)
    if not added:
        raise UserError("the target's tokenizer has no spare added token to use as the parallel draft's mask; set "
                        "draft.mask_token to a token id that the training text never contains")
    return added[-1]


def mark_parallel(model, mask_id: int, parallel_tokens: int) -> None:
    """Record in `model.config` what makes it a parallel draft, so the exported config.json carries
    it: `pard_token` (the mask id, where PARD's checkpoints and vLLM's parallel drafting read it),
    `spd_type` "pard" (as AMD's checkpoints), and `drafttrain.parallel_tokens` (K it was trained for)."""
    config = model.config
    config.pard_token = int(mask_id)
    config.spd_type = "pard"
    config.drafttrain = {**(getattr(config, "drafttrain", None) or {}), "parallel_tokens": int(parallel_tokens)}


def parallel_info(config) -> dict | None:
    """{"pard_token", "parallel_tokens"} of a parallel draft's config (None for a sequential draft)."""
    token = getattr(config, "pard_token", None)
    if not isinstance(token, int) or isinstance(token, bool):
        return None
    trained = (getattr(config, "drafttrain", None) or {}).get("parallel_tokens")
    return {"pard_token": token, "parallel_tokens": trained}


@dataclass
class ParallelLayout:
    """A batch laid out for parallel-draft training: the real tokens [B, L], then `depth - 1`
    blocks of masks, each covering positions `first .. L-1`, and the attention that gives every
    mask exactly what it sees at decoding time."""

    input_ids: torch.Tensor       # [B, L + (depth-1) * span]
    position_ids: torch.Tensor    # the same shape
    attention_mask: torch.Tensor  # [B, 1, T, T] bool: True = may attend
    depth: int                    # K: drafts per forward (the real block counts as depth 0)
    start: int                    # the first trained position
    first: int                    # the first position a mask block covers
    length: int                   # L

    @property
    def span(self) -> int:
        return self.length - self.first

    def additive_mask(self, dtype: torch.dtype) -> torch.Tensor:
        """The attention mask as the model's kernels take a 4-D one: 0 = attend, finfo.min = blocked."""
        return torch.zeros(self.attention_mask.shape, dtype=dtype, device=self.attention_mask.device).masked_fill_(
            ~self.attention_mask, torch.finfo(dtype).min)

    @property
    def logits_to_keep(self) -> int:
        """Logits from the first trained position of the real block to the end (every mask block)."""
        return self.input_ids.shape[1] - self.start

    def student(self, logits: torch.Tensor) -> torch.Tensor:
        """[B, depth * W, V] from the kept logits: the trained window W = L - start of the real
        block, then of each mask block (block b's row p predicts token p + 1 from x_0 .. x_{p-b})."""
        window = self.length - self.start
        blocks = [logits[:, :window]]
        for b in range(1, self.depth):
            offset = window + (b - 1) * self.span + (self.start - self.first)
            blocks.append(logits[:, offset:offset + window])
        return torch.cat(blocks, dim=1)

    def repeat(self, window: torch.Tensor) -> torch.Tensor:
        """A per-position tensor of the trained window [B, W, ...] (the teacher, labels) for every block."""
        return torch.cat([window] * self.depth, dim=1)

    def trained(self, loss_mask: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
        """[B, depth * W]: which rows of `student` carry a loss: block b's row p when position p is
        trained (`loss_mask`) and x_{p-b}, the last real token it drafts from, is a real token."""
        window = loss_mask[:, self.start:]
        rows = [window]
        for b in range(1, self.depth):
            behind = torch.zeros_like(window)
            p = torch.arange(self.start, self.length, device=window.device)
            ok = p - b >= 0
            behind[:, ok] = real[:, (p - b)[ok]].bool()
            rows.append(window & behind)
        return torch.cat(rows, dim=1)


def parallel_layout(input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor, *,
                    start: int, depth: int, mask_id: int) -> ParallelLayout:
    """The `ParallelLayout` of a right-padded (or prompt-aligned) batch whose loss begins at `start`."""
    if depth < 2:
        raise ValueError(f"a parallel layout needs depth >= 2 (K drafts per forward), got {depth}")
    B, L = input_ids.shape
    device = input_ids.device
    first = max(start - (depth - 1), 0)
    span = L - first
    T = L + (depth - 1) * span
    ids = torch.cat([input_ids, input_ids.new_full((B, (depth - 1) * span), mask_id)], dim=1)
    positions = torch.cat([position_ids] + [position_ids[:, first:]] * (depth - 1), dim=1)

    real = attention_mask.bool()
    allowed = torch.zeros(B, T, T, dtype=torch.bool, device=device)
    allowed[:, :L, :L] = torch.ones(L, L, dtype=torch.bool, device=device).tril() & real[:, None, :]
    p = torch.arange(first, L, device=device)                       # positions a mask block covers
    col_of_real = torch.arange(L, device=device)
    for b in range(1, depth):
        rows = L + (b - 1) * span + (p - first)                       # block b's row of position p
        sees_real = (col_of_real[None, :] <= (p - b)[:, None])        # x_0 .. x_{p-b}
        allowed[:, rows[:, None], col_of_real[None, :]] = sees_real & real[:, None, :]
        for b2 in range(1, b + 1):                                    # its chain: block b2 at p - b + b2
            q = p - b + b2
            ok = q >= first
            cols = L + (b2 - 1) * span + (q[ok] - first)
            allowed[:, rows[ok], cols] = True
    idx = torch.arange(T, device=device)
    allowed[:, idx, idx] = True  # every row sees itself (padding rows too: never an empty softmax)
    return ParallelLayout(ids, positions, allowed[:, None], depth, start, first, L)


__all__ = ["ParallelLayout", "mark_parallel", "mask_token_id", "parallel_info", "parallel_layout"]
