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


class TopkRecorder:
    """A logits processor for transformers' `generate` that keeps each step's top-k log-probs
    (float32, temperature 1) and their ids, and changes nothing: `generate(output_logits=True)`
    kept every step's whole [B, V] row instead, 17 GB for 32 answers of 512 tokens over Gemma-3's
    262k-token vocabulary (and the same again stacked), which ran a 24 GiB machine out of memory.
    First in the processor list, it reads the logits `generate` hands its processors: the model's
    own where the generation config adds no processor before them (ours add none)."""

    def __init__(self, k: int):
        self.k = k
        self.values: list[torch.Tensor] = []
        self.ids: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        logprobs = scores.to(torch.promote_types(scores.dtype, torch.float32)).log_softmax(-1)
        values, ids = logprobs.topk(min(self.k, logprobs.shape[-1]), dim=-1)
        self.values.append(values.float().cpu())
        self.ids.append(ids.cpu())
        return scores

    def stacked(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(log-probs, ids) [B, steps, k]."""
        return torch.stack(self.values, dim=1), torch.stack(self.ids, dim=1)


def sampling_kwargs(seeds: Sequence[int], width: int, temperature: float, top_p: float,
                    recorder: TopkRecorder | None = None) -> dict:
    """`generate` keyword arguments: greedy at temperature 0, else `RowSampling` from `seeds`;
    `recorder` (`TopkRecorder`) first among the processors where given."""
    from transformers import LogitsProcessorList

    processors = [recorder] if recorder is not None else []
    if temperature > 0:
        processors.append(RowSampling(seeds, width, temperature, top_p))
    return {"do_sample": False, **({"logits_processor": LogitsProcessorList(processors)} if processors else {})}


__all__ = ["RowSampling", "TopkRecorder", "prompt_seeds", "sampling_kwargs", "seed_of"]
