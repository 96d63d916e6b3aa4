"""How a recipe measures its drafter while training: greedy acceptance on held-out prompts.

The measurement that picks the exported weights is the one that matters in use: greedy
speculative decoding of held-out prompts with drafttrain's own decoders (built by the one
factory, `decoding.build_decoder`), summarised by tau (mean accepted length, SPEC §2).
"""

from __future__ import annotations

import time

from ..decoding import DecodeSettings, TreeDecoder
from ..kinds.base import Drafter
from ..kinds.factory import build_decoder
from ..errors import UserError
from ..evaluation.metrics import PromptResult, compute_metrics
from ..models import context_length
from ..prompts import EncodedPrompt, encode_prompts


def eval_prompts(records, tokenizer, target, *, num_prompts: int, max_new_tokens: int) -> list[EncodedPrompt]:
    """The first `num_prompts` held-out prompts that fit the target's context with the answer."""
    out = encode_prompts(records, tokenizer, max_new_tokens=max_new_tokens, context_limit=context_length(target),
                         on_too_long="skip", max_prompts=num_prompts)
    if not out:
        raise UserError("no held-out prompt fits the target's context together with eval.max_new_tokens; "
                        "lower eval.max_new_tokens or hold out shorter prompts")
    return out


ACCEPTANCE_KEYS = ("prompts", "new_tokens", "target_forwards", "draft_forwards", "draft_tokens", "accepted_tokens",
                   "acceptance_rate", "mean_accepted_length", "per_position_acceptance",
                   "per_position_acceptance_when_proposed")


def held_out_acceptance(target, drafter: Drafter, prompts: list[EncodedPrompt], settings: DecodeSettings,
                        max_new_tokens: int, extra: dict | None = None) -> dict:
    """Greedy decoding of `prompts` by `drafter` verified with `target`: tau and acceptance (+ `extra`,
    and a tree decoder's `tree_nodes`)."""
    decoder = build_decoder(target, drafter, settings)
    if isinstance(decoder, TreeDecoder):
        extra = {**(extra or {}), "tree_nodes": decoder.num_tree_nodes}
    return greedy_acceptance(decoder, prompts, max_new_tokens, extra)


def greedy_acceptance(decoder, prompts: list[EncodedPrompt], max_new_tokens: int, extra: dict | None = None) -> dict:
    """Greedy decoding of `prompts` with one of drafttrain's decoders: tau and acceptance (+ `extra`)."""
    results = []
    for p in prompts:
        start = time.perf_counter()
        gen = decoder.generate(p.ids, max_new_tokens)
        results.append(PromptResult(p.id, p.category, gen, time.perf_counter() - start))
    k = decoder.num_draft_tokens
    m = compute_metrics(results, k, greedy=True)
    return {"tau": m["mean_accepted_length"], **{key: m[key] for key in ACCEPTANCE_KEYS}, "num_draft_tokens": k,
            **(extra or {})}


def served_acceptance(export_dir, kind: str, target: str, prompts: list[EncodedPrompt], *, num_draft_tokens: int,
                      max_new_tokens: int, eos_token_ids: set[int], dtype: str) -> dict | None:
    """The export served by vLLM on the same held-out prompts (greedy, a chain of K), as
    `greedy_acceptance` reports it with `backend` added; None where vLLM is not installed (the
    recipes then export as before). A recipe adds it to the model card, so that a user sees the
    trained and the served acceptance agree before deploying."""
    from ..evaluation.vllm_backend import serve_export, vllm_version

    gens = serve_export(str(export_dir), kind, target, [p.ids for p in prompts], k=num_draft_tokens,
                        max_new_tokens=max_new_tokens, eos=eos_token_ids, dtype=dtype)
    if gens is None:
        return None
    results = [PromptResult(p.id, p.category, g, 0.0) for p, g in zip(prompts, gens)]
    m = compute_metrics(results, num_draft_tokens, greedy=True)
    return {"tau": m["mean_accepted_length"], **{key: m[key] for key in ACCEPTANCE_KEYS},
            "num_draft_tokens": num_draft_tokens, "backend": f"vllm {vllm_version()}"}


def served_row(export_dir, kind: str, target: str, prompts: list[EncodedPrompt], **kw) -> dict | None:
    """The model card's served row (None without vLLM)."""
    served = served_acceptance(export_dir, kind, target, prompts, **kw)
    if served is None:
        return None
    return table_row(f"served: {served['backend']}, chain of {served['num_draft_tokens']}", served)


def table_row(name: str, metrics: dict) -> dict:
    """One row of the exported acceptance table, from an evaluation's metrics."""
    return {"drafter": name, "num_draft_tokens": metrics["num_draft_tokens"], "tau": metrics["tau"],
            "acceptance_rate": metrics["acceptance_rate"], "per_position_acceptance": metrics["per_position_acceptance"]}


__all__ = ["eval_prompts", "greedy_acceptance", "held_out_acceptance", "served_acceptance", "served_row", "table_row"]
