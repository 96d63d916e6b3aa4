"""The evaluation run (SPEC §2): held-out prompts through the speculative decoder and through the
target alone, interleaved and timed in one process, summed up as a report dict.

Decoders come from a factory, `make_decoder(cfg, models, *, baseline, seed_offset,
record_margins)`. A decoder has `generate(prompt_ids, max_new_tokens) -> Generation`, `device`,
`num_draft_tokens` and `warmup()`. The target and each draft model are bound to ONE cached LM
each (`--engine`), built once the prompts are known and shared by every decoder of the run, so
steps are compiled and captured once; that time is reported on its own, never in tokens/s.
"""

from __future__ import annotations

import dataclasses
import platform
import resource
import time
from dataclasses import dataclass, field
from statistics import median
from typing import Callable

import torch

from .. import __version__
from ..decoding import (CachedLM, DraftModelProposer, Generation, NgramProposer, NoProposer, SpeculativeDecoder,
                        as_cached_lm, cached_lm)
from ..decoding.lm import device_tensor
from ..decoding.eagle3 import Eagle3Decoder, Eagle3State, draft_engine_for
from ..decoding.eagle3_engine import Eagle3Engine
from ..decoding.medusa import MedusaDecoder
from ..eagle3.export import load_eagle3
from ..eagle3.model import Eagle3Draft
from ..errors import UserError
from ..heads.export import load_medusa, read_heads_info
from ..heads.tree import DEFAULT_TREE, chain_tree, widest_choice
from ..models import context_length, first_line, load_causal_lm, load_tokenizer, resolve_device, resolve_dtype
from ..preflight import compatibility_checks, require_compatible
from ..prompts import EncodedPrompt, encode_prompts, read_prompts
from ..tokens import eos_token_ids, output_vocab_size
from .config import EvalConfig, read_tree_file, shared_settings
from .metrics import NEAR_TIE_TOLERANCE, PromptResult, compute_metrics, defects, metrics_by_category
from .outputs import prepare_output_dir, staged_output
from .report import prompt_digest, report_inputs, write_report


@dataclass
class LoadedModels:
    """Everything one evaluation needs, loaded and checked once."""

    target: torch.nn.Module
    tokenizer: object
    device: torch.device
    eos: set[int]
    draft: torch.nn.Module | None = None
    heads: torch.nn.Module | None = None
    heads_info: dict = field(default_factory=dict)
    eagle3: Eagle3Draft | None = None
    eagle3_info: dict = field(default_factory=dict)
    target_lm: CachedLM | None = None  # the engine-bound models (`bind_engine`), shared by every decoder
    draft_lm: CachedLM | None = None
    eagle3_engine: Eagle3Engine | None = None

    @property
    def dtype_name(self) -> str:
        return str(self.target.dtype).removeprefix("torch.")


def load_models(cfg: EvalConfig) -> LoadedModels:
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, device)
    tokenizer = load_tokenizer(cfg.target, "target")
    draft_tok = load_tokenizer(cfg.draft, "draft") if cfg.draft else None
    target = load_causal_lm(cfg.target, dtype, device, "target")
    models = LoadedModels(target=target, tokenizer=tokenizer, device=device, eos=set(eos_token_ids(tokenizer, target)))
    return attach_drafter(models, cfg, draft_tok)


def attach_drafter(models: LoadedModels, cfg: EvalConfig, draft_tok=None) -> LoadedModels:
    """Load cfg's draft model, heads or EAGLE-3 draft next to the target, after checking they fit it."""
    dtype = models.target.dtype
    if cfg.draft:
        draft_tok = draft_tok or load_tokenizer(cfg.draft, "draft")
        models.draft = load_causal_lm(cfg.draft, dtype, models.device, "draft")
        require_compatible(compatibility_checks(models.target, models.tokenizer, models.draft, draft_tok))
    if cfg.heads:
        models.heads = load_heads(cfg.heads, models.device, dtype)
        models.heads_info = read_heads_info(cfg.heads)
    if cfg.eagle3:
        models.eagle3, info = load_eagle3(cfg.eagle3, device=models.device, dtype=dtype,
                                          target_config=models.target.config)
        require_finite(models.eagle3, "EAGLE-3 draft", cfg.eagle3)
        models.eagle3.attach_embeddings(models.target.get_input_embeddings())
        models.eagle3.eval()
        models.eagle3_info = {"aux_layer_ids": list(info.aux_layer_ids), "draft_vocab_size": info.draft_vocab_size,
                              **(info.config.get("drafttrain") or {})}
    check_tree_fits(cfg, models)
    return models


