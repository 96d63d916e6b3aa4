"""`drafttrain bench` (SPEC §6): how close the decode engine runs to the hardware, in one process.

It measures, top to bottom: the device's read bandwidth and with it the roofline (weight bytes
read per decode step / bandwidth = the best batch-1 tokens/s any engine can reach); plain greedy
decoding on each of our engines and with transformers' `generate` (dynamic cache; static cache
+ compile); one forward by number of tokens (1 .. K+1 and a Medusa tree), which is what a
verification costs next to a plain step; and an oracle proposer at acceptance α, whose measured
speedup over plain decoding is set against Leviathan's prediction. The target is a model
directory or a random-weight shape built on the device (`--shape llama-8b`).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..decoding import ENGINES, StaticLM, cached_lm, resolve_engine, static_support
from ..decoding import NUM_DRAFT_TOKENS
from ..errors import UserError
from ..evaluation.summary import environment
from ..fileio import atomic_dir, atomic_write_json, atomic_write_text, check_output_dir
from ..trees import DEFAULT_TREE
from . import measure
from .report import plot, render_markdown

# Random-weight shapes built directly on the device.
SHAPES = {
    "llama-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                     num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                     rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False),
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=False),
}
DEFAULT_ALPHAS = (0.3, 0.5, 0.7, 0.9)


@dataclass
class BenchConfig:
    out: str
    target: str | None = None          # a model directory (or hub id)
    shape: str | None = None           # or a random-weight shape: llama-8b | tiny
    engine: str = "auto"               # engine of the forward-time and oracle measurements
    prompts: list[str] = field(default_factory=list)  # SPEC §1 files (needs --target); else random ids
    limit: int | None = 4              # prompts taken from the files
    num_prompts: int = 4               # random prompts
    prompt_length: int = 128           # tokens per random prompt
    num_draft_tokens: int = NUM_DRAFT_TOKENS
    oracle_alpha: list[float] = field(default_factory=lambda: list(DEFAULT_ALPHAS))
    max_new_tokens: int = 128
    repeats: int = 3
    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    bandwidth_mib: int = 0             # size of the bandwidth probe; 0: 1024 on CUDA, 64 on CPU
    hf_generate: bool = True           # also time transformers' generate
    overwrite: bool = False

    def validate(self) -> None:
        if (self.target is None) == (self.shape is None):
            raise UserError("give exactly one of --target DIR and --shape (llama-8b or tiny)")
        if self.shape is not None and self.shape not in SHAPES:
            raise UserError(f"unknown --shape {self.shape!r}; use {' or '.join(SHAPES)}")
        if self.prompts and self.target is None:
            raise UserError("--prompts needs --target (its tokenizer encodes them); a --shape uses random prompts")
        if self.engine not in ENGINES:
            raise UserError(f"unknown --engine {self.engine!r}; use {', '.join(ENGINES)}")
        for name in ("num_draft_tokens", "repeats", "num_prompts", "prompt_length"):
            if getattr(self, name) < 1:
                raise UserError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if self.limit is not None and self.limit < 1:
            raise UserError(f"--limit must be at least 1, got {self.limit}")
        if self.max_new_tokens < 2:
            raise UserError(f"--max-new-tokens must be at least 2, got {self.max_new_tokens}")
        if not self.oracle_alpha or not all(0 <= a <= 1 for a in self.oracle_alpha):
            raise UserError(f"--oracle-alpha must list acceptance rates in [0, 1], got {self.oracle_alpha}")
        if self.bandwidth_mib < 0:
            raise UserError(f"--bandwidth-mib must be >= 0, got {self.bandwidth_mib}")


def parse_alphas(text: str) -> list[float]:
    try:
        values = [float(a) for a in text.split(",") if a.strip()]
    except ValueError as e:
        raise UserError(f"--oracle-alpha {text!r} is not a comma-separated list of numbers, e.g. 0.3,0.5,0.7,0.9"
                        ) from e
    if any(math.isnan(a) for a in values):
        raise UserError(f"--oracle-alpha {text!r}: nan is not an acceptance rate")
    return values


MEMORY_HEADROOM = 1.2  # weights plus caches, activations and the allocator's slack: a floor, not a forecast


def shape_parameters(name: str) -> int:
    """Parameters of a named shape, counted on the meta device: nothing is allocated."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**SHAPES[name], bos_token_id=None, eos_token_id=None, pad_token_id=None)
    with torch.device("meta"):
        model = LlamaForCausalLM._from_config(config)
    return sum(p.numel() for p in model.parameters())


