"""Token-level distillation losses between a target LM (p) and a draft LM (q).

A draft is useful for speculative decoding when its next-token distribution q is close to
the target's p *in the way speculative sampling measures it*: a draft token is accepted with
probability sum_v min(p_v, q_v) = 1 - TVD(p, q). DistillSpec (Zhou et al., 2023) and GKD
(Agarwal et al., 2024) found that the best divergence depends on task and decoding strategy,
so all the usual ones live here behind one entry point, `distill_loss`.

The teacher is either the target's logits, computed on the fly, or its top-k log-probs stored
with the training data (`TopKTeacher`, offline distillation): `distill_loss` takes either and
picks the cheapest exact computation (the sparse forward KL needs no [.., V] teacher at all).

Conventions, shared by every loss:

- Logits are `[B, T, V]` (any leading shape works), and position t predicts token t + 1:
  the caller shifts. `mask` has the leading shape; only positions with mask != 0 count
  (response tokens), and the loss is the mean over those positions.
- Student and teacher vocabularies may differ in size (a draft's embedding matrix padded to
  a multiple of 64, say): both are cut to `V = min(Vs, Vt)` before the softmax, so padded
  entries get no probability and no gradient.
- Both logits are divided by `temperature` before the softmax. There is no T^2 factor
  (Hinton et al.'s gradient rescaling): fold it into the learning rate if you want it.
- Log-softmax runs in float32 even for bf16/fp16 logits (float64 stays float64), one chunk
  of rows at a time, so a 150k vocabulary never needs a float32 copy of all positions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

LOSSES = ("forward_kl", "reverse_kl", "jsd", "tvd", "ce")


def _check_args(kind: str, beta: float, temperature: float) -> None:
    if kind not in LOSSES:
        raise ValueError(f"unknown distillation loss {kind!r}; use one of {', '.join(LOSSES)}")
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1], got {beta}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")


def _compute_dtype(*tensors: torch.Tensor | None) -> torch.dtype:
    """float64 if any input is float64, else float32 (never half precision)."""
    if any(t is not None and t.dtype == torch.float64 for t in tensors):
        return torch.float64
    return torch.float32


def per_token_divergence(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor | None,
    kind: str,
    beta: float = 0.5,
    temperature: float = 1.0,
    labels: torch.Tensor | None = None,
) -> torch.Tensor:
    """Divergence per row for `[N, V]` logits, returned as `[N]` (float32 or float64).

    With p = softmax(teacher / temperature) and q = softmax(student / temperature):

    - `forward_kl`: KL(p || q) = sum p (log p - log q). Mean-seeking: q covers all of p.
    - `reverse_kl`: KL(q || p) = sum q (log q - log p). Mode-seeking: q avoids p's zeros.
    - `jsd`: generalised Jensen-Shannon, GKD's convention: with m = beta p + (1 - beta) q,
      JSD_beta = beta KL(p || m) + (1 - beta) KL(q || m). It is bounded by
      h(beta) = -beta log beta - (1-beta) log(1-beta) <= log 2, and is 0 at beta = 0 and
      beta = 1 (m equals one of the two), where it stays finite with zero gradient.
      For small beta, JSD_beta / beta -> KL(p || q); for beta near 1,
      JSD_beta / (1 - beta) -> KL(q || p), so beta slides between the two KLs.
    - `tvd`: total variation 0.5 sum |p - q|. 1 - TVD is exactly the probability that
      speculative sampling accepts a token drawn from q (see `acceptance_probability`),
      so minimising it maximises the expected acceptance rate directly.
    - `ce`: cross-entropy -log q[label] of the student on `labels` (`[N]` token ids, e.g.
      the target's own generations); the teacher is unused and may be None. This is the
      "fine-tune the draft on target outputs" baseline.

    Logits must already have the same vocabulary size (see `distill_loss` for slicing).
    """
    _check_args(kind, beta, temperature)
    dtype = _compute_dtype(student_logits, teacher_logits)
    if kind == "forward_kl" and teacher_logits is not None and teacher_logits.shape == student_logits.shape:
        # KL(p || q) = CE(p, q) - H(p): PyTorch's fused soft-target cross-entropy is several times
        # cheaper than spelling the sum out, and H(p) has no gradient (the teacher is fixed).
        with torch.no_grad():
            log_p = F.log_softmax(teacher_logits.to(dtype) / temperature, dim=-1)
            neg_entropy = (log_p.exp() * log_p).sum(-1)
        scaled = student_logits.to(dtype) if temperature == 1.0 else student_logits.to(dtype) / temperature
        return F.cross_entropy(scaled, log_p.exp(), reduction="none") + neg_entropy
    log_q = F.log_softmax(student_logits.to(dtype) / temperature, dim=-1)

    if kind == "ce":
        if labels is None:
            raise ValueError("the 'ce' loss needs labels (the target's token ids)")
        return -log_q.gather(-1, labels.long().unsqueeze(-1)).squeeze(-1)

    if teacher_logits is None:
        raise ValueError(f"the {kind!r} loss needs teacher logits")
    if teacher_logits.shape != student_logits.shape:
        raise ValueError(f"student logits {tuple(student_logits.shape)} and teacher logits "
                         f"{tuple(teacher_logits.shape)} must have the same shape")
    log_p = F.log_softmax(teacher_logits.detach().to(dtype) / temperature, dim=-1)
    p, q = log_p.exp(), log_q.exp()

    if kind == "forward_kl":
        return (p * (log_p - log_q)).sum(-1)
    if kind == "reverse_kl":
        return (q * (log_q - log_p)).sum(-1)
    if kind == "tvd":
        return 0.5 * (p - q).abs().sum(-1)
    # jsd: log m in log space, so tiny p and q never give log(0); log(0) = -inf drops a
    # term exactly at the beta = 0 / 1 ends.
    log_beta = math.log(beta) if beta > 0 else -math.inf
    log_1m_beta = math.log1p(-beta) if beta < 1 else -math.inf
    log_m = torch.logaddexp(log_p + log_beta, log_q + log_1m_beta)
    kl_p_m = (p * (log_p - log_m)).sum(-1)
    kl_q_m = (q * (log_q - log_m)).sum(-1)
    return beta * kl_p_m + (1.0 - beta) * kl_q_m


def topk_forward_kl(
    student_logits: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_logprobs: torch.Tensor,
    mask: torch.Tensor,
) -> torch.Tensor:
    """Forward KL(p || q) against a teacher stored as its top-k log-probs, mean over masked positions.

    p is the stored top-k with the remaining mass spread evenly over the other V - k tokens
    (exactly `distill_loss(student, topk_teacher_logits(...), mask, kind="forward_kl")`, temperature 1),
    but p is never built as a [.., V] tensor: with r the tail probability of one other token,
        sum_v p_v log q_v = sum_topk p_i log q_i + r (sum_v log q_v - sum_topk log q_i),
    and sum_v log q_v = sum_v z_v - V logsumexp(z). The student's logits are only reduced (a
    logsumexp and a sum) and gathered at k ids, several times cheaper on a 50k vocabulary.
    `topk_ids` / `topk_logprobs` are [..., k] with the leading shape of `mask`.
    """
    if mask.shape != student_logits.shape[:-1] or topk_ids.shape[:-1] != mask.shape:
        raise ValueError(f"mask {tuple(mask.shape)}, logits {tuple(student_logits.shape)} and top-k "
                         f"{tuple(topk_ids.shape)} must share their leading shape")
    mask = mask.bool()
    dtype = _compute_dtype(student_logits, topk_logprobs)
    vocab, k = student_logits.shape[-1], topk_ids.shape[-1]
    z = student_logits[mask].to(dtype)                                  # [N, V]
    if z.shape[0] == 0:
        return student_logits.reshape(-1)[:0].sum().to(dtype)
    ids = topk_ids[mask].long().clamp(0, vocab - 1)                      # [N, k]
    with torch.no_grad():
        lp = topk_logprobs[mask].to(dtype)
        others = vocab - k
        tail = (1.0 - lp.exp().sum(-1)).clamp_min(1e-12)                 # as topk_teacher_logits
        log_r = tail.log() - math.log(others) if others > 0 else torch.full_like(tail, -1e4)
        # Normalise as a softmax over the reconstructed logits would (the tail is clamped).
        log_z = torch.logaddexp(lp.logsumexp(-1), log_r + math.log(max(others, 1)))
        log_p, log_r = lp - log_z.unsqueeze(-1), log_r - log_z
        p, r = log_p.exp(), log_r.exp()
        neg_entropy = (p * log_p).sum(-1) + (others * r * log_r if others > 0 else 0.0)
    lse = z.logsumexp(-1)
    log_q_topk = z.gather(-1, ids) - lse.unsqueeze(-1)                   # [N, k]
    sum_log_q = z.sum(-1) - vocab * lse
    cross = (p * log_q_topk).sum(-1) + (r * (sum_log_q - log_q_topk.sum(-1)) if others > 0 else 0.0)
    return (neg_entropy - cross).mean()


def topk_teacher_logits(topk_ids: torch.Tensor, topk_logprobs: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Full-vocabulary teacher logits [..., V] from the target's stored top-k log-probs [..., k].

    An approximation of the target: its k most likely tokens keep their exact probabilities and
    the remaining mass 1 - sum(top-k) is spread evenly over the other V - k tokens (stored
    log-probs are at temperature 1, so a loss temperature applies to this reconstruction). Every
    token keeps some probability, so reverse KL, JSD and TVD stay finite, and forward KL differs
    from the exact one only in how the (small) tail is shaped.
    """
    k = topk_ids.shape[-1]
    logprobs = topk_logprobs.float()
    if k >= vocab_size:
        rest = torch.full_like(logprobs[..., :1], -1e4)
    else:
        tail = (1.0 - logprobs.exp().sum(-1, keepdim=True)).clamp_min(1e-12)
        rest = tail.log() - math.log(vocab_size - k)
    out = rest.expand(*logprobs.shape[:-1], vocab_size).clone()
    return out.scatter_(-1, topk_ids.long().clamp(0, vocab_size - 1), logprobs)


