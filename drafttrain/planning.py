"""How many tokens to draft on this machine: a cost model and the plan that maximises tokens/s.

A chain step with K drafts emits on average E(K) = 1 + a_1 + ... + a_K tokens, where a_j is the
probability that the first j drafts are all accepted (the reports' per-position acceptance,
which does not depend on K: the j-th draft is judged only if the ones before it were accepted).
It costs the target's verification of the drafts and the pending token, V(n), n = K + 1 tokens
(less where a drafter, like n-gram lookup, proposes fewer than K: `proposal_rates`), plus the
drafter's own step, plus a fixed overhead per step (sampling, bookkeeping, the host sync). Plain
decoding (K = 0) emits one token for V(1) plus the same overhead, without the drafter. The plan
is the K, from 0 (no speculation) to the deepest measured position, with the most tokens per
second. On a GPU at batch 1, V(n) barely grows with n and K comes out large; on 2 CPU cores a
5-token forward costs about 1.5 one-token forwards, and a draft LM's own forwards cost a third
of the target's each, so the plan is short or empty.

Acceptance must come from other prompts than the ones being timed (the drafter's recorded
held-out acceptance, or a calibration file), or the plan would be fitted to the test.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class Costs:
    """Measured seconds: `verify[n-1]` is one target forward of n tokens after a cached prefix;
    `draft[k]` is the drafter's share of a step that drafts k tokens (draft[0] = 0); `overhead`
    is what a step costs beyond its forwards."""

    verify: tuple[float, ...]
    draft: tuple[float, ...]
    overhead: float = 0.0
    warnings: tuple[str, ...] = field(default=())

    def as_dict(self) -> dict:
        return {"verify_seconds": list(self.verify), "draft_seconds": list(self.draft),
                "overhead_seconds": self.overhead}


@dataclass(frozen=True)
class Plan:
    """The chosen number of drafts per step (0: the target alone), its expected tokens per step and
    its speedup over plain decoding under the cost model, and every K's for the report."""

    num_draft_tokens: int
    expected_tokens: float
    planned_speedup: float
    candidates: tuple[tuple[int, float, float], ...]  # (K, E(K), planned speedup)

    def as_dict(self) -> dict:
        d = asdict(self)
        d["candidates"] = [{"num_draft_tokens": k, "expected_tokens": e, "planned_speedup": s}
                           for k, e, s in self.candidates]
        return d


def expected_tokens(acceptance: list[float], k: int) -> float:
    """E(K): tokens per step with K drafts, from per-position acceptance a_1 .. a_K."""
    return 1.0 + sum(acceptance[:k])


def interpolate(curve: tuple[float, ...], tokens: float) -> float:
    """A cost curve (index n - 1: n tokens) at a fractional number of tokens, linear between sizes."""
    tokens = min(max(tokens, 1.0), float(len(curve)))
    low = int(tokens)
    high = min(low + 1, len(curve))
    return curve[low - 1] + (curve[high - 1] - curve[low - 1]) * (tokens - low)


def step_seconds(costs: Costs, k: int, proposal_rates: list[float] | None = None, extra_tokens: float = 0.0) -> float:
    """One step's cost with K drafts. `proposal_rates[j]`: how often the drafter proposes at least
    j + 1 tokens (1 for model drafters, which always propose K; n-gram lookup often proposes
    fewer, and the target then verifies fewer). `extra_tokens`: tokens verified beside the K
    drafts on average (a hybrid's n-gram branch)."""
    if k == 0:
        return costs.verify[0] + costs.overhead
    if proposal_rates is None:
        return interpolate(costs.verify, k + 1 + extra_tokens) + costs.draft[k] + costs.overhead
    at_least = [1.0, *proposal_rates[:k], 0.0]  # P(proposes >= n), n = 0 .. k + 1
    verify = sum((at_least[n] - at_least[n + 1]) * costs.verify[n] for n in range(k + 1))
    return verify + costs.draft[k] + costs.overhead


def plan_chain(acceptance: list[float], costs: Costs, proposal_rates: list[float] | None = None,
               max_k: int | None = None, extra_tokens: float = 0.0) -> Plan:
    """The K in 0 .. max_k (default: the deepest position both acceptance and costs cover) with
    the most expected tokens per second; ties go to the smaller K. `extra_tokens`: a hybrid's
    n-gram nodes per step at the deepest K (scaled down with K)."""
    deepest = min(len(acceptance), len(costs.draft) - 1, len(costs.verify) - 1)
    if proposal_rates is not None:
        deepest = min(deepest, len(proposal_rates))
    max_k = deepest if max_k is None else min(max_k, deepest)
    plain = step_seconds(costs, 0)
    candidates = []
    for k in range(max_k + 1):
        e = expected_tokens(acceptance, k)
        extra = extra_tokens * k / max(max_k, 1)
        candidates.append((k, e, e * plain / step_seconds(costs, k, proposal_rates, extra)))
    best = max(candidates, key=lambda c: (round(c[2], 12), -c[0]))
    return Plan(best[0], best[1], best[2], tuple(candidates))


def noisy(seconds_by_size: list[list[float]], spread: float = 0.5) -> list[str]:
    """Why a measured cost curve looks like a busy machine rather than the model: a size whose
    repeats, less the fastest and the slowest, spread over more than `spread` of their median,
    or a forward of more tokens clearly cheaper than one of fewer (a cost curve is
    non-decreasing up to noise)."""
    from statistics import median

    meds = [median(s) for s in seconds_by_size]
    inner = [sorted(s)[1:-1] if len(s) > 3 else sorted(s) for s in seconds_by_size]
    out = [f"{n} tokens: {s[0] * 1e3:.1f}-{s[-1] * 1e3:.1f} ms around a median of {m * 1e3:.1f} ms"
           for n, (s, m) in enumerate(zip(inner, meds), start=1) if m > 0 and (s[-1] - s[0]) > spread * m]
    for n in range(1, len(meds)):
        if meds[n] < 0.8 * meds[n - 1]:
            out.append(f"{n + 1} tokens cost {meds[n] * 1e3:.1f} ms, less than {n} tokens' {meds[n - 1] * 1e3:.1f} ms")
    return out


__all__ = ["Costs", "Plan", "expected_tokens", "interpolate", "noisy", "plan_chain", "step_seconds"]
