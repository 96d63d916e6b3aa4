"""`drafttrain eval` (SPEC §2): held-out prompts through the speculative decoder and the target
alone, timed side by side in one process, written up as an acceptance report."""

from __future__ import annotations

import argparse
import dataclasses
import math
import platform
import resource
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from statistics import median

import torch

from .decoding import DraftModelProposer, Generation, NgramProposer, NoProposer, SpeculativeDecoder
from .decoding.cache import CachedLM
from .errors import UserError
from .metrics import PromptResult, compute_metrics, metrics_by_category, predicted_speedup, expected_tokens_per_step
from .models import context_length, load_causal_lm, load_tokenizer, resolve_device, resolve_dtype
from .preflight import compatibility_checks, eos_ids, require_compatible
from .prompts import encode_prompt, read_prompts


@dataclass
class EvalConfig:
    target: str
    prompts: list[str]
    out: str
    draft: str | None = None
    heads: str | None = None            # Medusa heads directory (vLLM's format)
    method: str | None = None           # "ngram" | "none" (a draft implies "draft", heads "heads")
    limit: int | None = None
    num_draft_tokens: int = 5
    temperature: float = 0.0
    top_p: float = 1.0
    max_new_tokens: int = 128
    seed: int = 0
    dtype: str = "auto"
    device: str = "auto"
    baseline: str = "ours"
    ngram_max: int = 3
    tree: str = "auto"                  # heads only: auto | default | chain | FILE.json

    def validate(self) -> None:
        chosen = [x for x in (self.draft and "--draft", self.heads and "--heads",
                              self.method and f"--method {self.method}") if x]
        if len(chosen) != 1:
            raise UserError("choose exactly one drafter: --draft DIR, --heads DIR, --method ngram or --method none"
                            + (f" (got {' and '.join(chosen)})" if chosen else ""))
        if self.method not in (None, "ngram", "none"):
            raise UserError(f"unknown --method {self.method!r}; use ngram or none (or --draft DIR)")
        if self.num_draft_tokens < 1:
            raise UserError(f"--num-draft-tokens must be at least 1, got {self.num_draft_tokens}")
        if not 0 <= self.temperature < math.inf:  # also rejects nan
            raise UserError(f"--temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise UserError(f"--top-p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise UserError(f"--max-new-tokens must be at least 1, got {self.max_new_tokens}")
        if self.limit is not None and self.limit < 1:
            raise UserError(f"--limit must be at least 1, got {self.limit}")
        if self.baseline not in ("ours", "none"):
            raise UserError(f"unknown --baseline {self.baseline!r}; use ours or none")
        if self.tree not in TREE_CHOICES:
            read_tree_file(self.tree)

    @property
    def proposer_name(self) -> str:
        return "draft" if self.draft else "heads" if self.heads else self.method


TREE_CHOICES = ("auto", "default", "chain")


def read_tree_file(path: str) -> list:
    """A tree as JSON: a list of paths, each a list of top-k choice indices, e.g. [[0], [1], [0, 0]]."""
    import json

    from .heads.tree import build_tree_buffers

    try:
        paths = [tuple(p) for p in json.loads(Path(path).read_text())]
        build_tree_buffers(paths)
    except OSError as e:
        raise UserError(f"--tree {path}: cannot read it ({e.strerror}); use auto, default, chain or a JSON file of "
                        "paths like [[0], [1], [0, 0]]") from e
    except (TypeError, ValueError) as e:
        raise UserError(f"--tree {path}: not a valid tree ({e}); write a JSON list of paths like [[0], [1], [0, 0]]"
                        ) from e
    return paths


def heads_tree(spec: str, heads_info: dict, depth: int) -> tuple[str, list]:
    """(which tree, its paths cut to `depth`): auto = the tree calibrated when the heads were
    trained (their config's drafttrain.tree), else the built-in default."""
    from .heads.tree import DEFAULT_TREE, chain_tree

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


@dataclass
class EncodedPrompt:
    id: object
    category: str
    ids: list[int]


@dataclass
class Engine:
    """Everything one evaluation needs, loaded and checked once."""

    target: torch.nn.Module
    tokenizer: object
    device: torch.device
    eos: set[int]
    draft: torch.nn.Module | None = None
    heads: torch.nn.Module | None = None
    heads_info: dict = field(default_factory=dict)


def load_engine(cfg: EvalConfig) -> Engine:
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, device)
    tokenizer = load_tokenizer(cfg.target, "target")
    draft_tok = load_tokenizer(cfg.draft, "draft") if cfg.draft else None
    target = load_causal_lm(cfg.target, dtype, device, "target")
    engine = Engine(target=target, tokenizer=tokenizer, device=device, eos=eos_ids(target, tokenizer))
    return attach_drafter(engine, cfg, draft_tok)


