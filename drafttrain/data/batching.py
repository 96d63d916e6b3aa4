"""The target's answers to a batch of prompts on drafttrain's own engines, and the batch size that
writes them fastest on this device (measured, since it depends on the model, the device and the
prompts: 2 CPU cores saturate at a few rows, a GPU only at hundreds)."""

from __future__ import annotations

import math
import time
from typing import Callable, Sequence

import torch

from ..tokens import cut_at_eos, left_pad, pad_token_id
from .config import DataConfig
from .sampling import prompt_seeds, sampling_kwargs

FIRST_PROBE = 8     # smaller batches never won (SmolLM2, 2 CPU cores: 1: 24, 4: 57, 8: 107 tokens/s) and cost the most
MAX_BATCH = 512     # past this, a GPU gains little on drafters' targets, and the chunks get too few to share
LOCKSTEP_BATCH = 16  # a sharded target's batch: its ranks cannot measure one alone
GAIN = 1.1          # a doubling that gains less than this has found the plateau: probing stops


def choose_batch_size(measure: Callable[[int], float], limit: int) -> tuple[int, dict[int, float]]:
    """The batch size of the best tokens/s among FIRST_PROBE, twice that, .. `limit` (`measure(b)`:
    tokens/s of a batch of b; it raises torch.OutOfMemoryError or MemoryError where b does not
    fit). Doubling stops at the first batch that does not fit or gains less than GAIN over the best
    so far. Returns (batch size, {b: tokens/s measured})."""
    rates: dict[int, float] = {}
    b = min(FIRST_PROBE, limit)
    measure(b)  # the first run pays one-time costs (kernels chosen, memory mapped): not counted
    while True:
        try:
            rates[b] = measure(b)
        except (torch.OutOfMemoryError, MemoryError):
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            break
        best = max(rates[c] for c in rates if c != b) if len(rates) > 1 else 0.0
        if b >= limit or rates[b] < best * GAIN:
            break
        b = min(2 * b, limit)
    return max(rates, key=lambda c: (rates[c], -c)) if rates else 1, rates


def batch_limit(prompts: int, workers: int) -> int:
    """The largest batch worth probing: every worker gets at least two batches (a fair share)."""
    return max(1, min(MAX_BATCH, math.ceil(prompts / (2 * workers))))


def longest_first(prompts: Sequence[Sequence[int]]) -> list[int]:
    """Prompt indices, longest first (ties in input order): similar lengths share a batch (little
    padding) and an out-of-memory shows up at once."""
    return sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))


