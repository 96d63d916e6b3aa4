"""The evaluation run (SPEC §2): held-out prompts through the speculative decoder and through the
target alone, interleaved and timed in one process, summed up as a report dict.

The story: check the inputs (`check_inputs`), load the models (`loading`), bind them to their
engines, plan each `auto` drafter's K from measured costs (`plan`), build every decoder with the one
factory (`make_decoder` -> `decoding.build_decoder`), compile and warm up, decode each prompt with the
target alone and then with each drafter, run the served ones again under load (`--concurrency`,
`load`), and sum up (`summary.build_report`). Compile and warm-up time is reported on its own, never
in tokens/s.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Callable

import torch

from ..decoding import CachedLM
from ..kinds.factory import build_decoder
from ..kinds.registry import BY_NAME, flagged, target_alone
from ..decoding.engines.compiled import capture_counts, compile_cache_state, compile_counts, use_compile_cache
from ..errors import UserError
from ..models import context_length
from ..prompts import encode_prompts, read_prompts, require_unique_ids
from .calibration import calibration_prompts, check_calibration
from .config import EvalConfig, shared_settings
from .costs import timed_generate
from .loading import LoadedModels, attach_drafter, bind_engine, load_models
from .metrics import PromptResult, defects
from .outputs import prepare_output_dir, staged_output
from .plan import no_tree_reason, resolve_plans
from .report import prompt_digest, write_report
from .summary import build_report
from .load import served_load
from .vllm_backend import ServedEngines, kv_cache_bytes, require_vllm, served_decoder


def make_decoder(cfg: EvalConfig, models: LoadedModels, *, baseline: bool = False, seed_offset: int = 0,
                 record_margins: bool = False):
    """The decoder for cfg's drafter, or (`baseline`) the target alone on the same engine.
    `record_margins` (greedy baselines): keep the target's top-1 minus top-2 logit per token.
    `--backend vllm`: the same, served by vLLM (`vllm_backend`)."""
    if cfg.backend == "vllm":
        return served_decoder(cfg, models, baseline=baseline, seed_offset=seed_offset, record_margins=record_margins)
    generator = None
    if cfg.temperature > 0:
        generator = torch.Generator(device=models.device).manual_seed(cfg.seed + seed_offset)
    settings = dataclasses.replace(cfg.decode_settings(generator=generator, record_margins=record_margins),
                                   eos_token_ids=frozenset(models.eos))
    drafter = models.drafter
    if baseline or cfg.num_draft_tokens == 0 or not BY_NAME[drafter.kind].drafts:
        drafter, settings = target_alone(), dataclasses.replace(settings.alone(), num_draft_tokens=0)
    return build_decoder(models.target_lm or models.target, drafter, settings)


@dataclass
class Evaluation:
    """One drafter's report (SPEC §2 report.json) with the per-prompt records behind it."""

    cfg: EvalConfig
    report: dict
    results: list[PromptResult]

    def defect_warnings(self, prefix: str = "") -> list[str]:
        """One `warning:` line per prompt whose greedy output left the baseline's at no near-tie."""
        num = self.report["numerics"]
        if self.report["overall"].get("divergences") is None:
            return []
        return [f"warning: {prefix}prompt {pid!r}: the speculative output differs from the target alone's at token "
                f"{index}, where the target's top-1 minus top-2 logit is "
                f"{'unknown' if margin is None else f'{margin:.4g}'}, above the {num['dtype']} near-tie tolerance "
                f"{num['near_tie_tolerance']}: not rounding, a decoder defect; please report it with this report"
                for pid, index, margin in defects(self.results, num["near_tie_tolerance"])]


DecoderFactory = Callable[..., object]


def check_inputs(cfgs: list[EvalConfig]) -> None:
    """Everything that can be checked without a model: settings and prompt files."""
    for cfg in cfgs:
        cfg.validate()
        if shared_settings(cfg) != shared_settings(cfgs[0]):
            raise UserError("compared drafters must share target, prompts and decoding settings")
    check_tree_used(cfgs)
    check_tree_nodes_auto(cfgs)
    records = read_prompts(cfgs[0].prompts, cfgs[0].limit)
    require_unique_ids(records)
    check_calibration(cfgs[0], records)
    if any(cfg.backend == "vllm" for cfg in cfgs):
        require_vllm()
    most = max(cfgs[0].concurrency)
    if most > len(records):
        limit = f" (--limit {cfgs[0].limit})" if cfgs[0].limit else ""
        raise UserError(f"--concurrency {most} keeps {most} requests in flight, but there are {len(records)} prompts"
                        f"{limit}: at most {len(records)} could be; give at least {most} prompts or a concurrency of "
                        f"{len(records)} or less")


