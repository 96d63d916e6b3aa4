"""Lossless speculative decoding: a target verifies a drafter's proposals in one forward pass.

The engine (`cached_lm`: eager or static cached LMs), the decoders (chain: `SpeculativeDecoder`
with a `Proposer`; tree: `TreeDecoder` with a `TreeDrafter`; `MedusaDecoder` picks one for Medusa
heads), and batched generation of the target's answers (`batch`).
"""

from .decoder import Decoder, Generation
from .eager import EagerLM
from .engine import ENGINES, as_cached_lm, cached_lm, resolve_engine
from .lm import CachedLM
from .proposers import DraftModelProposer, NgramProposer, NoProposer, OracleProposer, Proposer, ngram_lookup
from .speculative import SpeculativeDecoder
from .static import StaticLM, static_support
from .tree import Tree, tree_from_parents
from .tree_decoder import TreeDecoder, TreeDrafter

__all__ = ["CachedLM", "Decoder", "DraftModelProposer", "ENGINES", "EagerLM", "Generation", "NgramProposer",
           "NoProposer", "OracleProposer", "Proposer", "SpeculativeDecoder", "StaticLM", "Tree", "TreeDecoder",
           "TreeDrafter", "as_cached_lm", "cached_lm", "ngram_lookup", "resolve_engine", "static_support",
           "tree_from_parents"]
