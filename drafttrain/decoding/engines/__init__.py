"""Engines: how a model runs under a decoder, as a `CachedLM` (a model bound to its own KV cache).

- `base`: the cached-LM interface every decoder uses, the only way it touches a model;
- `eager`: the model's own forward on transformers' DynamicCache (the reference, any model);
- `matmul`: few-row linear layers on CPU taken as `W · xᵀ` where this machine computes that faster
  (measured per weight shape; both engines install it);
- `static`: a preallocated cache and fixed-shape compiled steps (`compiled`, CUDA graphs on CUDA).

A new architecture for the static engine goes in `static.py` (`static_support` and its step).
This module chooses and builds one: `--engine auto|eager|static`.
"""

from __future__ import annotations

from ...errors import UserError
from .base import CachedLM, device_tensor, synchronize
from .eager import EagerLM
from .matmul import use_skinny_matmuls
from .static import StaticLM, static_support

ENGINES = ("auto", "eager", "static")


def resolve_engine(name: str, model, *, max_length: int | None = None) -> str:
    """"eager" or "static". auto: static on CUDA for the architectures it reproduces exactly, else
    eager. An explicit `static` on an unsupported model is a UserError naming the reason."""
    if name not in ENGINES:
        raise UserError(f"unknown --engine {name!r}; use {', '.join(ENGINES)}")
    if name == "eager":
        return "eager"
    reason = static_support(model, max_length)
    if name == "static":
        if reason:
            raise UserError(f"--engine static: {reason}; use --engine eager")
        return "static"
    device = next(model.parameters()).device
    return "static" if device.type == "cuda" and reason is None else "eager"


def cached_lm(model, engine: str, *, max_length: int | None = None, compile: bool | None = None) -> CachedLM:
    """A cached LM for `model` on `engine` (auto|eager|static). `max_length`: the most tokens the
    cache will hold (longest prompt + max_new_tokens + K + 1; required by the static engine).
    `compile` None: compiled steps (CUDA graphs) on CUDA, uncompiled on CPU."""
    engine = resolve_engine(engine, model, max_length=max_length)
    if engine == "eager":
        return EagerLM(model, max_length=max_length)
    if max_length is None:
        raise ValueError("the static engine needs max_length (longest prompt + max_new_tokens + K + 1)")
    return StaticLM(model, max_length=max_length, compile=compile)


def as_cached_lm(target) -> CachedLM:
    """A decoder's target or draft: a cached LM as given, or a plain HF model on the eager engine."""
    return target if isinstance(target, CachedLM) else EagerLM(target)


__all__ = ["ENGINES", "CachedLM", "EagerLM", "StaticLM", "as_cached_lm", "cached_lm", "device_tensor", "resolve_engine",
           "static_support", "synchronize", "use_skinny_matmuls"]
