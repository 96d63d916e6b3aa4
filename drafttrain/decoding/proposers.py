"""Proposers: where a chain decoder's draft tokens come from.

A proposer sees the whole token sequence so far and proposes up to k next tokens, together with
the distribution q each was drawn from (None: a deterministic proposal, i.e. one-hot q). After
the target has verified them, `commit` tells it which tokens were emitted so it can keep its
own state (a draft model's KV cache) in step.

A proposer that reads the target's hidden states (EAGLE-style) names the layers it wants in
`hidden_layers` (transformers' `output_hidden_states` indexing: 0 = embeddings, L = the final
post-norm state). The decoder then asks the target for them in the same forward passes it runs
anyway and hands over those of every position that enters the target's cache: the prompt's
(all but its last token) to `reset(prompt, hidden=...)`, and after each step those of pending
plus the accepted drafts to `commit(n_accepted, emitted, hidden=...)`, [n_accepted + 1, D].
"""

from __future__ import annotations

import random

import torch

from .engine import as_cached_lm
from .lm import device_tensor
from .sampling import probabilities, sample


class Proposer:
    name = "none"
    hidden_layers: tuple[int, ...] = ()

    def reset(self, prompt: list[int], hidden: torch.Tensor | None = None) -> None:
        pass

    def propose(self, k: int, sequence: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        raise NotImplementedError

    def commit(self, n_accepted: int, emitted: list[int], hidden: torch.Tensor | None = None) -> None:
        pass

    def warmup(self) -> float:
        """Compile/capture whatever the proposer runs; returns the seconds spent."""
        return 0.0


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
        self.device, self.max_ngram, self.min_ngram = torch.device(device), max_ngram, min_ngram

    def propose(self, k, sequence):
        return device_tensor(ngram_lookup(sequence, k, self.max_ngram, self.min_ngram), self.device), None


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
    cache when all k drafts were accepted (the k-th draft itself was never fed). `model`: a
    cached LM (any engine) or a plain HF model (eager).
    """

    name = "draft"

    def __init__(self, model, target_vocab_size: int, temperature: float, top_p: float,
                 generator: torch.Generator | None):
        self.lm = as_cached_lm(model)
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
        return self.lm.warmup([1, 2])

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
        step_input = device_tensor(self.pending, self.device)
        self.fed = 0
        for i in range(k):
            logits = self._logits(self.lm.forward(step_input)[0][-1])
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


class OracleProposer(Proposer):
    """Measures the engine, not a drafter: proposes the target's own greedy continuation with each
    token independently replaced by a different one with probability 1 - alpha.

    Greedy verification then accepts each proposed token with probability alpha, independently:
    exactly the i.i.d. model behind Leviathan et al.'s expected speedup (1 - alpha^(K+1)) /
    (1 - alpha) at zero proposal cost, so measured / predicted speedup is the engine's efficiency.
    `references` maps a prompt (tuple of ids) to the target's greedy continuation of it (e.g. a
    plain-decoding run on the same engine); any shape works, random weights included.
    """

    name = "oracle"

    def __init__(self, references: dict, alpha: float, vocab_size: int, device, seed: int = 0):
        if not 0 <= alpha <= 1:
            raise ValueError(f"alpha must be in [0, 1], got {alpha}")
        if vocab_size < 2:
            raise ValueError("the oracle needs a vocabulary of at least 2 tokens to corrupt a draft")
        self.references = {tuple(p): list(r) for p, r in references.items()}
        self.alpha, self.vocab = alpha, vocab_size
        self.device = torch.device(device)
        self.rng = random.Random(seed)
        self.reference: list[int] = []
        self.prompt_len = 0

    def reset(self, prompt, hidden=None):
        key = tuple(prompt)
        if key not in self.references:
            raise KeyError("the oracle has no greedy continuation for this prompt; decode it plainly first")
        self.reference = self.references[key]
        self.prompt_len = len(prompt)

    def propose(self, k, sequence):
        done = len(sequence) - self.prompt_len
        truth = self.reference[done:done + k]
        draft = [t if self.rng.random() < self.alpha else (t + 1 + self.rng.randrange(self.vocab - 1)) % self.vocab
                 for t in truth]
        return device_tensor(draft, self.device), None
