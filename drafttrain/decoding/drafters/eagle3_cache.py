"""The EAGLE-3 draft layer's KV caches, and the draft bound to one on an engine (`CachedEagle3Draft`).

The draft's cache mirrors the target's (one entry per cached target position), so it lives on
the same kind of engine as the target's cached LM:
- eager: `Eagle3KVCache`, grown by concatenation; every step runs as written.
- static: `Eagle3StaticCache`, preallocated, written in place. Drafting steps (one token of a
  chain, one level of a tree) run `Eagle3Draft.step_in_place`, where every length is a tensor:
  with `compile` (default on CUDA) each (new nodes, tree width) shape is one `CompiledStep`, as
  the target's static steps are. Feeding the target's features after a verification (a variable
  count) runs uncompiled.

One cached draft per run, shared by every decoder of that run (only one decodes at a time), so
each shape compiles once; `compile_seconds` is reported apart from decoding time.
"""

from __future__ import annotations

import functools
import time

import torch
from torch import nn

from ...eagle3.model import DraftStep, Eagle3Config, Eagle3Draft
from ..engines import device_tensor, synchronize, use_skinny_matmuls
from ..engines.compiled import WARMUP_RUNS, CompiledStep


class Eagle3KVCache:
    """The draft layer's keys (rotated) and values for decoding: a simple growing cache.

    `valid` [B, S] marks real entries (a batch's left padding is never attended). Entries are in
    the order they were appended; `rollback` drops the newest.
    """

    def __init__(self):
        self.keys: torch.Tensor | None = None    # [B, kv_heads, S, d]
        self.values: torch.Tensor | None = None
        self.valid: torch.Tensor | None = None   # bool [B, S]

    @property
    def length(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def reset(self) -> None:
        self.keys = self.values = self.valid = None

    def rollback(self, length: int) -> None:
        """Keep the first `length` entries (drop what was drafted since)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot roll back a cache of {self.length} entries to {length}")
        if length == 0:
            self.reset()
            return
        self.keys, self.values = self.keys[:, :, :length], self.values[:, :, :length]
        self.valid = self.valid[:, :length]

    def append(self, keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor | None = None) -> None:
        if valid is None:
            valid = torch.ones(keys.shape[0], keys.shape[2], dtype=torch.bool, device=keys.device)
        if self.keys is None:
            self.keys, self.values, self.valid = keys, values, valid.bool()
        else:
            self.keys = torch.cat([self.keys, keys], dim=2)
            self.values = torch.cat([self.values, values], dim=2)
            self.valid = torch.cat([self.valid, valid.bool()], dim=1)


class Eagle3StaticCache(nn.Module):
    """The draft layer's cache preallocated for `capacity` entries ([B, kv_heads, capacity, d] and
    valid [B, capacity]), written in place, with Eagle3KVCache's bookkeeping (length, reset,
    rollback; a decoder drops drafted entries by rollback and feeds the accepted ones anew).
    Entries past `length` are stale and never read: every mask stops at the written ones.
    Fixed shapes and addresses are what lets one compiled step serve every length
    (`Eagle3Draft.step_in_place`; CUDA graphs replay in place)."""

    def __init__(self, config: Eagle3Config, capacity: int, *, batch_size: int = 1, device=None,
                 dtype: torch.dtype | None = None):
        super().__init__()
        shape = (batch_size, config.num_key_value_heads, capacity, config.head_dim)
        self.register_buffer("keys", torch.zeros(shape, device=device, dtype=dtype), persistent=False)
        self.register_buffer("values", torch.zeros(shape, device=device, dtype=dtype), persistent=False)
        self.register_buffer("valid", torch.zeros(batch_size, capacity, dtype=torch.bool, device=device),
                             persistent=False)
        for t in (self.keys, self.values, self.valid):
            torch._dynamo.mark_static_address(t)
        self.capacity = capacity
        self.length = 0

    def reset(self) -> None:
        self.length = 0

    def check_room(self, n: int) -> None:
        if self.length + n > self.capacity:
            raise ValueError(f"the draft's static cache holds {self.capacity} entries; {self.length} + {n} do not fit")

    def rollback(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot roll back a cache of {self.length} entries to {length}")
        self.length = length

    @torch.no_grad()
    def append(self, keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor | None = None) -> None:
        n = keys.shape[2]
        self.check_room(n)
        slots = torch.arange(self.length, self.length + n, device=self.keys.device)
        self.keys.index_copy_(2, slots, keys.to(self.keys.dtype))
        self.values.index_copy_(2, slots, values.to(self.values.dtype))
        self.valid[:, slots] = True if valid is None else valid.bool()
        self.length += n


class CachedEagle3Draft:
    """An EAGLE-3 draft bound to its own KV cache on an engine (eager or static), as a `CachedLM`
    binds a model to its cache."""

    def __init__(self, draft: Eagle3Draft, engine: str = "eager", *, capacity: int | None = None,
                 compile: bool | None = None):
        """`capacity` (static): the most entries the draft's cache holds: the target's cache
        capacity plus the most tree nodes one drafting pass adds. `compile` None: on for CUDA."""
        if engine not in ("eager", "static"):
            raise ValueError(f"unknown draft engine {engine!r}; use eager or static")
        self.draft = draft
        self.engine = engine
        self.device = next(draft.parameters()).device
        use_skinny_matmuls(draft)
        if engine == "static":
            if not capacity or capacity < 1:
                raise ValueError("the static draft engine needs a capacity")
            self.cache = Eagle3StaticCache(draft.config, capacity, device=self.device, dtype=draft.fc.weight.dtype)
        else:
            self.cache = Eagle3KVCache()
        self.compile = engine == "static" and (self.device.type == "cuda" if compile is None else bool(compile))
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
                logits, hidden = self._step_fn()(*inputs)
        else:
            logits, hidden = self.draft.step_in_place(cache, hidden, tokens, positions, tree_start, mask)
        cache.length += n
        return DraftStep(logits, hidden)

    def _step_fn(self) -> CompiledStep:
        if self._compiled is None:
            self._compiled = CompiledStep(functools.partial(self.draft.step_in_place, self.cache), self.device)
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
            for _ in range(WARMUP_RUNS):
                self.cache.length = 1 + m - n  # a committed entry, then the tree's older nodes
                hidden = torch.zeros(1, n, hidden_size, dtype=self.draft.fc.weight.dtype, device=self.device)
                tokens = torch.zeros(1, n, dtype=torch.long, device=self.device)
                positions = torch.zeros(1, n, dtype=torch.long, device=self.device)
                mask = torch.ones(n, m, dtype=torch.bool, device=self.device)
                self.step(hidden, tokens, positions, None if (n, m) == (1, 1) else mask)
        self.cache.reset()
        synchronize(self.device)
        seconds = time.perf_counter() - start
        self.compile_seconds += seconds
        return seconds


def as_cached_draft(draft) -> CachedEagle3Draft:
    """A decoder's EAGLE-3 draft: a cached draft as given, or a plain draft on the eager engine."""
    return draft if isinstance(draft, CachedEagle3Draft) else CachedEagle3Draft(draft)
