"""N-gram drafting (prompt lookup): continue the latest earlier occurrence of the current suffix.

Free to propose (no model), and strong wherever the output copies its context, as code does.
"""

from __future__ import annotations

import torch

from ...decoding.chain import Proposer
from ...decoding.engines import device_tensor


class NgramProposer(Proposer):
    """Prompt lookup decoding: continue the latest earlier occurrence of the current suffix."""

    name = "ngram"

    def __init__(self, device: torch.device, max_ngram: int = 3, min_ngram: int = 1):
        self.device, self.max_ngram, self.min_ngram = torch.device(device), max_ngram, min_ngram

    def lookup(self, k: int, sequence: list[int]) -> list[int]:
        """The continuation on the host (what a hybrid hangs from a model's tree)."""
        return ngram_lookup(sequence, k, self.max_ngram, self.min_ngram)

    def propose(self, k, sequence):
        return device_tensor(self.lookup(k, sequence), self.device), None


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
