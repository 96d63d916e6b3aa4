"""A draft LM: a small same-family model drafting K tokens in a row on its own cached LM.

Sequential drafting is K forwards of the draft per step, each a few dozen kernels on a GPU, so
launching them one by one from Python costs more than their arithmetic; each also paid its own
staging copies. On the static engine a greedy step's K drafts are ONE function (`draft_chain`,
compiled once per pending width: one CUDA graph, as SGLang runs EAGLE's draft loop): it feeds the
pending tokens, takes the argmax, then feeds each draft back K - 1 times, with positions and
cache slots computed inside from a 0-d start slot, so a step is the draft's one launch plus the
target's verification (which computes the verdict). Pending stays on the device: after a step it
is a view of the target's verdict (`keep`), never a host list copied over.
The prompt (all but its last token) goes into the draft's cache at `reset`, beside the target's
prefill, not in the first step. Sampling, and drafts on the eager engine, run the same drafts as
one forward per token, each token picked by the decoder's rule (`rule.pick`: the argmax, or a
draw from q, returned beside it)).
"""

from __future__ import annotations

import functools

import torch

from ...decoding.chain import Proposer
from ...decoding.engines import StaticLM, as_cached_lm, device_tensor
from ...decoding.engines.compiled import WARMUP_RUNS, CompiledStep, timed_warmup
from ...decoding.engines.static import static_step
from ...decoding.verify import Greedy, Sampled


def target_vocab_logits(logits: torch.Tensor, vocab: int) -> torch.Tensor:
    """A draft's logits over the target's `vocab` tokens (a padded embedding matrix is fine)."""
    v = logits.shape[-1]
    if v > vocab:
        return logits[..., :vocab]
    if v < vocab:
        pad = logits.new_full((*logits.shape[:-1], vocab - v), float("-inf"))
        return torch.cat([logits, pad], dim=-1)
    return logits


def draft_chain(model, cache, tokens: torch.Tensor, start: torch.Tensor, *, count: int, vocab: int) -> torch.Tensor:
    """`count` greedy drafts as one function (one graph compiled per pending width): `tokens` [p]
    (pending) fed at slots start .. start + p - 1 (`start` 0-d, on the device), the argmax of the
    last row over the target's `vocab`, then count - 1 single-token steps each feeding the previous
    draft. Writes p + count - 1 cache entries; returns the drafts [count]."""
    p = tokens.shape[0]
    slots = start + torch.arange(p, device=tokens.device)
    causal = torch.ones(p, p, dtype=torch.bool, device=tokens.device).tril()
    logits, _ = static_step(model, cache, tokens[None], slots[None], slots, causal, None)
    token = target_vocab_logits(logits[0, -1], vocab).argmax(dim=-1, keepdim=True)
    drafts, one = [token], causal[:1, :1]
    for i in range(count - 1):
        slot = (start + p + i).view(1)
        logits, _ = static_step(model, cache, token[None], slot[None], slot, one, None)
        token = target_vocab_logits(logits[0, -1], vocab).argmax(dim=-1, keepdim=True)
        drafts.append(token)
    return torch.cat(drafts)


