"""The oracle's declaration (`KIND`): `bench`'s row that measures the engine at a set acceptance.
"""

from __future__ import annotations

from typing import TYPE_CHECKING


from ...decoding.chain import ChainDecoder
from ..base import Drafter, DrafterKind, chain_decoder
from .decode import (OracleProposer)

if TYPE_CHECKING:
    from ...decoding.engines import CachedLM
    from ...decoding.settings import DecodeSettings


class OracleKind(DrafterKind):
    name = "oracle"  # `drafttrain bench` only: no flag

    def build(self, target: CachedLM, d: Drafter, s: DecodeSettings) -> ChainDecoder:
        """A chain decoder of the oracle's corrupted references (`d.model`) at `d.info["alpha"]`."""
        oracle = OracleProposer(d.model, d.info["alpha"], d.info.get("vocab", target.vocab_size), target.device,
                                seed=d.info.get("seed", 0))
        return chain_decoder(target, oracle, s)


KIND = OracleKind()
