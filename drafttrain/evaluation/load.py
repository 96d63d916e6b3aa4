"""Speedup under load (SPEC §9 served concurrency): every served drafter and the target alone
with N requests in flight in vLLM's engine, for each N of `--concurrency`.

Speculation's gain shrinks as the batch grows: verifying K drafts of 16 requests is no longer
nearly free, and the draft's own steps batch less well than the target's. A speedup said without
its concurrency misleads, so a served report carries one entry per concurrency (`load`), each
against the target alone at the SAME concurrency, measured in the same run on the same prompts:
- `tokens_per_s`: all output tokens / the wall time of all requests (what a server delivers);
- `tokens_per_s_per_request`: the mean over requests of its tokens / its seconds (what a user sees);
- `speedup`: `tokens_per_s` against the target alone's.
Concurrency 1 is the report's own per-prompt rows (one request at a time, the same thing); each
higher one runs every prompt once more, the target alone first, then each drafter, so a drift of
the machine's speed hits them alike. Greedy outputs are compared with plain decoding (the target
alone at concurrency 1): batching must not change them. `stops_paying_at` is the lowest
concurrency measured where a drafter's speedup falls below 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from statistics import mean

from ..decoding import Generation
from .metrics import PromptResult


@dataclass
class LoadRun:
    """Every prompt once at one concurrency: generations in prompt order, each request's seconds,
    the wall seconds of the whole."""

    gens: list[Generation]
    request_seconds: list[float]
    wall_seconds: float

    @classmethod
    def one_at_a_time(cls, gens: list[Generation], seconds: list[float]) -> LoadRun:
        return cls(gens, seconds, sum(seconds))

    @property
    def tokens(self) -> int:
        return sum(len(g.tokens) for g in self.gens)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_seconds if self.wall_seconds > 0 else 0.0

    @property
    def tokens_per_s_per_request(self) -> float:
        return mean(len(g.tokens) / s for g, s in zip(self.gens, self.request_seconds) if s > 0)


def load_entry(concurrency: int, run: LoadRun, base: LoadRun | None, plain: list[Generation] | None,
               greedy: bool) -> dict:
    """One concurrency of a report's `load` block."""
    steps = sum(len(g.accepted_lengths) for g in run.gens)
    entry = {"concurrency": concurrency, "tokens_per_s": run.tokens_per_s,
             "tokens_per_s_per_request": run.tokens_per_s_per_request,
             "speedup": run.tokens_per_s / base.tokens_per_s if base is not None and base.tokens_per_s else None,
             "baseline_tokens_per_s": base.tokens_per_s if base is not None else None,
             "baseline_tokens_per_s_per_request": base.tokens_per_s_per_request if base is not None else None,
             "requests": len(run.gens), "output_tokens": run.tokens, "seconds": run.wall_seconds,
             "tau": run.tokens / steps if steps else None, "outputs_match_plain": None}
    if greedy and plain is not None:
        entry["outputs_match_plain"] = sum(g.tokens == p.tokens for g, p in zip(run.gens, plain)) / len(plain)
    return entry


def stops_paying_at(load: list[dict] | None) -> int | None:
    """The lowest concurrency whose speedup is below 1, None where every one measured pays."""
    return next((e["concurrency"] for e in load or [] if e["speedup"] is not None and e["speedup"] < 1), None)


def served_load(cfgs, decoders, served_base, prompts: list[list[int]], results: list[list[PromptResult]],
                progress: bool = True) -> list[list[dict] | None]:
    """The `load` block of each config (None for a drafttrain row, or where nothing is served).
    `decoders[i]`, `served_base`: the run's served decoders (`vllm_backend.ServedDecoder`) and its
    served plain decoder (None without a baseline); `results[i]`: the per-prompt rows already
    timed, one request at a time (concurrency 1)."""
    from tqdm.auto import tqdm

    first = cfgs[0]
    served = [i for i, cfg in enumerate(cfgs) if cfg.backend == "vllm"]
    if not served:
        return [None] * len(cfgs)
    with_base = served_base is not None
    rows = results[served[0]]
    plain = [r.baseline for r in rows] if with_base else None
    loads: dict[int, list[dict]] = {i: [] for i in served}
    runs = sum(c > 1 for c in first.concurrency) * (len(served) + with_base)
    with tqdm(total=runs, desc="load", unit="run", disable=not progress or not runs) as bar:
        for c in first.concurrency:
            if c == 1:
                base = LoadRun.one_at_a_time(plain, [r.baseline_seconds for r in rows]) if with_base else None
                measured = {i: LoadRun.one_at_a_time([r.speculative for r in results[i]],
                                                     [r.speculative_seconds for r in results[i]]) for i in served}
            else:
                base = (LoadRun(*served_base.generate_concurrently(prompts, first.max_new_tokens, c)) if with_base
                        else None)
                bar.update(with_base)
                measured = {}
                for i in served:
                    measured[i] = LoadRun(*decoders[i].generate_concurrently(prompts, first.max_new_tokens, c))
                    bar.update()
            for i in served:
                loads[i].append(load_entry(c, measured[i], base, plain, first.greedy))
    return [loads.get(i) for i in range(len(cfgs))]


__all__ = ["LoadRun", "load_entry", "served_load", "stops_paying_at"]
