"""Lossless speculative decoding (batch size 1): a target verifies a drafter's proposals in one pass.

Where things live (read top to bottom for one step):
- `engines/`: how a model runs, as a `CachedLM` (eager, static with compiled steps);
- `loop.py`: the decode loop every decoder shares (prefill, steps, EOS, the `Generation` record);
  `batch.py`: batched generation of the target's answers for the recipes, on the static engine;
- `verify.py`: the acceptance rules (greedy and sampled, chain and tree) that keep it lossless;
- `chain.py` / `tree.py`: the chain decoder (a `Proposer` drafts K tokens) and the tree decoder
  (a `TreeDrafter` proposes a tree);
- `dynamic_tree.py`: EAGLE-2's dynamic tree, grown on the device by any draft with per-token logits;
- `hybrid.py`: a lookup's chain joined to a model drafter's chain or tree (`+ngram`);
- `settings.py`: what every decoder of a run shares (`DecodeSettings`);
- `timing.py`: what a forward costs on this machine (reports' cost ratios, plans' costs).

Where drafts come from is `drafttrain/kinds/` (one folder per drafter kind), and the one decoder
factory is `kinds/factory.py`: `build_decoder(target, Drafter(kind, ...), DecodeSettings(...))`. A new
acceptance rule is a class in `verify.py` (decoders take it as `rule`); a new architecture for the
static engine goes in `engines/static.py`.
"""

from .chain import ChainDecoder, NoProposer, Proposer
from .engines import ENGINES, CachedLM, EagerLM, StaticLM, as_cached_lm, cached_lm, resolve_engine, static_support
from .loop import Decoder, Generation
from .settings import NUM_DRAFT_TOKENS, DecodeSettings
from .tree import TreeDecoder, TreeDrafter

__all__ = ["CachedLM", "ChainDecoder", "DecodeSettings", "Decoder", "ENGINES", "EagerLM", "Generation",
           "NUM_DRAFT_TOKENS", "NoProposer", "Proposer", "StaticLM", "TreeDecoder", "TreeDrafter", "as_cached_lm",
           "cached_lm", "resolve_engine", "static_support"]
