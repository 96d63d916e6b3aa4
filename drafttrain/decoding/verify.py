"""Token distributions and the acceptance rules that make speculative decoding lossless.

Everything here stays on the device and returns tensors: the decode loop syncs with the host
once per step, not once per token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..trees import Tree, path_nodes


def probabilities(logits: torch.Tensor, temperature: float, top_p: float = 1.0) -> torch.Tensor:
    """The sampling distribution for `logits` [..., V]: temperature, then nucleus (top-p).

    Computed in float32 at least (float64 stays float64) so that p/q ratios are exact enough.
    The target and the draft pass through this same function, as the rejection rule requires.
    """
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    probs = torch.softmax(logits.to(dtype) / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass strictly above each token
        sorted_probs = sorted_probs.masked_fill(before >= top_p, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of `probs` [..., V] -> [...].

    argmax(p / E) with E ~ Exp(1) i.i.d. picks token i with probability p_i (the exponential race;
    `torch.multinomial` draws one sample the same way), but without multinomial's validity check,
    which copies to the host: on CUDA a sampling step keeps its single host sync.
    """
    race = torch.empty_like(probs).exponential_(1, generator=generator)
    race.clamp_(min=torch.finfo(race.dtype).tiny)  # an exact 0 would turn p = 0 into nan, which argmax picks
    return (probs / race).argmax(dim=-1)


def verify_greedy(draft: torch.Tensor, target_logits: torch.Tensor) -> torch.Tensor:
    """Greedy acceptance: the longest draft prefix equal to the target's argmax, then its token.

    `draft` [k], `target_logits` [k+1, V]. Returns [n, t_1, ..., t_{k+1}]: `n` accepted, and the
    emitted tokens are the first n+1 of the target's argmax (the accepted drafts equal them).
    """
    best = target_logits.argmax(dim=-1)
    k = draft.numel()
    n = torch.cumprod((draft == best[:k]).to(torch.int64), dim=0).sum() if k else best.new_zeros(())
    return torch.cat([n.view(1), best])


def verify_sampled(draft: torch.Tensor, q: torch.Tensor | None, p: torch.Tensor,
                   generator: torch.Generator | None) -> torch.Tensor:
    """Speculative sampling (Leviathan et al. 2023; Chen et al. 2023).

    `draft` [k] drawn from `q` [k, V] (None means one-hot: a deterministic proposer such as
    n-gram lookup), `p` [k+1, V] the target's distributions. Draft i is accepted with probability
    min(1, p(x)/q(x)); at the first rejection the token comes from normalise(max(p - q, 0)); if
    all k are accepted the bonus token comes from p[k]. The emitted text then follows p exactly.
    Returns [n, emitted_1, ..., emitted_{n+1}, padding...] (length k+2; read n first).
    """
    k = draft.numel()
    rows = torch.arange(k, device=p.device)
    p_x = p[rows, draft]
    if q is None:
        q = torch.zeros_like(p[:k]).scatter_(-1, draft.view(-1, 1), 1.0)
    q_x = q[rows, draft]
    u = torch.rand(k, generator=generator, device=p.device, dtype=p.dtype)
    accepted = u * q_x <= p_x  # u <= p/q without dividing by q
    n = torch.cumprod(accepted.to(torch.int64), dim=0).sum() if k else torch.zeros((), dtype=torch.int64, device=p.device)
    residual = torch.cat([(p[:k] - q).clamp_min(0.0), p[k:]], dim=0)  # row k is p itself
    row = residual[n]
    # p == q at that row (up to rounding) leaves no residual mass; then p is the right law.
    row = torch.where(row.sum() > 0, row, p[n])
    last = sample(row / row.sum(), generator)
    emitted = torch.cat([draft, draft.new_zeros(1)])
    emitted = emitted.scatter(0, n.view(1), last.view(1))
    return torch.cat([n.view(1), emitted])


def greedy_tree_verdict(target_argmax: torch.Tensor, candidate_tokens: torch.Tensor, tree: Tree,
                        depth: int | None = None) -> torch.Tensor:
    """Greedy acceptance on the device: [best, path_0, ..., path_D, argmax_0, ..., argmax_{N-1}]
    (D = tree.max_depth; read `best` first).

    A node is accepted when its token equals the target's argmax at its parent and its parent is
    accepted; `best` is the deepest accepted node no deeper than `depth` (None: any; ties: the
    lowest index, i.e. the first path in depth-first order for Medusa's node order). `path` is
    root-to-`best`, padded by repeating `best` (`trees.path_nodes`). The accepted drafts are the
    argmax at `best`'s ancestors, the bonus token is the argmax at `best`: nothing else needs to
    leave the device, and the host learns all of it in one read.
    """
    device = target_argmax.device
    n = candidate_tokens.shape[0]
    ok = candidate_tokens == target_argmax[tree.parent.clamp(min=0)]
    ok[0] = True
    accepted = ~(tree.attention_mask & ~ok[None, :]).any(dim=1)  # every ancestor (and self) matched
    if depth is not None and depth < tree.max_depth:
        accepted &= tree.depths <= depth
    order = torch.arange(n, device=device)
    score = torch.where(accepted, tree.depths * n + (n - 1 - order), -1)
    best = score.argmax()
    return torch.cat([best.view(1), path_nodes(tree, best), target_argmax])