def attach_drafter(engine: Engine, cfg: EvalConfig, draft_tok=None) -> Engine:
    """Load cfg's draft model or heads next to an engine's target, after checking they fit it."""
    dtype = engine.target.dtype
    if cfg.draft:
        draft_tok = draft_tok or load_tokenizer(cfg.draft, "draft")
        engine.draft = load_causal_lm(cfg.draft, dtype, engine.device, "draft")
        require_compatible(compatibility_checks(engine.target, engine.tokenizer, engine.draft, draft_tok))
    if cfg.heads:
        from .heads.export import load_medusa, read_heads_info

        engine.heads = load_medusa(cfg.heads, device=engine.device, dtype=dtype)
        engine.heads_info = read_heads_info(cfg.heads)
    return engine


def encode_prompts(cfg: EvalConfig, engine: Engine) -> list[EncodedPrompt]:
    records = read_prompts(cfg.prompts, cfg.limit)
    limit = context_length(engine.target)
    out = []
    for r in records:
        ids = encode_prompt(r, engine.tokenizer)
        if limit is not None and len(ids) + cfg.max_new_tokens > limit:
            raise UserError(
                f"{r.source}: prompt of {len(ids)} tokens plus --max-new-tokens {cfg.max_new_tokens} exceeds the "
                f"target's context of {limit} tokens; shorten the prompt or lower --max-new-tokens")
        out.append(EncodedPrompt(r.id, r.category, ids))
    return out


def make_decoder(cfg: EvalConfig, engine: Engine, *, baseline: bool = False, seed_offset: int = 0):
    """The speculative decoder for cfg's drafter, or (`baseline`) the target alone on the same engine."""
    generator = None
    if cfg.temperature > 0:
        generator = torch.Generator(device=engine.device).manual_seed(cfg.seed + seed_offset)
    name = "none" if baseline else cfg.proposer_name
    if name == "heads":
        from .decoding.medusa import MedusaDecoder

        # K caps the tree's depth; so does the number of heads (head i drafts position i+1).
        depth = min(cfg.num_draft_tokens, engine.heads.config.num_heads)
        return MedusaDecoder(engine.target, engine.heads, tree=heads_tree(cfg.tree, engine.heads_info, depth)[1],
                             temperature=cfg.temperature, top_p=cfg.top_p, eos_token_ids=engine.eos,
                             generator=generator)
    if name == "draft":
        proposer = DraftModelProposer(engine.draft, engine.target.get_output_embeddings().weight.shape[0],
                                      cfg.temperature, cfg.top_p, generator)
    elif name == "ngram":
        proposer = NgramProposer(engine.device, max_ngram=cfg.ngram_max)
    else:
        proposer = NoProposer(engine.device)
    return SpeculativeDecoder(engine.target, proposer, num_draft_tokens=cfg.num_draft_tokens,
                              temperature=cfg.temperature, top_p=cfg.top_p, eos_token_ids=engine.eos,
                              generator=generator)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_generate(decoder: SpeculativeDecoder, prompt: list[int], max_new: int) -> tuple[Generation, float]:
    _sync(decoder.device)
    start = time.perf_counter()
    gen = decoder.generate(prompt, max_new)
    _sync(decoder.device)
    return gen, time.perf_counter() - start


