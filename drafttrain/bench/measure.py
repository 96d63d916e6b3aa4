"""What `drafttrain bench` times, each piece on its own: read bandwidth, plain decoding on an
engine, transformers' `generate`, one forward by number of tokens, oracle speculation.

Every timing brackets the work with a device sync on CUDA (the host otherwise only measures how
fast it queues kernels), repeats it, and reports the median with the spread.
"""

from __future__ import annotations

import time
from statistics import median

import torch

from ..decoding import CachedLM, DecodeSettings
from ..kinds.base import Drafter
from ..kinds.factory import build_decoder
from ..decoding.engines import device_tensor, synchronize
from ..trees import chain, static_tree


def summary(values: list[float]) -> dict:
    """Median and spread of repeated measurements."""
    return {"median": median(values), "min": min(values), "max": max(values), "runs": list(values)}


def read_bandwidth(device: torch.device, nbytes: int, repeats: int) -> dict:
    """Bytes per second of a large on-device reduction: every byte is read once, nothing written."""
    x = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    for _ in range(2):
        x.sum()
    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        x.sum()
        synchronize(device)
        times.append(time.perf_counter() - start)
    seconds = summary(times)
    return {"bytes": x.numel() * 4, "seconds": seconds, "bytes_per_s": x.numel() * 4 / seconds["median"]}


def weight_bytes(model) -> dict:
    """Parameter bytes, and those one decode step must read: all but the input embedding, which
    only gives up one row per token (unless it is tied to the LM head, which reads it whole)."""
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    embed = model.get_input_embeddings().weight
    tied = embed.data_ptr() == model.get_output_embeddings().weight.data_ptr()
    per_step = total - (0 if tied else embed.numel() * embed.element_size())
    return {"parameters_bytes": total, "read_per_step_bytes": per_step, "tied_embeddings": tied}


def decode_rate(decoder, prompts: list[list[int]], max_new_tokens: int, repeats: int) -> tuple[dict, list]:
    """Decode tokens/s over all prompts (prefill excluded: the steps' own wall time, each ending in
    the step's host sync), per repeat; returns (summary, the last repeat's Generations)."""
    rates, gens = [], []
    for _ in range(repeats):
        gens = [decoder.generate(p, max_new_tokens) for p in prompts]
        tokens = sum(len(g.tokens) for g in gens)
        seconds = sum(sum(g.step_seconds) for g in gens)
        rates.append(tokens / seconds)
    return summary(rates), gens


def plain_decoding(lm: CachedLM, prompts, max_new_tokens: int, repeats: int) -> tuple[dict, list]:
    """Tokens/s of plain greedy decoding on a cached LM, after one untimed warm-up generation."""
    decoder = build_decoder(lm, Drafter("none"), DecodeSettings(num_draft_tokens=0))
    compile_seconds = decoder.warmup()
    decoder.generate(prompts[0], min(8, max_new_tokens))
    rate, gens = decode_rate(decoder, prompts, max_new_tokens, repeats)
    return {"tokens_per_s": rate, "compile_seconds": compile_seconds}, gens


def oracle_decoding(lm: CachedLM, references: dict, alpha: float, k: int, vocab: int, prompts, max_new_tokens: int,
                    repeats: int, seed: int) -> dict:
    oracle = Drafter("oracle", references, {"alpha": alpha, "vocab": vocab, "seed": seed})
    decoder = build_decoder(lm, oracle, DecodeSettings(num_draft_tokens=k))
    compile_seconds = decoder.warmup()
    decoder.generate(prompts[0], min(8, max_new_tokens))
    rate, gens = decode_rate(decoder, prompts, max_new_tokens, repeats)
    steps = sum(len(g.accepted_lengths) for g in gens)
    accepted = sum(sum(g.accepted_lengths) for g in gens)
    tried = sum(a + (a < m) for g in gens for a, m in zip(g.accepted_lengths, g.proposed_lengths))
    match = all(g.tokens == references[tuple(p)][:len(g.tokens)] for g, p in zip(gens, prompts))
    return {"tokens_per_s": rate, "tau": sum(len(g.tokens) for g in gens) / steps,
            "acceptance": accepted / tried if tried else None, "outputs_match_plain": match,
            "compile_seconds": compile_seconds}


def forward_times(lm: CachedLM, prompt: list[int], sizes: list[int], tree_paths, repeats: int) -> tuple[list, float]:
    """Median seconds of one forward of n tokens after `prompt` (cache rolled back after each), for
    each n in `sizes` (a chain), and of one tree pass over `tree_paths`, the shapes interleaved in
    each round so that a machine slowing down mid-measurement hits them alike. Returns (rows,
    compile s); each row keeps its repeats, for `planning.noisy`."""
    tree = static_tree(tree_paths).to(lm.device)
    shapes = [(n, chain(n, lm.device) if n > 1 else None, "chain") for n in sizes]
    shapes.append((tree.num_nodes, tree, "tree"))
    compile_seconds = lm.warmup(sorted({n for n, _, _ in shapes}))
    lm.reset()
    lm.prefill(device_tensor(prompt, lm.device))
    past = lm.length
    times: list[list[float]] = [[] for _ in shapes]
    for i in range(repeats + 2):
        for (n, structure, kind), spent in zip(shapes, times):
            tokens = device_tensor([(prompt[j % len(prompt)]) for j in range(n)], lm.device)
            synchronize(lm.device)
            start = time.perf_counter()
            lm.forward(tokens, tree=structure if kind == "tree" else None)
            synchronize(lm.device)
            if i >= 2:
                spent.append(time.perf_counter() - start)
            lm.rollback(past)
    rows = [{"tokens": n, "kind": kind, "seconds": summary(spent), "repeats": spent}
            for (n, _, kind), spent in zip(shapes, times)]
    one = next(r for r in rows if r["tokens"] == 1)["seconds"]["median"]
    for r in rows:
        r["ratio_to_one_token"] = r["seconds"]["median"] / one
    return rows, compile_seconds


def hf_generate_rate(model, prompts, max_new_tokens: int, repeats: int, **kwargs) -> dict:
    """transformers' `generate`, greedy, exactly max_new_tokens: decode tokens/s as
    (N - 1) / (t(N) - t(1)), which takes prefill out as our own figures do."""
    device = next(model.parameters()).device

    def run(prompt, n):
        ids = torch.tensor([prompt], device=device)
        synchronize(device)
        start = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                       do_sample=False, pad_token_id=0, **kwargs)
        synchronize(device)
        return time.perf_counter() - start

    start = time.perf_counter()
    for _ in range(2):  # warm-up (with a static cache: compilation and CUDA graph capture)
        run(prompts[0], max_new_tokens)
        run(prompts[0], 1)
    warm = time.perf_counter() - start
    rates = []
    for _ in range(repeats):
        long = sum(run(p, max_new_tokens) for p in prompts)
        short = sum(run(p, 1) for p in prompts)
        rates.append(len(prompts) * (max_new_tokens - 1) / max(long - short, 1e-9))
    return {"tokens_per_s": summary(rates), "warmup_seconds": warm}
