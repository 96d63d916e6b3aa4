"""Acceptance and speed figures (SPEC §2 METRICS) from per-prompt decode records.

Every figure here is derived from what `outputs.jsonl` holds plus the timings of the same run,
so the report's totals can always be recomputed from the outputs file.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from statistics import median

from .decoding import Generation


@dataclass
class PromptResult:
    id: object
    category: str
    speculative: Generation
    speculative_seconds: float
    baseline: Generation | None = None
    baseline_seconds: float | None = None
    extra: dict = field(default_factory=dict)


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in 0..100), None for no data."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = int(pos), min(int(pos) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def token_latencies_ms(gens: list[Generation]) -> list[float]:
    """Per emitted token: its step's wall time shared among the tokens that step emitted."""
    out = []
    for g in gens:
        for seconds, n in zip(g.step_seconds, g.step_tokens):
            out.extend([1000.0 * seconds / n] * n)
    return out


def latency_summary(gens: list[Generation]) -> dict:
    lat = token_latencies_ms(gens)
    return {f"p{q}": percentile(lat, q) for q in (50, 90, 99)}


def expected_tokens_per_step(alpha: float, k: int) -> float:
    """Leviathan et al. 2023, eq. 1: E[tokens per target pass] = (1 - a^(k+1)) / (1 - a)."""
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def predicted_speedup(alpha: float, k: int, cost_ratio: float) -> float:
    """Leviathan et al. 2023, Theorem 3.8: E / (k c + 1), c = draft step cost / target step cost."""
    return expected_tokens_per_step(alpha, k) / (k * cost_ratio + 1.0)


def compute_metrics(results: list[PromptResult], k: int, greedy: bool) -> dict:
    gens = [r.speculative for r in results]
    new_tokens = sum(len(g.tokens) for g in gens)
    forwards = sum(len(g.accepted_lengths) for g in gens)
    drafted = sum(sum(g.proposed_lengths) for g in gens)
    accepted = sum(sum(g.accepted_lengths) for g in gens)
    steps = [a for g in gens for a in g.accepted_lengths]
    per_position = [sum(a >= i for a in steps) / len(steps) if steps else 0.0 for i in range(1, k + 1)]
    # The same, counting only steps that proposed position i (n-gram lookups and the last step
    # of a generation may propose fewer than k).
    pairs = [(a, m) for g in gens for a, m in zip(g.accepted_lengths, g.proposed_lengths)]
    given_proposed = [
        sum(a >= i for a, m in pairs if m >= i) / max(1, sum(m >= i for _, m in pairs)) for i in range(1, k + 1)
    ]
    spec_seconds = sum(r.speculative_seconds for r in results)
    spec_tps = new_tokens / spec_seconds if spec_seconds > 0 else 0.0

    with_baseline = all(r.baseline is not None for r in results) and results
    base_tps = speedup = match = None
    base_latency = None
    if with_baseline:
        base_tokens = sum(len(r.baseline.tokens) for r in results)
        base_seconds = sum(r.baseline_seconds for r in results)
        base_tps = base_tokens / base_seconds if base_seconds > 0 else None
        speedup = spec_tps / base_tps if base_tps else None
        if greedy:
            match = sum(r.baseline.tokens == r.speculative.tokens for r in results) / len(results)
        base_latency = latency_summary([r.baseline for r in results])

    return {
        "prompts": len(results),
        "new_tokens": new_tokens,
        "target_forwards": forwards,
        "draft_tokens": drafted,
        "accepted_tokens": accepted,
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "mean_accepted_length": new_tokens / forwards if forwards else 0.0,
        "per_position_acceptance": per_position,
        "per_position_acceptance_when_proposed": given_proposed,
        "baseline_tokens_per_s": base_tps,
        "speculative_tokens_per_s": spec_tps,
        "speedup": speedup,
        "outputs_match_baseline": match,
        "speculative_token_latency_ms": latency_summary(gens),
        "baseline_token_latency_ms": base_latency,
        "speculative_seconds_median_per_prompt": median(r.speculative_seconds for r in results) if results else None,
    }


def metrics_by_category(results: list[PromptResult], k: int, greedy: bool) -> dict[str, dict]:
    cats: dict[str, list[PromptResult]] = {}
    for r in results:
        cats.setdefault(r.category, []).append(r)
    return {c: compute_metrics(rs, k, greedy) for c, rs in sorted(cats.items())}
