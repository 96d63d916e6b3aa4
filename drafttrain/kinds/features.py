"""The run time of drafts that read the target's features (EAGLE-3's; a DFlash block drafter's):
their KV cache (`DraftKVCache`) and the draft bound to it on an engine (`FeatureDraftRuntime`).

Such a draft keeps one cache entry per cached target position, made from the target's hidden
states there (its features, which the verification forward returns at `hidden_layers`) and the
token that follows: its cache mirrors the target's, so it lives on the same kind of engine.
- eager: the cache grows by concatenation; every step runs as written.
- static: the cache is preallocated and written in place, every length a tensor inside a step, so
  each fixed-shape step is one `CompiledStep` (`compile`, default on CUDA), compiled once per
  shape and kept by name (`_fn`): the feed after a verification (padded to `feed_width` entries,
  the count a tensor in `meta`) and the kind's drafting steps. The prompt's longer feed runs as
  written.

The cache writes its own entries: a draft layer hands it its new keys and values (`update`, as
transformers' and gpt-fast's caches) and attends to what it returns. The runtime keeps the cache
in step with the target's: `reset` with the prompt's features, `commit` after each verification
(the drafted entries dropped, the kept positions' features fed). One runtime per run, shared by
every decoder of that run (only one decodes at a time), so each shape compiles once;
`compile_seconds` is reported apart from decoding time.

A new feature-reading kind subclasses `FeatureDraftRuntime` in its `decode.py`, passes its cache's
shape to the constructor (draft layers, KV heads, head size, dtype) and overrides these hooks:
- `hidden_layers` (a property): the target layers whose features the draft reads;
- `feed_as_written(features [n, F], next_tokens: list[int], start: int)`: the feed of n entries at
  slots start.. on either engine, any n: the draft's output there, which becomes `last`;
- `feed_padded(features [1, W, F], meta [W + 2])`: the same as one fixed-shape step of W =
  `feed_width` rows (`meta`: the W tokens that follow, the first slot, the real count n; the
  padding is written past the n real entries and never read), compiled through `_fn("feed", ...)`;
- its drafting steps, each compiled through `_fn(name, fn)` on the static engine, writing its
  entries at tensor slots (`update(..., slots=...)`) and leaving `length` to the host (EAGLE-3:
  a chain step, EAGLE-2's dynamic tree, the steps after a verification; DFlash: one block step of
  [last token, mask × (B - 1)] attending to the committed context and to the block, non-causal);
- `warmup(...)`: a dummy call of every compiled shape a decoder will run, handed to `_warm`.
Drafting entries past `committed` are scratch: a rollback drops them (eager), the next feed
overwrites them (static).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable

import torch
from torch import nn

from ..decoding.chain import Proposer
from ..decoding.engines import device_tensor, use_skinny_matmuls
from ..decoding.engines.compiled import CompiledStep, static_capacity, step_state, timed_warmup
from ..decoding.verify import Greedy, Sampled


class DraftKVCache(nn.Module):
    """A feature-reading draft's keys (rotated) and values for decoding, `layers` draft layers deep.

    `valid` [B, S] marks real entries (a batch's left padding is never attended); entries are in
    the order they were written and `rollback` drops the newest. A forward writes its layers in
    order, 0 first, each at the same slots: `valid` is written with layer 0 and `length` moves
    once, with the last layer's write.
    - `capacity` None, the eager storage: one growing tensor per layer for K and for V
      (`keys[layer]` [B, kv_heads, S, d]), grown by concatenation.
    - else the static storage: K and V preallocated as [layers, B, kv_heads, capacity, d] and
      valid [B, capacity], written in place; entries past `length` are stale and never read (every
      mask stops at the written ones). Fixed shapes and addresses are what lets one compiled step
      serve every length (CUDA graphs replay in place).
    On either storage `keys[layer]` and `values[layer]` are a layer's entries (a step that reads the
    committed ones without writing, a block drafter's, reads them there)."""

    def __init__(self, layers: int = 1, *, capacity: int | None = None, kv_heads: int = 0, head_dim: int = 0,
                 batch_size: int = 1, device=None, dtype: torch.dtype | None = None):
        super().__init__()
        self.layers, self.capacity = layers, capacity
        self.length = 0
        if capacity is None:
            self.reset()
            return
        shape = (layers, batch_size, kv_heads, capacity, head_dim)
        self.register_buffer("keys", step_state(shape, device=device, dtype=dtype), persistent=False)
        self.register_buffer("values", step_state(shape, device=device, dtype=dtype), persistent=False)
        self.register_buffer("valid", step_state((batch_size, capacity), dtype=torch.bool, device=device),
                             persistent=False)

    @property
    def static(self) -> bool:
        return self.capacity is not None

    def reset(self) -> None:
        self.length = 0
        if not self.static:
            self.keys: list[torch.Tensor | None] = [None] * self.layers
            self.values: list[torch.Tensor | None] = [None] * self.layers
            self.valid: torch.Tensor | None = None

    def check_room(self, n: int) -> None:
        """n more entries fit (the eager storage has no bound)."""
        if self.static and self.length + n > self.capacity:
            raise ValueError(f"the draft's static cache holds {self.capacity} entries; {self.length} + {n} do not fit")

    def rollback(self, length: int) -> None:
        """Keep the first `length` entries (drop what was drafted since)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot roll back a cache of {self.length} entries to {length}")
        if not self.static:
            if length == 0:
                self.reset()
                return
            self.keys = [k[:, :, :length] for k in self.keys]
            self.values = [v[:, :, :length] for v in self.values]
            self.valid = self.valid[:, :length]
        self.length = length

    def update(self, layer: int, keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor | None = None, *,
               slots: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Write n entries of draft layer `layer` (keys/values [B, kv_heads, n, d]); returns that
        layer's whole cache (keys, values, valid) to attend to: on the static storage the
        preallocated tensors, stale tail included (every mask stops before it).
        `slots` None: appended after `length`, which moves with the last layer's write (`valid`
        [B, n] or None: all real). `slots` [n], a tensor (static): written there, all valid,
        `length` unmoved: a compiled step's write, every length a tensor (its caller moves `length`)."""
        if not self.static:
            return self._append(layer, keys, values, valid)
        if slots is None:
            return self._write_next(layer, keys, values, valid)
        return self._write_at(layer, slots, keys, values)

    def _append(self, layer, keys, values, valid):
        if layer == 0:
            if valid is None:
                valid = torch.ones(keys.shape[0], keys.shape[2], dtype=torch.bool, device=keys.device)
            self.valid = valid.bool() if self.valid is None else torch.cat([self.valid, valid.bool()], dim=1)
        if self.keys[layer] is None:
            self.keys[layer], self.values[layer] = keys, values
        else:
            self.keys[layer] = torch.cat([self.keys[layer], keys], dim=2)
            self.values[layer] = torch.cat([self.values[layer], values], dim=2)
        self._written(layer, keys.shape[2])
        return self.keys[layer], self.values[layer], self.valid

    def _write_next(self, layer, keys, values, valid):
        n = keys.shape[2]
        self.check_room(n)
        slots = torch.arange(self.length, self.length + n, device=self.keys.device)
        with torch.no_grad():
            self.keys[layer].index_copy_(2, slots, keys.to(self.keys.dtype))
            self.values[layer].index_copy_(2, slots, values.to(self.values.dtype))
            if layer == 0:
                self.valid[:, slots] = True if valid is None else valid.bool()
        self._written(layer, n)
        return self.keys[layer], self.values[layer], self.valid

    def _write_at(self, layer, slots, keys, values):
        self.keys[layer].index_copy_(2, slots, keys.to(self.keys.dtype))
        self.values[layer].index_copy_(2, slots, values.to(self.values.dtype))
        if layer == 0:
            self.valid.index_fill_(1, slots, True)
        return self.keys[layer], self.values[layer], self.valid

    def _written(self, layer: int, n: int) -> None:
        """After an append: the last layer's write completes the n entries."""
        if layer == self.layers - 1:
            self.length += n


class FeatureDraftRuntime(ABC):
    """A feature-reading draft bound to its own KV cache on an engine (eager or static), as a
    `CachedLM` binds a model to its cache: the one object a kind's proposer or tree drafter holds.
    It keeps the cache in step with the target's (one entry per cached target position: `reset`
    with the prompt's features, `commit` after each verification), the draft's output at the last
    committed entry (`last`: it predicts the token after pending; what it holds is the kind's),
    the entries kept after the last verification (`committed`) and the draft's forwards
    (`forwards`: feeds of the target's features and drafting steps). `feed_width`: the most
    entries one feed after a verification writes (K + 1), the padded width of the static engine's
    compiled feed. The hooks a kind overrides: the module docstring."""

    def __init__(self, draft: nn.Module, engine: str = "eager", *, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 layers: int = 1, capacity: int | None = None, compile: bool | None = None, feed_width: int = 0):
        """`kv_heads`, `head_dim`, `dtype`, `layers`: the cache's shape (static). `capacity` (static):
        the entries the draft's cache must hold: the target's cache capacity plus the most one
        drafting pass adds, rounded up as every static cache is (`static_capacity`: the same graphs
        for other prompt sets). `compile` None: on for CUDA."""
        if engine not in ("eager", "static"):
            raise ValueError(f"unknown draft engine {engine!r}; use eager or static")
        self.draft = draft
        self.engine = engine
        self.device = next(draft.parameters()).device
        use_skinny_matmuls(draft)
        if engine == "static":
            if not capacity or capacity < 1:
                raise ValueError("the static draft engine needs a capacity")
            self.cache = DraftKVCache(layers, capacity=static_capacity(capacity), kv_heads=kv_heads,
                                      head_dim=head_dim, device=self.device, dtype=dtype)
        else:
            self.cache = DraftKVCache(layers)
        self.compile = engine == "static" and (self.device.type == "cuda" if compile is None else bool(compile))
        self.feed_width = feed_width
        self.compile_seconds = 0.0
        self.meta: torch.Tensor | None = None  # static: [feed tokens..., start, count] of the last feed
        self.last = None    # the draft's output at the last committed entry: predicts the token after pending
        self.committed = 0  # entries kept after the last verification (the target's cached positions)
        self.deferred: tuple[torch.Tensor, list[int]] | None = None  # kept positions not fed yet (`commit(defer=True)`)
        self.forwards = 0   # draft forwards: feeds of the target's features and drafting steps
        self._compiled: dict[str, CompiledStep] = {}
        self._slots = torch.arange(self.cache.capacity or 0, device=self.device)

    # --- the kind's hooks ---------------------------------------------------------------------

    @property
    @abstractmethod
    def hidden_layers(self) -> tuple[int, ...]:
        """The target layers whose features the draft reads."""

    @abstractmethod
    def feed_as_written(self, features: torch.Tensor, next_tokens: list[int], start: int):
        """Entries for positions start.. from the target's features there ([n, F]) and the tokens
        that follow, any n, on either engine; returns the draft's output at the last one."""

    @abstractmethod
    def feed_padded(self, features: torch.Tensor, meta: torch.Tensor):
        """`feed_as_written` as one fixed-shape step (static, compiled through `_fn`): `features`
        [1, W, F] padded to W = `feed_width` rows, `meta` [W + 2] the W tokens that follow, the
        first entry's slot and the real count n; the cache's `length` is moved by the caller."""

    # --- what every feature-reading draft shares ----------------------------------------------

    @property
    def length(self) -> int:
        return self.cache.length

    @property
    def padded(self) -> bool:
        """The static engine with a fixed-width feed: a verification's feed is one compiled step,
        which the kind's steps after a verification may run in one graph with its next drafts."""
        return self.engine == "static" and self.feed_width > 0

    def at(self, index: int) -> torch.Tensor:
        """`index` as a 0-d tensor on the device (static): a view of a preallocated range, so a
        step's start slot reaches a graph with neither a host copy nor a sync."""
        return self._slots[index]

    def reset(self, prompt: list[int] | None = None, hidden: torch.Tensor | None = None) -> None:
        """An empty cache; with a prompt and its target features (`hidden`, of prompt[:-1]), their
        entries fed: the same count as the target's cache (every position but pending's)."""
        self.cache.reset()
        self.meta = self.last = self.deferred = None
        if hidden is not None and prompt is not None and len(prompt) > 1:
            self.feed(hidden, prompt[1:], start=0)
        self.committed = self.length

    def rollback(self, length: int) -> None:
        self.cache.rollback(length)

    def commit(self, hidden: torch.Tensor, next_tokens: list[int], defer: bool = False) -> None:
        """After a verification: forget the drafted entries, feed the kept positions' features
        (`hidden`) and the tokens that follow them (the accepted drafts and the bonus token), with any
        positions kept before and not fed yet. `defer`: keep them for the next feed instead (a step the
        draft did not draft, beside a lookup that drafted alone: a feed is a draft forward, which a run
        of lookup steps would pay each step; `flush` feeds them all in one before the draft drafts)."""
        self.rollback(self.committed)
        if self.deferred is not None:
            before, tokens = self.deferred
            hidden, next_tokens = torch.cat([before, hidden]), [*tokens, *next_tokens]
        self.deferred = (hidden, list(next_tokens)) if defer else None
        if not defer:
            self.feed(hidden, next_tokens, start=self.committed)
            self.committed = self.length

    def flush(self) -> None:
        """Feed the positions `commit(defer=True)` kept, if any: before anything reads the cache or `last`."""
        if self.deferred is not None:
            self.commit(self.deferred[0][:0], [])

    @torch.inference_mode()
    def feed(self, features: torch.Tensor, next_tokens: list[int], start: int):
        """Entries for positions start.. from the target's features there ([n, F]) and the tokens
        that follow; the draft's output at the last one becomes `last`. On the static engine a
        feed of at most `feed_width` entries is one fixed-shape step (padding written past the end,
        never read); the prompt's longer feed runs as written."""
        self.last = self._feed(features, next_tokens, start)
        self.forwards += 1
        return self.last

    def _feed(self, features: torch.Tensor, next_tokens: list[int], start: int):
        n, width = len(next_tokens), self.feed_width
        if not self.padded or n > width:
            out = self.feed_as_written(features, next_tokens, start)
            if self.padded:  # the prompt's feed: the compiled steps after it read where it ended
                self.meta = device_tensor([0] * width + [0, self.cache.length], self.device)
            return out
        self.cache.check_room(width)
        self.meta = device_tensor(list(next_tokens) + [0] * (width - n) + [start, n], self.device)
        out = self.feed_padded(torch.nn.functional.pad(features, (0, 0, 0, width - n)).view(1, width, -1), self.meta)
        self.cache.length = start + n
        return out

    def _fn(self, name: str, fn: Callable) -> Callable:
        """`fn` as this draft runs it: compiled once per name (static + compile), else as written."""
        if not self.compile:
            return fn
        if name not in self._compiled:
            self._compiled[name] = CompiledStep(fn, self.device)
        return self._compiled[name]

    @torch.inference_mode()
    def _warm(self, every_step: Callable[[], object]) -> float:
        """Compile and capture the steps `every_step` runs on dummy inputs (`timed_warmup`: thrice,
        then an empty cache), so no timed step compiles; nothing without compiled steps. Counts no
        forward. Returns the seconds spent, also added to `compile_seconds`."""
        if not self.compile:
            return 0.0
        return timed_warmup(self, [every_step])


class RuntimeView:
    """What a kind's proposer or tree drafter shares as a thin view on a `FeatureDraftRuntime`: its
    forwards are the runtime's, and a reset resets the runtime and, where `fused` (its next drafts come
    from `keep`, in the graph after a verification), drafts the first ones with the prefill
    (`first_drafts`), so no decode step runs a drafting graph of its own."""

    runtime: FeatureDraftRuntime
    _next = None  # the next step's drafts, made by `keep` (or `reset`)

    @property
    def forwards(self) -> int:
        return self.runtime.forwards

    @property
    def fused(self) -> bool:
        """Whether `keep` drafts the next step in the verification's graph (the kind says when)."""
        return False

    def first_drafts(self, prompt: list[int]):
        """The first step's drafts after the prompt's features were fed (fused kinds)."""
        raise NotImplementedError

    def reset(self, prompt, hidden=None):
        self.runtime.reset(prompt, hidden)
        self._next = None
        if self.fused and self.runtime.length:  # the prompt gave features to draft from
            self._next = self.first_drafts(prompt)


class FeatureChainProposer(RuntimeView, Proposer):
    """A chain proposer on a `FeatureDraftRuntime` (EAGLE-3's, DFlash's): K drafts a step under the
    decoder's rule (None: greedy), greedy chains drafted `max_k` long (one shape) and cut. Greedy on
    the static engine, `keep` feeds the verified positions and drafts the next K in one graph
    (`keep_and_draft`); otherwise `commit` feeds them and `draft` drafts. A kind overrides `fused`,
    `first_drafts`, `keep_and_draft`, `draft` and `warmup`."""

    def __init__(self, runtime: FeatureDraftRuntime, rule: Greedy | Sampled | None = None, max_k: int = 1):
        self.runtime, self.rule, self.max_k = runtime, rule or Greedy(), max_k
        self._proposed = False  # whether it drafted since its last commit (`commit` feeds at once, else defers)
        self.hidden_layers = runtime.hidden_layers
        self.device = runtime.device
        self.empty = torch.empty(0, dtype=torch.long, device=self.device)

    def keep_and_draft(self, verdict: torch.Tensor, hidden: torch.Tensor, kept: int) -> torch.Tensor:
        """The fused step after a greedy verification: the next K drafts (`kept`: the target's length)."""
        raise NotImplementedError

    def draft(self, k: int, sequence: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """k drafts after `sequence` (and their q when sampling) from the committed features."""
        raise NotImplementedError

    def keep(self, n_accepted, emitted, verdict, hidden):
        width = self.runtime.feed_width
        if not (self.fused and hidden is not None and hidden.shape[0] == width and verdict.shape[0] == 1 + width):
            return super().keep(n_accepted, emitted, verdict, hidden)  # a step the token budget cut short
        self._next = self.keep_and_draft(verdict, hidden, self.runtime.committed + n_accepted + 1)

    def propose(self, k, sequence):
        self.runtime.flush()
        self._proposed = True
        if self.runtime.length == 0 or k == 0:  # a one-token prompt: no feature to draft from yet
            return self.empty, None
        if self._next is not None:  # drafted by the last step's `keep`
            drafts, self._next = self._next, None
            return drafts[:k], None
        return self.draft(k, sequence)

    def commit(self, n_accepted, emitted, hidden=None):
        """Feeds the kept positions, or, where it was not asked to draft (a hybrid's lookup drafted the
        step alone: `HybridDrafter.lookup_first`), keeps them for the feed before its next draft; drafts
        made ahead (`reset`'s) are for a root now passed."""
        self.runtime.commit(hidden, emitted, defer=not self._proposed)
        self._next, self._proposed = None, False


__all__ = ["DraftKVCache", "FeatureChainProposer", "FeatureDraftRuntime", "RuntimeView"]
