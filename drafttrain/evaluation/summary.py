"""One drafter's report dict (SPEC §2 report.json): its metrics, the costs behind its predicted
speedup, the engine, the numerics its divergences are judged by, and the environment."""

from __future__ import annotations

import dataclasses
import platform
import resource

import torch

from .. import __version__
from ..decoding import as_cached_lm
from ..parallel import parallel_info
from ..prompts import EncodedPrompt
from .config import EvalConfig
from .costs import eagle3_step_seconds, forward_seconds, single_token_seconds
from .loading import LoadedModels
from .metrics import NEAR_TIE_TOLERANCE, PromptResult, compute_metrics, metrics_by_category
from .report import report_inputs
from .vllm_backend import backend_info


def environment(device: torch.device) -> dict:
    import transformers

    if device.type == "cuda":
        name = f"cuda ({torch.cuda.get_device_name(device)})"
    else:
        name = f"cpu ({platform.machine()}, {torch.get_num_threads()} threads)"
    return {"device": name, "torch": torch.__version__, "transformers": transformers.__version__,
            "drafttrain": __version__}


def numerics(dtype_name: str) -> dict:
    """The report's `numerics` block: the dtype and the near-tie tolerance its divergences are judged by."""
    return {"dtype": dtype_name, "near_tie_tolerance": NEAR_TIE_TOLERANCE.get(dtype_name),
            "near_tie": "a greedy divergence from the target alone is a near-tie when the baseline's top-1 minus "
                        "top-2 logit there is at most near_tie_tolerance: rounding, not a decoder defect"}


def peak_memory(device: torch.device) -> tuple[int, str]:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), "CUDA max allocated"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "process max RSS"


def build_report(cfg: EvalConfig, models: LoadedModels, decoder, results: list[PromptResult], probe: EncodedPrompt,
                 engine: dict, plan: dict | None = None) -> dict:
    k = 0 if cfg.drafter_kind == "none" else decoder.num_draft_tokens
    parallel = parallel_info(models.draft.config) if models.draft is not None else None
    cost = None
    if k and cfg.backend == "drafttrain":  # vLLM's step costs are its own: no prediction from ours
        cost = 0.0  # n-gram lookup and heads cost next to nothing beside a target forward
        target_lm = models.target_lm or as_cached_lm(models.target)
        if parallel:  # one forward of the last token and K-1 masks per step, spread over its K drafts
            step = probe.ids[-1:] + [parallel["pard_token"]] * (k - 1)
            cost = (forward_seconds(models.draft_lm or as_cached_lm(models.draft), probe.ids, step)
                    / k / single_token_seconds(target_lm, probe.ids))
        elif models.draft is not None:
            cost = (single_token_seconds(models.draft_lm or as_cached_lm(models.draft), probe.ids)
                    / single_token_seconds(target_lm, probe.ids))
        elif models.eagle3 is not None:
            cost = (eagle3_step_seconds(models.eagle3_lm or models.eagle3, target_lm, probe.ids)
                    / single_token_seconds(target_lm, probe.ids))
    num = numerics(models.dtype_name)
    kwargs = {"cost_ratio": cost, "near_tie_tolerance": num["near_tie_tolerance"]}
    overall = compute_metrics(results, k, cfg.greedy, **kwargs)
    mem, mem_kind = peak_memory(models.device)
    overall.update(peak_memory_bytes=mem, peak_memory_kind=mem_kind)
    tree = getattr(decoder, "tree_name", None)  # None: a chain drafter, or a plan of no speculation
    if tree is not None and (cfg.drafter_kind in ("eagle3", "medusa") or cfg.ngram):
        overall["tree"] = tree
        if cfg.drafter_kind == "medusa" or tree.startswith("dynamic"):
            overall["tree_nodes"] = decoder.num_tree_nodes
    if cfg.drafter_kind == "medusa":
        overall["per_head_acceptance"] = overall["per_position_acceptance"]  # position i = head i's token
    return {
        "drafter": cfg.drafter_name,
        # SPEC §2 rev 2: config.engine is the engine used; what was asked for is engine.requested.
        "config": {**dataclasses.asdict(cfg), "engine": engine["used"]},
        "inputs": report_inputs(cfg.target),  # what `replay` checks its --target against
        "environment": environment(models.device),
        "numerics": num,
        "backend": backend_info(cfg, decoder),  # SPEC §7
        "engine": dict(engine),
        **({"heads": models.heads_info} if models.heads_info else {}),
        **({"eagle3": models.eagle3_info} if models.eagle3_info else {}),
        **({"parallel_draft": parallel} if parallel else {}),
        **({"plan": {**plan, "measured_speedup": overall.get("speedup")}} if plan else {}),
        "overall": overall,
        "by_category": metrics_by_category(results, k, cfg.greedy, **kwargs),
    }