def available_memory(device: torch.device) -> int | None:
    """Bytes the device can still give: free CUDA memory, else the host's available memory
    (None where neither can be read)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        import psutil

        return psutil.virtual_memory().available
    except ImportError:
        try:
            return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError):
            return None


def check_shape_fits(name: str, dtype: torch.dtype, device: torch.device) -> None:
    """Refuse a shape whose weights alone do not fit the device, before building it: on the CPU
    the kernel kills such a run minutes later with no message (llama-8b in float32 is ~30 GiB)."""
    params = shape_parameters(name)
    needed = int(params * torch.empty((), dtype=dtype, device="meta").element_size() * MEMORY_HEADROOM)
    available = available_memory(device)
    if available is not None and needed > available:
        dtype_name = str(dtype).removeprefix("torch.")
        raise UserError(f"--shape {name} needs about {needed / 2**30:.1f} GiB on {device} ({params / 1e9:.2f} B "
                        f"parameters in {dtype_name}, plus {MEMORY_HEADROOM - 1:.0%} for caches), but only "
                        f"{available / 2**30:.1f} GiB is available; use a device with more memory, a smaller "
                        "--dtype, or --shape tiny")


def build_shape(name: str, dtype: torch.dtype, device: torch.device):
    """A Llama of the named shape with random weights, initialised on the device itself."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**SHAPES[name], bos_token_id=None, eos_token_id=None, pad_token_id=None)
    with torch.device(device):
        model = LlamaForCausalLM._from_config(config, dtype=dtype)
    return model.eval()


def load_target(cfg: BenchConfig, device: torch.device, dtype: torch.dtype):
    from ..models import load_causal_lm, load_tokenizer

    if cfg.shape:
        check_shape_fits(cfg.shape, dtype, device)
        return build_shape(cfg.shape, dtype, device), None, f"random {cfg.shape}-shaped Llama"
    tokenizer = load_tokenizer(cfg.target, "target") if cfg.prompts else None
    return load_causal_lm(cfg.target, dtype, device, "target"), tokenizer, cfg.target


def bench_prompts(cfg: BenchConfig, tokenizer, model) -> list[list[int]]:
    """The prompts, each of which with --max-new-tokens must fit the model's context, as `eval`
    demands (its check, for prompt files): past it positions are undefined, the figures meaningless."""
    from ..models import context_length

    limit = context_length(model)
    if cfg.prompts:
        from ..prompts import encode_prompts, read_prompts

        return [p.ids for p in encode_prompts(read_prompts(cfg.prompts, cfg.limit), tokenizer,
                                              max_new_tokens=cfg.max_new_tokens, context_limit=limit)]
    if limit is not None and cfg.prompt_length + cfg.max_new_tokens > limit:
        raise UserError(f"--prompt-length {cfg.prompt_length} plus --max-new-tokens {cfg.max_new_tokens} exceeds the "
                        f"target's context of {limit} tokens; lower --prompt-length or --max-new-tokens")
    vocab = model.get_output_embeddings().weight.shape[0]
    g = torch.Generator().manual_seed(cfg.seed)
    return torch.randint(vocab, (cfg.num_prompts, cfg.prompt_length), generator=g).tolist()


