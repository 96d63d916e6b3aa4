"""The EAGLE-3 draft layer on an engine: its KV cache and how its drafting steps run.

- eager: `Eagle3KVCache`, grown by concatenation; every step runs as written.
- static: `Eagle3StaticCache`, preallocated, written in place. Drafting steps (one token of a
  chain, one level of a tree) run `Eagle3Draft.step_in_place`, where every length is a tensor:
  with `compile` (default on CUDA) each (new nodes, tree width) shape is compiled once with
  fixed shapes, as CUDA graphs on CUDA (`mode="reduce-overhead"`), like the target's static
  engine. Feeding the target's features after a verification (a variable count) runs uncompiled.

One engine per draft and run, shared by every decoder of that run (only one decodes at a time),
so each shape compiles once; `compile_seconds` is reported apart from decoding time.
"""

from __future__ import annotations

import functools
import time

import torch

from ..eagle3.model import DraftStep, Eagle3Draft, Eagle3KVCache, Eagle3StaticCache
from .lm import device_tensor
from .static import _raise_compile_limits


class Eagle3Engine:
    def __init__(self, draft: Eagle3Draft, engine: str = "eager", *, capacity: int | None = None,
                 compile: bool | None = None):
        """`capacity` (static): the most entries the draft's cache holds: the target's cache
        capacity plus the most tree nodes one drafting pass adds. `compile` None: on for CUDA."""
        if engine not in ("eager", "static"):
            raise ValueError(f"unknown draft engine {engine!r}; use eager or static")
        self.draft = draft
        self.engine = engine
        self.device = next(draft.parameters()).device
        if engine == "static":
            if not capacity or capacity < 1:
                raise ValueError("the static draft engine needs a capacity")
            self.cache = Eagle3StaticCache(draft.config, capacity, device=self.device, dtype=draft.fc.weight.dtype)
        else:
            self.cache = Eagle3KVCache()
        self.compile = engine == "static" and (self.device.type == "cuda" if compile is None else bool(compile))
        self.cudagraphs = self.compile and self.device.type == "cuda"
        self.compile_seconds = 0.0
        self._compiled = None
        self._one = torch.ones(1, 1, dtype=torch.bool, device=self.device)

    def prefill(self, features: torch.Tensor, next_tokens: torch.Tensor, positions: torch.Tensor) -> DraftStep:
        return self.draft.prefill(self.cache, features, next_tokens, positions)

    def step(self, hidden: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
             tree_mask: torch.Tensor | None = None) -> DraftStep:
        """`Eagle3Draft.step` on this engine's cache (tree_mask [n, m], or None for a chain)."""
        n = tokens.shape[1]
        if self.engine == "eager" or (tree_mask is None and n != 1):
            return self.draft.step(self.cache, hidden, tokens, positions, tree_mask=tree_mask)
        mask = self._one if tree_mask is None else tree_mask.to(torch.bool)
        m = mask.shape[-1]
        cache = self.cache
        cache.check_room(n)
        if not n <= m <= cache.length + n:
            raise ValueError(f"tree_mask covers {m} entries; it needs the {n} new nodes and at most the "
                             f"{cache.length + n} cached")
        tree_start = device_tensor(cache.length + n - m, self.device)  # 0-d, without a host sync
        if self.compile:
            with torch.inference_mode():  # guards check strides and inference-ness: hand in fresh, standard inputs
                inputs = [t.clone(memory_format=torch.contiguous_format)
                          for t in (hidden, tokens, positions, tree_start, mask)]
                if self.cudagraphs:
                    torch.compiler.cudagraph_mark_step_begin()
                logits, hidden = self._step_fn()(*inputs)
                logits, hidden = logits.clone(), hidden.clone()  # a CUDA graph's outputs are its next replay's
        else:
            logits, hidden = self.draft.step_in_place(cache, hidden, tokens, positions, tree_start, mask)
        cache.length += n
        return DraftStep(logits, hidden)

    def _step_fn(self):
        if self._compiled is None:
            _raise_compile_limits()
            self._compiled = torch.compile(functools.partial(self.draft.step_in_place, self.cache), fullgraph=True,
                                           dynamic=False, mode="reduce-overhead" if self.cudagraphs else None)
        return self._compiled

    @torch.inference_mode()
    def warmup(self, shapes) -> float:
        """Compile and capture the drafting steps of these (n, m) shapes (three runs each: CUDA
        graph trees warm up, record, replay), so no timed step compiles. Leaves the cache empty."""
        if not self.compile:
            return 0.0
        start = time.perf_counter()
        hidden_size = self.draft.config.hidden_size
        for n, m in sorted(set(shapes)):
            if m + 1 > self.cache.capacity:
                continue
            for _ in range(3):
                self.cache.length = 1 + m - n  # a committed entry, then the tree's older nodes
                hidden = torch.zeros(1, n, hidden_size, dtype=self.draft.fc.weight.dtype, device=self.device)
                tokens = torch.zeros(1, n, dtype=torch.long, device=self.device)
                positions = torch.zeros(1, n, dtype=torch.long, device=self.device)
                mask = torch.ones(n, m, dtype=torch.bool, device=self.device)
                self.step(hidden, tokens, positions, None if (n, m) == (1, 1) else mask)
        self.cache.reset()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - start
        self.compile_seconds += seconds
        return seconds


def as_draft_engine(draft) -> Eagle3Engine:
    """A decoder's EAGLE-3 draft: an engine as given, or a plain draft on the eager engine."""
    return draft if isinstance(draft, Eagle3Engine) else Eagle3Engine(draft)


__all__ = ["Eagle3Engine", "as_draft_engine"]
