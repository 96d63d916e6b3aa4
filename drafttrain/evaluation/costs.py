"""What one decoding step costs on this machine, measured on the run's engines.

A drafter's cost beside the target's (the report's `cost_ratio`, behind its predicted speedup)
is the median of repeated steps, bracketed by device synchronisation, after warm-up.
"""

from __future__ import annotations

import time
from statistics import median

import torch

from ..decoding import CachedLM, Generation
from ..decoding.drafters.eagle3 import Eagle3DraftCache
from ..decoding.drafters.eagle3_cache import CachedEagle3Draft
from ..decoding.drafters.medusa import head_logits
from ..decoding.engines import device_tensor, synchronize
from ..eagle3.model import Eagle3Draft
from ..trees import tree_from_parents


def timed_generate(decoder, prompt: list[int], max_new: int) -> tuple[Generation, float]:
    """One timed decode. A decoder whose engine stays busy after returning (`settle_seconds`:
    vLLM's workers poll for a second after each request, on the cores drafttrain's decoder uses)
    is left that long, untimed, so the next timing does not share the machine with it."""
    synchronize(decoder.device)
    start = time.perf_counter()
    gen = decoder.generate(prompt, max_new)
    synchronize(decoder.device)
    seconds = time.perf_counter() - start
    time.sleep(getattr(decoder, "settle_seconds", 0.0))
    return gen, seconds


def single_token_seconds(lm: CachedLM, prompt: list[int], repeats: int = 10) -> float:
    """Median time of one cached single-token forward at this prompt's length, on the run's engine."""
    return forward_seconds(lm, prompt, prompt[-1:], repeats)


def forward_seconds(lm: CachedLM, prompt: list[int], tokens: list[int], repeats: int = 10) -> float:
    """Median time of one cached forward of `tokens` after prompt[:-1], on the run's engine (a
    parallel draft's step: the last real token and its masks)."""
    lm.warmup([len(tokens)])
    lm.reset()
    lm.forward(device_tensor(prompt[:-1], lm.device))
    step = device_tensor(tokens, lm.device)
    times = []
    for _ in range(repeats + 2):
        synchronize(lm.device)
        start = time.perf_counter()
        lm.forward(step)
        synchronize(lm.device)
        times.append(time.perf_counter() - start)
        lm.rollback(lm.length - len(tokens))
    return median(times[2:])


def eagle3_step_seconds(draft: Eagle3Draft | CachedEagle3Draft, target_lm: CachedLM, prompt: list[int],
                        repeats: int = 10) -> float:
    """Median time of one EAGLE-3 chain drafting step (one token through the draft layer and its
    head, on the draft's engine), after feeding the prompt's target features: the draft's share
    of a chain step."""
    state = Eagle3DraftCache(draft, target_lm.device)
    draft = state.draft
    state.engine.warmup([(1, 1)])
    target_lm.reset()
    _, hidden = target_lm.forward(device_tensor(prompt[:-1], target_lm.device),
                                  hidden_layers=tuple(draft.config.aux_layer_ids))
    state.reset(prompt, hidden)
    token = device_tensor(prompt[-1:], target_lm.device).view(1, 1)
    position = torch.full((1, 1), state.length, dtype=torch.long, device=target_lm.device)
    times = []
    for _ in range(repeats + 2):
        synchronize(target_lm.device)
        start = time.perf_counter()
        out = state.step(state.last.hidden[:, -1:], token, position)
        draft.to_target_logits(out.logits[0, -1]).argmax()
        synchronize(target_lm.device)
        times.append(time.perf_counter() - start)
        state.cache.rollback(state.length - 1)
    return median(times[2:])


def medusa_heads_seconds(heads, k: int, device: torch.device, repeats: int = 10) -> float:
    """Median time of the first k Medusa heads reading one hidden state: a sampling chain's draft."""
    hidden = torch.randn(heads.config.hidden_size, device=device)
    times = []
    for _ in range(repeats + 2):
        synchronize(device)
        start = time.perf_counter()
        head_logits(heads, hidden, k, device).argmax(dim=-1)
        synchronize(device)
        times.append(time.perf_counter() - start)
    return median(times[2:])


def forward_curve(lm: CachedLM, prompt: list[int], sizes: int | list[int], repeats: int = 7,
                  tree: bool = False) -> list[list[float]]:
    """Seconds of cached forwards of 1 .. `sizes` tokens (or of each size listed) after
    prompt[:-1]: `repeats` rounds, the sizes interleaved within each round, so a machine slowing
    down mid-measurement hits every size alike. One list of repeat timings per size (after one
    warm-up round). `tree`: the tokens are verified as a tree (one level under the first: a
    branching tree's mask and positions cost what any tree of that size does), not a chain."""
    sizes = list(range(1, sizes + 1)) if isinstance(sizes, int) else list(sizes)
    lm.warmup(sizes)
    lm.reset()
    lm.forward(device_tensor(prompt[:-1], lm.device))
    steps = [device_tensor((prompt[-1:] * n)[:n], lm.device) for n in sizes]
    trees = [tree_from_parents([-1] + [0] * (n - 1), lm.device) if tree and n > 2 else None for n in sizes]
    times: list[list[float]] = [[] for _ in steps]
    for round_ in range(repeats + 1):
        for i, (step, shape) in enumerate(zip(steps, trees)):
            synchronize(lm.device)
            start = time.perf_counter()
            lm.forward(step, tree=shape) if shape is not None else lm.forward(step)
            synchronize(lm.device)
            if round_:
                times[i].append(time.perf_counter() - start)
            lm.rollback(lm.length - len(step))
    return times
