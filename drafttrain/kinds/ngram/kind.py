"""n-gram lookup's declaration (`KIND`): `--method ngram`, its `--ngram-max`, its branch in a
model drafter's tree (`+ngram`) and how vLLM serves it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ...config import setting
from ...decoding.chain import ChainDecoder
from ..base import Drafter, DrafterKind, chain_decoder
from .decode import NgramProposer

if TYPE_CHECKING:
    from ...decoding.engines import CachedLM
    from ...decoding.settings import DecodeSettings


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
