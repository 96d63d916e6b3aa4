"""N-gram drafting (prompt lookup): continue the latest earlier occurrence of the current suffix.

Free to propose (no model), and strong wherever the output copies its context, as code does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ...config import setting
from ..chain import ChainDecoder, Proposer
from ..engines import device_tensor
from .kind import Drafter, DrafterKind, chain_decoder

if TYPE_CHECKING:
    from ..engines import CachedLM
    from ..factory import DecodeSettings


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


class NgramKind(DrafterKind):
    name, method, help, label, planned_from_walks = "ngram", True, "prompt lookup", "n-gram", True
    served_note = ("vLLM continues the earliest match of the longest suffix, drafttrain the latest, so the two "
                   "propose different drafts (no export is involved)")

    def settings(self) -> dict[str, tuple[str, object]]:
        """--ngram-max N: the longest suffix looked up."""
        return {"ngram_max": ("int", setting(3, "Longest suffix n-gram that n-gram lookup matches.", metavar="N",
                                             at_least=1))}

    def build(self, target: CachedLM, d: Drafter, s: DecodeSettings) -> ChainDecoder:
        """A chain decoder of prompt lookup up to --ngram-max tokens long."""
        return chain_decoder(target, NgramProposer(target.device, max_ngram=self.value(s, "ngram_max")), s)

    def lookup(self, s: DecodeSettings) -> NgramProposer:
        """Prompt lookup on the host: a hybrid's branch."""
        return NgramProposer("cpu", max_ngram=self.value(s, "ngram_max"))

    def bench_rows(self, target: torch.nn.Module, k: int, max_length: int) -> list[tuple[str, Drafter, dict]]:
        """The lookup alone: no model."""
        return [("n-gram", Drafter(self.name), {})]

    def vllm(self, path: str | None, k: int, d: Drafter, s: DecodeSettings | None) -> dict:
        """vLLM's prompt lookup with the same longest n-gram."""
        return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1,
                "prompt_lookup_max": self.value(s, "ngram_max")}


KIND = NgramKind()