def run_bench(cfg: BenchConfig, log=print) -> dict:
    from ..models import resolve_device, resolve_dtype

    cfg.validate()
    out = check_output_dir(cfg.out)
    if out.is_dir() and any(out.iterdir()) and not cfg.overwrite:
        raise UserError(f"--out {cfg.out} exists and is not empty; pass --overwrite to replace it or choose another")
    if cfg.prompts:
        from ..prompts import read_prompts

        read_prompts(cfg.prompts, cfg.limit)  # a bad prompt file fails before any model loads
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, device)
    model, tokenizer, name = load_target(cfg, device, dtype)
    model.requires_grad_(False)
    vocab = model.get_output_embeddings().weight.shape[0]
    prompts = bench_prompts(cfg, tokenizer, model)
    k = cfg.num_draft_tokens
    tree_nodes = len(DEFAULT_TREE) + 1
    max_length = max(map(len, prompts)) + max(cfg.max_new_tokens + k + 1, tree_nodes)
    engine = resolve_engine(cfg.engine, model, max_length=max_length)
    notes: list[str] = []

    log("bench: read bandwidth")
    nbytes = (cfg.bandwidth_mib or (1024 if device.type == "cuda" else 64)) * 2**20
    bandwidth = measure.read_bandwidth(device, nbytes, max(cfg.repeats, 5))
    weights = measure.weight_bytes(model)
    roofline = bandwidth["bytes_per_s"] / weights["read_per_step_bytes"]

    lms = {"eager": cached_lm(model, "eager", max_length=max_length)}
    reason = static_support(model, max_length)
    if reason is None:
        lms["static"] = StaticLM(model, max_length=max_length)
    plain, outputs = {}, {}
    for eng in ("eager", "static"):
        if eng not in lms:
            plain[f"drafttrain {eng}"] = {"skipped": reason}
            notes.append(f"static engine skipped: {reason}")
            continue
        log(f"bench: plain decoding, {eng} engine")
        result, gens = measure.plain_decoding(lms[eng], prompts, cfg.max_new_tokens, cfg.repeats)
        plain[f"drafttrain {eng}"] = result
        outputs[eng] = [g.tokens for g in gens]
    if cfg.hf_generate:
        log("bench: transformers generate, dynamic cache")
        plain["transformers dynamic cache"] = measure.hf_generate_rate(model, prompts, cfg.max_new_tokens, cfg.repeats)
        if device.type == "cuda":
            log("bench: transformers generate, static cache + compile")
            try:
                from transformers import CompileConfig

                plain["transformers static cache + compile"] = measure.hf_generate_rate(
                    model, prompts, cfg.max_new_tokens, cfg.repeats, cache_implementation="static",
                    compile_config=CompileConfig(mode="reduce-overhead"))
            except Exception as e:  # a version that cannot compile this model: say so, keep the rest
                plain["transformers static cache + compile"] = {"skipped": f"{type(e).__name__}: {e}"[:300]}
        else:
            plain["transformers static cache + compile"] = {
                "skipped": "transformers compiles static-cache generate on CUDA only"}
    for r in plain.values():
        if "tokens_per_s" in r:
            r["fraction_of_roofline"] = r["tokens_per_s"]["median"] / roofline

    same = None
    if len(outputs) > 1:
        equal = [a == b for a, b in zip(outputs["eager"], outputs["static"])]
        same = {"reference": "drafttrain eager", "all_equal": all(equal),
                "detail": f"{sum(equal)} of {len(equal)} prompts identical between the eager and static engines"}
        if not all(equal):
            notes.append("eager and static greedy outputs differ on some prompts: in reduced precision a near-tie "
                         "can break either way when the same logits are computed by different kernels")

    lm = lms[engine]
    log(f"bench: one forward by number of tokens, {engine} engine")
    rows, forward_compile = measure.forward_times(lm, prompts[0], list(range(1, k + 2)), DEFAULT_TREE, cfg.repeats)
    cost = next(r for r in rows if r["tokens"] == k + 1 and r["kind"] == "chain")["ratio_to_one_token"]
    base_rate = plain[f"drafttrain {engine}"]["tokens_per_s"]["median"]
    references = {tuple(p): t for p, t in zip(prompts, outputs[engine])}
    oracle_rows = []
    for alpha in cfg.oracle_alpha:
        log(f"bench: oracle speculation, alpha {alpha}")
        r = measure.oracle_decoding(lm, references, alpha, k, vocab, prompts, cfg.max_new_tokens, cfg.repeats,
                                    cfg.seed)
        predicted = (k + 1.0) if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)
        measured = r["tokens_per_s"]["median"] / base_rate
        oracle_rows.append({"alpha": alpha, **r, "measured_speedup": measured, "predicted_speedup": predicted,
                            "efficiency": measured / predicted, "predicted_speedup_with_cost": predicted / cost})

    params = sum(p.numel() for p in {p.data_ptr(): p for p in model.parameters()}.values())
    bench = {
        "config": {**asdict(cfg), "num_prompts": len(prompts), "engine_resolved": engine},
        "environment": environment(device),
        "model": {"name": name, "dtype": str(dtype).replace("torch.", ""), "parameters": params, **weights,
                  "layers": model.config.num_hidden_layers, "vocab_size": vocab},
        "bandwidth": bandwidth,
        "roofline_tokens_per_s": roofline,
        "plain_decoding": plain,
        "outputs": same,
        "forward": {"engine": engine, "prompt_tokens": len(prompts[0]), "rows": rows,
                    "compile_seconds": forward_compile},
        "oracle": {"engine": engine, "k": k, "rows": oracle_rows},
        "compile_seconds": {eng: lm_.compile_seconds for eng, lm_ in lms.items()},
        "notes": notes,
    }
    with atomic_dir(out, overwrite=True) as tmp:
        atomic_write_json(tmp / "bench.json", bench)
        atomic_write_text(tmp / "bench.md", render_markdown(bench))
        plot(bench, tmp / "bench.png")
    return bench