def check_tree_used(cfgs: list[EvalConfig]) -> None:
    """--tree shapes only a tree drafter's steps (Medusa heads', EAGLE-3 drafts'): given for a run
    with none, it would be silently ignored, so it is an error (auto, the default, always fits)."""
    tree = cfgs[0].tree
    if tree != "auto" and not any(BY_NAME[cfg.drafter_kind].supports("tree") for cfg in cfgs):
        trees = ", ".join(f"--{k.flag}" for k in flagged() if k.supports("tree"))
        drafters = ", ".join(sorted({f"--method {c.method}" if c.method else f"--{BY_NAME[c.drafter_kind].flag}"
                                     for c in cfgs}))
        raise UserError(f"--tree {tree} shapes the steps of tree drafters ({trees}), not of {drafters}; leave --tree "
                        "out")


def check_tree_nodes_auto(cfgs: list[EvalConfig]) -> None:
    """--tree-nodes auto sizes a tree: with no drafter of the run verifying one, it (and the
    calibration file it reads) would be silently unused, so it is an error. In a compare beside a
    tree drafter, a chain drafter's report says it did not apply (`plan.resolve_plans`)."""
    reasons = [no_tree_reason(cfg) for cfg in cfgs]
    if cfgs[0].tree_nodes == "auto" and all(reasons):
        raise UserError(f"--tree-nodes auto sizes a tree, but {reasons[0]}; plan K with --num-draft-tokens auto, or "
                        "leave --tree-nodes out")