def single_token_seconds(model, prompt: list[int], device: torch.device, repeats: int = 10) -> float:
    """Median time of one cached single-token forward at this prompt's length."""
    lm = CachedLM(model)
    lm.reset()
    lm.forward(torch.tensor(prompt, dtype=torch.long, device=device))
    one = torch.tensor(prompt[-1:], dtype=torch.long, device=device)
    times = []
    for _ in range(repeats + 2):
        _sync(device)
        start = time.perf_counter()
        lm.forward(one)
        _sync(device)
        times.append(time.perf_counter() - start)
        lm.rollback(lm.length - 1)
    return median(times[2:])


def environment(device: torch.device) -> dict:
    import transformers

    from . import __version__

    if device.type == "cuda":
        name = f"cuda ({torch.cuda.get_device_name(device)})"
    else:
        name = f"cpu ({platform.machine()}, {torch.get_num_threads()} threads)"
    return {"device": name, "torch": torch.__version__, "transformers": transformers.__version__,
            "drafttrain": __version__}


def peak_memory(device: torch.device) -> tuple[int, str]:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), "CUDA max allocated"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "process max RSS"


def run_eval(cfg: EvalConfig, engine: Engine | None = None, progress: bool = True) -> dict:
    """One drafter against the target alone: SPEC §2's `drafttrain eval`."""
    return run_evals([cfg], engines=[engine] if engine else None, progress=progress)[0]


def run_evals(cfgs: list[EvalConfig], engines: list[Engine] | None = None, progress: bool = True) -> list[dict]:
    """Several drafters on the same target and prompts, in one process, side by side.

    Every prompt is decoded once by the target alone and then by each drafter, interleaved, so
    drift in the machine's speed hits all of them alike; each drafter's report shares that
    baseline. The configs may differ only in the drafter and the output directory.
    """
    from tqdm.auto import tqdm

    from .report import write_report

    first = cfgs[0]
    for cfg in cfgs:
        cfg.validate()
        read_prompts(cfg.prompts, cfg.limit)  # bad prompt files fail before any model loads
        same = {k: v for k, v in asdict(cfg).items() if k not in ("draft", "heads", "method", "out")}
        if same != {k: v for k, v in asdict(first).items() if k not in ("draft", "heads", "method", "out")}:
            raise UserError("compared drafters must share target, prompts and decoding settings")
    if engines is None:
        engines = [load_engine(first)]
        for cfg in cfgs[1:]:
            engines.append(attach_drafter(dataclasses.replace(engines[0], draft=None, heads=None, heads_info={}), cfg))
    engine = engines[0]
    prompts = encode_prompts(first, engine)
    torch.manual_seed(first.seed)
    if engine.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(engine.device)

    specs = [make_decoder(cfg, e) for cfg, e in zip(cfgs, engines)]
    base = make_decoder(first, engine, baseline=True) if first.baseline == "ours" else None
    # Warm-up (kernels, allocator, caches) with decoders of their own, so the seeded runs are untouched.
    for cfg, e in zip(cfgs, engines):
        make_decoder(cfg, e, seed_offset=1000).generate(prompts[0].ids, min(8, cfg.max_new_tokens))
    if base is not None:
        make_decoder(first, engine, baseline=True, seed_offset=1000).generate(prompts[0].ids, min(8, first.max_new_tokens))

    results: list[list[PromptResult]] = [[] for _ in cfgs]
    for p in tqdm(prompts, desc="eval", unit="prompt", disable=not progress):
        baseline = timed_generate(base, p.ids, first.max_new_tokens) if base is not None else (None, None)
        for spec, rs in zip(specs, results):
            r = PromptResult(p.id, p.category, *timed_generate(spec, p.ids, first.max_new_tokens))
            r.baseline, r.baseline_seconds = baseline
            rs.append(r)

    reports = []
    for cfg, e, spec, rs in zip(cfgs, engines, specs, results):
        report = build_report(cfg, e, spec, rs, prompts[0].ids)
        write_report(cfg.out, report, rs)
        reports.append(report)
    return reports