def top2_margins(logits: torch.Tensor) -> torch.Tensor:
    """Top-1 minus top-2 logit per row, in float64 (token ids stay exact next to them)."""
    top2 = logits.topk(2, dim=-1).values.double()
    return top2[:, 0] - top2[:, 1]


@dataclass(frozen=True)
class GreedyVerdict:
    """The greedy verdict as the target's verification graph computes it, after the logits and in
    the same graph (`CachedLM.verify`): so the argmax, the comparison and the accepted path cost
    no launches of their own. Frozen: one compiled graph per verdict kind.

    `tokens` [W] are the verified tokens (pending first); a static engine pads them to its step
    size with -1, which equals no argmax, so padding is never accepted. A chain gives
    `verify_greedy`'s [n, t_1 .. t_W], a tree `greedy_tree_verdict`'s [best, path, argmax]; with
    `margins`, the target's top-1 minus top-2 logit of every row follows, and the tokens are in
    float64 (exact below 2^53)."""

    tree: bool = False
    margins: bool = False

    def __call__(self, logits: torch.Tensor, tokens: torch.Tensor, tree: Tree | None = None) -> torch.Tensor:
        if self.tree:
            verdict = greedy_tree_verdict(logits.argmax(dim=-1), tokens, tree)
        else:
            verdict = verify_greedy(tokens[1:], logits)
        return torch.cat([verdict.double(), top2_margins(logits)]) if self.margins else verdict


class Greedy:
    """The greedy acceptance rule: a draft is kept while it equals the target's argmax. A decoder
    takes its rule as an object, so a new rule is a class here and nothing else changes."""

    greedy = True

    def pick(self, logits: torch.Tensor) -> tuple[torch.Tensor, None]:
        """A draft's tokens from its `logits` [..., V] -> ([...], None): the argmax, the token this
        rule accepts when the target agrees (a deterministic draft: q is one-hot, not returned)."""
        return logits.argmax(dim=-1), None

    def chain(self, draft: torch.Tensor, q: torch.Tensor | None, logits: torch.Tensor) -> torch.Tensor:
        """[n, emitted_1, ...]: `verify_greedy` (q is not read: greedy drafts are deterministic)."""
        return verify_greedy(draft, logits)

    def tree(self, logits: torch.Tensor, tokens: torch.Tensor, tree: Tree, depth: int | None) -> torch.Tensor:
        """[best, path..., argmax...]: `greedy_tree_verdict`."""
        return greedy_tree_verdict(logits.argmax(dim=-1), tokens, tree, depth)


class Sampled:
    """Speculative sampling at `temperature` (> 0) and `top_p`, drawing from `generator`: the
    emitted text follows the target's distribution exactly (`verify_sampled`)."""

    greedy = False

    def __init__(self, temperature: float, top_p: float = 1.0, generator: torch.Generator | None = None):
        if not temperature > 0:
            raise ValueError(f"sampling needs a temperature above 0, got {temperature}")
        self.temperature, self.top_p, self.generator = temperature, top_p, generator

    def pick(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A draft's tokens from its `logits` [..., V] -> ([...], q [..., V]): drawn from q, the
        draft's distribution under this rule's temperature and top-p. The rejection rule reads q
        beside the target's p made by the same transform (`probabilities`): a draft drawn from
        anything else would make the emitted text drift from the target's."""
        q = probabilities(logits, self.temperature, self.top_p)
        return sample(q, self.generator), q

    def chain(self, draft: torch.Tensor, q: torch.Tensor | None, logits: torch.Tensor) -> torch.Tensor:
        return verify_sampled(draft, q, probabilities(logits, self.temperature, self.top_p), self.generator)

    def tree(self, logits, tokens, tree, depth):
        raise ValueError("tree verification is greedy; a sampled run verifies chains")


def acceptance_rule(temperature: float = 0.0, top_p: float = 1.0,
                    generator: torch.Generator | None = None) -> Greedy | Sampled:
    """The rule of a run's settings: greedy at temperature 0, else speculative sampling."""
    return Greedy() if temperature == 0 else Sampled(temperature, top_p, generator)