@dataclass
class TopKTeacher:
    """The target's stored top-k log-probs as a teacher: `ids` / `logprobs` [..., k] (the leading
    shape of the student's logits), over a vocabulary of `vocab_size` tokens (the target's)."""

    ids: torch.Tensor
    logprobs: torch.Tensor
    vocab_size: int
    _dense: torch.Tensor | None = field(default=None, init=False, repr=False)

    def dense_logits(self) -> torch.Tensor:
        """`topk_teacher_logits`, built once however many masks a loss is taken over."""
        if self._dense is None:
            self._dense = topk_teacher_logits(self.ids, self.logprobs, self.vocab_size)
        return self._dense


def acceptance_probability(p_probs: torch.Tensor, q_probs: torch.Tensor) -> torch.Tensor:
    """Probability that speculative sampling accepts a token drawn from q when the target is p.

    A draft token x ~ q is kept with probability min(1, p(x) / q(x)), so the total is
    sum_x q(x) min(1, p(x) / q(x)) = sum_x min(p(x), q(x)) = 1 - TVD(p, q).
    Takes probabilities (not logits); reduces over the last dimension.
    """
    return torch.minimum(p_probs, q_probs).sum(-1)


def distill_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor | TopKTeacher | None,
    mask: torch.Tensor,
    *,
    kind: str,
    beta: float = 0.5,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    labels: torch.Tensor | None = None,
) -> torch.Tensor:
    """Mean over masked positions of `per_token_divergence(kind)`; a scalar with grad.

    THE entry point for every distillation loss. The teacher is the target's logits, or a
    `TopKTeacher`: with forward KL at temperature 1 that is `topk_forward_kl` (exact, and it
    never builds the teacher's [.., V] tensor); any other loss runs on
    `TopKTeacher.dense_logits()`. `ce` ignores the teacher.

    `student_logits` and `teacher_logits` are `[..., Vs]` and `[..., Vt]` with the same
    leading shape as `mask`; both are cut to `min(Vs, Vt)` entries (for `ce` with no teacher,
    the student's full vocabulary is used). `labels` (same shape as `mask`, `ce` only) holds
    the token each position should predict; entries outside the mask are ignored.

    Only the masked rows are gathered, then processed `chunk_size` rows at a time. When the
    student needs a gradient each chunk is checkpointed: autograd keeps just the gathered
    rows and recomputes one chunk's float32 softmaxes during backward, so peak memory grows
    with `chunk_size * V`, not with the number of tokens times V (a single chunk is not
    checkpointed: it would hold as much anyway). An all-zero mask returns
    a zero that is still attached to `student_logits` (every DDP rank must run backward).
    """
    _check_args(kind, beta, temperature)
    if isinstance(teacher_logits, TopKTeacher):
        stored = teacher_logits
        if kind == "forward_kl" and temperature == 1.0:
            return topk_forward_kl(student_logits[..., :stored.vocab_size], stored.ids, stored.logprobs, mask)
        teacher_logits = None if kind == "ce" else stored.dense_logits()
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if mask.shape != student_logits.shape[:-1]:
        raise ValueError(f"mask shape {tuple(mask.shape)} does not match the logits' leading "
                         f"shape {tuple(student_logits.shape[:-1])}")
    if kind == "ce":
        if labels is None:
            raise ValueError("the 'ce' loss needs labels (the target's token ids)")
        if labels.shape != mask.shape:
            raise ValueError(f"labels shape {tuple(labels.shape)} does not match mask shape "
                             f"{tuple(mask.shape)}")
        teacher_logits = None  # unused: "SFT on target outputs"
    elif teacher_logits is None:
        raise ValueError(f"the {kind!r} loss needs teacher logits")
    elif teacher_logits.shape[:-1] != student_logits.shape[:-1]:
        raise ValueError(f"student logits {tuple(student_logits.shape)} and teacher logits "
                         f"{tuple(teacher_logits.shape)} disagree outside the vocabulary dim")

    vocab = student_logits.shape[-1]
    if teacher_logits is not None:
        vocab = min(vocab, teacher_logits.shape[-1])
    mask = mask.bool()
    dtype = _compute_dtype(student_logits, teacher_logits)

    student = student_logits[..., :vocab][mask]  # [N, V], still in the input dtype
    teacher = None if teacher_logits is None else teacher_logits.detach()[..., :vocab][mask]
    targets = None if labels is None else labels[mask].long()
    n = student.shape[0]
    if n == 0:
        # A sum over nothing: exactly 0, and backward gives zero gradients, never NaN.
        return student_logits.reshape(-1)[:0].sum().to(dtype)
    if targets is not None and bool(((targets < 0) | (targets >= vocab)).any()):
        raise ValueError(f"labels at masked positions must be token ids in [0, {vocab})")

    def chunk_sum(s: torch.Tensor, t: torch.Tensor | None, y: torch.Tensor | None) -> torch.Tensor:
        return per_token_divergence(s, t, kind, beta, temperature, labels=y).sum()

    # One chunk holds chunk_size x V floats anyway; recomputing it in backward only pays off when
    # there are several chunks whose intermediates would otherwise all wait for backward.
    use_checkpoint = torch.is_grad_enabled() and student.requires_grad and n > chunk_size
    total = student.new_zeros((), dtype=dtype)
    for start in range(0, n, chunk_size):
        rows = slice(start, start + chunk_size)
        args = (student[rows],
                None if teacher is None else teacher[rows],
                None if targets is None else targets[rows])
        if use_checkpoint:
            total = total + checkpoint(chunk_sum, *args, use_reentrant=False)
        else:
            total = total + chunk_sum(*args)
    return total / n
