"""One drafter's report dict (SPEC §2 report.json): its metrics, the costs behind its predicted
speedup, the engine, the numerics its divergences are judged by, and the environment."""

from __future__ import annotations

import dataclasses
import platform
import resource

import torch

from .. import __version__
from ..decoding import as_cached_lm
from ..kinds.registry import BY_NAME
from ..prompts import EncodedPrompt
from .config import EvalConfig
from .loading import LoadedModels
from .metrics import NEAR_TIE_TOLERANCE, PromptResult, compute_metrics, metrics_by_category
from .report import report_inputs
from .vllm_backend import backend_info
from .windows import acceptance_by_window, window_prompts


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
                 engine: dict, plan: dict | None = None, load: list[dict] | None = None) -> dict:
    """`load`: the served concurrency block (`evaluation.load`), None where nothing was served."""
    drafter = models.drafter
    kind = BY_NAME[drafter.kind]
    k = decoder.num_draft_tokens if kind.drafts else 0
    cost = None
    if k and cfg.backend == "drafttrain":  # vLLM's step costs are its own: no prediction from ours
        # a lookup's or heads' step costs next to nothing beside a target forward
        target_lm = models.target_lm or as_cached_lm(models.target)
        cost = kind.cost_ratio(drafter, target_lm, probe.ids, k)
    num = numerics(models.dtype_name)
    kwargs = {"cost_ratio": cost, "near_tie_tolerance": num["near_tie_tolerance"]}
    overall = compute_metrics(results, k, cfg.greedy, **kwargs)
    gens = [r.speculative for r in results]
    mem, mem_kind = peak_memory(models.device)
    overall.update(peak_memory_bytes=mem, peak_memory_kind=mem_kind)
    tree = getattr(decoder, "tree_name", None)  # None: a chain drafter, or a plan of no speculation
    if tree is not None and (kind.supports("tree") or cfg.hybrid):  # a served chain is no tree drafter's
        overall["tree"] = tree
    blocks = kind.report(drafter, decoder, overall)  # the kind's own, e.g. its export's record
    return {
        "drafter": cfg.drafter_name,
        # SPEC §2 rev 2: config.engine is the engine used; what was asked for is engine.requested.
        "config": {**dataclasses.asdict(cfg), "engine": engine["used"]},
        "inputs": report_inputs(cfg.target),  # what `replay` checks its --target against
        "environment": environment(models.device),
        "numerics": num,
        "backend": backend_info(cfg, decoder),  # SPEC §7
        "engine": dict(engine),
        **blocks,
        **({"plan": {**plan, "measured_speedup": overall.get("speedup")}} if plan else {}),
        "overall": overall,
        "by_category": metrics_by_category(results, k, cfg.greedy, **kwargs),
        # SPEC §9: tau by output window, over the prompts whose steps are in time order
        "by_window": acceptance_by_window(gens, cfg.acceptance_window, k),
        "by_window_prompts": window_prompts(gens),
        **({"load": load} if load is not None else {}),
    }
