"""Medusa heads (Cai et al. 2024): a few residual MLP heads on the target's last hidden state.

Head i reads the target's final (post-norm) hidden state at position t and predicts the token
at t + 2 + i: the target itself already predicts t + 1, head 0 guesses one further, and so on.

The module tree is laid out exactly like vLLM's `Medusa` model (`blocks.{i}.layers.{j}` and
`lm_heads.{i}`), so `state_dict()` *is* the vLLM checkpoint and export needs no renaming. With
`shared_lm_head` there is one `lm_heads.0` behind every block (vLLM's `original_lm_head`): a
vocab x hidden head per Medusa head is what a large vocabulary cannot afford (Gemma-3's 262k
tokens: 168M parameters each), while the residual blocks alone tell the heads apart.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn


@dataclass
class MedusaConfig:
    hidden_size: int
    vocab_size: int
    num_heads: int = 4
    num_layers: int = 1  # residual blocks per head (vLLM calls it `num_hidden_layers`)
    shared_lm_head: bool = False  # one LM head for all heads (vLLM's `original_lm_head`)

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if name == "shared_lm_head":
                if not isinstance(value, bool):
                    raise ValueError(f"MedusaConfig.shared_lm_head must be a bool, got {value!r}")
            elif not isinstance(value, int) or value < (0 if name == "num_layers" else 1):
                raise ValueError(f"MedusaConfig.{name} must be a positive integer, got {value!r}")


class ResidualBlock(nn.Module):
    """`num_layers` times `h = h + SiLU(W h + b)`, W zero-initialised so a fresh block is the identity."""

    def __init__(self, hidden_size: int, num_layers: int, **factory):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(hidden_size, hidden_size, bias=True, **factory)
                                    for _ in range(num_layers))
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + self.act(layer(x))
        return x


class MedusaHeads(nn.Module):
    def __init__(self, config: MedusaConfig, lm_head_weight: torch.Tensor | None = None, *,
                 dtype: torch.dtype | None = None, device=None):
        """dtype/device default to lm_head_weight's (so a float64 target is copied exactly)."""
        super().__init__()
        self.config = config
        if lm_head_weight is not None:
            dtype = dtype or lm_head_weight.dtype
            device = device or lm_head_weight.device
        factory = {"dtype": dtype, "device": device}
        H, V = config.hidden_size, config.vocab_size
        self.blocks = nn.ModuleList(ResidualBlock(H, config.num_layers, **factory) for _ in range(config.num_heads))
        count = 1 if config.shared_lm_head else config.num_heads
        self.lm_heads = nn.ModuleList(nn.Linear(H, V, bias=False, **factory) for _ in range(count))
        self.reset_parameters(lm_head_weight)

    @torch.no_grad()
    def reset_parameters(self, lm_head_weight: torch.Tensor | None = None) -> None:
        """Blocks start as the identity (W = 0, b = 0, as SiLU(0) = 0); LM heads copy the target's.

        Medusa zeroes only W; zeroing b too makes a fresh head exactly `lm_head(h)`, i.e. it starts
        by guessing the target's own next token, which is a much better start than noise.
        """
        for block in self.blocks:
            for layer in block.layers:
                layer.weight.zero_()
                layer.bias.zero_()
        if lm_head_weight is not None:
            expected = (self.config.vocab_size, self.config.hidden_size)
            if tuple(lm_head_weight.shape) != expected:
                raise ValueError(f"lm_head_weight has shape {tuple(lm_head_weight.shape)}, expected {expected}")
            for head in self.lm_heads:
                head.weight.copy_(lm_head_weight)

    @classmethod
    def from_target(cls, target: nn.Module, num_heads: int = 4, num_layers: int = 1,
                    shared_lm_head: bool = False) -> "MedusaHeads":
        """Fresh heads for a Hugging Face causal LM, on its device and in its dtype."""
        lm_head = target.get_output_embeddings()
        if lm_head is None or getattr(lm_head, "bias", None) is not None:
            raise ValueError("the target needs a bias-free output projection (get_output_embeddings())")
        weight = lm_head.weight.detach()
        config = MedusaConfig(hidden_size=weight.shape[1], vocab_size=weight.shape[0],
                              num_heads=num_heads, num_layers=num_layers, shared_lm_head=shared_lm_head)
        return cls(config, lm_head_weight=weight)

    def lm_head(self, i: int) -> nn.Linear:
        return self.lm_heads[0 if self.config.shared_lm_head else i]

    def forward_head(self, i: int, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [..., V] of head i alone (lets a trainer compute one head's loss at a time)."""
        return self.lm_head(i)(self.blocks[i](hidden))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., H] (the target's last, post-norm hidden state) -> logits [num_heads, ..., V].
        A shared LM head runs once over every block's output: its weight is read once, not per head."""
        if self.config.shared_lm_head:
            return self.lm_heads[0](torch.stack([block(hidden) for block in self.blocks]))
        return torch.stack([self.forward_head(i, hidden) for i in range(self.config.num_heads)])

    @torch.no_grad()
    def topk(self, hidden: torch.Tensor, k: int) -> torch.Tensor:
        """Top-k token ids of every head for one position: hidden [H] -> LongTensor [num_heads, k]."""
        return self(hidden).topk(k, dim=-1).indices
