"""What a forward costs on this machine, measured on a run's engines: the medians behind a
report's cost ratio and a plan's costs, bracketed by device synchronisation, after warm-up."""

from __future__ import annotations

import time
from statistics import median

from ..trees import tree_from_parents
from .engines import CachedLM, device_tensor, synchronize


def single_token_seconds(lm: CachedLM, prompt: list[int], repeats: int = 10) -> float:
    """Median time of one cached single-token forward at this prompt's length, on the run's engine."""
    return forward_seconds(lm, prompt, prompt[-1:], repeats)


def forward_seconds(lm: CachedLM, prompt: list[int], tokens: list[int], repeats: int = 10) -> float:
    """Median time of one cached forward of `tokens` after prompt[:-1], on the run's engine (a
    parallel draft's step: the last real token and its masks)."""
    lm.warmup([len(tokens)])
    lm.reset()
    lm.prefill(device_tensor(prompt[:-1], lm.device))
    step = device_tensor(tokens, lm.device)
    return timed(lambda: lm.forward(step), repeats, lm.device, after=lambda: lm.rollback(lm.length - len(tokens)))


def timed(fn, repeats: int, device, after=None) -> float:
    """Median seconds of `fn()` over `repeats` runs after two untimed ones; `after()` undoes what
    a run left (a cache entry), untimed."""
    times = []
    for _ in range(repeats + 2):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
        if after is not None:
            after()
    return median(times[2:])


def forward_curve(lm: CachedLM, prompt: list[int], sizes: int | list[int], repeats: int = 7,
                  tree: bool = False, hidden_layers: tuple[int, ...] = ()) -> list[list[float]]:
    """Seconds of cached forwards of 1 .. `sizes` tokens (or of each size listed) after
    prompt[:-1]: `repeats` rounds, the sizes interleaved within each round, so a machine slowing
    down mid-measurement hits every size alike. One list of repeat timings per size (after one
    warm-up round). `tree`: the tokens are verified as a tree (one level under the first: a
    branching tree's mask and positions cost what any tree of that size does), not a chain.
    `hidden_layers`: the target layers the forwards also return, as a decoder whose drafter reads
    them (EAGLE-3's aux layers, Medusa's last) verifies: the static engine compiles one graph per
    (size, hidden layers), so those are the ones registered, warmed and timed here (a plain
    size's graph would be another step, and one never registered runs uncompiled)."""
    sizes = list(range(1, sizes + 1)) if isinstance(sizes, int) else list(sizes)
    hidden_layers = tuple(hidden_layers)
    lm.warmup(sizes, hidden_layers=hidden_layers)
    lm.reset()
    lm.prefill(device_tensor(prompt[:-1], lm.device))
    steps = [device_tensor((prompt[-1:] * n)[:n], lm.device) for n in sizes]
    trees = [tree_from_parents([-1] + [0] * (n - 1), lm.device) if tree and n > 2 else None for n in sizes]
    times: list[list[float]] = [[] for _ in steps]
    for round_ in range(repeats + 1):
        for i, (step, shape) in enumerate(zip(steps, trees)):
            synchronize(lm.device)
            start = time.perf_counter()
            lm.forward(step, tree=shape, hidden_layers=hidden_layers)
            synchronize(lm.device)
            if round_:
                times[i].append(time.perf_counter() - start)
            lm.rollback(lm.length - len(step))
    return times


__all__ = ["forward_curve", "forward_seconds", "single_token_seconds", "timed"]
