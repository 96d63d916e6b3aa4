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

import copy
import functools
from typing import TYPE_CHECKING
from statistics import median

import torch

from ...planning import noisy
from ...tokens import output_vocab_size
from ..chain import ChainDecoder, Proposer
from ..engines import CachedLM, StaticLM, as_cached_lm, cached_lm, device_tensor
from ..engines.compiled import WARMUP_RUNS, CompiledStep, timed_warmup
from ..engines.static import static_step
from ..timing import forward_curve, single_token_seconds
from ..verify import Greedy, Sampled
from .kind import Drafter, DrafterKind, chain_decoder, parameter_share, per_token, replayed_sequence

if TYPE_CHECKING:
    from ..factory import DecodeSettings


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
            self.lm.forward(tokens[:-1])
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
            self.lm.forward(pending[:-1])
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


def draft_lm_drafter(model, info: dict | None = None) -> Drafter:
    """A draft LM as the factory sees it: parallel (one forward for K drafts) when its config
    names a `pard_token` (SPEC §7), else sequential; the one place that choice is made."""
    from ...parallel import parallel_info

    parallel = info if info is not None else parallel_info(getattr(model, "config", None) or model.model.config)
    return Drafter("parallel_draft", model, parallel) if parallel else Drafter("draft", model)


class DraftLMKind(DrafterKind):
    """A draft LM drafting K tokens in a row on its own cached LM (`--draft DIR`)."""

    name, flag, help = "draft", "draft", "Draft model: a directory or hub id with the target's tokenizer."
    takes_lookup, sglang, replay_default = True, "STANDALONE", True

    def build(self, target: CachedLM, d: Drafter, s: DecodeSettings) -> ChainDecoder:
        """A chain decoder of the draft LM's K tokens in a row, in the target's vocabulary."""
        rule = s.rule()
        proposer = DraftModelProposer(d.model, output_vocab_size(target.model), rule, s.num_draft_tokens)
        return chain_decoder(target, proposer, s, rule=rule)

    def load(self, path: str | None, target: torch.nn.Module, tokenizer: object, device: torch.device,
             dtype: torch.dtype) -> Drafter:
        """A draft LM with the target's tokenizer, checked against the target (one `error:` line)."""
        from ...models import load_causal_lm, load_tokenizer
        from ...parallel import check_parallel_config
        from ...preflight import compatibility_checks, require_compatible

        draft_tok = load_tokenizer(path, "draft")
        model = load_causal_lm(path, dtype, device, "draft")
        check_parallel_config(model, path)
        require_compatible(compatibility_checks(target, tokenizer, model, draft_tok))
        return draft_lm_drafter(model)

    def bind(self, d: Drafter, target_lm: CachedLM, engine: str, max_length: int, s: DecodeSettings) -> Drafter:
        """The draft LM on its own cached LM (`--engine`; auto: eager where static cannot run it)."""
        return Drafter(d.kind, cached_lm(d.model, engine, max_length=max_length), d.info)

    def step_seconds(self, d: Drafter, target_lm: CachedLM, ids: list[int], max_k: int, acceptance: list[float],
                     repeats: int) -> tuple[list[float], list[str]]:
        """One forward per draft token: k of them to draft k."""
        curve = forward_curve(as_cached_lm(d.model), ids, 1, repeats=repeats)
        return per_token(median(curve[0]), max_k), noisy(curve)

    def draft_forwards(self, d: Drafter, max_k: int, acceptance: list[float]) -> list[tuple[int, int]]:
        """k forwards of one token each to draft k."""
        return [(k, 1) for k in range(1, max_k + 1)]

    def cost_ratio(self, d: Drafter, target_lm: CachedLM, ids: list[int], k: int) -> float:
        """One draft LM forward over one target forward, each of one token."""
        return single_token_seconds(as_cached_lm(d.model), ids) / single_token_seconds(target_lm, ids)

    def gpu_costs(self, d: Drafter, target: torch.nn.Module, max_k: int) -> list[float]:
        """One forward per draft token, each costing the draft's share of the target's parameters."""
        return per_token(parameter_share(d.model, target), max_k)

    def bench_rows(self, target: torch.nn.Module, k: int, max_length: int) -> list[tuple[str, Drafter, dict]]:
        """A copy of the target on its own static, compiled LM: alone, and with n-gram lookup's branch."""
        drafter = Drafter(self.name, StaticLM(copy.deepcopy(target), max_length=max_length, compile=True))
        return [("draft LM", drafter, {}), ("draft LM + n-gram", drafter, {"hybrid": "ngram"})]

    def vllm(self, path: str | None, k: int, d: Drafter, s: DecodeSettings | None) -> dict:
        """vLLM's draft model at `path` (with its parallel drafting for a parallel draft)."""
        spec = {"method": "draft_model", "model": path, "num_speculative_tokens": k}
        return {**spec, "parallel_drafting": True} if d.kind == "parallel_draft" else spec

    def vllm_forwards(self, k: int, d: Drafter) -> int:
        """One draft forward per draft token."""
        return k

    @torch.no_grad()
    def replay_matches(self, d: Drafter, target: torch.nn.Module, prompt: list[int], target_tokens: list[int],
                       k: int) -> list[bool]:
        """Whether the draft's greedy token equals the target's at each output position (its guess there does
        not depend on where the step began): one forward of the draft, the target unused."""
        if not target_tokens:
            return []
        ids = replayed_sequence(d.model, prompt, target_tokens)[1]
        keep = len(target_tokens) + 1  # logits of the last prompt position onwards
        logits = d.model(input_ids=ids, logits_to_keep=keep).logits[0, :len(target_tokens)]
        return [p == t for p, t in zip(logits.argmax(-1).tolist(), target_tokens)]


KIND = DraftLMKind()
