"""Acceptance and speed figures (SPEC §2 METRICS) from per-prompt decode records.

Every figure here is derived from what `outputs.jsonl` holds plus the timings of the same run,
so the report's totals can always be recomputed from the outputs file.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from statistics import median

from ..decoding import Generation

# Near-ties: a greedy speculative run and the target alone can pick different tokens where the
# target's top-1 and top-2 logits are closer than the rounding error of its forward pass, because
# a verification forward over k+1 tokens and a plain 1-token forward round differently (other
# matmul blocking, other attention kernels). The tolerance is that rounding error, generously:
# for the 16-bit formats 8 units in the last place of a logit of magnitude 16..32, typical of LM
# heads (bf16 keeps 8 significant bits: ulp 0.125 there; fp16 11: ulp 0.0156). SmolLM2-135M in
# bf16 diverged at margins of 0.125 and 0.25, one and two ulps. float32 and float64 get far more
# than their rounding (~1e-5 and ~1e-13 on logits), still far below the O(1) margins of a real
# disagreement. Too small a tolerance calls rounding a defect; too large hides only defects that
# land on a near-tie, and a decoder bug flips tokens at any margin, not only there.
NEAR_TIE_TOLERANCE = {"float64": 1e-9, "float32": 1e-3, "float16": 0.125, "bfloat16": 1.0}


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


# ----------------------------------------------------------------------------- Leviathan's model


def expected_tokens_per_step(alpha: float, m: int) -> float:
    """Leviathan et al. 2023, eq. 1: E[tokens per target pass] = (1 - a^(m+1)) / (1 - a) for m
    drafts, each accepted with probability a once the ones before it were."""
    if alpha >= 1.0:
        return float(m + 1)
    return (1.0 - alpha ** (m + 1)) / (1.0 - alpha)


def mean_expected_tokens(alpha: float, proposed_lengths: list[int]) -> float:
    """The expectation averaged over steps, each with its own number of drafts m."""
    counts: dict[int, int] = {}
    for m in proposed_lengths:
        counts[m] = counts.get(m, 0) + 1
    return sum(n * expected_tokens_per_step(alpha, m) for m, n in counts.items()) / len(proposed_lengths)


def estimate_alpha(proposed_lengths: list[int], accepted_lengths: list[int], tau: float) -> float | None:
    """Leviathan's per-token acceptance probability alpha, fitted to a run: the alpha whose
    expected tokens per step, averaged over the run's steps with each step's own number of
    drafts, equals the measured tau. None when nothing was drafted (alpha says nothing then).

    accepted/proposed is not alpha: a rejection ends a step, so later positions are proposed
    but never judged, and accepted/proposed comes out well below the alpha that explains tau.
    """
    if not proposed_lengths or sum(proposed_lengths) == 0:
        return None
    if all(a == m for a, m in zip(accepted_lengths, proposed_lengths)):
        return 1.0  # every draft accepted (tau can still fall short of the maximum at an EOS)
    if tau <= 1.0:
        return 0.0
    if tau >= mean_expected_tokens(1.0, proposed_lengths):
        return 1.0
    lo, hi = 0.0, 1.0  # the mean expectation rises monotonically from 1 (alpha 0) to mean(m + 1)
    for _ in range(60):  # 2^-60: exact to double precision
        mid = (lo + hi) / 2
        if mean_expected_tokens(mid, proposed_lengths) < tau:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def predicted_speedup(expected_tokens: float, k: int, cost_ratio: float) -> float:
    """Leviathan et al. 2023, Theorem 3.8: E / (k c + 1), c = draft forward cost / target forward cost."""
    return expected_tokens / (k * cost_ratio + 1.0)


def predicted_block(gens: list[Generation], tau: float, k: int, cost_ratio: float,
                    measured_speedup: float | None) -> dict:
    """SPEC §2 rev 2 `predicted`: what Leviathan's model expects from this run's alpha and cost."""
    proposed = [m for g in gens for m in g.proposed_lengths]
    accepted = [a for g in gens for a in g.accepted_lengths]
    alpha = estimate_alpha(proposed, accepted, tau)
    expected = mean_expected_tokens(alpha or 0.0, proposed) if proposed else 1.0
    speedup = predicted_speedup(expected, k, cost_ratio)
    return {"alpha": alpha, "expected_tokens_per_step": expected, "cost_ratio": cost_ratio, "speedup": speedup,
            "efficiency": measured_speedup / speedup if measured_speedup is not None else None}


# ----------------------------------------------------------------------------- greedy divergences


def first_divergence(speculative: list[int], baseline: list[int]) -> int | None:
    """Index in the continuation where the two outputs first differ (a length difference counts at
    the shorter length), or None when they are equal."""
    for i, (a, b) in enumerate(zip(speculative, baseline)):
        if a != b:
            return i
    return None if len(speculative) == len(baseline) else min(len(speculative), len(baseline))


def divergence(result: PromptResult) -> tuple[int | None, float | None]:
    """(first_divergence, the baseline's top-1 minus top-2 logit there, or None when the baseline
    has no token or no margin there)."""
    if result.baseline is None:
        return None, None
    index = first_divergence(result.speculative.tokens, result.baseline.tokens)
    margins = result.baseline.margins
    if index is None or margins is None or index >= len(margins):
        return index, None
    return index, float(margins[index])


def is_near_tie(margin: float | None, tolerance: float) -> bool:
    return margin is not None and margin <= tolerance


def defects(results: list[PromptResult], tolerance: float) -> list[tuple[object, int, float | None]]:
    """(prompt id, index, margin) of every divergence that is not a near-tie: a decoder defect."""
    out = []
    for r in results:
        index, margin = divergence(r)
        if index is not None and not is_near_tie(margin, tolerance):
            out.append((r.id, index, margin))
    return out


# ----------------------------------------------------------------------------- METRICS


def compute_metrics(results: list[PromptResult], k: int, greedy: bool, *, cost_ratio: float | None = None,
                    near_tie_tolerance: float | None = None) -> dict:
    """SPEC §2 METRICS. `cost_ratio` (k > 0) adds `predicted`; `near_tie_tolerance` classifies the
    greedy divergences from a baseline that recorded its margins."""
    gens = [r.speculative for r in results]
    new_tokens = sum(len(g.tokens) for g in gens)
    forwards = sum(len(g.accepted_lengths) for g in gens)
    drafted = sum(sum(g.proposed_lengths) for g in gens)
    accepted = sum(sum(g.accepted_lengths) for g in gens)
    steps = [a for g in gens for a in g.accepted_lengths]
    drafting = sum(1 for g in gens for m in g.proposed_lengths if m)
    per_position = [sum(a >= i for a in steps) / len(steps) if steps else 0.0 for i in range(1, k + 1)]
    # The same, counting only steps that proposed position i (n-gram lookups and the last step
    # of a generation may propose fewer than k).
    pairs = [(a, m) for g in gens for a, m in zip(g.accepted_lengths, g.proposed_lengths)]
    given_proposed = [
        sum(a >= i for a, m in pairs if m >= i) / max(1, sum(m >= i for _, m in pairs)) for i in range(1, k + 1)
    ]
    spec_seconds = sum(r.speculative_seconds for r in results)
    spec_tps = new_tokens / spec_seconds if spec_seconds > 0 else 0.0
    tau = new_tokens / forwards if forwards else 0.0

    with_baseline = bool(results) and all(r.baseline is not None for r in results)
    base_tps = speedup = match = base_latency = diverged = near_ties = None
    if with_baseline:
        base_tokens = sum(len(r.baseline.tokens) for r in results)
        base_seconds = sum(r.baseline_seconds for r in results)
        base_tps = base_tokens / base_seconds if base_seconds > 0 else None
        speedup = spec_tps / base_tps if base_tps else None
        if greedy:
            match = sum(r.baseline.tokens == r.speculative.tokens for r in results) / len(results)
            found = [divergence(r) for r in results]
            diverged = sum(index is not None for index, _ in found)
            if near_tie_tolerance is not None:
                near_ties = sum(index is not None and is_near_tie(m, near_tie_tolerance) for index, m in found)
        base_latency = latency_summary([r.baseline for r in results])

    metrics = {
        "prompts": len(results),
        "new_tokens": new_tokens,
        "target_forwards": forwards,
        "draft_forwards": sum(g.draft_forwards for g in gens),  # SPEC §7: the drafter's model forwards
        "draft_tokens": drafted,
        "accepted_tokens": accepted,
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "mean_accepted_length": tau,
        # vLLM's and SGLang's "mean acceptance length": 1 + accepted drafts per step that drafted.
        "mean_acceptance_length": 1 + accepted / drafting if drafting else None,
        "per_position_acceptance": per_position,
        "per_position_acceptance_when_proposed": given_proposed,
        "baseline_tokens_per_s": base_tps,
        "speculative_tokens_per_s": spec_tps,
        "speedup": speedup,
        "outputs_match_baseline": match,
        "divergences": diverged,
        "divergences_at_near_ties": near_ties,
        "speculative_token_latency_ms": latency_summary(gens),
        "baseline_token_latency_ms": base_latency,
        "speculative_seconds_median_per_prompt": median(r.speculative_seconds for r in results) if results else None,
    }
    if k and cost_ratio is not None and forwards:
        metrics["predicted"] = predicted_block(gens, tau, k, cost_ratio, speedup)
    return metrics


def metrics_by_category(results: list[PromptResult], k: int, greedy: bool, **kwargs) -> dict[str, dict]:
    cats: dict[str, list[PromptResult]] = {}
    for r in results:
        cats.setdefault(r.category, []).append(r)
    return {c: compute_metrics(rs, k, greedy, **kwargs) for c, rs in sorted(cats.items())}
