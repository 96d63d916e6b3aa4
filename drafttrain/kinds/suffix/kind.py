"""Suffix lookup's declaration (`KIND`): `--method suffix`, its branch in a model drafter's tree
(`+suffix`) and how vLLM serves it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ...decoding.chain import ChainDecoder
from ..base import Drafter, DrafterKind, chain_decoder
from .decode import SuffixTrie, SuffixProposer, MAX_DEPTH, SPEC_FACTOR, MIN_TOKEN_PROB

if TYPE_CHECKING:
    from ...decoding.engines import CachedLM
    from ...decoding.settings import DecodeSettings


class SuffixKind(DrafterKind):
    name, method, help, label, planned_from_walks = "suffix", True, "suffix lookup", "suffix", True
    served_note = ("vLLM's suffix trees (ArcticInference's) score matches and break ties their own way, so the two "
                   "may propose different drafts (no export is involved)")

    def build(self, target: CachedLM, d: Drafter, s: DecodeSettings) -> ChainDecoder:
        """A chain decoder of suffix lookup."""
        return chain_decoder(target, SuffixProposer(target.device), s)

    def lookup(self, s: DecodeSettings) -> SuffixProposer:
        """Suffix lookup on the host: a hybrid's branch."""
        return SuffixProposer("cpu")

    def bench_rows(self, target: torch.nn.Module, k: int, max_length: int) -> list[tuple[str, Drafter, dict]]:
        """The lookup alone: no model."""
        return [("suffix", Drafter(self.name), {})]

    def vllm(self, path: str | None, k: int, d: Drafter, s: DecodeSettings | None) -> dict:
        """vLLM's suffix decoding with these limits and no global tree of earlier requests' answers
        (max_cached_requests 0), so it drafts from what drafttrain's does: the prompt and the answer."""
        return {"method": "suffix", "num_speculative_tokens": k, "suffix_decoding_max_tree_depth": MAX_DEPTH,
                "suffix_decoding_max_spec_factor": SPEC_FACTOR, "suffix_decoding_min_token_prob": MIN_TOKEN_PROB,
                "suffix_decoding_max_cached_requests": 0}


KIND = SuffixKind()

__all__ = ["KIND", "SuffixProposer", "SuffixTrie"]