def check_tree_fits(cfg: EvalConfig, models: LoadedModels) -> None:
    """A tree's top-k choice index must be below the vocabulary it picks from (the heads', or the
    EAGLE-3 draft's vocabulary), else decoding crashes at its first step; checked once the drafter
    is loaded, before any prompt is decoded."""
    if not cfg.greedy:  # sampling runs chains: no tree is used
        return
    if models.heads is not None:
        name, paths = heads_tree(cfg.tree, models.heads_info, min(cfg.num_draft_tokens, models.heads.config.num_heads))
        _require_choices_fit(name, paths, models.heads.config.vocab_size, "the Medusa heads'")
    if models.eagle3 is not None:
        name, tree = eagle3_tree(cfg)
        vocab = models.eagle3.config.draft_vocab_size
        if isinstance(tree, list):
            _require_choices_fit(name, tree, vocab, "the EAGLE-3 draft's")
        elif tree == "dynamic" and cfg.tree_topk > vocab:
            raise UserError(f"--tree-topk {cfg.tree_topk} exceeds the EAGLE-3 draft's vocabulary of {vocab} tokens; "
                            f"pass --tree-topk {vocab} or less")


def _require_choices_fit(name: str, paths: list, vocab_size: int, whose: str) -> None:
    widest = widest_choice(paths)
    if widest >= vocab_size:
        raise UserError(f"--tree {name}: a path takes choice {widest} (the top-{widest + 1} token), but {whose} "
                        f"vocabulary has {vocab_size} tokens; use choice indices below {vocab_size}")


def require_finite(module: torch.nn.Module, what: str, path: str) -> None:
    bad = next((name for name, p in module.named_parameters() if not bool(torch.isfinite(p).all())), None)
    if bad is not None:
        raise UserError(f"the {what} at {path!r} has non-finite weights (NaN or inf in {bad}); the file is damaged: "
                        "export it again")


def load_heads(path: str, device: torch.device, dtype: torch.dtype):
    """Medusa heads, or one UserError line for a damaged weights file or non-finite weights."""
    try:
        heads = load_medusa(path, device=device, dtype=dtype)
    except UserError:
        raise
    except Exception as e:  # safetensors' SafetensorError (truncated or empty file), a bad pickle, ...
        raise UserError(f"cannot load the Medusa heads from {path!r}: their weights file is damaged "
                        f"({first_line(e)}); export the heads again") from e
    require_finite(heads, "Medusa heads", path)
    return heads


def heads_tree(spec: str, heads_info: dict, depth: int) -> tuple[str, list]:
    """(which tree, its paths cut to `depth`): auto = the tree calibrated when the heads were
    trained (their config's drafttrain.tree), else the built-in default."""
    if spec == "auto":
        stored = heads_info.get("tree")
        name, paths = ("calibrated", [tuple(p) for p in stored]) if stored else ("default", DEFAULT_TREE)
    elif spec == "default":
        name, paths = "default", DEFAULT_TREE
    elif spec == "chain":
        name, paths = "chain", chain_tree(depth)
    else:
        name, paths = spec, read_tree_file(spec)
    return name, [p for p in paths if len(p) <= depth]


def cache_room(cfg: EvalConfig, models: LoadedModels) -> int:
    """Tokens one verification step may add beyond the emitted ones: K + 1, or a tree's nodes."""
    if cfg.proposer_name == "heads":
        depth = min(cfg.num_draft_tokens, models.heads.config.num_heads)
        return max(cfg.num_draft_tokens, len(heads_tree(cfg.tree, models.heads_info, depth)[1])) + 1
    if cfg.proposer_name == "eagle3":
        return max(cfg.num_draft_tokens, cfg.tree_nodes - 1, len(eagle3_tree(cfg)[1])) + 1
    return cfg.num_draft_tokens + 1


