"""Acceptance by output window (SPEC §9): tau and per-position acceptance over windows of W
output tokens, so a report shows whether a draft's acceptance holds as the answer grows.

Drafts trained on short answers are reported to degrade past their training length (acceptance of
DFlash, EAGLE-3 and PARD drafts falls toward 1 within a few thousand tokens), which one tau over the
whole output hides. A verification step belongs to the window that holds the first token it
emitted; its tokens, accepted and proposed drafts are counted there, so the windows add up to the
report's own counts. tau of a window = tokens its steps emitted / its steps, as the report's tau.

A served generation whose steps are not in time order (vLLM records only the steps that drafted:
where a lookup found nothing, the step is missing from its per-step record and `served_generation`
appends it at the end) cannot be placed; it is left out of the windows, and `window_prompts` says
how many prompts they cover.
"""

from __future__ import annotations

from ..decoding import Generation

ACCEPTANCE_WINDOW = 128  # --acceptance-window: output tokens per window


def placed_steps(gen: Generation) -> list[tuple[int, int, int, int]]:
    """(first output index, tokens emitted, accepted, proposed) of each step of `gen`, in order.
    A step's tokens are cut at the output's end (vLLM counts drafts accepted past max_tokens)."""
    steps, start = [], 0
    sizes = gen.step_tokens or [a + 1 for a in gen.accepted_lengths]
    for size, accepted, proposed in zip(sizes, gen.accepted_lengths, gen.proposed_lengths):
        emitted = max(0, min(size, len(gen.tokens) - start))
        steps.append((start, emitted, accepted, proposed))
        start += emitted
    return steps


def acceptance_by_window(gens: list[Generation], window: int, k: int) -> list[dict]:
    """One entry per window of `window` output tokens that any step of `gens` begins in (SPEC §9
    `by_window`): start, end (exclusive), steps, tokens, tau, accepted, proposed, acceptance,
    per-position acceptance (positions 1..k, as the report's), and the prompts that reach it.
    Generations whose steps are out of order are skipped (`steps_in_order`)."""
    if window < 1:
        raise ValueError(f"window must be at least 1, got {window}")
    buckets: dict[int, dict] = {}
    for gen in gens:
        if not gen.steps_in_order:
            continue
        reached = set()
        for start, emitted, accepted, proposed in placed_steps(gen):
            w = start // window
            b = buckets.setdefault(w, {"steps": 0, "tokens": 0, "accepted": 0, "proposed": 0, "prompts": 0,
                                       "lengths": []})
            b["steps"] += 1
            b["tokens"] += emitted
            b["accepted"] += accepted
            b["proposed"] += proposed
            b["lengths"].append(accepted)
            if w not in reached:
                reached.add(w)
                b["prompts"] += 1
    out = []
    for w in sorted(buckets):
        b = buckets[w]
        lengths = b.pop("lengths")
        out.append({"start": w * window, "end": (w + 1) * window, **b,
                    "tau": b["tokens"] / b["steps"],
                    "acceptance": b["accepted"] / b["proposed"] if b["proposed"] else 0.0,
                    "per_position_acceptance": [sum(a >= i for a in lengths) / len(lengths) for i in range(1, k + 1)]})
    return out


def window_prompts(gens: list[Generation]) -> int:
    """How many of `gens` the windows cover (those whose steps are in time order)."""
    return sum(1 for g in gens if g.steps_in_order)


__all__ = ["ACCEPTANCE_WINDOW", "acceptance_by_window", "placed_steps", "window_prompts"]
