"""Plain decoding, the baseline: the target alone on the same engine and decode loop (K = 0)."""

from __future__ import annotations

from ..chain import NoProposer
from .kind import DrafterKind, chain_decoder


def _plain(target, drafter, s):
    return chain_decoder(target, NoProposer(target.device), s, k=0)


KIND = DrafterKind("none", _plain, drafts=False, method=True, help="the target alone")
