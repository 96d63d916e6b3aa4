"""Proposers: where draft tokens come from.

A proposer sees the whole token sequence so far and proposes up to k next tokens, together with
the distribution q each was drawn from (None: a deterministic proposal, i.e. one-hot q). After
the target has verified them, `commit` tells it which tokens were emitted so it can keep its
own state (a draft model's KV cache) in step.
"""

from __future__ import annotations

import torch

from .cache import CachedLM
from .sampling import probabilities, sample


class Proposer:
    name = "none"

    def reset(self, prompt: list[int]) -> None:
        pass

    def propose(self, k: int, sequence: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        raise NotImplementedError

    def commit(self, n_accepted: int, emitted: list[int]) -> None:
        pass


class NoProposer(Proposer):
    """Plain decoding on the same engine: the baseline."""

    name = "none"

    def __init__(self, device: torch.device):
        self.empty = torch.empty(0, dtype=torch.long, device=device)

    def propose(self, k, sequence):
        return self.empty, None


class NgramProposer(Proposer):
    """Prompt lookup decoding: continue the latest earlier occurrence of the current suffix."""

    name = "ngram"

    def __init__(self, device: torch.device, max_ngram: int = 3, min_ngram: int = 1):
        self.device, self.max_ngram, self.min_ngram = device, max_ngram, min_ngram

    def propose(self, k, sequence):
        return torch.tensor(ngram_lookup(sequence, k, self.max_ngram, self.min_ngram),
                            dtype=torch.long, device=self.device), None


def ngram_lookup(sequence: list[int], k: int, max_ngram: int = 3, min_ngram: int = 1) -> list[int]:
    """Tokens that followed the most recent earlier match of the longest matching suffix."""
    if k <= 0:
        return []
    n_tokens = len(sequence)
    for n in range(min(max_ngram, n_tokens - 1), min_ngram - 1, -1):
        suffix = sequence[n_tokens - n:]
        for start in range(n_tokens - n - 1, -1, -1):  # latest match first, excluding the suffix itself
            if sequence[start:start + n] == suffix:
                return sequence[start + n:start + n + k]
    return []


class DraftModelProposer(Proposer):
    """A small LM drafting autoregressively on its own KV cache.

    The cache holds every token of the sequence except `pending` (tokens emitted but not yet fed
    to the draft). Feeding `pending` first is what puts the last accepted token into the draft's
    cache when all k drafts were accepted (the k-th draft itself was never fed).
    """

    name = "draft"

    def __init__(self, model, target_vocab_size: int, temperature: float, top_p: float,
                 generator: torch.Generator | None):
        self.lm = CachedLM(model)
        self.vocab = target_vocab_size
        self.temperature, self.top_p, self.generator = temperature, top_p, generator
        self.device = next(model.parameters()).device
        self.pending: list[int] = []
        self.fed = 0  # drafts of the current step fed back into the cache

    def reset(self, prompt):
        self.lm.reset()
        self.pending = list(prompt)
        self.fed = 0

    def _logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Align the draft's vocabulary with the target's (a padded embedding matrix is fine)."""
        v = logits.shape[-1]
        if v > self.vocab:
            return logits[..., : self.vocab]
        if v < self.vocab:
            pad = logits.new_full((*logits.shape[:-1], self.vocab - v), float("-inf"))
            return torch.cat([logits, pad], dim=-1)
        return logits

    def propose(self, k, sequence):
        tokens, dists = [], []
        step_input = torch.tensor(self.pending, dtype=torch.long, device=self.device)
        self.fed = 0
        for i in range(k):
            logits = self._logits(self.lm.forward(step_input)[-1])
            if self.temperature == 0:
                token = logits.argmax(dim=-1, keepdim=True)
            else:
                q = probabilities(logits, self.temperature, self.top_p)
                token = sample(q, self.generator).view(1)
                dists.append(q)
            tokens.append(token)
            if i + 1 < k:
                step_input = token
                self.fed += 1
        if k:
            self.pending = []
        draft = torch.cat(tokens) if tokens else torch.empty(0, dtype=torch.long, device=self.device)
        return draft, (torch.stack(dists) if dists else None)

    def commit(self, n_accepted, emitted):
        keep = min(n_accepted, self.fed)
        self.lm.rollback(self.lm.length - (self.fed - keep))
        self.pending = self.pending + list(emitted[keep:])
        self.fed = 0
