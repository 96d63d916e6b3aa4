"""Lossless speculative decoding (batch size 1): a target verifies a drafter's proposals in one pass.

Where things live (read top to bottom for one step):
- `engines/`: how a model runs, as a `CachedLM` (eager, static with compiled steps);
- `loop.py`: the decode loop every decoder shares (prefill, steps, EOS, the `Generation` record);
  `batch.py`: batched generation of the target's answers for the recipes, on the static engine;
- `verify.py`: the acceptance rules (greedy and sampled, chain and tree) that keep it lossless;
- `chain.py` / `tree.py`: the chain decoder (a `Proposer` drafts K tokens) and the tree decoder
  (a `TreeDrafter` proposes a tree);
- `drafters/`: one file per drafter kind (draft LM, parallel draft, n-gram, suffix, oracle, Medusa,
  EAGLE-3 and its caches), each declaring its `DrafterKind` once, listed in `drafters.REGISTRY`;
- `factory.py`: the one decoder factory, `build_decoder(target, Drafter(kind, ...), DecodeSettings(...))`;
- `timing.py`: what a forward costs on this machine (reports' cost ratios, plans' costs).

A new drafter kind is a file in `drafters/` and a line in `drafters.REGISTRY`; a new acceptance
rule is a class in `verify.py` (decoders take it as `rule`); a new architecture for the static
engine goes in `engines/static.py`.
"""

from .chain import ChainDecoder, NoProposer, Proposer
from .drafters.draft_lm import DraftModelProposer
from .drafters.ngram import NgramProposer, ngram_lookup
from .drafters.oracle import OracleProposer
from .engines import ENGINES, CachedLM, EagerLM, StaticLM, as_cached_lm, cached_lm, resolve_engine, static_support
from .factory import NUM_DRAFT_TOKENS, DecodeSettings, Drafter, build_decoder
from .loop import Decoder, Generation
from .tree import TreeDecoder, TreeDrafter

__all__ = ["CachedLM", "ChainDecoder", "DecodeSettings", "Decoder", "DraftModelProposer", "Drafter", "ENGINES",
           "EagerLM", "Generation", "NUM_DRAFT_TOKENS", "NgramProposer", "NoProposer", "OracleProposer", "Proposer",
           "StaticLM", "TreeDecoder", "TreeDrafter", "as_cached_lm", "build_decoder", "cached_lm", "ngram_lookup",
           "resolve_engine", "static_support"]
