"""Measure how often each head's k-th guess is the target's token, and shape the tree from it.

A fixed tree spends nodes on guesses the heads rarely get right. Medusa builds its trees from
measured top-k accuracies instead; so do we, on held-out prompts that training never saw: the
target answers them greedily (the text the verifier will accept), the heads read the target's
hidden states along that answer, and accuracy[i][j] counts how often head i's j-th most likely
token is the token i + 1 places ahead. `tree_from_accuracies` turns that into the tree.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ...tokens import cut_at_eos, left_pad
from .model import MedusaHeads


@torch.no_grad()
def head_topk_accuracy(target, heads: MedusaHeads, prompts: Sequence[Sequence[int]], *, topk: int,
                       max_new_tokens: int, eos_token_ids: Sequence[int], batch_size: int = 8) -> list[list[float]]:
    """accuracy [num_heads][topk] over every response position of the target's greedy answers."""
    device = next(target.parameters()).device
    eos = list(eos_token_ids)
    pad = eos[0]
    hits = torch.zeros(heads.config.num_heads, topk, dtype=torch.float64)
    counts = torch.zeros(heads.config.num_heads, dtype=torch.float64)
    for start in range(0, len(prompts), batch_size):
        rows = [list(p) for p in prompts[start:start + batch_size]]
        input_ids, attention_mask = left_pad(rows, pad, device)
        out = target.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=max_new_tokens,
                              do_sample=False, eos_token_id=eos, pad_token_id=pad)
        for prompt, new in zip(rows, out[:, input_ids.shape[1]:].tolist()):
            seq = prompt + cut_at_eos(new, eos)
            ids = torch.tensor([seq], device=device)
            hidden = target(input_ids=ids, output_hidden_states=True, use_cache=False).hidden_states[-1][0]
            tokens = ids[0]
            first = len(prompt) - 1  # the state that predicts the first response token
            for i in range(heads.config.num_heads):
                # Head i at position t guesses token t + 2 + i; t runs over the answer's states.
                if len(seq) - 2 - i <= first:
                    continue
                positions = torch.arange(first, len(seq) - 2 - i, device=device)
                guesses = heads.forward_head(i, hidden[positions].to(heads.lm_head(i).weight.dtype))
                guesses = guesses.topk(topk, dim=-1).indices                     # [n, topk]
                truth = tokens[positions + 2 + i]
                hits[i] += (guesses == truth[:, None]).double().sum(0).cpu()
                counts[i] += len(positions)
    return (hits / counts.clamp_min(1)[:, None]).tolist()


__all__ = ["head_topk_accuracy"]
