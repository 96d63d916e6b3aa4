"""A draft LM: a small same-family model drafting K tokens in a row on its own cached LM."""

from __future__ import annotations

import torch

from ..chain import Proposer
from ..engines import as_cached_lm, device_tensor
from ..verify import probabilities, sample


def target_vocab_logits(logits: torch.Tensor, vocab: int) -> torch.Tensor:
    """A draft's logits over the target's `vocab` tokens (a padded embedding matrix is fine)."""
    v = logits.shape[-1]
    if v > vocab:
        return logits[..., :vocab]
    if v < vocab:
        pad = logits.new_full((*logits.shape[:-1], vocab - v), float("-inf"))
        return torch.cat([logits, pad], dim=-1)
    return logits


class DraftModelProposer(Proposer):
    """A small LM drafting autoregressively on its own KV cache.

    The cache holds every token of the sequence except `pending` (tokens emitted but not yet fed
    to the draft). Feeding `pending` first is what puts the last accepted token into the draft's
    cache when all k drafts were accepted (the k-th draft itself was never fed). `model`: a
    cached LM (any engine) or a plain HF model (eager).
    """

    name = "draft"

    def __init__(self, model, target_vocab_size: int, temperature: float, top_p: float,
                 generator: torch.Generator | None, num_draft_tokens: int = 1):
        """`num_draft_tokens`: K, which bounds what the draft catches up with in one forward."""
        self.lm = as_cached_lm(model)
        self.k = num_draft_tokens
        self.vocab = target_vocab_size
        self.temperature, self.top_p, self.generator = temperature, top_p, generator
        self.device = self.lm.device
        self.pending: list[int] = []
        self.fed = 0  # drafts of the current step fed back into the cache

    def reset(self, prompt, hidden=None):
        self.lm.reset()
        self.pending = list(prompt)
        self.fed = 0

    def warmup(self) -> float:
        # Pending is one token (the bonus) or two (the last draft + the bonus); drafts go one by one.
        # Beside n-gram lookup (+ngram) a step may accept the lookup's branch: up to K + 1 tokens.
        return self.lm.warmup([1, 2, self.k + 1])

    def propose(self, k, sequence):
        tokens, dists = [], []
        step_input = device_tensor(self.pending, self.device)
        self.fed = 0
        for i in range(k):
            logits = target_vocab_logits(self.lm.forward(step_input)[0][-1], self.vocab)
            self.forwards += 1
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

    def commit(self, n_accepted, emitted, hidden=None):
        keep = min(n_accepted, self.fed)
        self.lm.rollback(self.lm.length - (self.fed - keep))
        self.pending = self.pending + list(emitted[keep:])
        self.fed = 0
