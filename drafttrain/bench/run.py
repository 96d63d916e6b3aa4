"""The bench run (SPEC §6), top to bottom: bandwidth and roofline, plain decoding on every engine and
with transformers' `generate`, one forward by number of tokens, oracle speculation; then
bench.json, bench.md and the plot, written atomically; then, unless turned off, each drafter kind's step
overhead on tiny models and the report again with it."""

from __future__ import annotations

import sys
from dataclasses import asdict

from ..decoding import StaticLM, cached_lm, resolve_engine, static_support
from ..decoding.engines.compiled import capture_counts, compile_counts
from ..errors import UserError
from ..evaluation.metrics import expected_tokens_per_step
from ..evaluation.summary import environment
from ..evaluation.outputs import staged_output
from ..fileio import atomic_write_json, atomic_write_text, check_output_dir
from ..planning import noisy
from ..trees import DEFAULT_TREE
from . import measure, target
from .overhead import step_overheads
from .config import BenchConfig
from .report import plot, render_markdown


def run_bench(cfg: BenchConfig, log=print) -> dict:
    from ..models import resolve_device, resolve_dtype

    cfg.validate()
    counts = compile_counts()  # torch's counters are process-wide: this run's captures are those after
    out = check_output_dir(cfg.out)
    if out.is_dir() and any(out.iterdir()) and not cfg.overwrite:
        raise UserError(f"--out {cfg.out} exists and is not empty; pass --overwrite to replace it or choose another")
    if cfg.prompts:
        from ..prompts import read_prompts

        read_prompts(cfg.prompts, cfg.prompts_per_file)  # a bad prompt file fails before any model loads
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, device)
    model, tokenizer, name = target.load_target(cfg, device, dtype)
    model.requires_grad_(False)
    vocab = model.get_output_embeddings().weight.shape[0]
    prompts = target.bench_prompts(cfg, tokenizer, model)
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
        before = compile_counts()
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
        after = compile_counts()  # transformers' own graphs are not ours to count
        counts = {k: v + after[k] - before[k] for k, v in counts.items()}
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
    chain_repeats = [r.pop("repeats") for r in rows if r["kind"] == "chain"]
    for r in rows:
        r.pop("repeats", None)
    noise = noisy(chain_repeats)
    if noise:
        print(f"warning: bench: the forward-by-tokens curve looks like a busy machine ({'; '.join(noise)}); its "
              "ratios (and any plan made from them) may be noise: run alone", file=sys.stderr)
        notes.append(f"busy machine: {'; '.join(noise)}")
    base_rate = plain[f"drafttrain {engine}"]["tokens_per_s"]["median"]
    references = {tuple(p): t for p, t in zip(prompts, outputs[engine])}
    oracle_rows = []
    for alpha in cfg.oracle_alpha:
        log(f"bench: oracle speculation, alpha {alpha}")
        r = measure.oracle_decoding(lm, references, alpha, k, vocab, prompts, cfg.max_new_tokens, cfg.repeats,
                                    cfg.seed)
        predicted = expected_tokens_per_step(alpha, k)
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
        "capture": capture_counts(device, since=counts),
        "step_overhead": None,
        "notes": notes,
    }
    if not cfg.step_overhead:
        return write_report(bench, out, cfg.overwrite)
    # The tiny models' section compiles a graph per drafter kind (minutes on a GPU): the target's figures
    # are written first, so a run stopped in it (a device's time limit) still leaves them.
    write_report({**bench, "notes": notes + ["step overhead not yet measured: the run stopped before it"]},
                 out, cfg.overwrite)
    log("bench: step overhead by drafter kind, tiny models")
    bench["step_overhead"] = {"k": k, "rows": step_overheads(device, dtype, k, cfg.seed)}
    bench["capture"] = capture_counts(device, since=counts)  # the tiny models' graphs too
    return write_report(bench, out, overwrite=True)  # this run's own report, replaced by its complete one


def write_report(bench: dict, out, overwrite: bool) -> dict:
    """bench.json, bench.md and the plot, replacing `out` whole (see `staged_output`)."""
    with staged_output(out, overwrite) as tmp:  # a report another run wrote meanwhile is kept
        atomic_write_json(tmp / "bench.json", bench)
        atomic_write_text(tmp / "bench.md", render_markdown(bench))
        plot(bench, tmp / "bench.png")
    return bench


