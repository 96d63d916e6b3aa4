"""Shared pieces of the DFlash tests: a tiny float64 target, a draft with non-trivial weights, and one
trained on the target's answers (the decoding, export and hybrid tests share it)."""

from __future__ import annotations

import functools

import torch

from drafttrain.data.collate import TrainingCollator
from drafttrain.kinds.dflash.loss import batch_seed, dflash_loss, sample_anchors, slot_targets, slot_weights
from drafttrain.kinds.dflash.model import DFlashDraft
from drafttrain.kinds.layers import RMSNorm
from drafttrain.kinds.vocab import build_draft_vocab
from tiny import greedy_reference, tiny_causal_lm

VOCAB = 64
LAYERS = 7  # default target layers (1, 2, 4)
EOS = 2
BLOCK = 5


def tiny_target(seed: int = 0, arch: str = "llama", **kw):
    """A Llama, or a Gemma-3 (sliding and global layers, a 4-token window) of the same sizes."""
    return tiny_causal_lm(arch, seed, vocab_size=VOCAB, layers=LAYERS, **kw)


def tiny_draft(target, draft_vocab_size: int | None = None, seed: int = 1, scale: float = 1.0, layers: int = 2,
               block_size: int = BLOCK, causal: bool = False, vocab_size: int = VOCAB) -> DFlashDraft:
    """A draft (two layers) with weights large enough that attention is far from uniform, so mask and
    position mistakes show; over the `draft_vocab_size` most frequent tokens of a fixed list (None: all)."""
    g = torch.Generator().manual_seed(seed)
    counts = [[t] * (1 + (t * 7) % 5) for t in range(vocab_size)]
    vocab = build_draft_vocab(counts, vocab_size, draft_vocab_size or vocab_size, always_include=(EOS,))
    draft = DFlashDraft.from_target(target, vocab, layers=layers, block_size=block_size, mask_token_id=vocab_size - 1,
                                    dtype=torch.float64)
    draft.config.causal = causal
    with torch.no_grad():
        for module in draft.modules():
            if isinstance(module, torch.nn.Linear) and module is not draft.lm_head:
                fan_in = module.weight.shape[1]
                module.weight.copy_(scale * torch.randn(module.weight.shape, generator=g, dtype=torch.float64)
                                    * 2.0 / fan_in ** 0.5)
            elif isinstance(module, RMSNorm):
                module.weight.copy_(1.0 + 0.2 * torch.randn(module.weight.shape, generator=g, dtype=torch.float64))
        draft.mask_embedding.copy_(torch.randn(draft.mask_embedding.shape, generator=g, dtype=torch.float64))
    return draft.eval()


def target_hidden_states(target, ids: torch.Tensor, attention_mask=None, position_ids=None):
    with torch.no_grad():
        return target(input_ids=ids, attention_mask=attention_mask, position_ids=position_ids,
                      output_hidden_states=True).hidden_states


def training_step(draft, target, batch: dict, anchors: int = 6, seed: int = 0, hidden_states=None):
    """One batch's loss (`dflash_loss`) of `draft` on the target's features (`hidden_states`: the
    target's, computed once by the caller; None: computed here)."""
    hs = hidden_states or target_hidden_states(target, batch["input_ids"], batch["attention_mask"],
                                               batch["position_ids"])
    starts, real = sample_anchors(batch["loss_mask"], anchors, batch_seed(seed, batch["input_ids"]))
    logits = draft(draft.target_features(hs), batch["input_ids"], starts, position_ids=batch["position_ids"],
                   attention_mask=batch["attention_mask"])
    tokens, trained = slot_targets(batch["input_ids"], batch["loss_mask"], starts, real, draft.config.block_size)
    return dflash_loss(logits, tokens, trained, draft.t2d, slot_weights(draft.config.block_size))


@functools.cache
def trained_pair(arch: str = "llama"):
    """A draft trained for a few seconds on the target's greedy answers: right often enough that
    acceptance lengths of every size occur."""
    target = tiny_target(seed=3, arch=arch)
    draft = tiny_draft(target, scale=0.5).train()
    g = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(24):
        prompt = torch.randint(3, VOCAB, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g).tolist()
        rows.append({"prompt_ids": prompt, "response_ids": greedy_reference(target, prompt, 16, eos=EOS)})
    collate = TrainingCollator(max_seq_len=32, pad_id=EOS, align_prompts=True)
    optim = torch.optim.Adam([p for p in draft.parameters() if p.requires_grad], lr=3e-3)
    for it in range(80):
        out = training_step(draft, target, collate(rows[(it * 8) % 24:(it * 8) % 24 + 8]), seed=it)
        optim.zero_grad()
        out.loss.backward()
        optim.step()
    return target, draft.eval()