def evaluate(cfgs: list[EvalConfig], models: list[LoadedModels] | None = None, progress: bool = True,
             decoder_factory: DecoderFactory | None = None) -> list[Evaluation]:
    """Several drafters on the same target and prompts, in one process, side by side.

    Every prompt is decoded once by the target alone and then by each drafter, interleaved, so
    drift in the machine's speed hits all of them alike; each drafter's report shares that
    baseline. The configs may differ only in the drafter, its name and the output directory.
    Nothing is written here.
    """
    from tqdm.auto import tqdm

    factory = decoder_factory or make_decoder
    first = cfgs[0]
    check_inputs(cfgs)
    counts = compile_counts()  # torch's counters are process-wide: this run's compiles are those after
    if models is None:
        models = [load_models(first)]
        for cfg in cfgs[1:]:
            models.append(attach_drafter(models[0], cfg))
    loaded = models[0]
    prompts = encode_prompts(read_prompts(first.prompts, first.limit), loaded.tokenizer,
                             max_new_tokens=first.max_new_tokens, context_limit=context_length(loaded.target))
    calibration = calibration_prompts(first, loaded.tokenizer, context_length(loaded.target))
    engine_used = bind_engine(cfgs, models, prompts + calibration)
    if "static" in {engine_used, *draft_engines(models)}:  # before anything compiles: a home that cannot
        use_compile_cache(loaded.device)  # keep compiled steps is one warning, and the report's cache is "off"
    served = [cfg.backend == "vllm" for cfg in cfgs]
    if any(served):  # one set of vLLM engines for the run, sized as drafttrain's caches are
        max_len = models[0].target_lm.max_length or context_length(loaded.target) or 4096
        seqs = max(first.concurrency)
        engines = ServedEngines(max_model_len=max_len, max_num_seqs=seqs,
                                kv_cache_bytes=kv_cache_bytes(loaded.target.config, loaded.target.dtype, max_len, seqs))
        for m in models:
            m.served = engines
    cfgs, plans = resolve_plans(cfgs, models, prompts, calibration, progress)  # --num-draft-tokens auto: K from costs
    first = cfgs[0]
    torch.manual_seed(first.seed)
    if loaded.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(loaded.device)

    with_baseline = first.baseline == "ours"
    margins = with_baseline and first.greedy
    decoders = [factory(cfg, m) for cfg, m in zip(cfgs, models)]
    ours = dataclasses.replace(first, backend="drafttrain")
    base = factory(ours, loaded, baseline=True, record_margins=margins) if with_baseline else None
    # Served rows are timed against vLLM's own plain decoding of the same prompts.
    served_cfg = next((cfg for cfg in cfgs if cfg.backend == "vllm"), None)
    served_base = (factory(served_cfg, loaded, baseline=True, record_margins=margins)
                   if with_baseline and served_cfg is not None else None)
    # Compile and capture every step shape first (static engine; nothing to do on eager), then
    # warm up (kernels, allocator, caches) with decoders of their own, so the seeded runs are
    # untouched. Neither is counted in tokens/s; both are reported.
    for decoder in [*decoders, *(b for b in (base, served_base) if b is not None)]:
        warm = getattr(decoder, "warmup", None)
        if warm is not None:
            warm()
    warmups = [factory(cfg, m, seed_offset=1000) for cfg, m in zip(cfgs, models)]
    if with_baseline:
        warmups.append(factory(ours, loaded, baseline=True, seed_offset=1000, record_margins=margins))
    if served_base is not None:
        warmups.append(factory(served_cfg, loaded, baseline=True, seed_offset=1000, record_margins=margins))
    start = time.perf_counter()
    for decoder in warmups:
        decoder.generate(prompts[0].ids, min(8, first.max_new_tokens))
    warmup_seconds = time.perf_counter() - start

    results: list[list[PromptResult]] = [[] for _ in cfgs]
    with tqdm(prompts, desc="eval", unit="prompt", disable=not progress) as bar:
        for p in bar:
            baseline = timed_generate(base, p.ids, first.max_new_tokens) if base is not None else (None, None)
            served_baseline = (timed_generate(served_base, p.ids, first.max_new_tokens) if served_base is not None
                               else (None, None))
            for decoder, rs, is_served in zip(decoders, results, served):
                r = PromptResult(p.id, p.category, *timed_generate(decoder, p.ids, first.max_new_tokens),
                                 extra={"prompt_sha256": prompt_digest(p.ids)})
                r.baseline, r.baseline_seconds = served_baseline if is_served else baseline
                rs.append(r)

    loads = served_load(cfgs, decoders, served_base, [p.ids for p in prompts], results, progress)
    lms = {id(lm): lm for m in models for lm in (m.target_lm, m.drafter.model) if hasattr(lm, "compile_seconds")}
    compile_seconds = sum(lm.compile_seconds for lm in lms.values())
    engine = {"requested": first.engine, "used": engine_used, "compile_seconds": compile_seconds,
              "compile_cache": compile_cache_state(compile_seconds, since=counts), "warmup_seconds": warmup_seconds,
              **capture_counts(loaded.device, since=counts)}
    drafts = draft_engines(models)
    if drafts - {engine_used}:
        engine["draft_engines"] = sorted(drafts)
    evaluations = [Evaluation(cfg, build_report(cfg, m, decoder, rs, prompts[0], engine, plan, load), rs)
                   for cfg, m, decoder, rs, plan, load in zip(cfgs, models, decoders, results, plans, loads)]
    if any(served):
        models[0].served.close()
    return evaluations


def draft_engines(models: list[LoadedModels]) -> set[str]:
    """The engines the run's draft models decode on (those that are cached LMs of their own)."""
    return {m.drafter.model.engine for m in models if isinstance(m.drafter.model, CachedLM)}


def run_eval(cfg: EvalConfig, progress: bool = True, decoder_factory: DecoderFactory | None = None) -> Evaluation:
    """`drafttrain eval`: check everything, run, and write the report into cfg.out (replacing an
    earlier one only with cfg.overwrite)."""

    check_inputs([cfg])
    prepare_output_dir(cfg.out, cfg.overwrite)
    evaluation = evaluate([cfg], progress=progress, decoder_factory=decoder_factory)[0]
    with staged_output(cfg.out, cfg.overwrite) as stage:
        write_report(stage, evaluation.report, evaluation.results)
    return evaluation
