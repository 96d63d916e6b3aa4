"""Timing a decode on the run's engines. A forward's cost on this machine (the medians behind a
report's `cost_ratio` and a plan's costs) is measured by `decoding.timing`; each drafter kind
times its own step (`DrafterKind.step_seconds`, `cost_ratio`)."""

from __future__ import annotations

import time

from ..decoding import Generation
from ..decoding.engines import synchronize
from ..decoding.timing import forward_curve, forward_seconds, single_token_seconds


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


__all__ = ["forward_curve", "forward_seconds", "single_token_seconds", "timed_generate"]