def build_report(cfg: EvalConfig, engine: Engine, spec, results: list[PromptResult], probe: list[int]) -> dict:
    greedy = cfg.temperature == 0
    k = 0 if cfg.proposer_name == "none" else spec.num_draft_tokens
    overall = compute_metrics(results, k, greedy)
    mem, mem_kind = peak_memory(engine.device)
    overall.update(peak_memory_bytes=mem, peak_memory_kind=mem_kind)
    if k:
        cost = 0.0  # n-gram lookup and heads cost next to nothing beside a target forward
        if engine.draft is not None:
            cost = (single_token_seconds(engine.draft, probe, engine.device)
                    / single_token_seconds(engine.target, probe, engine.device))
        alpha = overall["acceptance_rate"]
        overall["predicted"] = {"cost_ratio": cost, "alpha": alpha,
                                "expected_tokens_per_step": expected_tokens_per_step(alpha, k),
                                "speedup": predicted_speedup(alpha, k, cost)}
    if cfg.proposer_name == "heads":
        overall["per_head_acceptance"] = overall["per_position_acceptance"]  # position i = head i's token
        overall["tree_nodes"] = spec.num_tree_nodes
        overall["tree"] = heads_tree(cfg.tree, engine.heads_info, 1)[0] if greedy else "chain (sampling)"
    return {
        "config": asdict(cfg),
        "environment": environment(engine.device),
        **({"heads": engine.heads_info} if engine.heads_info else {}),
        "overall": overall,
        "by_category": metrics_by_category(results, k, greedy),
    }


def add_decoding_args(p) -> None:
    """Flags shared by `eval` and `compare`: prompts and decoding settings."""
    p.add_argument("--prompts", action="append", required=True, help="JSONL prompt file (SPEC §1); repeatable")
    p.add_argument("--limit", type=int, help="at most N prompts from each file")
    p.add_argument("--num-draft-tokens", type=int, default=5, help="K: drafts per verification step")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="auto", help="auto|float32|bfloat16|float16|float64")
    p.add_argument("--device", default="auto", help="auto|cpu|cuda")
    p.add_argument("--baseline", default="ours", help="ours: also time the target alone; none: skip")
    p.add_argument("--ngram-max", type=int, default=3, help="longest suffix n-gram for n-gram lookup")
    p.add_argument("--tree", default="auto",
                   help="Medusa heads' candidate tree: auto (the one calibrated at training, else default), "
                        "default, chain, or a JSON file of paths like [[0], [1], [0, 0]]")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def config_from_args(args: argparse.Namespace, **drafter) -> EvalConfig:
    return EvalConfig(target=args.target, prompts=args.prompts, limit=args.limit,
                      num_draft_tokens=args.num_draft_tokens, temperature=args.temperature, top_p=args.top_p,
                      max_new_tokens=args.max_new_tokens, seed=args.seed, dtype=args.dtype, device=args.device,
                      baseline=args.baseline, ngram_max=args.ngram_max, tree=args.tree, out=args.out,
                      **drafter)


def add_cli(sub) -> None:
    p = sub.add_parser("eval", help="measure acceptance and speedup of a drafter on held-out prompts")
    p.add_argument("--target", required=True, help="target model: local directory or hub id")
    p.add_argument("--draft", help="draft model directory (same tokenizer as the target)")
    p.add_argument("--heads", help="Medusa heads directory (vLLM's Medusa format) trained on this target")
    p.add_argument("--method", help="ngram (prompt lookup) or none (target alone)")
    add_decoding_args(p)
    p.add_argument("--out", required=True, help="report directory")
    p.set_defaults(func=run_cli)


def run_cli(args: argparse.Namespace) -> int:
    cfg = config_from_args(args, draft=args.draft, heads=args.heads, method=args.method)
    report = run_eval(cfg, progress=not args.quiet)
    o = report["overall"]
    speed = f", speedup {o['speedup']:.2f}x" if o["speedup"] is not None else ""
    print(f"tau {o['mean_accepted_length']:.3f}, acceptance {o['acceptance_rate']:.3f}{speed}; report in {args.out}/report.md")
    return 0
