"""EAGLE-3's training loss: forward KL from the target to the draft, on the draft vocabulary,
for every unrolled step, over response positions only.

The teacher at a position is the target's next-token distribution restricted to the draft
vocabulary and renormalised: the softmax of the target's logits at the draft vocabulary only,
final_hidden @ W[draft ids]^T (`teacher_logits_from_hidden`), so the full-vocabulary LM head is
never run. A stored top-k teacher (`teacher_logits_from_topk`) works the same way.

Coordinates. Everything per position is a "block" starting at one global index `start` (the
`logits_from` of `Eagle3Draft.forward`): row i is index start + i. Step j at row i predicts the
token after index start + i + 1 + j, so it learns the teacher's row i + 1 + j and is trained iff
- the collator's loss_mask is set at row i + 1 + j (that prediction targets a response token),
- row i is a real token (attention_mask), and
- the target's top token at row i + 1 + j is in the draft vocabulary.
The last rule follows SpecForge (`position_mask = t2d[target argmax] * loss_mask`): the draft can
never propose a token outside its vocabulary, so greedy decoding loses such a position whatever
the draft does, and the renormalised rest of the target's distribution there ("what would it
say if its favourite were banned") is a question decoding never asks; fitting it only pulls the
draft away from positions it can win. Top-1 accuracy still counts these positions, as misses,
so it estimates real greedy acceptance per step.

`target_ids` names the target's top token per row. On the target's own greedy answers (the
demo's data) that is simply the next token, `next_tokens(input_ids, start)`: no full-vocabulary
logits needed for the mask either.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def first_trained_index(loss_mask: torch.Tensor, num_steps: int) -> int:
    """The first index any of `num_steps` steps trains (step j at index p needs loss_mask[p+1+j]):
    pass it as `logits_from` so the draft skips the prompt's head, LM head included."""
    columns = loss_mask.any(dim=0).nonzero()
    if columns.numel() == 0:
        return 0
    return max(int(columns[0]) - num_steps, 0)


def next_tokens(input_ids: torch.Tensor, start: int) -> torch.Tensor:
    """Row i = input_ids[start + i + 1]: the target's top token there when the data are its greedy
    answers. The last row, which has no next token, repeats the last token (it is never trained)."""
    ids = input_ids[:, start + 1:]
    return torch.cat([ids, input_ids[:, -1:]], dim=1)


@torch.no_grad()
def teacher_logits_from_hidden(final_hidden: torch.Tensor, lm_head_weight: torch.Tensor,
                               draft_target_ids: torch.Tensor | None = None) -> torch.Tensor:
    """The target's logits at the draft vocabulary only: [..., H] x [V, H] rows -> [..., Vd]
    (in at least float32). `final_hidden` is after the target's final norm (transformers'
    `hidden_states[-1]`); `draft_target_ids` is `Eagle3Draft.draft_target_ids`, or None when
    `lm_head_weight` holds just those rows already ([Vd, H], picked once for a whole run)."""
    rows = lm_head_weight if draft_target_ids is None else \
        lm_head_weight.index_select(0, draft_target_ids.to(lm_head_weight.device))
    dtype = torch.promote_types(final_hidden.dtype, torch.float32)
    return final_hidden.to(dtype) @ rows.to(dtype).T


