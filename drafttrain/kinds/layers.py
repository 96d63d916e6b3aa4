"""Building blocks the feature-reading drafts' models share (EAGLE-3's layer, DFlash's layers): an
RMSNorm computed in at least float32 (float64 stays float64, for the exact tests), Llama's rotary
embedding, a softmax in at least float32, the target's rotary settings in transformers 5's form,
and the scale a target's RMSNorm applies (Gemma's store their offset from 1)."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """Llama's RMSNorm, computed in at least float32 (float64 stays float64 for exact tests)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(torch.promote_types(x.dtype, torch.float32))
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Llama's rotary embedding; x [B, heads, n, d], cos/sin [B, n, d]."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def softmax(scores: torch.Tensor) -> torch.Tensor:
    return torch.softmax(scores.to(torch.promote_types(scores.dtype, torch.float32)), dim=-1).to(scores.dtype)


def rope_parameters(target_config) -> dict:
    """The target's rotary settings in transformers 5's `rope_parameters` form."""
    params = getattr(target_config, "rope_parameters", None)
    if isinstance(params, dict) and params and all(isinstance(v, dict) for v in params.values()):
        params = params.get("full_attention") or next(iter(params.values()))  # per-layer-type configs
    if not params:  # transformers 4 style
        params = {"rope_type": "default", "rope_theta": getattr(target_config, "rope_theta", 10000.0)}
        scaling = getattr(target_config, "rope_scaling", None)
        if scaling:
            params |= dict(scaling)
            params["rope_type"] = params.pop("type", None) or params.get("rope_type", "default")
    return dict(params)


def norm_scale(norm: nn.Module | None) -> torch.Tensor | None:
    """The factor an RMSNorm multiplies by: its weight, or 1 + weight for Gemma's norms, which
    store the offset from 1 (copying Gemma-3's raw weight into the draft's Llama-style norm
    would scale its output by ~0 instead of ~1)."""
    weight = getattr(norm, "weight", None)
    if weight is None:
        return None
    return weight.detach() + 1 if type(norm).__name__.startswith("Gemma") else weight.detach()
