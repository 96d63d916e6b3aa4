"""Deprecated import path: `CachedLM(model)` here is the eager engine (`decoding.eager.EagerLM`).

Kept so that `from drafttrain.decoding.cache import CachedLM; CachedLM(model)` (the evaluation
code before the engine switch) still works; new code uses `drafttrain.decoding.cached_lm`.
"""

from .eager import EagerLM as CachedLM

__all__ = ["CachedLM"]