@torch.no_grad()
def teacher_logits_from_topk(topk_ids: torch.Tensor, topk_logprobs: torch.Tensor,
                             draft_target_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """A stored top-k teacher (the collator's `topk_ids` / `topk_logprobs`, [B, T, k]) on the
    draft vocabulary: its log-probs where the top-k tokens are draft tokens, -inf elsewhere."""
    draft_size = draft_target_ids.numel()
    to_draft = torch.full((vocab_size,), draft_size, dtype=torch.long, device=topk_ids.device)
    to_draft[draft_target_ids.to(topk_ids.device)] = torch.arange(draft_size, device=topk_ids.device)
    out = torch.full((*topk_ids.shape[:-1], draft_size + 1), float("-inf"), device=topk_ids.device,
                     dtype=torch.promote_types(topk_logprobs.dtype, torch.float32))
    out.scatter_(-1, to_draft[topk_ids], topk_logprobs.to(out.dtype))  # tokens outside land in the spare column
    return out[..., :draft_size]


@dataclass
class Eagle3LossOutput:
    loss: torch.Tensor            # the weighted mean of the per-step KLs (differentiable)
    step_kl: torch.Tensor         # [num_steps], detached; nan where a step trained nothing
    step_accuracy: torch.Tensor   # [num_steps]: draft top-1 == target top-1, over response positions
    step_positions: torch.Tensor  # [num_steps]: positions trained by the KL
    coverage: float               # fraction of response positions whose target token is a draft token


def step_weights(num_steps: int, decay: float) -> torch.Tensor:
    """decay**j, normalised to sum 1: later steps matter less (they are reached less often)."""
    w = torch.tensor([decay ** j for j in range(num_steps)], dtype=torch.float64)
    return w / w.sum()


def eagle3_loss(step_logits: torch.Tensor, teacher_logits: torch.Tensor, loss_mask: torch.Tensor,
                attention_mask: torch.Tensor, target_ids: torch.Tensor, d2t: torch.Tensor, t2d: torch.Tensor,
                decay: float = 0.8) -> Eagle3LossOutput:
    """step_logits [n, B, Tb, Vd] (`Eagle3Draft.forward`); teacher_logits [B, Tb, Vd]; loss_mask,
    attention_mask, target_ids [B, Tb]; all in block coordinates (module docstring). The KL of
    step j is the mean over its trained positions; the loss weighs the steps by `step_weights`,
    renormalised over the steps that trained something."""
    n, B, Tb, _ = step_logits.shape
    teacher_logp = torch.log_softmax(teacher_logits.float() if teacher_logits.dtype in (torch.float16, torch.bfloat16)
                                     else teacher_logits, dim=-1)
    teacher_ok = torch.isfinite(teacher_logp).any(-1)  # a top-k teacher with no draft token: nothing to learn
    in_vocab = t2d[target_ids]
    weights = step_weights(n, decay)
    kls, accs, counts = [], [], []
    total = step_logits.sum() * 0.0  # keeps the graph (and DDP) whole when nothing trains
    weight_sum, covered, responses = 0.0, 0, 0
    for j in range(n):
        width = Tb - 1 - j
        if width <= 0:
            kls.append(float("nan")), accs.append(float("nan")), counts.append(0)
            continue
        scored = loss_mask[:, 1 + j:1 + j + width].bool() & attention_mask[:, :width].bool()
        trained = scored & in_vocab[:, 1 + j:1 + j + width] & teacher_ok[:, 1 + j:1 + j + width]
        b, i = trained.nonzero(as_tuple=True)
        if b.numel():
            logq = torch.log_softmax(step_logits[j, b, i].to(teacher_logp.dtype), dim=-1)
            logp = teacher_logp[b, i + 1 + j]
            p = logp.exp()
            kl = (p * (logp.masked_fill(p == 0, 0.0) - logq)).sum(-1).mean()
            total = total + float(weights[j]) * kl
            weight_sum += float(weights[j])
            kls.append(float(kl.detach()))
        else:
            kls.append(float("nan"))
        counts.append(int(b.numel()))
        with torch.no_grad():
            sb, si = scored.nonzero(as_tuple=True)
            if sb.numel():
                guess = step_logits[j, sb, si].argmax(-1)
                accs.append(float((guess + d2t[guess] == target_ids[sb, si + 1 + j]).double().mean()))
            else:
                accs.append(float("nan"))
            if j == 0:
                covered, responses = int(in_vocab[sb, si + 1].sum()), int(sb.numel())
    loss = total / weight_sum if weight_sum else total
    return Eagle3LossOutput(loss=loss, step_kl=torch.tensor(kls), step_accuracy=torch.tensor(accs),
                            step_positions=torch.tensor(counts), coverage=covered / responses if responses else float("nan"))
