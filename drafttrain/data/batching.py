"""The target's answers to a batch of prompts on drafttrain's own engines, and the batch size that
writes them fastest on this device (measured, since it depends on the model, the device and the
prompts: 2 CPU cores saturate at a few rows, a GPU only at hundreds).

How it is measured (issue 29): a batch of b is timed writing the run's own first chunk at that size
- the b longest prompts, whole answers - so the probe pads, attends and waits for its longest
answer as the real chunks do, and the chunk of the size chosen is kept as the run's first chunk
(written once). Probes of other, mid-length prompts overrated wide batches: SmolLM2 on 2 CPU cores
probed 248 tokens/s at 128 rows of the shortest prompts, and 128-row chunks then wrote 156 where 32
rows wrote 185 (docs/benchmarks.md, session 10 and issue 29). Of sizes within TOLERANCE of the best, the
smallest is chosen: a wider batch pads more and waits longer for its longest answer on the chunks
not probed, and splits into fewer chunks to share between ranks."""

from __future__ import annotations

import math
import time
from typing import Callable, Sequence

import torch

from ..tokens import cut_at_eos, left_pad, pad_token_id
from .config import DataConfig
from .sampling import TopkRecorder, prompt_seeds, sampling_kwargs

FIRST_PROBE = 8     # smaller batches never won (SmolLM2, 2 CPU cores: 1: 24, 4: 57, 8: 107 tokens/s) and cost the most
MAX_BATCH = 512     # past this, a GPU gains little on drafters' targets, and the chunks get too few to share
LOCKSTEP_BATCH = 16  # a sharded target's batch: its ranks cannot measure one alone
GAIN = 1.1          # a doubling that gains less than this has found the plateau: probing stops
TOLERANCE = 0.05    # the smallest batch within 5% of the best tokens/s is chosen (a tie within noise)
WARMUP_TOKENS = 2   # the first forwards pay one-time costs (kernels chosen, memory mapped): not timed


def choose_batch_size(measure: Callable[[int], float], limit: int) -> tuple[int, dict[int, float]]:
    """The batch size for `measure`'s tokens/s among FIRST_PROBE, twice that, .. `limit` (`measure(b)`:
    tokens/s of a batch of b; it raises torch.OutOfMemoryError or MemoryError where b does not
    fit). Doubling stops at the first batch that does not fit or gains less than GAIN over the best
    so far; the smallest size within TOLERANCE of the best rate is chosen. Returns (batch size,
    {b: tokens/s measured})."""
    rates: dict[int, float] = {}
    b = min(FIRST_PROBE, limit)
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
    if not rates:
        return 1, rates
    best = max(rates.values())
    return min(c for c in rates if rates[c] >= best * (1 - TOLERANCE)), rates


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
        self.probed: dict[int, tuple[list[int], dict]] = {}  # the first chunk at each size measured
        self.kept: tuple[list[int], dict] | None = None  # the chosen size's: written once, by the probe

    def chunk_size(self, ranks) -> tuple[int, str]:
        """(batch size, how it was chosen): data.generation_batch_size, else measured (by the main
        process alone; ranks in lockstep cannot time forwards they must all run: a fixed size)."""
        if self.cfg.generation_batch_size:
            return self.cfg.generation_batch_size, "data.generation_batch_size"
        if ranks.lockstep:
            return LOCKSTEP_BATCH, "fixed: the ranks of a sharded target run every forward together"
        order = longest_first(self.prompts)
        self.write(order[:FIRST_PROBE], max_new_tokens=WARMUP_TOKENS,
                   static=self._generator(min(FIRST_PROBE, len(order)), compile=False)
                   if self.engine == "static" else None)
        size, rates = choose_batch_size(self.measure, batch_limit(len(self.prompts), ranks.workers))
        self.kept = self.probed.get(size) if ranks.share == 0 else None  # chunk 0 falls to share 0
        self.probed = {}
        kept = ""
        if self.kept:
            tokens = sum(len(r) for r in self.kept[1]["response_ids"])
            kept = f"; chunk 0 ({tokens} tokens at {rates[size]:.0f} tokens/s) written by its probe, kept"
        return size, ("measured on the first chunk at each size, tokens/s by batch: "
                      + ", ".join(f"{b}: {r:.0f}" for b, r in rates.items())
                      + f" -> the smallest within {TOLERANCE:.0%} of the best" + kept)

    def measure(self, b: int) -> float:
        """tokens/s of whole answers to the run's first chunk at size b: the b longest prompts
        (uncompiled). Whole, not a few tokens: a batch runs until its longest answer ends, so a
        short probe, where every row still runs, overrates big batches; and the first chunk, not
        mid-length prompts: the real chunks pad to their longest prompt (see the module's doc). On
        the eager engine the chunk is the one `write` would compute, kept for the size chosen."""
        indices = longest_first(self.prompts)[:b]
        static = self._generator(b, compile=False) if self.engine == "static" else None
        start = time.perf_counter()
        chunk = self.write(indices, static=static)
        seconds = max(time.perf_counter() - start, 1e-9)
        if static is None:  # the static engine's chunks come from a compiled generator: not the same bits
            self.probed[b] = (indices, chunk)
        return sum(len(r) for r in chunk["response_ids"]) / seconds

    def _generator(self, batch_size: int, compile: bool | None = None):
        from ..decoding.batch import BatchGenerator

        return BatchGenerator(self.model, batch_size=batch_size, max_length=self.max_length, compile=compile)

    @torch.inference_mode()
    def write(self, indices: list[int], *, max_new_tokens: int | None = None, static=None) -> dict:
        if self.kept is not None and self.kept[0] == list(indices) and max_new_tokens is None:
            chunk, self.kept = self.kept[1], None  # written while measuring, exactly as here
            return chunk
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
        recorder = TopkRecorder(k) if k else None  # each step's top-k, not its whole vocabulary row
        out = self.model.generate(
            input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=max_new_tokens,
            eos_token_id=self.eos_ids, pad_token_id=self.pad_id, return_dict_in_generate=True,
            **sampling_kwargs(seeds, width, cfg.response_temperature, cfg.response_top_p, recorder))
        if recorder is None:
            return out.sequences[:, width:].tolist(), None, None
        return out.sequences[:, width:].tolist(), *recorder.stacked()

    def close(self) -> None:
        self.static, self.kept, self.probed = None, None, {}


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


__all__ = ["EngineWriter", "FIRST_PROBE", "GAIN", "MAX_BATCH", "TOLERANCE", "batch_limit", "choose_batch_size", "longest_first", "prompt_topk"]