class EngineWriter:
    """Answers on the eager engine (transformers' `generate`) or the static one (`BatchGenerator`).
    `write(indices)` -> one chunk (see `shards`): the rows of those prompts."""

    main_only = False  # every rank runs its own copy of the target

    def __init__(self, model, tokenizer, prompts: list[list[int]], cfg: DataConfig, eos_ids: list[int], engine: str):
        self.model, self.prompts, self.cfg, self.eos_ids, self.engine = model, prompts, cfg, eos_ids, engine
        self.device = next(model.parameters()).device
        self.pad_id = pad_token_id(tokenizer, model)
        self.seeds = prompt_seeds(cfg.seed, prompts)
        self.max_length = max(map(len, prompts)) + cfg.max_response_tokens
        self.batch_size = 1  # set to the plan's chunk size before the first write
        self.static = None  # the static engine's generator, built at that size

    def chunk_size(self, ranks) -> tuple[int, str]:
        """(batch size, how it was chosen): data.generation_batch_size, else measured (by the main
        process alone; ranks in lockstep cannot time forwards they must all run: a fixed size)."""
        if self.cfg.generation_batch_size:
            return self.cfg.generation_batch_size, "data.generation_batch_size"
        if ranks.lockstep:
            return LOCKSTEP_BATCH, "fixed: the ranks of a sharded target run every forward together"
        size, rates = choose_batch_size(self.measure, batch_limit(len(self.prompts), ranks.workers))
        return size, "measured, tokens/s by batch: " + ", ".join(f"{b}: {r:.0f}" for b, r in rates.items())

    def measure(self, b: int) -> float:
        """tokens/s of whole answers to b mid-length prompts (uncompiled). Whole, not a few tokens:
        a batch runs until its longest answer ends, so a short probe, where every row still runs,
        overrates big batches (SmolLM2 on 2 CPU cores: 32 tokens probed 290 tokens/s at 128 rows,
        which then wrote 158 where 32 rows wrote 191; docs/benchmarks.md, session 10)."""
        order = longest_first(self.prompts)
        middle = len(order) // 2
        indices = [order[(middle + j) % len(order)] for j in range(b)]
        static = self._generator(b, compile=False) if self.engine == "static" else None
        start = time.perf_counter()
        chunk = self.write(indices, static=static)
        return sum(len(r) for r in chunk["response_ids"]) / max(time.perf_counter() - start, 1e-9)

    def _generator(self, batch_size: int, compile: bool | None = None):
        from ..decoding.batch import BatchGenerator

        return BatchGenerator(self.model, batch_size=batch_size, max_length=self.max_length, compile=compile)

    @torch.inference_mode()
    def write(self, indices: list[int], *, max_new_tokens: int | None = None, static=None) -> dict:
        cfg, k = self.cfg, self.cfg.store_topk
        input_ids, attention_mask = left_pad([self.prompts[i] for i in indices], self.pad_id, self.device)
        chunk: dict = {"index": torch.tensor(indices, dtype=torch.long)}
        if k and cfg.prompt_loss_weight > 0:
            pairs = prompt_topk(self.model, input_ids, attention_mask, k)
            chunk["prompt_topk_ids"], chunk["prompt_topk_logprobs"] = [p[0] for p in pairs], [p[1] for p in pairs]
        if self.engine == "static" and static is None:
            self.static = self.static or self._generator(max(self.batch_size, len(indices)))
            static = self.static
        seeds = [self.seeds[i] for i in indices]
        new_tokens, values, ids = self._generate(input_ids, attention_mask, seeds, max_new_tokens or
                                                 cfg.max_response_tokens, static)
        responses = [cut_at_eos(row, self.eos_ids) for row in new_tokens]
        chunk["response_ids"] = [torch.tensor(r, dtype=torch.long) for r in responses]
        if k:
            chunk["topk_ids"] = [ids[row, :len(r)] for row, r in enumerate(responses)]
            chunk["topk_logprobs"] = [values[row, :len(r)] for row, r in enumerate(responses)]
        return chunk

    def _generate(self, input_ids, attention_mask, seeds, max_new_tokens, static):
        """(new tokens per row, top-k log-probs [b, steps, k] float32 and their ids, or Nones)."""
        cfg, k = self.cfg, self.cfg.store_topk
        if static is not None:
            return static.generate(input_ids, attention_mask, max_new_tokens=max_new_tokens,
                                   eos_token_ids=self.eos_ids, temperature=cfg.response_temperature,
                                   top_p=cfg.response_top_p, seeds=torch.tensor(seeds), topk=k)
        width = input_ids.shape[1]
        out = self.model.generate(
            input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=max_new_tokens,
            eos_token_id=self.eos_ids, pad_token_id=self.pad_id, return_dict_in_generate=True, output_logits=k > 0,
            **sampling_kwargs(seeds, width, cfg.response_temperature, cfg.response_top_p))
        if not k:
            return out.sequences[:, width:].tolist(), None, None
        logits = torch.stack(out.logits, dim=1)  # [B, steps, V], unprocessed
        logprobs = logits.to(torch.promote_types(logits.dtype, torch.float32)).log_softmax(-1)
        values, indices = logprobs.topk(k, dim=-1)
        return out.sequences[:, width:].tolist(), values.float().cpu(), indices.cpu()

    def close(self) -> None:
        self.static = None


def prompt_topk(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                k: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per left-padded row: the target's top-k (ids, float32 log-probs) at each prompt position
    but the last (that one predicts the first response token, stored with the response)."""
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp_min(0)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    out = []
    for row in range(input_ids.shape[0]):  # one row at a time: a float32 [T, V] copy is small, [B, T, V] is not
        n = int(attention_mask[row].sum())
        lp = logits[row, input_ids.shape[1] - n:-1].float().log_softmax(-1)
        values, indices = lp.topk(min(k, lp.shape[-1]), dim=-1)
        out.append((indices.cpu(), values.cpu()))
    return out


__all__ = ["EngineWriter", "FIRST_PROBE", "GAIN", "MAX_BATCH", "batch_limit", "choose_batch_size", "longest_first", "prompt_topk"]