def eagle3_tree(cfg: EvalConfig) -> tuple[str, str | list]:
    """(which tree, what `Eagle3Decoder` takes): auto = EAGLE-2's dynamic tree."""
    if not cfg.greedy or cfg.tree == "chain":
        return "chain" if cfg.greedy else "chain (sampling)", "chain"
    if cfg.tree in ("auto", "dynamic"):
        return f"dynamic ({cfg.tree_nodes} nodes, top-{cfg.tree_topk})", "dynamic"
    if cfg.tree == "default":
        return "default", [p for p in DEFAULT_TREE if len(p) <= cfg.num_draft_tokens]
    return cfg.tree, [p for p in read_tree_file(cfg.tree) if len(p) <= cfg.num_draft_tokens]


def bind_engine(cfgs: list[EvalConfig], models: list[LoadedModels], prompts: list[EncodedPrompt]) -> str:
    """Bind the target (once, shared) and every draft model to a cached LM on `--engine`, sized for
    the longest prompt; returns the target's engine. `auto` decides per model (a draft the static
    engine cannot run stays eager); an explicit `static` on an unsupported model is an error."""
    first = cfgs[0]
    max_length = (max(len(p.ids) for p in prompts) + first.max_new_tokens
                  + max(cache_room(cfg, m) for cfg, m in zip(cfgs, models)))
    target_lm = cached_lm(models[0].target, first.engine, max_length=max_length)
    for cfg, m in zip(cfgs, models):
        m.target_lm = target_lm
        if m.draft is not None:
            m.draft_lm = cached_lm(m.draft, cfg.engine, max_length=max_length)
        if m.eagle3 is not None:  # the draft layer follows the target: static (compiled) beside static
            m.eagle3_engine = draft_engine_for(target_lm, m.eagle3, num_draft_tokens=cfg.num_draft_tokens,
                                               tree_nodes=cfg.tree_nodes, tree_topk=cfg.tree_topk)
    return target_lm.engine


def make_decoder(cfg: EvalConfig, models: LoadedModels, *, baseline: bool = False, seed_offset: int = 0,
                 record_margins: bool = False):
    """The decoder for cfg's drafter, or (`baseline`) the target alone on the same engine.
    `record_margins` (greedy baselines): keep the target's top-1 minus top-2 logit per token."""
    generator = None
    if cfg.temperature > 0:
        generator = torch.Generator(device=models.device).manual_seed(cfg.seed + seed_offset)
    name = "none" if baseline else cfg.proposer_name
    target = models.target_lm or models.target
    if name == "heads":
        # K caps the tree's depth; so does the number of heads (head i drafts position i+1).
        depth = min(cfg.num_draft_tokens, models.heads.config.num_heads)
        return MedusaDecoder(target, models.heads, tree=heads_tree(cfg.tree, models.heads_info, depth)[1],
                             temperature=cfg.temperature, top_p=cfg.top_p, eos_token_ids=models.eos,
                             generator=generator)
    if name == "eagle3":
        return Eagle3Decoder(target, models.eagle3_engine or models.eagle3, num_draft_tokens=cfg.num_draft_tokens,
                             tree=eagle3_tree(cfg)[1], tree_nodes=cfg.tree_nodes, tree_topk=cfg.tree_topk,
                             temperature=cfg.temperature, top_p=cfg.top_p, eos_token_ids=models.eos,
                             generator=generator, record_margins=record_margins)
    if name == "draft":
        proposer = DraftModelProposer(models.draft_lm or models.draft, output_vocab_size(models.target),
                                      cfg.temperature, cfg.top_p, generator)
    elif name == "ngram":
        proposer = NgramProposer(models.device, max_ngram=cfg.ngram_max)
    else:
        proposer = NoProposer(models.device)
    return SpeculativeDecoder(target, proposer, num_draft_tokens=cfg.num_draft_tokens,
                              temperature=cfg.temperature, top_p=cfg.top_p, eos_token_ids=models.eos,
                              generator=generator, record_margins=record_margins)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_generate(decoder, prompt: list[int], max_new: int) -> tuple[Generation, float]:
    _sync(decoder.device)
    start = time.perf_counter()
    gen = decoder.generate(prompt, max_new)
    _sync(decoder.device)
    return gen, time.perf_counter() - start


