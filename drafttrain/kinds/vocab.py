"""The draft vocabulary: the target tokens an EAGLE-3 draft can propose.

A reduced vocabulary makes the draft's LM head (often its largest and slowest part) small, and
costs little acceptance: the target's answers use a few thousand tokens most of the time. It is
the N most frequent target tokens in the training answers.

Maps, in the convention SGLang and vLLM load (`llama_eagle3.py`):
- `d2t` (int64, [N]): target_id = draft_id + d2t[draft_id]. Draft ids follow ascending target
  ids (as SpecForge writes them), so d2t >= 0 and a target id's draft id is its rank among the
  kept ids.
- `t2d` (bool, [V]): True where a target token is in the draft vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import torch


@dataclass(frozen=True)
class DraftVocab:
    """The kept target ids, ascending, and the size of the target's vocabulary."""

    target_ids: torch.Tensor  # int64 [N], strictly ascending
    vocab_size: int

    def __post_init__(self):
        ids = self.target_ids
        if ids.dim() != 1 or ids.numel() == 0:
            raise ValueError("a draft vocabulary needs at least one token")
        if ids.dtype != torch.long:
            raise ValueError(f"target_ids must be int64, got {ids.dtype}")
        if bool((ids[1:] <= ids[:-1]).any()):
            raise ValueError("target_ids must be strictly ascending (no duplicates)")
        if int(ids[0]) < 0 or int(ids[-1]) >= self.vocab_size:
            raise ValueError(f"target_ids must lie in [0, {self.vocab_size})")

    @property
    def size(self) -> int:
        return self.target_ids.numel()

    @property
    def d2t(self) -> torch.Tensor:
        return self.target_ids - torch.arange(self.size, dtype=torch.long)

    @property
    def t2d(self) -> torch.Tensor:
        mask = torch.zeros(self.vocab_size, dtype=torch.bool)
        mask[self.target_ids] = True
        return mask

    @classmethod
    def from_d2t(cls, d2t: torch.Tensor, vocab_size: int) -> "DraftVocab":
        """Read back a saved `d2t` (e.g. of a checkpoint written by SpecForge or drafttrain)."""
        d2t = d2t.detach().to("cpu", torch.long)
        return cls(d2t + torch.arange(d2t.numel(), dtype=torch.long), vocab_size)


def token_counts(token_lists: Iterable[Sequence[int]], vocab_size: int) -> torch.Tensor:
    """How often each target token occurs in `token_lists` (int64 [vocab_size])."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for tokens in token_lists:
        ids = torch.as_tensor(list(tokens), dtype=torch.long)
        if ids.numel():
            if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
                raise ValueError(f"token id outside the target's vocabulary of {vocab_size}")
            counts += torch.bincount(ids, minlength=vocab_size)
    return counts


def build_draft_vocab(token_lists: Iterable[Sequence[int]], vocab_size: int, draft_vocab_size: int,
                      always_include: Sequence[int] = ()) -> DraftVocab:
    """The `draft_vocab_size` most frequent tokens of `token_lists` (the target's training answers).

    Ties (tokens seen equally often, including never) go to the lower token id, so the result
    depends on the counts only, not on the order of the data. `always_include` (e.g. the EOS
    ids: a draft that cannot propose the end of an answer loses a token on every answer) are
    kept whatever their counts, in place of the least frequent others.
    """
    if not 0 < draft_vocab_size <= vocab_size:
        raise ValueError(f"draft_vocab_size must be in [1, {vocab_size}], got {draft_vocab_size}")
    forced = sorted({int(i) for i in always_include})
    if len(forced) > draft_vocab_size:
        raise ValueError(f"always_include has {len(forced)} tokens, more than draft_vocab_size {draft_vocab_size}")
    if forced and (forced[0] < 0 or forced[-1] >= vocab_size):
        raise ValueError(f"always_include ids must lie in [0, {vocab_size})")
    counts = token_counts(token_lists, vocab_size)
    # Sort by (-count, id): a stable sort of the ids by descending count keeps ties in id order.
    order = torch.sort(-counts, stable=True).indices
    if forced:
        order = order[~torch.isin(order, torch.tensor(forced, dtype=torch.long))]
    chosen = torch.cat([torch.tensor(forced, dtype=torch.long), order[:draft_vocab_size - len(forced)]])
    return DraftVocab(torch.sort(chosen).values, vocab_size)
