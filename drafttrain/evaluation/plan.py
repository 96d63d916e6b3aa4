"""`--num-draft-tokens auto`: each drafter's K chosen from this machine's measured costs and the
drafter's acceptance on OTHER prompts (`drafttrain.planning` holds the model and the search).

The story, per drafter, before anything is timed: find its acceptance (the held-out acceptance
its export recorded in `drafttrain.json`, else a decode of `--calibration-prompts` at the
deepest K), measure the target's forward of 1 .. K+1 tokens and the drafter's step on the run's
engines (interleaved repeats, medians), measure the decode loop's own overhead per step, and
plan. A cost curve that looks like a busy machine is one `warning:` line and a note in the
report: a plan made from noise is said to be one.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path
from statistics import median

from ..decoding import DecodeSettings, as_cached_lm, build_decoder
from ..errors import UserError
from ..export import RECORD
from ..planning import Costs, Plan, noisy, plan_chain
from ..prompts import EncodedPrompt, encode_prompts, read_prompts
from .config import PLAN_MAX_K, EvalConfig
from .costs import forward_curve
from .loading import LoadedModels

CALIBRATION_PROMPTS = 8  # prompts of --calibration-prompts decoded per drafter


@dataclasses.dataclass(frozen=True)
class Acceptance:
    """Per-position acceptance a_1 .. a_K and how often each position was proposed at all."""

    per_position: list[float]
    proposal_rates: list[float] | None
    source: str
    extra_tokens: float = 0.0  # a hybrid's n-gram nodes per step beside the model's K drafts


def recorded_acceptance(cfg: EvalConfig) -> Acceptance | None:
    """The held-out acceptance a draft's export recorded (`drafttrain.json`), if there is one."""
    path = Path(cfg.draft) / RECORD if cfg.draft else None
    if path is None or not path.is_file():
        return None
    try:
        held_out = json.loads(path.read_text())["held_out"]
        per_position = [float(a) for a in held_out["per_position_acceptance"]]
    except (ValueError, KeyError, TypeError) as e:
        raise UserError(f"{path} is damaged ({type(e).__name__}: {e}); re-export the draft, or plan from "
                        "--calibration-prompts FILE") from None
    return Acceptance(per_position, None, f"held-out acceptance recorded at export ({path})")


def calibration_prompts(cfg: EvalConfig, tokenizer, context_limit: int | None) -> list[EncodedPrompt]:
    """The first `CALIBRATION_PROMPTS` prompts of --calibration-prompts (none without it), encoded
    before the engines are sized, so they fit the caches."""
    if not cfg.calibration_prompts:
        return []
    return encode_prompts(read_prompts([cfg.calibration_prompts], CALIBRATION_PROMPTS), tokenizer,
                          max_new_tokens=cfg.max_new_tokens, context_limit=context_limit)


def calibrated_acceptance(cfg: EvalConfig, models: LoadedModels, prompts: list[EncodedPrompt]) -> Acceptance:
    """Decode the calibration prompts with K = PLAN_MAX_K and count, per position, how often it was
    accepted and how often proposed."""
    settings = dataclasses.replace(cfg.decode_settings(k=PLAN_MAX_K), eos_token_ids=frozenset(models.eos))
    decoder = build_decoder(models.target_lm or models.target, models.drafter(cfg.drafter_kind), settings)
    accepted, proposed = [], []
    for p in prompts:
        gen = decoder.generate(p.ids, cfg.max_new_tokens)
        accepted += gen.accepted_lengths
        proposed += gen.proposed_lengths
    steps = max(1, len(accepted))
    hybrid = getattr(getattr(decoder, "drafter", None), "lookup_nodes", None)
    return Acceptance([sum(a >= j for a in accepted) / steps for j in range(1, PLAN_MAX_K + 1)],
                      None if cfg.ngram else [sum(m >= j for m in proposed) / steps for j in range(1, PLAN_MAX_K + 1)],
                      f"{len(prompts)} calibration prompts from {cfg.calibration_prompts}",
                      hybrid / steps if hybrid is not None else 0.0)


