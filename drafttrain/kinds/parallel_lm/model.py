"""Parallel draft LMs (PARD): K drafts from ONE forward over [the sequence, K-1 mask tokens].

At decoding time a parallel draft reads `[x_0 .. x_t, m, m, ..., m]` (K-1 copies of one mask
token, positions t+1 .. t+K-1, plain causal attention): its logits at x_t propose token t+1, at
mask j token t+1+j. The mask token is an existing token id the data never uses (`tokens.mask_token_id`),
named in the exported config as `pard_token`, as PARD's checkpoints and vLLM's parallel drafting
read it.

Training sees every such view of a sequence at once (`ParallelLayout`): the real tokens, then
K-1 blocks of masks, block b standing for "depth b". The mask of block b at position p plays
mask b after the last real token t = p - b: it sits at position p, attends to the real tokens
x_0 .. x_{p-b} and to its own chain (block b' at position p - b + b', for b' = 1 .. b), never to
other chains, and real tokens never attend to masks. Its target is the target model's
distribution at position p (for token p + 1), exactly what a decoder drafting from x_t needs.
Mask blocks only span the trained window (plus K-1 positions of chain before it), so a sequence
whose loss covers a short answer after a long prompt costs little more than one forward; PARD's
conditional drop (`mask_positions`' keep) thins the deeper blocks further.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...errors import UserError


# The most tokens a parallel draft drafts per forward. Training holds K-1 blocks of masks beside the
# sequence, so a step costs about K forwards of it; and the K-th draft is accepted only when every one
# before it was (0.8^16 = 3%), so past 16 a deeper draft costs more than it can ever return (eval's
# --num-draft-tokens auto weighs at most 6).
PARALLEL_MAX_TOKENS = 16
PARALLEL_LIMIT_REASON = (f"at most {PARALLEL_MAX_TOKENS}: training holds K-1 blocks of mask tokens beside each sequence "
                         "(a step costs about K forwards), and the K-th draft counts only when all before it are "
                         "accepted, so deeper drafts cost more than they can return")


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
    if not _is_int(token):
        return None
    trained = (getattr(config, "drafttrain", None) or {}).get("parallel_tokens")
    return {"pard_token": token, "parallel_tokens": trained}


def check_parallel_config(model, path: str) -> None:
    """A draft whose config.json says it is parallel (`pard_token`, `spd_type` "pard", or a recorded
    `drafttrain.parallel_tokens`) must say it whole, as an EAGLE-3 export is checked on load: a mask
    token outside the vocabulary was an IndexError mid-decode, and one missing or not an integer
    decoded the draft as a sequential one (K forwards a step), silently. A recorded K must be a K it
    can draft: from 2 to `PARALLEL_MAX_TOKENS`, and below its context."""
    config = model.config
    token = getattr(config, "pard_token", None)
    trained = (getattr(config, "drafttrain", None) or {}).get("parallel_tokens")
    if token is None and getattr(config, "spd_type", None) != "pard" and not trained:
        return  # a sequential draft
    vocab = model.get_input_embeddings().num_embeddings
    where = f"the parallel draft at {path!r} (its config.json)"
    if not _is_int(token) or not 0 <= token < vocab:
        raise UserError(f"{where} has pard_token {token!r}, not the id of a token of its vocabulary of {vocab}; set "
                        "pard_token to the mask token's id, or export the draft again")
    from ...models import context_length

    context = context_length(model) or PARALLEL_MAX_TOKENS + 1
    limit = min(PARALLEL_MAX_TOKENS, context - 1)
    if trained is not None and not (_is_int(trained) and 2 <= trained <= limit):
        raise UserError(f"{where} records drafttrain.parallel_tokens {trained!r}, but a parallel draft drafts 2 to "
                        f"{limit} tokens a forward ({PARALLEL_LIMIT_REASON}, and below its context of {context}); "
                        "export the draft again")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass
class ParallelLayout:
    """A batch laid out for parallel-draft training: the real tokens [B, L], then one block of
    masks per depth b = 1 .. K-1 at the positions `positions[b]`, and the attention that gives every
    mask exactly what it sees at decoding time."""

    input_ids: torch.Tensor          # [B, L + sum of the mask blocks' lengths]
    position_ids: torch.Tensor       # the same shape
    attention_mask: torch.Tensor     # [B, 1, T, T] bool: True = may attend
    positions: list[torch.Tensor]    # per depth (0 = the real block's trained window): its positions
    start: int                       # the first trained position
    length: int                      # L

    @property
    def depth(self) -> int:
        return len(self.positions)

    def additive_mask(self, dtype: torch.dtype) -> torch.Tensor:
        """The attention mask as the model's kernels take a 4-D one: 0 = attend, finfo.min = blocked."""
        return torch.zeros(self.attention_mask.shape, dtype=dtype, device=self.attention_mask.device).masked_fill_(
            ~self.attention_mask, torch.finfo(dtype).min)

    @property
    def logits_to_keep(self) -> torch.Tensor:
        """The sequence indices whose logits carry a loss (transformers' `logits_to_keep` takes
        them as a 1-D tensor, so the LM head runs on those rows only), depth after depth: the real
        block's window, then each mask block's positions at or after `start` (depth b's row p
        predicts token p + 1 from x_0 .. x_{p-b})."""
        index, offset = [], 0
        for b, p in enumerate(self.positions):
            rows = torch.arange(len(p), device=p.device) + offset if b else p
            index.append(rows[p >= self.start])
            offset += len(p) if b else self.length
        return torch.cat(index)

    def _trained_positions(self) -> list[torch.Tensor]:
        return [p[p >= self.start] for p in self.positions]

    def rows(self) -> list[tuple[int, int]]:
        """(depth, position) of each row the model returns with `logits_to_keep`."""
        return [(b, int(p)) for b, ps in enumerate(self._trained_positions()) for p in ps]

    def row_depths(self) -> torch.Tensor:
        """The depth (0: the real tokens' rows, which draft the first token) of each row the model
        returns with `logits_to_keep`, [rows]."""
        return torch.cat([torch.full((len(p),), b, dtype=torch.long, device=p.device)
                          for b, p in enumerate(self._trained_positions())])

    def repeat(self, window: torch.Tensor) -> torch.Tensor:
        """A per-position tensor of the trained window [B, W, ...] (the teacher, labels), gathered
        for every row of the logits."""
        return torch.cat([window[:, p - self.start] for p in self._trained_positions()], dim=1)

    def trained(self, loss_mask: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
        """Which rows of the logits carry a loss: depth b's row p when position p is trained
        (`loss_mask`) and x_{p-b}, the last real token it drafts from, is a real token."""
        rows = []
        for b, p in enumerate(self._trained_positions()):
            behind = torch.zeros(loss_mask.shape[0], len(p), dtype=torch.bool, device=loss_mask.device)
            ok = p - b >= 0
            behind[:, ok] = real[:, (p - b)[ok]].bool()
            rows.append(loss_mask[:, p] & behind)
        return torch.cat(rows, dim=1)


def depth_balanced(loss_over, mask: torch.Tensor, depths: torch.Tensor) -> torch.Tensor:
    """The mean over depths of each depth's loss (`loss_over(mask)`: a mean over the mask's rows),
    so that every depth weighs the same however many rows the conditional drop left it: the
    deepest masks, the fewest rows, learn as fast as the first draft. `depths`: each row's depth
    (`ParallelLayout.row_depths`); a depth with no trained row is left out."""
    per_depth = [mask & (depths == b) for b in torch.unique(depths).tolist()]
    return torch.stack([loss_over(m) for m in per_depth if m.any()]).mean()


def mask_positions(first: int, length: int, depth: int, keep: float = 1.0, keep_min: float = 0.2,
                   generator: torch.Generator | None = None) -> list[torch.Tensor]:
    """Each mask block's positions, depth 1 .. K-1. Depth 1 covers `first` .. L-1; depth b only
    positions whose chain predecessor (depth b-1, position p-1) is there, so every mask sees its
    whole chain. With `keep` < 1, PARD's conditional drop: depth b keeps a random
    max(keep^b, keep_min) of the span among those, so deep masks cost a fraction of a forward."""
    span = length - first
    blocks, previous = [], None
    for b in range(1, depth):
        candidates = torch.arange(first, length) if previous is None else (previous + 1)[previous + 1 < length]
        if keep < 1.0:
            n = min(len(candidates), max(int(span * max(keep ** b, keep_min)), 1))
            candidates = candidates[torch.randperm(len(candidates), generator=generator)[:n]].sort().values
        blocks.append(candidates)
        previous = candidates
    return blocks


def parallel_layout(input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor, *,
                    start: int, depth: int, mask_id: int, keep: float = 1.0, keep_min: float = 0.2,
                    generator: torch.Generator | None = None) -> ParallelLayout:
    """The `ParallelLayout` of a right-padded (or prompt-aligned) batch whose loss begins at `start`
    (`keep`, `keep_min`, `generator`: `mask_positions`' conditional drop)."""
    if depth < 2:
        raise ValueError(f"a parallel layout needs depth >= 2 (K drafts per forward), got {depth}")
    B, L = input_ids.shape
    device = input_ids.device
    first = max(start - (depth - 1), 0)
    blocks = [p.to(device) for p in mask_positions(first, L, depth, keep, keep_min, generator)]
    T = L + sum(len(p) for p in blocks)
    ids = torch.cat([input_ids, input_ids.new_full((B, T - L), mask_id)], dim=1)
    positions = torch.cat([position_ids] + [position_ids[:, p] for p in blocks], dim=1)

    real = attention_mask.bool()
    allowed = torch.zeros(B, T, T, dtype=torch.bool, device=device)
    allowed[:, :L, :L] = torch.ones(L, L, dtype=torch.bool, device=device).tril() & real[:, None, :]
    row_of = torch.full((depth, L), -1, dtype=torch.long, device=device)  # the row of (depth, position)
    offset = L
    for b, p in enumerate(blocks, start=1):
        row_of[b, p] = offset + torch.arange(len(p), device=device)
        offset += len(p)
    col_of_real = torch.arange(L, device=device)
    for b, p in enumerate(blocks, start=1):
        rows = row_of[b, p]
        allowed[:, rows[:, None], col_of_real[None, :]] = (col_of_real[None, :] <= (p - b)[:, None]) & real[:, None, :]
        for b2 in range(1, b + 1):                          # its chain: depth b2 at p - b + b2 (there by construction)
            allowed[:, rows, row_of[b2, p - b + b2]] = True
    idx = torch.arange(T, device=device)
    allowed[:, idx, idx] = True  # every row sees itself (padding rows too: never an empty softmax)
    window = torch.arange(start, L, device=device)
    return ParallelLayout(ids, positions, allowed[:, None], [window, *blocks], start, L)


__all__ = ["PARALLEL_MAX_TOKENS", "ParallelLayout", "check_parallel_config", "depth_balanced", "mark_parallel", "mask_positions",
           "parallel_info", "parallel_layout"]
