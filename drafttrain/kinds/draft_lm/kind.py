"""A draft LM's declaration (`KIND`, `--draft DIR`): how it loads and binds beside the target,
its costs for the planner, how vLLM and SGLang serve it and how `replay` scores it.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING
from statistics import median

import torch

from ...decoding.chain import ChainDecoder
from ...decoding.engines import CachedLM, StaticLM, as_cached_lm, cached_lm
from ...decoding.timing import forward_curve, single_token_seconds
from ...planning import noisy
from ...tokens import output_vocab_size
from ..base import Drafter, DrafterKind, chain_decoder, parameter_share, per_token, replayed_sequence
from .decode import DraftModelProposer

if TYPE_CHECKING:
    from ...decoding.settings import DecodeSettings


def draft_lm_drafter(model, info: dict | None = None) -> Drafter:
    """A draft LM as the factory sees it: parallel (one forward for K drafts) when its config
    names a `pard_token` (SPEC §7), else sequential; the one place that choice is made."""
    from ..parallel_lm.model import parallel_info

    parallel = info if info is not None else parallel_info(getattr(model, "config", None) or model.model.config)
    return Drafter("parallel_draft", model, parallel) if parallel else Drafter("draft", model)


class DraftLMKind(DrafterKind):
    """A draft LM drafting K tokens in a row on its own cached LM (`--draft DIR`)."""

    name, flag, help = "draft", "draft", "Draft model: a directory or hub id with the target's tokenizer."
    takes_lookup, sglang, replay_default = True, "STANDALONE", True

    def drafter(self, model: object, info: dict | None = None) -> Drafter:
        """A draft LM loads as a parallel one when its config names a `pard_token` (`draft_lm_drafter`)."""
        return draft_lm_drafter(model, info)

    def build(self, target: CachedLM, d: Drafter, s: DecodeSettings) -> ChainDecoder:
        """A chain decoder of the draft LM's K tokens in a row, in the target's vocabulary."""
        rule = s.rule()
        proposer = DraftModelProposer(d.model, output_vocab_size(target.model), rule, s.num_draft_tokens)
        return chain_decoder(target, proposer, s, rule=rule)

    def load(self, path: str | None, target: torch.nn.Module, tokenizer: object, device: torch.device,
             dtype: torch.dtype) -> Drafter:
        """A draft LM with the target's tokenizer, checked against the target (one `error:` line)."""
        from ...models import load_causal_lm, load_tokenizer
        from ..parallel_lm.model import check_parallel_config
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