def add_cli(sub) -> None:
    p = sub.add_parser("bench", help="measure the decode engine against the memory-bandwidth roofline")
    what = p.add_mutually_exclusive_group()
    what.add_argument("--target", help="target model: local directory or hub id")
    what.add_argument("--shape", help=f"random-weight target of a known shape: {', '.join(SHAPES)}")
    p.add_argument("--engine", default="auto", help="engine for the forward and oracle figures: auto|eager|static "
                                                    "(plain decoding is measured on every engine)")
    p.add_argument("--prompts", action="append", default=[], help="JSONL prompt file (SPEC §1; needs --target)")
    p.add_argument("--limit", type=int, default=4, help="prompts taken from each file")
    p.add_argument("--num-prompts", type=int, default=4, help="random prompts (without --prompts)")
    p.add_argument("--prompt-length", type=int, default=128, help="tokens per random prompt")
    p.add_argument("--num-draft-tokens", type=int, default=NUM_DRAFT_TOKENS, help="K of the oracle")
    p.add_argument("--oracle-alpha", default=",".join(map(str, DEFAULT_ALPHAS)),
                   help="comma-separated per-token acceptance rates of the oracle")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3, help="timed repeats (medians reported)")
    p.add_argument("--dtype", default="auto", help="auto|float32|bfloat16|float16|float64")
    p.add_argument("--device", default="auto", help="auto|cpu|cuda")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bandwidth-mib", type=int, default=0, help="bandwidth probe size (0: 1024 on CUDA, 64 on CPU)")
    p.add_argument("--no-hf-generate", action="store_true", help="skip timing transformers' generate")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.add_argument("--out", required=True, help="output directory (bench.json, bench.md, bench.png)")
    p.set_defaults(func=run_cli)


def run_cli(args: argparse.Namespace) -> int:
    cfg = BenchConfig(out=args.out, target=args.target, shape=args.shape, engine=args.engine, prompts=args.prompts,
                      limit=args.limit, num_prompts=args.num_prompts, prompt_length=args.prompt_length,
                      num_draft_tokens=args.num_draft_tokens, oracle_alpha=parse_alphas(args.oracle_alpha),
                      max_new_tokens=args.max_new_tokens, repeats=args.repeats, dtype=args.dtype, device=args.device,
                      seed=args.seed, bandwidth_mib=args.bandwidth_mib, hf_generate=not args.no_hf_generate,
                      overwrite=args.overwrite)
    log = (lambda *a: None) if args.quiet else (lambda msg: print(msg, file=sys.stderr, flush=True))
    b = run_bench(cfg, log=log)
    best = max((r["tokens_per_s"]["median"], n) for n, r in b["plain_decoding"].items() if "tokens_per_s" in r)
    print(f"roofline {b['roofline_tokens_per_s']:.1f} tok/s; best plain decoding {best[0]:.1f} tok/s ({best[1]}); "
          f"report in {Path(args.out) / 'bench.md'}")
    return 0
