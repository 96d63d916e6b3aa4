"""A draft LM: a small same-family model drafting K tokens in a row on its own cached LM."""

from __future__ import annotations

from statistics import median

import torch

from ...planning import noisy
from ...tokens import output_vocab_size
from ..chain import Proposer
from ..engines import as_cached_lm, cached_lm, device_tensor
from ..timing import forward_curve, single_token_seconds
from ..verify import probabilities, sample
from .kind import Drafter, DrafterKind, chain_decoder, parameter_share, per_token


def target_vocab_logits(logits: torch.Tensor, vocab: int) -> torch.Tensor:
    """A draft's logits over the target's `vocab` tokens (a padded embedding matrix is fine)."""
    v = logits.shape[-1]
    if v > vocab:
        return logits[..., :vocab]
    if v < vocab:
        pad = logits.new_full((*logits.shape[:-1], vocab - v), float("-inf"))
        return torch.cat([logits, pad], dim=-1)
    return logits


class DraftModelProposer(Proposer):
    """A small LM drafting autoregressively on its own KV cache.

    The cache holds every token of the sequence except `pending` (tokens emitted but not yet fed
    to the draft). Feeding `pending` first is what puts the last accepted token into the draft's
    cache when all k drafts were accepted (the k-th draft itself was never fed). `model`: a
    cached LM (any engine) or a plain HF model (eager).
    """

    name = "draft"

    def __init__(self, model, target_vocab_size: int, temperature: float, top_p: float,
                 generator: torch.Generator | None, num_draft_tokens: int = 1):
        """`num_draft_tokens`: K, which bounds what the draft catches up with in one forward."""
        self.lm = as_cached_lm(model)
        self.k = num_draft_tokens
        self.vocab = target_vocab_size
        self.temperature, self.top_p, self.generator = temperature, top_p, generator
        self.device = self.lm.device
        self.pending: list[int] = []
        self.fed = 0  # drafts of the current step fed back into the cache

    def reset(self, prompt, hidden=None):
        self.lm.reset()
        self.pending = list(prompt)
        self.fed = 0

    def warmup(self) -> float:
        # Pending is one token (the bonus) or two (the last draft + the bonus); drafts go one by one.
        # Beside n-gram lookup (+ngram) a step may accept the lookup's branch: up to K + 1 tokens.
        return self.lm.warmup([1, 2, self.k + 1])

    def propose(self, k, sequence):
        tokens, dists = [], []
        step_input = device_tensor(self.pending, self.device)
        self.fed = 0
        for i in range(k):
            logits = target_vocab_logits(self.lm.forward(step_input)[0][-1], self.vocab)
            self.forwards += 1
            if self.temperature == 0:
                token = logits.argmax(dim=-1, keepdim=True)
            else:
                q = probabilities(logits, self.temperature, self.top_p)
                token = sample(q, self.generator).view(1)
                dists.append(q)
            tokens.append(token)
            if i + 1 < k:
                step_input = token
                self.fed += 1
        if k:
            self.pending = []
        draft = torch.cat(tokens) if tokens else torch.empty(0, dtype=torch.long, device=self.device)
        return draft, (torch.stack(dists) if dists else None)

    def commit(self, n_accepted, emitted, hidden=None):
        keep = min(n_accepted, self.fed)
        self.lm.rollback(self.lm.length - (self.fed - keep))
        self.pending = self.pending + list(emitted[keep:])
        self.fed = 0


def draft_lm_drafter(model, info: dict | None = None) -> Drafter:
    """A draft LM as the factory sees it: parallel (one forward for K drafts) when its config
    names a `pard_token` (SPEC §7), else sequential; the one place that choice is made."""
    from ...parallel import parallel_info

    parallel = info if info is not None else parallel_info(getattr(model, "config", None) or model.model.config)
    return Drafter("parallel_draft", model, parallel) if parallel else Drafter("draft", model)


def load_draft_lm(path: str, target, tokenizer, device, dtype) -> Drafter:
    """A draft LM with the target's tokenizer, checked against the target (one `error:` line)."""
    from ...models import load_causal_lm, load_tokenizer
    from ...parallel import check_parallel_config
    from ...preflight import compatibility_checks, require_compatible

    draft_tok = load_tokenizer(path, "draft")
    model = load_causal_lm(path, dtype, device, "draft")
    check_parallel_config(model, path)
    require_compatible(compatibility_checks(target, tokenizer, model, draft_tok))
    return draft_lm_drafter(model)


def bind_draft_lm(drafter: Drafter, target_lm, engine: str, max_length: int, s) -> Drafter:
    """The draft LM on its own cached LM (`--engine`; auto: eager where static cannot run it)."""
    return Drafter(drafter.kind, cached_lm(drafter.model, engine, max_length=max_length), drafter.info)


def draft_lm_seconds(drafter: Drafter, target_lm, ids: list[int], max_k: int, acceptance,
                     repeats: int) -> tuple[list[float], list[str]]:
    """One forward per draft token: k of them to draft k."""
    curve = forward_curve(as_cached_lm(drafter.model), ids, 1, repeats=repeats)
    return per_token(median(curve[0]), max_k), noisy(curve)


def draft_lm_cost(drafter: Drafter, target_lm, ids: list[int], k: int) -> float:
    return single_token_seconds(as_cached_lm(drafter.model), ids) / single_token_seconds(target_lm, ids)


def _draft_lm(target, drafter, s):
    proposer = DraftModelProposer(drafter.model, output_vocab_size(target.model), s.temperature, s.top_p,
                                  s.generator, s.num_draft_tokens)
    return chain_decoder(target, proposer, s)


def served_path(path: str, k: int, drafter: Drafter, s) -> dict:
    spec = {"method": "draft_model", "model": path, "num_speculative_tokens": k}
    return {**spec, "parallel_drafting": True} if drafter.kind == "parallel_draft" else spec


KIND = DrafterKind(
    "draft", _draft_lm, flag="draft", help="Draft model: a directory or hub id with the target's tokenizer.",
    load=load_draft_lm, bind=bind_draft_lm, takes_lookup=True, step_seconds=draft_lm_seconds,
    draft_forwards=lambda d, max_k, acceptance: [(k, 1) for k in range(1, max_k + 1)], cost_ratio=draft_lm_cost,
    gpu_costs=lambda d, target, max_k: per_token(parameter_share(d.model, target), max_k),
    vllm=served_path, vllm_forwards=lambda k, d: k, sglang="STANDALONE", replay="tokens",
    replay_default=True)
