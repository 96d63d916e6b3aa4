"""The oracle drafter: measures the engine, not a drafter (`drafttrain bench`)."""

from __future__ import annotations

import random

import torch

from ...decoding.chain import Proposer
from ...decoding.engines import device_tensor


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
