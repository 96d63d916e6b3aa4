"""Building blocks the feature-reading drafts' models share (EAGLE-3's layer, DFlash's layers): an
RMSNorm computed in at least float32 (float64 stays float64, for the exact tests), Llama's rotary
embedding, a softmax in at least float32, the target's rotary settings in transformers 5's form,
and the scale a target's RMSNorm applies (Gemma's store their offset from 1); `DraftShape`, the sizes
such a draft takes from its target."""

from __future__ import annotations

from dataclasses import dataclass, field

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


# Targets whose sizes a feature-reading draft's layers copy (Gemma-3: its head_dim, KV heads and the
# global layers' rotary; the drafts normalise the target's embedding and features before use, so
# Gemma's embedding scale does not reach them).
SHAPED_LIKE = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text")


def check_shaped_like(target_config, drafter: str) -> None:
    """The target is one whose decoder layer `drafter` ("the EAGLE-3 draft") copies, or one error line."""
    from ..errors import UserError

    kind = getattr(target_config, "model_type", None)
    if kind not in SHAPED_LIKE:
        raise UserError(f"{drafter} copies the shape of a {', '.join(SHAPED_LIKE)} decoder layer; this target is "
                        f"{kind!r}")


@dataclass(kw_only=True)
class DraftShape:
    """The sizes a feature-reading draft takes from its target (its layers are shaped like the target's,
    and it shares the target's embedding, so its hidden size is the target's), common to every kind's
    config; each kind's config adds what is its own (EAGLE-3's aux layers, DFlash's block)."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    vocab_size: int                  # the target's
    draft_vocab_size: int
    target_hidden_size: int
    target_num_layers: int
    max_position_embeddings: int
    rope_parameters: dict = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0})
    hidden_act: str = "silu"
    initializer_range: float = 0.02

    def __post_init__(self):
        if self.hidden_size != self.target_hidden_size:
            raise ValueError("the draft shares the target's embedding, so its hidden size must be the target's")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")

    @staticmethod
    def of_target(c, draft_vocab_size: int) -> dict:
        """The shape fields of a draft for the target config `c` over `draft_vocab_size` tokens."""
        heads = c.num_attention_heads
        return dict(hidden_size=c.hidden_size, intermediate_size=c.intermediate_size, num_attention_heads=heads,
                    num_key_value_heads=getattr(c, "num_key_value_heads", None) or heads,
                    head_dim=getattr(c, "head_dim", None) or c.hidden_size // heads,
                    rms_norm_eps=getattr(c, "rms_norm_eps", 1e-6), vocab_size=c.vocab_size,
                    draft_vocab_size=draft_vocab_size, target_hidden_size=c.hidden_size,
                    target_num_layers=c.num_hidden_layers,
                    max_position_embeddings=getattr(c, "max_position_embeddings", 2048),
                    rope_parameters=rope_parameters(c), initializer_range=getattr(c, "initializer_range", 0.02))
