"""A causal LM bound to its own KV cache.

The decoder only ever does two things to a model: append tokens (`forward`) and forget the
newest ones (`rollback`). Keeping that behind this small class is what lets a static,
preallocated cache (CUDA graphs, torch.compile) replace the dynamic one without touching the
decode loop: a static cache rolls back by moving `length`, nothing else.
"""

from __future__ import annotations

import torch


class CachedLM:
    def __init__(self, model):
        self.model = model
        self.cache = None
        self.length = 0  # tokens held in the cache

    def reset(self) -> None:
        from transformers import DynamicCache

        try:
            self.cache = DynamicCache(config=self.model.config)
        except TypeError:  # older signature
            self.cache = DynamicCache()
        self.length = 0

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, *, hidden_states: bool = False, attention_mask=None,
                position_ids=None):
        """Append `tokens` ([n] on the model's device); return logits [n, V] (and last hidden [n, H])."""
        out = self.model(
            input_ids=tokens.view(1, -1),
            past_key_values=self.cache,
            use_cache=True,
            attention_mask=attention_mask,
            position_ids=position_ids,
            output_hidden_states=hidden_states,
        )
        self.cache = out.past_key_values
        self.length += tokens.numel()
        if hidden_states:
            return out.logits[0], out.hidden_states[-1][0]
        return out.logits[0]

    def rollback(self, length: int) -> None:
        """Keep only the first `length` cached tokens."""
        drop = self.length - length
        if drop < 0:
            raise ValueError(f"cannot roll back to {length}: the cache holds {self.length}")
        if drop:
            self.cache.crop(-drop)  # a negative count works on every transformers 5.x
            self.length = length
