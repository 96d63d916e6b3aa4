"""Sampled answers (and self-instruct prompts) with a seed per row, not one stream per run.

One random stream drawn batch after batch makes a row's sample depend on its batch, its place in
it and the process that wrote it; answers written by several ranks, or resumed after a kill,
would then differ from one process's. Each row instead samples from its own seed, taken from
the run's seed and the prompt itself (`prompt_seeds`), through the counter-based draw of
`decoding.batch.sample_rows` on both engines (transformers' `generate` through `RowSampling`).
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from typing import Sequence

import torch

from ..decoding.batch import sample_rows
from ..decoding.verify import probabilities


def seed_of(*parts) -> int:
    """A non-negative int64 seed from JSON-able `parts`."""
    digest = hashlib.sha256(json.dumps(parts).encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def prompt_seeds(seed: int, prompts: Sequence[Sequence[int]]) -> list[int]:
    """Each prompt's sampling seed: the run's seed, its tokens, and how many copies of it came
    before (copies of a prompt still get independent answers)."""
    copies: Counter = Counter()
    seeds = []
    for ids in prompts:
        key = tuple(ids)
        seeds.append(seed_of(seed, list(key), copies[key]))
        copies[key] += 1
    return seeds


class RowSampling:
    """A logits processor for transformers' `generate(do_sample=False)`: scores whose argmax is a
    sample of the temperature / top-p distribution from each row's seed (0 at the sampled token,
    -inf elsewhere). `width`: the left-padded prompts' width, so the step is the new token's index."""

    def __init__(self, seeds: Sequence[int], width: int, temperature: float, top_p: float):
        self.seeds = torch.tensor(list(seeds), dtype=torch.long)
        self.width, self.temperature, self.top_p = width, temperature, top_p

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        probs = probabilities(scores, self.temperature, self.top_p)
        token = sample_rows(probs, self.seeds, input_ids.shape[1] - self.width)
        return torch.full_like(scores, float("-inf")).scatter(-1, token[:, None], 0.0)


def sampling_kwargs(seeds: Sequence[int], width: int, temperature: float, top_p: float) -> dict:
    """`generate` keyword arguments: greedy at temperature 0, else `RowSampling` from `seeds`."""
    from transformers import LogitsProcessorList

    if temperature <= 0:
        return {"do_sample": False}
    return {"do_sample": False, "logits_processor": LogitsProcessorList([RowSampling(seeds, width, temperature, top_p)])}


__all__ = ["RowSampling", "prompt_seeds", "sampling_kwargs", "seed_of"]
