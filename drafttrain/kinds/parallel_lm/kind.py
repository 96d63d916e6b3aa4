"""A parallel draft LM's declaration (`KIND`; a draft LM whose config names a `pard_token`): its
costs for the planner (one forward for K drafts), how vLLM serves it and how `replay` scores it.
"""

from __future__ import annotations

import copy
from statistics import median
from typing import TYPE_CHECKING

import torch

from ...decoding.chain import ChainDecoder
from ...decoding.engines import CachedLM, StaticLM, as_cached_lm
from ...decoding.timing import forward_curve, forward_seconds, single_token_seconds
from ...planning import noisy
from ...tokens import output_vocab_size
from ..base import Drafter, DrafterKind, chain_decoder, parameter_share, replayed_sequence
from ..draft_lm.kind import DraftLMKind
from .decode import (ParallelDraftProposer)

if TYPE_CHECKING:
    from ...decoding.settings import DecodeSettings
    from ...decoding.loop import Decoder


def parallel_widths(acceptance: list[float], max_k: int) -> list[int]:
    """A parallel draft's forward when drafting k = 1 .. max_k: the pending tokens (the last step's
    emitted ones, on average, from per-position `acceptance`) and k - 1 masks."""
    return [min(2 * max_k, round(1 + sum(acceptance[:k - 1])) + k - 1) for k in range(1, max_k + 1)]


class ParallelLMKind(DrafterKind):
    """A parallel draft LM (PARD): loaded by `--draft DIR` (`draft_lm_drafter`), bound and served as a draft LM."""

    name, takes_lookup = "parallel_draft", True
    bind, vllm = DraftLMKind.bind, DraftLMKind.vllm

    def build(self, target: CachedLM, d: Drafter, s: DecodeSettings) -> ChainDecoder:
        """A chain decoder of K drafts from one forward of the pending tokens and K - 1 masks."""
        rule = s.rule()
        proposer = ParallelDraftProposer(d.model, output_vocab_size(target.model), d.info["pard_token"], rule,
                                         parallel_tokens=d.info.get("parallel_tokens"))
        return chain_decoder(target, proposer, s, rule=rule)

    def step_seconds(self, d: Drafter, target_lm: CachedLM, ids: list[int], max_k: int, acceptance: list[float],
                     repeats: int) -> tuple[list[float], list[str]]:
        """One forward of the pending tokens and k - 1 masks to draft k."""
        widths = parallel_widths(acceptance, max_k)
        curve = forward_curve(as_cached_lm(d.model), ids, max(widths), repeats=repeats)
        return [0.0] + [median(curve[w - 1]) for w in widths], noisy(curve)

    def draft_forwards(self, d: Drafter, max_k: int, acceptance: list[float]) -> list[tuple[int, int]]:
        """One forward of `parallel_widths` tokens to draft k."""
        return [(1, w) for w in parallel_widths(acceptance, max_k)]

    def cost_ratio(self, d: Drafter, target_lm: CachedLM, ids: list[int], k: int) -> float:
        """One forward of the last token and K-1 masks per step, spread over its K drafts."""
        step = ids[-1:] + [d.info["pard_token"]] * (k - 1)
        return forward_seconds(as_cached_lm(d.model), ids, step) / k / single_token_seconds(target_lm, ids)

    def gpu_costs(self, d: Drafter, target: torch.nn.Module, max_k: int) -> list[float]:
        """One forward for any k >= 1, costing the draft's share of the target's parameters."""
        return [0.0] + [parameter_share(d.model, target)] * max_k

    def report(self, d: Drafter, decoder: Decoder, overall: dict) -> dict:
        """Its parallel configuration (`pard_token`, the K it was trained for)."""
        return {"parallel_draft": d.info}

    def bench_rows(self, target: torch.nn.Module, k: int, max_length: int) -> list[tuple[str, Drafter, dict]]:
        """A copy of the target on its own static, compiled LM, its last token the mask, trained for K."""
        model = StaticLM(copy.deepcopy(target), max_length=max_length, compile=True)
        info = {"pard_token": target.config.vocab_size - 1, "parallel_tokens": k}
        return [("parallel draft", Drafter(self.name, model, info), {})]

    def vllm_forwards(self, k: int, d: Drafter) -> int:
        """One draft forward a step, whatever K."""
        return 1


    @torch.no_grad()
    def replay_matches(self, d: Drafter, target: torch.nn.Module, prompt: list[int], target_tokens: list[int],
                       k: int) -> list[list[bool]]:
        """The grid from ONE forward over (prompt + the target's output) laid out for every depth at once
        (`drafttrain.kinds.parallel_lm.model`): the step that begins with t output tokens emitted (last real token at index
        c - 1, c = P + t) drafts its token j from depth j at position c - 1 + j, which sees x_0 .. x_{c-1} and
        j masks, as the decoder's forward does. The target unused."""
        from .model import parallel_layout

        if not target_tokens:
            return []
        draft = d.model
        sequence, ids = replayed_sequence(draft, prompt, target_tokens)
        ones = torch.ones_like(ids)
        depth = max(k, 2)
        start = len(prompt) - 1
        layout = parallel_layout(ids, ones, torch.arange(len(sequence), device=ids.device)[None], start=start,
                                 depth=depth, mask_id=d.info["pard_token"])
        dtype = next(draft.parameters()).dtype
        logits = draft(input_ids=layout.input_ids, position_ids=layout.position_ids,
                       attention_mask=layout.additive_mask(dtype), logits_to_keep=layout.logits_to_keep).logits
        guess = dict(zip(layout.rows(), logits[0].argmax(-1).tolist()))  # (depth, position) -> its draft
        rows = []
        for t in range(len(target_tokens)):
            c = len(prompt) + t
            rows.append([c + j < len(sequence) and guess.get((j, c - 1 + j)) == sequence[c + j] for j in range(k)])
        return rows


KIND = ParallelLMKind()
