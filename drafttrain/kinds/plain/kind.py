"""Plain decoding, the baseline: the target alone on the same engine and decode loop (K = 0)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...decoding.chain import ChainDecoder, NoProposer
from ..base import Drafter, DrafterKind, chain_decoder

if TYPE_CHECKING:
    import torch

    from ...decoding.engines import CachedLM
    from ...decoding.settings import DecodeSettings


class PlainKind(DrafterKind):
    name, drafts, method, help = "none", False, True, "the target alone"

    def build(self, target: CachedLM, d: Drafter, s: DecodeSettings) -> ChainDecoder:
        """A chain decoder drafting nothing: every step one target token."""
        return chain_decoder(target, NoProposer(target.device), s, k=0)

    def bench_rows(self, target: torch.nn.Module, k: int, max_length: int) -> list[tuple[str, Drafter, dict]]:
        """The target alone: the floor every other row adds to."""
        return [("plain", Drafter(self.name), {})]


KIND = PlainKind()