def single_token_seconds(lm: CachedLM, prompt: list[int], repeats: int = 10) -> float:
    """Median time of one cached single-token forward at this prompt's length, on the run's engine."""
    lm.warmup([1])
    lm.reset()
    lm.forward(device_tensor(prompt[:-1], lm.device))
    one = device_tensor(prompt[-1:], lm.device)
    times = []
    for _ in range(repeats + 2):
        _sync(lm.device)
        start = time.perf_counter()
        lm.forward(one)
        _sync(lm.device)
        times.append(time.perf_counter() - start)
        lm.rollback(lm.length - 1)
    return median(times[2:])


def eagle3_step_seconds(draft: Eagle3Draft | Eagle3Engine, target_lm: CachedLM, prompt: list[int],
                        repeats: int = 10) -> float:
    """Median time of one EAGLE-3 chain drafting step (one token through the draft layer and its
    head, on the draft's engine), after feeding the prompt's target features: the draft's share
    of a chain step."""
    state = Eagle3State(draft, target_lm.device)
    draft = state.draft
    state.engine.warmup([(1, 1)])
    target_lm.reset()
    _, hidden = target_lm.forward(device_tensor(prompt[:-1], target_lm.device),
                                  hidden_layers=tuple(draft.config.aux_layer_ids))
    state.reset(prompt, hidden)
    token = device_tensor(prompt[-1:], target_lm.device).view(1, 1)
    position = torch.full((1, 1), state.length, dtype=torch.long, device=target_lm.device)
    times = []
    for _ in range(repeats + 2):
        _sync(target_lm.device)
        start = time.perf_counter()
        out = state.step(state.last.hidden[:, -1:], token, position)
        draft.to_target_logits(out.logits[0, -1]).argmax()
        _sync(target_lm.device)
        times.append(time.perf_counter() - start)
        state.cache.rollback(state.length - 1)
    return median(times[2:])


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
    read_prompts(cfgs[0].prompts, cfgs[0].limit)


def check_tree_used(cfgs: list[EvalConfig]) -> None:
    """--tree shapes only Medusa heads' and EAGLE-3 drafts' steps: given for a run with neither, it
    would be silently ignored, so it is an error (auto, the default, always fits)."""
    tree = cfgs[0].tree
    if tree != "auto" and not any(cfg.proposer_name in ("heads", "eagle3") for cfg in cfgs):
        drafters = ", ".join(sorted({f"--method {c.method}" if c.method else f"--{c.proposer_name}" for c in cfgs}))
        raise UserError(f"--tree {tree} shapes the steps of Medusa heads (--heads) and EAGLE-3 drafts (--eagle3), "
                        f"not of {drafters}; leave --tree out")


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
    if models is None:
        models = [load_models(first)]
        for cfg in cfgs[1:]:
            models.append(attach_drafter(dataclasses.replace(models[0], draft=None, heads=None, heads_info={},
                                                             eagle3=None, eagle3_info={}), cfg))
    loaded = models[0]
    prompts = encode_prompts(read_prompts(first.prompts, first.limit), loaded.tokenizer,
                             max_new_tokens=first.max_new_tokens, context_limit=context_length(loaded.target))
    engine_used = bind_engine(cfgs, models, prompts)
    torch.manual_seed(first.seed)
    if loaded.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(loaded.device)

    with_baseline = first.baseline == "ours"
    margins = with_baseline and first.greedy
    specs = [factory(cfg, m) for cfg, m in zip(cfgs, models)]
    base = factory(first, loaded, baseline=True, record_margins=margins) if with_baseline else None
    # Compile and capture every step shape first (static engine; nothing to do on eager), then
    # warm up (kernels, allocator, caches) with decoders of their own, so the seeded runs are
    # untouched. Neither is counted in tokens/s; both are reported.
    for decoder in [*specs, *([base] if base is not None else [])]:
        warm = getattr(decoder, "warmup", None)
        if warm is not None:
            warm()
    warmups = [factory(cfg, m, seed_offset=1000) for cfg, m in zip(cfgs, models)]
    if with_baseline:
        warmups.append(factory(first, loaded, baseline=True, seed_offset=1000, record_margins=margins))
    start = time.perf_counter()
    for decoder in warmups:
        decoder.generate(prompts[0].ids, min(8, first.max_new_tokens))
    warmup_seconds = time.perf_counter() - start

    results: list[list[PromptResult]] = [[] for _ in cfgs]
    with tqdm(prompts, desc="eval", unit="prompt", disable=not progress) as bar:
        for p in bar:
            baseline = timed_generate(base, p.ids, first.max_new_tokens) if base is not None else (None, None)
            for spec, rs in zip(specs, results):
                r = PromptResult(p.id, p.category, *timed_generate(spec, p.ids, first.max_new_tokens),
                                 extra={"prompt_sha256": prompt_digest(p.ids)})
                r.baseline, r.baseline_seconds = baseline
                rs.append(r)

    lms = {id(lm): lm for m in models for lm in (m.target_lm, m.draft_lm, m.eagle3_engine) if lm is not None}
    engine = {"requested": first.engine, "used": engine_used,
              "compile_seconds": sum(lm.compile_seconds for lm in lms.values()),
              "warmup_seconds": warmup_seconds}
    drafts = {m.draft_lm.engine for m in models if m.draft_lm is not None}
    if drafts - {engine_used}:
        engine["draft_engines"] = sorted(drafts)
    return [Evaluation(cfg, build_report(cfg, m, spec, rs, prompts[0], engine), rs)
            for cfg, m, spec, rs in zip(cfgs, models, specs, results)]