def drafter_acceptance(cfg: EvalConfig, models: LoadedModels, calibration: list[EncodedPrompt]) -> Acceptance:
    if cfg.calibration_prompts:
        return calibrated_acceptance(cfg, models, calibration)
    recorded = None if cfg.ngram else recorded_acceptance(cfg)  # a hybrid's own acceptance is not recorded
    if recorded is None:
        raise UserError(f"--num-draft-tokens auto needs {cfg.drafter_name}'s acceptance on other prompts than the "
                        f"evaluated ones, and it has none recorded ({RECORD}); pass --calibration-prompts FILE")
    return recorded


def loop_overhead(models: LoadedModels, probe: EncodedPrompt, single: float, tokens: int = 12) -> float:
    """Seconds a plain decoding step spends beyond its forward (sampling, bookkeeping, the sync)."""
    settings = DecodeSettings(num_draft_tokens=1)
    decoder = build_decoder(models.target_lm or models.target, models.drafter("none"), settings)
    gen = decoder.generate(probe.ids, tokens)
    return max(0.0, median(gen.step_seconds) - single) if gen.step_seconds else 0.0


def drafter_seconds(cfg: EvalConfig, models: LoadedModels, probe: EncodedPrompt, acceptance: Acceptance,
                    max_k: int) -> tuple[list[float], list[str]]:
    """The drafter's share of a step drafting k = 0 .. max_k tokens, and any noise warnings."""
    drafter = models.drafter(cfg.drafter_kind)
    if drafter.kind == "ngram":
        return [0.0] * (max_k + 1), []  # a suffix lookup: nothing beside a forward
    if drafter.kind not in ("draft", "parallel_draft"):
        raise UserError(f"--num-draft-tokens auto plans chain drafters (draft models, parallel drafts, n-gram); "
                        f"{cfg.drafter_name} ({drafter.kind}) drafts a tree: give --num-draft-tokens K")
    lm = models.draft_lm or as_cached_lm(models.draft)
    if drafter.kind == "draft":  # one forward per draft token
        curve = forward_curve(lm, probe.ids, 1)
        return [k * median(curve[0]) for k in range(max_k + 1)], noisy(curve)
    # a parallel draft: one forward of the pending tokens (the last step's emitted ones) and k-1 masks
    widths = [0] + [min(2 * max_k, round(1 + sum(acceptance.per_position[:k - 1])) + k - 1)
                    for k in range(1, max_k + 1)]
    curve = forward_curve(lm, probe.ids, max(widths))
    return [0.0] + [median(curve[w - 1]) for w in widths[1:]], noisy(curve)


def plan_drafter(cfg: EvalConfig, models: LoadedModels, probe: EncodedPrompt,
                 calibration: list[EncodedPrompt]) -> tuple[Plan, dict]:
    """The plan for one drafter and the report's `plan` block (SPEC §7)."""
    acceptance = drafter_acceptance(cfg, models, calibration)
    max_k = min(PLAN_MAX_K, len(acceptance.per_position))
    target_lm = models.target_lm or as_cached_lm(models.target)
    start = time.perf_counter()
    verify = forward_curve(target_lm, probe.ids, max_k + 1 + (max_k if cfg.ngram else 0))
    draft, draft_noise = drafter_seconds(cfg, models, probe, acceptance, max_k)
    single = median(verify[0])
    costs = Costs(tuple(median(v) for v in verify), tuple(draft), loop_overhead(models, probe, single),
                  tuple(noisy(verify) + draft_noise))
    plan = plan_chain(acceptance.per_position, costs, acceptance.proposal_rates, max_k, acceptance.extra_tokens)
    for line in costs.warnings:
        print(f"warning: {cfg.drafter_name}: the cost measurement looks like a busy machine ({line}); the plan "
              "may be made from noise: run alone", file=sys.stderr)
    block = {"num_draft_tokens": plan.num_draft_tokens, "tree_nodes": None, "costs": costs.as_dict(),
             "planned_speedup": plan.planned_speedup, "expected_tokens": plan.expected_tokens,
             "source": acceptance.source, "acceptance": acceptance.per_position,
             "proposal_rates": acceptance.proposal_rates, "extra_tokens": acceptance.extra_tokens, "candidates": plan.as_dict()["candidates"],
             "noise": list(costs.warnings), "seconds": time.perf_counter() - start}
    return plan, block


