"""Lossless speculative decoding: a target verifies a proposer's drafts in one forward pass."""

from .proposers import DraftModelProposer, NgramProposer, NoProposer, Proposer, ngram_lookup
from .speculative import Generation, SpeculativeDecoder

__all__ = ["DraftModelProposer", "Generation", "NgramProposer", "NoProposer", "Proposer",
           "SpeculativeDecoder", "ngram_lookup"]