def build_report(cfg: EvalConfig, models: LoadedModels, spec, results: list[PromptResult], probe: EncodedPrompt,
                 engine: dict) -> dict:
    k = 0 if cfg.proposer_name == "none" else spec.num_draft_tokens
    cost = None
    if k:
        cost = 0.0  # n-gram lookup and heads cost next to nothing beside a target forward
        target_lm = models.target_lm or as_cached_lm(models.target)
        if models.draft is not None:
            cost = (single_token_seconds(models.draft_lm or as_cached_lm(models.draft), probe.ids)
                    / single_token_seconds(target_lm, probe.ids))
        elif models.eagle3 is not None:
            cost = (eagle3_step_seconds(models.eagle3_engine or models.eagle3, target_lm, probe.ids)
                    / single_token_seconds(target_lm, probe.ids))
    num = numerics(models.dtype_name)
    kwargs = {"cost_ratio": cost, "near_tie_tolerance": num["near_tie_tolerance"]}
    overall = compute_metrics(results, k, cfg.greedy, **kwargs)
    mem, mem_kind = peak_memory(models.device)
    overall.update(peak_memory_bytes=mem, peak_memory_kind=mem_kind)
    if cfg.proposer_name == "eagle3":
        overall["tree"] = eagle3_tree(cfg)[0]
        if hasattr(spec, "num_tree_nodes") and overall["tree"].startswith("dynamic"):
            overall["tree_nodes"] = spec.num_tree_nodes
    if cfg.proposer_name == "heads":
        overall["per_head_acceptance"] = overall["per_position_acceptance"]  # position i = head i's token
        overall["tree_nodes"] = spec.num_tree_nodes
        overall["tree"] = heads_tree(cfg.tree, models.heads_info, 1)[0] if cfg.greedy else "chain (sampling)"
    return {
        "drafter": cfg.drafter_name,
        # SPEC §2 rev 2: config.engine is the engine used; what was asked for is engine.requested.
        "config": {**dataclasses.asdict(cfg), "engine": engine["used"]},
        "inputs": report_inputs(cfg.target),  # what `replay` checks its --target against
        "environment": environment(models.device),
        "numerics": num,
        "engine": dict(engine),
        **({"heads": models.heads_info} if models.heads_info else {}),
        **({"eagle3": models.eagle3_info} if models.eagle3_info else {}),
        "overall": overall,
        "by_category": metrics_by_category(results, k, cfg.greedy, **kwargs),
    }


def run_eval(cfg: EvalConfig, progress: bool = True, decoder_factory: DecoderFactory | None = None) -> Evaluation:
    """`drafttrain eval`: check everything, run, and write the report into cfg.out (replacing an
    earlier one only with cfg.overwrite)."""

    check_inputs([cfg])
    prepare_output_dir(cfg.out, cfg.overwrite)
    evaluation = evaluate([cfg], progress=progress, decoder_factory=decoder_factory)[0]
    with staged_output(cfg.out) as stage:
        write_report(stage, evaluation.report, evaluation.results)
    return evaluation
