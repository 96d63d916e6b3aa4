"""The frozen target's features for EAGLE-3 training, computed online (no hidden-state dumps).

Every training step needs the target's hidden states at the draft's three layers (and its final
hidden state for the `hidden` teacher). By default they come from one no-grad target forward over
the batch. On a small data set trained for several epochs on a CPU that forward dominates the
step, so `keep_in_memory` computes each example's features once and keeps them in RAM for its
later epochs. Each example is then run ALONE (no padding, positions 0..n-1): its features do not
depend on which batch it first came in, so a resumed run, whose memo starts empty, trains on
exactly the values an uninterrupted run would have kept.
"""

from __future__ import annotations

from typing import Sequence

import torch


class TargetFeatures:
    def __init__(self, target, aux_layer_ids: Sequence[int], *, need_final: bool, keep_in_memory: bool):
        self.target = target
        self.aux_layer_ids = tuple(aux_layer_ids)
        self.need_final = need_final
        self.keep_in_memory = keep_in_memory
        self.memo: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}

    def _hidden_states(self, input_ids, attention_mask, position_ids) -> tuple[torch.Tensor, ...]:
        """The whole model's forward (a sharded target gathers its weights in it), but the LM head
        on one position only (`logits_to_keep`): its full-vocabulary logits are never needed."""
        return self.target(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                           output_hidden_states=True, use_cache=False, logits_to_keep=1).hidden_states

    def _split(self, hidden_states) -> tuple[torch.Tensor, torch.Tensor | None]:
        features = torch.cat([hidden_states[i] for i in self.aux_layer_ids], dim=-1)
        return features, hidden_states[-1] if self.need_final else None

    @torch.no_grad()
    def __call__(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(features [B, T, 3·H], final hidden [B, T, H] or None) for a collated batch; padding
        positions hold zeros in memory mode (nothing reads them: masked in attention and loss)."""
        if not self.keep_in_memory:
            return self._split(self._hidden_states(batch["input_ids"], batch["attention_mask"],
                                                   batch["position_ids"]))
        if "example_index" not in batch:
            raise ValueError("keep_in_memory needs batches that carry example_index")
        input_ids, attention_mask = batch["input_ids"], batch["attention_mask"].bool()
        per_row = [self._example(int(i), input_ids[b, attention_mask[b]])
                   for b, i in enumerate(batch["example_index"].tolist())]
        B, T = input_ids.shape
        features = per_row[0][0].new_zeros(B, T, per_row[0][0].shape[-1])
        final = per_row[0][1].new_zeros(B, T, per_row[0][1].shape[-1]) if self.need_final else None
        for b, (f, h) in enumerate(per_row):
            features[b, attention_mask[b]] = f
            if final is not None:
                final[b, attention_mask[b]] = h
        return features, final

    def _example(self, index: int, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        if index not in self.memo:
            positions = torch.arange(tokens.numel(), device=tokens.device)[None]
            features, final = self._split(self._hidden_states(tokens[None], None, positions))
            self.memo[index] = (features[0], final[0] if final is not None else None)
        features, final = self.memo[index]
        if features.shape[0] != tokens.numel():
            raise ValueError(f"example {index} has {tokens.numel()} tokens but its kept features cover "
                             f"{features.shape[0]}")
        return features, final
