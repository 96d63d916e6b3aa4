"""Shared pieces of the EAGLE-3 tests: a tiny float64 target, a draft with non-trivial weights, and
one trained on the target's answers (the decoding tests of tests/eagle3 and of +ngram share it)."""

from __future__ import annotations

import functools

import torch

from drafttrain.data.collate import TrainingCollator
from drafttrain.decoding.dynamic_tree import DYNAMIC_TREE_NODES, DYNAMIC_TREE_TOPK
from drafttrain.decoding.engines import as_cached_lm
from drafttrain.kinds.eagle3.decode import eagle3_decoder, eagle3_runtime
from drafttrain.kinds.eagle3.loss import eagle3_loss, first_trained_index, next_tokens, teacher_logits_from_hidden
from drafttrain.kinds.eagle3.model import Eagle3Draft
from drafttrain.kinds.layers import RMSNorm
from drafttrain.kinds.vocab import build_draft_vocab
from tiny import greedy_reference, tiny_causal_lm

VOCAB = 64
LAYERS = 7  # default aux layers (2, 3, 4)
EOS = 2


def tiny_target(seed: int = 0, arch: str = "llama", **kw):
    """A Llama, or a Gemma-3 (sliding and global layers, a 4-token window) of the same sizes."""
    return tiny_causal_lm(arch, seed, vocab_size=VOCAB, layers=LAYERS, **kw)


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


def draft_decoder(target, draft: Eagle3Draft, *, num_draft_tokens: int, tree_nodes: int = DYNAMIC_TREE_NODES,
                  tree_topk: int = DYNAMIC_TREE_TOPK, **settings):
    """`eagle3_decoder` of `draft` bound beside `target` (a cached LM or an HF model) as the kind
    binds it (`eagle3_runtime`: static and compiled with a static target, else eager)."""
    lm = as_cached_lm(target)
    runtime = eagle3_runtime(lm, draft, num_draft_tokens=num_draft_tokens, tree_nodes=tree_nodes, tree_topk=tree_topk)
    return eagle3_decoder(lm, runtime, num_draft_tokens=num_draft_tokens, tree_nodes=tree_nodes, tree_topk=tree_topk,
                          **settings)


def target_hidden_states(target, ids: torch.Tensor, attention_mask=None, position_ids=None):
    with torch.no_grad():
        return target(input_ids=ids, attention_mask=attention_mask, position_ids=position_ids,
                      output_hidden_states=True).hidden_states


@functools.cache
def trained_pair(arch: str = "llama"):
    """A draft trained for a few seconds on the target's greedy answers: it is right often
    enough that acceptance lengths of every size occur."""
    target = tiny_target(seed=3, arch=arch)
    draft = tiny_draft(target, draft_vocab_size=48, scale=0.5).train()
    g = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(24):
        prompt = torch.randint(3, VOCAB, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g).tolist()
        rows.append({"prompt_ids": prompt, "response_ids": greedy_reference(target, prompt, 16, eos=EOS)})
    collate = TrainingCollator(max_seq_len=32, pad_id=EOS, align_prompts=True)
    optim = torch.optim.Adam([p for p in draft.parameters() if p.requires_grad], lr=3e-3)
    steps = 3
    for it in range(80):
        batch = collate(rows[(it * 8) % 24:(it * 8) % 24 + 8])
        hs = target_hidden_states(target, batch["input_ids"], batch["attention_mask"], batch["position_ids"])
        start = first_trained_index(batch["loss_mask"], steps)
        logits = draft(draft.target_features(hs), batch["input_ids"], attention_mask=batch["attention_mask"],
                       position_ids=batch["position_ids"], num_steps=steps, logits_from=start)
        teacher = teacher_logits_from_hidden(hs[-1][:, start:], target.lm_head.weight, draft.draft_target_ids)
        out = eagle3_loss(logits, teacher, batch["loss_mask"][:, start:], batch["attention_mask"][:, start:],
                          next_tokens(batch["input_ids"], start), draft.d2t, draft.t2d)
        optim.zero_grad()
        out.loss.backward()
        optim.step()
    return target, draft.eval()