class DraftModelProposer(Proposer):
    """A small LM drafting autoregressively on its own KV cache.

    The cache holds every token of the sequence except `pending` (tokens emitted but not yet fed
    to the draft, [p] on the device). Feeding `pending` first is what puts the last accepted token
    into the draft's cache when all k drafts were accepted (the k-th draft itself was never fed).
    `model`: a cached LM (any engine) or a plain HF model (eager); `rule`: the decoder's
    acceptance rule (None: greedy), which picks each draft (`rule.pick`).

    Greedy on the static engine, a step's drafts are `draft_chain`: one compiled call (compiled
    for pending widths 1 and 2 at `warmup`; other shapes run the same function uncompiled). It
    drafts K even where the step's budget asks for fewer (the extra drafts are rolled back by
    `commit`), so the last steps of a generation reuse the same graph.
    """

    name = "draft"

    def __init__(self, model, target_vocab_size: int, rule: Greedy | Sampled | None = None,
                 num_draft_tokens: int = 1):
        """`num_draft_tokens`: K, which bounds what the draft catches up with in one forward."""
        self.lm = as_cached_lm(model)
        self.k = num_draft_tokens
        self.vocab = target_vocab_size
        self.rule = rule or Greedy()
        self.device = self.lm.device
        self.pending = torch.empty(0, dtype=torch.long, device=self.device)
        self.fed = 0  # drafts of the current step fed back into the cache
        # greedy on the static engine: K drafts as one function (`draft_chain`)
        self.one_graph = self.rule.greedy and isinstance(self.lm, StaticLM)
        self._chains: dict[int, CompiledStep] = {}  # draft count -> its compiled chain
        self._warm: set[tuple[int, int]] = set()     # (pending width, draft count) compiled at warm-up

    def reset(self, prompt, hidden=None):
        """Feeds the prompt but its last token to the draft now, beside the target's prefill."""
        self.lm.reset()
        tokens = device_tensor(list(prompt), self.device)
        if tokens.numel() > 1:
            self.lm.prefill(tokens[:-1])
        self.pending = tokens[-1:]
        self.fed = 0

    def warmup_sizes(self) -> list[int]:
        """Pending is one token (the bonus) or two (the last draft + the bonus). Beside n-gram
        lookup (+ngram) a step may accept the lookup's branch: up to K + 1 tokens, all but the last
        fed first (bucket K + 1). Sampled drafts go one by one (buckets 1 and 2)."""
        return [1, 2, self.k + 1]

    def warmup(self) -> float:
        """The LM's steps (`warmup_sizes`), then, greedy on the static engine, the K-draft chain."""
        seconds = super().warmup()
        if not self.one_graph:
            return seconds
        keys = [(p, self.k) for p in (1, 2)]
        steps = [functools.partial(self._dummy_chain, *key) for key in keys]
        seconds += timed_warmup(self.lm, steps, runs=WARMUP_RUNS if self.lm.compile else 1)
        self._warm.update(keys)
        return seconds

    def _dummy_chain(self, width: int, count: int) -> None:
        tokens = torch.zeros(width, dtype=torch.long, device=self.device)
        with torch.no_grad():
            self._chain_fn(count, compiled=True)(tokens, self.lm.at(0))

    def _chain_fn(self, count: int, compiled: bool):
        step = functools.partial(draft_chain, self.lm.model, self.lm.cache, count=count, vocab=self.vocab)
        if not (compiled and self.lm.compile):
            return step
        if count not in self._chains:
            self._chains[count] = CompiledStep(step, self.device)
        return self._chains[count]

    def propose(self, k, sequence):
        if not k:
            return self.pending[:0], None
        if self.one_graph:
            return self._propose_chain(k), None
        tokens, dists = [], []
        step_input = self.pending
        self.fed = 0
        for i in range(k):
            logits = target_vocab_logits(self.lm.forward(step_input)[0][-1], self.vocab)
            self.forwards += 1
            token, q = self.rule.pick(logits)
            token = token.view(1)
            if q is not None:
                dists.append(q)
            tokens.append(token)
            if i + 1 < k:
                step_input = token
                self.fed += 1
        self.pending = self.pending[:0]
        return torch.cat(tokens), (torch.stack(dists) if dists else None)

    @torch.no_grad()
    def _propose_chain(self, k: int) -> torch.Tensor:
        """`draft_chain` for K drafts (k where K would not fit the cache or k > K); the first k."""
        pending = self.pending
        if pending.numel() > 2:  # +ngram: the lookup's branch was accepted; catch up on all but one
            self.lm.prefill(pending[:-1])
            self.forwards += 1
            pending = pending[-1:]
        p, count = pending.numel(), max(k, self.k)
        if self.lm.length + p + count - 1 > self.lm.max_length:
            count = k
        self.lm._check_room(p + count - 1)
        fn = self._chain_fn(count, compiled=(p, count) in self._warm)
        drafts = fn(pending, self.lm.at(self.lm.length))
        self.lm.length += p + count - 1
        self.fed = count - 1
        self.forwards += count
        self.pending = pending[:0]
        return drafts[:k]

    def keep(self, n_accepted, emitted, verdict, hidden):
        """ChainDecoder's commit: the target's verdict is on the device, so pending is a view of it."""
        self.commit(n_accepted, emitted, verdict=verdict)

    def commit(self, n_accepted, emitted, hidden=None, verdict=None):
        """`verdict` (the target's [n, t_1 ..], on the device): the new pending tokens are a view
        of it, not a host list copied over."""
        keep = min(n_accepted, self.fed)
        self.lm.rollback(self.lm.length - (self.fed - keep))
        if verdict is not None:
            rest = verdict[1 + keep:n_accepted + 2]
            rest = rest if rest.dtype == torch.long else rest.long()  # margins: a float64 verdict
        else:
            rest = device_tensor(list(emitted[keep:]), self.device)
        self.pending = torch.cat([self.pending, rest]) if self.pending.numel() else rest
        self.fed = 0