def resolve_plans(cfgs: list[EvalConfig], models: list[LoadedModels], probe: EncodedPrompt,
                  calibration: list[EncodedPrompt]) -> tuple[list[EvalConfig], list[dict | None]]:
    """Every `auto` config with its planned K (0: the target alone), and the plans for the reports."""
    planned, blocks = [], []
    for cfg, m in zip(cfgs, models):
        if cfg.num_draft_tokens != "auto" or cfg.drafter_kind == "none":
            planned.append(cfg if cfg.num_draft_tokens != "auto" else dataclasses.replace(cfg, num_draft_tokens=0))
            blocks.append(None)
            continue
        plan, block = plan_drafter(cfg, m, probe, calibration)
        planned.append(dataclasses.replace(cfg, num_draft_tokens=plan.num_draft_tokens))
        blocks.append(block)
    return planned, blocks




def export_plans(target, draft, acceptance: list[float], parallel: dict | None, probe: list[int]) -> dict:
    """The plans an export records beside its held-out acceptance (`drafttrain.json` "plans"):
    one from costs measured now on the training machine, and one for a GPU at batch 1, where a
    forward of a few tokens costs what one token does (memory-bound) and a draft forward costs
    its share of the target's parameters; with the vLLM `speculative_config` that GPU plan means."""
    from ..decoding import EagerLM

    max_k = min(PLAN_MAX_K, len(acceptance))
    if max_k == 0:
        return {}
    target_lm, draft_lm = EagerLM(target), EagerLM(draft)
    verify = tuple(median(t) for t in forward_curve(target_lm, probe, max_k + 1))
    share = sum(p.numel() for p in draft.parameters()) / sum(p.numel() for p in target.parameters())
    if parallel:
        widths = [min(2 * max_k, round(1 + sum(acceptance[:k - 1])) + k - 1) for k in range(1, max_k + 1)]
        curve = forward_curve(draft_lm, probe, max(widths))
        here = (0.0, *(median(curve[w - 1]) for w in widths))
        gpu_draft = (0.0, *([share] * max_k))
    else:
        one = median(forward_curve(draft_lm, probe, 1)[0])
        here = tuple(k * one for k in range(max_k + 1))
        gpu_draft = tuple(k * share for k in range(max_k + 1))
    cpu = plan_chain(acceptance, Costs(verify, here))
    gpu = plan_chain(acceptance, Costs((1.0,) * (max_k + 1), gpu_draft))
    config = {"method": "draft_model", "num_speculative_tokens": max(gpu.num_draft_tokens, 1)}
    if parallel:
        config["parallel_drafting"] = True
    return {"this_machine": {"num_draft_tokens": cpu.num_draft_tokens, "planned_speedup": cpu.planned_speedup,
                             "costs": Costs(verify, here).as_dict()},
            "gpu_batch1": {"num_draft_tokens": gpu.num_draft_tokens, "planned_speedup": gpu.planned_speedup,
                           "assumption": f"verification flat in tokens; a draft forward costs {share:.3f} of a "
                                         "target forward (its parameter share)"},
            "vllm_speculative_config": config}


__all__ = ["CALIBRATION_PROMPTS", "Acceptance", "export_plans", "plan_drafter", "resolve_plans"]
