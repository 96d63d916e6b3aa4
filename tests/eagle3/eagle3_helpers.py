"""Shared pieces of the EAGLE-3 tests: a tiny float64 target, a draft with non-trivial weights."""

from __future__ import annotations

import torch

from drafttrain.eagle3.model import Eagle3Draft, RMSNorm
from drafttrain.eagle3.vocab import build_draft_vocab
from tiny import tiny_lm

VOCAB = 64
LAYERS = 7  # default aux layers (2, 3, 4)


def tiny_target(seed: int = 0, **kw):
    return tiny_lm(seed=seed, vocab_size=VOCAB, layers=LAYERS, **kw)


def tiny_draft(target, draft_vocab_size: int = 40, seed: int = 1, scale: float = 1.0,
               always_include=(2,), vocab_size: int = VOCAB) -> Eagle3Draft:
    """A draft over the `draft_vocab_size` most frequent tokens of a fixed token list, with weights
    large enough that attention is far from uniform (the default init is nearly uniform, which
    would hide attention-mask and position mistakes)."""
    g = torch.Generator().manual_seed(seed)
    counts = [[t] * (1 + (t * 7) % 5) for t in range(vocab_size)]
    vocab = build_draft_vocab(counts, vocab_size, draft_vocab_size, always_include=always_include)
    draft = Eagle3Draft.from_target(target, vocab, dtype=torch.float64)
    with torch.no_grad():
        for module in draft.modules():
            if isinstance(module, torch.nn.Linear):
                fan_in = module.weight.shape[1]
                module.weight.copy_(scale * torch.randn(module.weight.shape, generator=g, dtype=torch.float64)
                                    * 2.0 / fan_in ** 0.5)
            elif isinstance(module, RMSNorm):
                module.weight.copy_(1.0 + 0.2 * torch.randn(module.weight.shape, generator=g, dtype=torch.float64))
    return draft.eval()


def target_hidden_states(target, ids: torch.Tensor, attention_mask=None, position_ids=None):
    with torch.no_grad():
        return target(input_ids=ids, attention_mask=attention_mask, position_ids=position_ids,
                      output_hidden_states=True).hidden_states
