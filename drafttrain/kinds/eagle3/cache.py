"""The EAGLE-3 draft layer's KV caches, and the draft bound to one on an engine (`CachedEagle3Draft`).

The draft's cache mirrors the target's (one entry per cached target position), so it lives on
the same kind of engine as the target's cached LM. Either cache writes its own entries: the
draft layer hands it the new keys and values (`update`, as transformers' and gpt-fast's caches)
and attends to what it returns.
- eager: `Eagle3KVCache`, grown by concatenation; every step runs as written.
- static: `Eagle3StaticCache`, preallocated, written in place, every length a tensor
  (`Eagle3Draft.step_in_place`). Three fixed-shape steps, each one `CompiledStep` with `compile`
  (default on CUDA): a chain's drafting step (one token), the feed of the target's features after
  a verification (padded to K + 1 entries; the count a tensor) and EAGLE-2's whole dynamic tree
  (`grow_dynamic_tree`: every depth in one graph). The prompt's features are fed uncompiled.

`CachedEagle3Draft` is what the EAGLE-3 proposer and tree drafter hold: the draft, its cache,
its compiled steps, its output at the last committed entry and its forward count. One cached
draft per run, shared by every decoder of that run (only one decodes at a time), so each shape
compiles once; `compile_seconds` is reported apart from decoding time.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from .model import DraftStep, Eagle3Config, Eagle3Draft
from ...decoding.engines import device_tensor, use_skinny_matmuls
from ...decoding.engines.static import move_entries
from ...decoding.engines.compiled import CompiledStep, static_capacity, step_state, timed_warmup
from ...decoding.dynamic_tree import DynamicTree, grow_dynamic_tree


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

    def update(self, keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Append n entries (keys/values [B, kv_heads, n, d], `valid` [B, n] or None: all real);
        returns the whole cache (keys, values, valid) to attend to."""
        if valid is None:
            valid = torch.ones(keys.shape[0], keys.shape[2], dtype=torch.bool, device=keys.device)
        if self.keys is None:
            self.keys, self.values, self.valid = keys, values, valid.bool()
        else:
            self.keys = torch.cat([self.keys, keys], dim=2)
            self.values = torch.cat([self.values, values], dim=2)
            self.valid = torch.cat([self.valid, valid.bool()], dim=1)
        return self.keys, self.values, self.valid


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
        self.register_buffer("keys", step_state(shape, device=device, dtype=dtype), persistent=False)
        self.register_buffer("values", step_state(shape, device=device, dtype=dtype), persistent=False)
        self.register_buffer("valid", step_state((batch_size, capacity), dtype=torch.bool, device=device),
                             persistent=False)
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

    def update(self, keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor | None = None, *,
               slots: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Write n entries (keys/values [B, kv_heads, n, d]); returns the whole preallocated cache
        (keys, values, valid) to attend to, stale tail included (every mask stops before it).
        `slots` None: appended after `length`, which moves (`valid` [B, n] or None: all real).
        `slots` [n], a tensor: written there, all valid, `length` unmoved: a compiled step's write,
        every length a tensor (`Eagle3Draft.step_in_place`; its caller moves `length`)."""
        if slots is not None:
            self.keys.index_copy_(2, slots, keys.to(self.keys.dtype))
            self.values.index_copy_(2, slots, values.to(self.values.dtype))
            self.valid.index_fill_(1, slots, True)
            return self.keys, self.values, self.valid
        n = keys.shape[2]
        self.check_room(n)
        slots = torch.arange(self.length, self.length + n, device=self.keys.device)
        with torch.no_grad():
            self.keys.index_copy_(2, slots, keys.to(self.keys.dtype))
            self.values.index_copy_(2, slots, values.to(self.values.dtype))
            self.valid[:, slots] = True if valid is None else valid.bool()
        self.length += n
        return self.keys, self.values, self.valid


class CachedEagle3Draft:
    """An EAGLE-3 draft bound to its own KV cache on an engine (eager or static), as a `CachedLM`
    binds a model to its cache: the one object the EAGLE-3 proposer and tree drafter hold. It
    keeps the cache in step with the target's (one entry per cached target position: `reset`
    with the prompt's features, `commit` after each verification), the draft's output at the last
    committed entry (`last`: it predicts the token after pending) and its forwards (`forwards`:
    feeds of the target's features and drafting steps). `feed_width`: the most entries one feed
    after a verification writes (K + 1), the padded width of the static engine's compiled feed."""

    def __init__(self, draft: Eagle3Draft, engine: str = "eager", *, capacity: int | None = None,
                 compile: bool | None = None, feed_width: int = 0):
        """`capacity` (static): the entries the draft's cache must hold: the target's cache
        capacity plus the most one drafting pass adds, rounded up as every static cache is
        (`static_capacity`: the same graphs for other prompt sets). `compile` None: on for CUDA."""
        if engine not in ("eager", "static"):
            raise ValueError(f"unknown draft engine {engine!r}; use eager or static")
        self.draft = draft
        self.engine = engine
        self.device = next(draft.parameters()).device
        use_skinny_matmuls(draft)
        if engine == "static":
            if not capacity or capacity < 1:
                raise ValueError("the static draft engine needs a capacity")
            self.cache = Eagle3StaticCache(draft.config, static_capacity(capacity), device=self.device,
                                           dtype=draft.fc.weight.dtype)
        else:
            self.cache = Eagle3KVCache()
        self.compile = engine == "static" and (self.device.type == "cuda" if compile is None else bool(compile))
        self.feed_width = feed_width
        self.compile_seconds = 0.0
        self.meta: torch.Tensor | None = None  # static: [feed tokens..., start, count] of the last feed
        self.last: DraftStep | None = None  # output at the last committed entry: predicts the token after pending
        self.committed = 0  # entries kept after the last verification (the target's cached positions)
        self.forwards = 0   # draft-layer forwards: feeds of the target's features and drafting steps
        self._compiled: dict[str, CompiledStep] = {}
        self._one = torch.ones(1, 1, dtype=torch.bool, device=self.device)
        self._positions = torch.arange(self.cache.capacity if engine == "static" else 0, device=self.device)

    @property
    def hidden_layers(self) -> tuple[int, ...]:
        """The target layers whose features the draft reads."""
        return tuple(self.draft.config.aux_layer_ids)

    @property
    def length(self) -> int:
        return self.cache.length

    def reset(self, prompt: list[int] | None = None, hidden: torch.Tensor | None = None) -> None:
        """An empty cache; with a prompt and its target features (`hidden`, of prompt[:-1]), their
        entries fed: the same count as the target's cache (every position but pending's)."""
        self.cache.reset()
        self.meta = self.last = None
        if hidden is not None and prompt is not None and len(prompt) > 1:
            self.feed(hidden, prompt[1:], start=0)
        self.committed = self.length

    def rollback(self, length: int) -> None:
        self.cache.rollback(length)

    def commit(self, hidden: torch.Tensor, next_tokens: list[int]) -> None:
        """After a verification: forget the drafted entries, feed the kept positions' features
        (`hidden`) and the tokens that follow them (the accepted drafts and the bonus token)."""
        self.rollback(self.committed)
        self.feed(hidden, next_tokens, start=self.committed)
        self.committed = self.length

    def _fn(self, name: str, fn):
        """`fn` as this draft runs it: compiled once (static + compile), else as written."""
        if not self.compile:
            return fn
        if name not in self._compiled:
            self._compiled[name] = CompiledStep(fn, self.device)
        return self._compiled[name]

    def _padded(self) -> bool:
        return self.engine == "static" and self.feed_width > 0

    @torch.inference_mode()
    def feed(self, features: torch.Tensor, next_tokens: list[int], start: int) -> DraftStep:
        """Entries for positions start.. from the target's features there ([n, 3H]) and the tokens
        that follow; the draft's output at the last one becomes `last`. On the static engine a
        feed of at most `feed_width` entries is one fixed-shape step (padding written past the end,
        never read); the prompt's longer feed runs as written."""
        self.last = self._feed(features, next_tokens, start)
        self.forwards += 1
        return self.last

    def _feed(self, features: torch.Tensor, next_tokens: list[int], start: int) -> DraftStep:
        n = len(next_tokens)
        if not self._padded() or n > self.feed_width:
            out = self.draft.prefill(self.cache, features.view(1, n, -1), device_tensor(next_tokens, self.device).view(1, n),
                                     torch.arange(start, start + n, device=self.device).view(1, n))
            if self._padded():  # the prompt's feed: the compiled steps after it read where it ended
                self.meta = device_tensor([0] * self.feed_width + [0, self.cache.length], self.device)
            return DraftStep(out.logits[:, -1:], out.hidden[:, -1:])
        width = self.feed_width
        self.cache.check_room(width)
        self.meta = device_tensor(list(next_tokens) + [0] * (width - n) + [start, n], self.device)
        features = torch.nn.functional.pad(features, (0, 0, 0, width - n)).view(1, width, -1)
        logits, hidden = self._fn("feed", functools.partial(feed_in_place, self.draft, self.cache))(features, self.meta)
        self.cache.length = start + n
        return DraftStep(logits, hidden)

    def step(self, hidden: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
             tree_mask: torch.Tensor | None = None) -> DraftStep:
        """`Eagle3Draft.step` on this engine's cache (tree_mask [n, m], or None for a chain)."""
        self.forwards += 1
        with torch.inference_mode():
            return self._step(hidden, tokens, positions, tree_mask)

    def _step(self, hidden: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
              tree_mask: torch.Tensor | None = None) -> DraftStep:
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
        step = self._fn("step", functools.partial(self.draft.step_in_place, cache))
        logits, hidden = step(hidden, tokens, positions, tree_start, mask)
        cache.length += n
        return DraftStep(logits, hidden)

    def dynamic_tree(self, last: DraftStep, root: torch.Tensor, *, depth: int, topk: int, nodes: int) -> DynamicTree:
        """EAGLE-2's tree from the draft's output at the last committed entry (`last`) below the
        pending token `root` [1] (`grow_dynamic_tree`). The drafted levels are scratch entries
        past the committed ones: the next feed overwrites them (static) or a rollback drops them."""
        shape = dict(depth=depth, topk=topk, nodes=nodes)
        if not self._padded():
            committed = self.cache.length
            return grow_dynamic_tree(self.draft, functools.partial(_eager_level, self, committed),
                                     last.logits[0, -1:], last.hidden[0, -1:], root, **shape)
        self.cache.check_room((depth - 1) * topk)
        grow = self._fn(f"tree{depth},{topk},{nodes}",
                        functools.partial(tree_in_place, self.draft, self.cache, **shape))
        return grow(last.logits[0, -1:], last.hidden[0, -1:], root.view(1), self.meta)

    def keep_tree(self, target_lm, path: torch.Tensor, argmax: torch.Tensor, hidden: torch.Tensor, past: int,
                  kept: int, *, depth: int, topk: int, nodes: int) -> DynamicTree:
        """The static engine's step after a tree verification (`keep_path_and_grow_tree`): one
        call moves the target's accepted entries, feeds the draft and grows the next tree. Then the
        host's bookkeeping: both caches hold the `kept` entries (past + the path's nodes)."""
        self.cache.check_room(path.shape[0] + (depth - 1) * topk)
        step = self._keep_tree_step(target_lm, depth=depth, topk=topk, nodes=nodes)
        tree, logits, last_hidden = step(path, argmax, hidden, target_lm.at(past))
        self.last = DraftStep(logits, last_hidden)
        self.forwards += depth  # the feed, then depth - 1 drafting levels
        target_lm.rollback(kept)
        self.cache.length = self.committed = kept
        return tree

    def keep_chain(self, verdict: torch.Tensor, hidden: torch.Tensor, kept: int, k: int) -> torch.Tensor:
        """The static engine's step after a greedy chain verification (`keep_and_draft_chain`): one
        call feeds the kept positions and drafts the next K. `kept`: the target's length now."""
        self.cache.check_room(self.feed_width + k)
        drafts, logits, last_hidden = self._keep_chain_step(k)(verdict, hidden, self._positions[self.committed])
        self.last = DraftStep(logits, last_hidden)
        self.forwards += k  # the feed, then k - 1 drafting steps
        self.cache.length = self.committed = kept
        return drafts

    def _keep_tree_step(self, target_lm, **shape):
        return self._fn("keep{depth},{topk},{nodes}".format(**shape),
                        functools.partial(keep_path_and_grow_tree, self.draft, self.cache, target_lm.cache, **shape))

    def _keep_chain_step(self, k: int):
        return self._fn(f"keep_chain{k}", functools.partial(keep_and_draft_chain, self.draft, self.cache, k=k))

    def greedy_chain(self, last: DraftStep, k: int) -> torch.Tensor:
        """K greedy drafts [k] from the draft's output at the last committed entry: one compiled step
        on the static engine; the drafted entries are scratch past the committed ones."""
        if not self._padded():
            committed = self.cache.length
            return greedy_chain(self.draft, functools.partial(_eager_chain_step, self, committed),
                                last.logits[0, -1:], last.hidden[0, -1:], k)
        self.cache.check_room(k)
        chain = self._fn(f"chain{k}", functools.partial(chain_in_place, self.draft, self.cache, k=k))
        return chain(last.logits[0, -1:], last.hidden[0, -1:], self.meta)

    @torch.inference_mode()
    def warmup(self, levels=(), tree: dict | None = None, chain: int = 0, target_lm=None) -> float:
        """Compile and capture the steps a decoder will run (`timed_warmup`), so no timed step
        compiles: the feed, drafting steps of these (n new, m tree entries) shapes (a chain's is
        (1, 1)) and the dynamic tree of `tree` (depth, topk, nodes); `chain`: the K of greedy
        chains; with `target_lm` (static) the steps after a verification that grow the next tree
        (`keep_tree`), or draft the next chain (`keep_chain`). Counts no forward; leaves the cache
        empty."""
        if not self.compile:
            return 0.0
        H, dtype, width = self.draft.config.hidden_size, self.draft.fc.weight.dtype, self.feed_width
        zeros = functools.partial(torch.zeros, device=self.device)

        def every_step():
            self.cache.length = 1
            last = self._feed(zeros(width, 3 * H, dtype=dtype), [0] * width, 1) if width else None
            for n, m in levels:
                self.cache.length = 1 + m - n  # a committed entry, then the tree's older nodes
                mask = None if (n, m) == (1, 1) else torch.ones(n, m, dtype=torch.bool, device=self.device)
                self._step(zeros(1, n, H, dtype=dtype), zeros(1, n, dtype=torch.long), zeros(1, n, dtype=torch.long), mask)
            self.cache.length = 1 + width
            if tree and last is not None:
                self.dynamic_tree(last, zeros(1, dtype=torch.long), **tree)
            if chain and last is not None:
                self.greedy_chain(last, chain)
            if target_lm is not None and width:
                features = zeros(width, 3 * H, dtype=target_lm.cache.keys[0].dtype)
                if chain:
                    self._keep_chain_step(chain)(zeros(1 + width, dtype=torch.long), features, self._positions[1])
                if tree:
                    rows = zeros(tree["nodes"], dtype=torch.long)
                    self._keep_tree_step(target_lm, **tree)(rows[:tree["depth"] + 1], rows, features.new_zeros(
                        tree["nodes"], 3 * H), target_lm.at(1))

        return timed_warmup(self, [every_step])


def feed_in_place(draft: Eagle3Draft, cache: Eagle3StaticCache, features: torch.Tensor, meta: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The feed as one fixed-shape step: `features` [1, W, 3H] (padded), `meta` [W + 2]: the W
    tokens that follow, the first entry's slot (its position too) and the real count n. The
    padding rows are written past the n real ones and never read. Returns the output at the n-th."""
    width = features.shape[1]
    tokens, start, n = meta[:width].view(1, width), meta[width], meta[width + 1]
    positions = (start + torch.arange(width, device=meta.device)).view(1, width)
    causal = torch.ones(width, width, dtype=torch.bool, device=meta.device).tril()
    logits, hidden = draft.step_in_place(cache, draft.fc(features.to(draft.fc.weight.dtype)), tokens, positions,
                                         start, causal)
    last = (n - 1).view(1)
    return logits.index_select(1, last), hidden.index_select(1, last)


def keep_path_and_grow_tree(draft: Eagle3Draft, cache: Eagle3StaticCache, target_cache, path: torch.Tensor,
                            argmax: torch.Tensor, features: torch.Tensor, past: torch.Tensor, *, depth: int, topk: int,
                            nodes: int) -> tuple[DynamicTree, torch.Tensor, torch.Tensor]:
    """Everything after a tree verification but the host's read, as one fixed-shape step driven by
    the device verdict: the target's cache keeps the accepted path (`move_entries`), the draft is fed
    the path's features and the tokens after them (the target's argmax along it: the accepted drafts,
    then the bonus), and the next tree is grown below the bonus token. `path` [P] is padded by
    repeating its last node, `past` (0-d) is the target's length before the verification, which the
    draft's committed entries equal. Returns (the next tree, the feed's last logits and hidden)."""
    feed_width = path.shape[0]
    n = (path != path[-1]).sum() + 1
    order = torch.arange(feed_width, device=path.device)
    move_entries(target_cache, past + path, past + order.clamp(max=n - 1))
    tokens = argmax.index_select(0, path)
    meta = torch.cat([tokens, past.view(1), n.view(1)])
    logits, hidden = feed_in_place(draft, cache, features.index_select(0, path)[None], meta)
    root = tokens[-1:]
    tree = tree_in_place(draft, cache, logits[0], hidden[0], root, meta, depth=depth, topk=topk, nodes=nodes)
    return tree, logits, hidden


def keep_and_draft_chain(draft: Eagle3Draft, cache: Eagle3StaticCache, verdict: torch.Tensor, features: torch.Tensor,
                         past: torch.Tensor, *, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Everything after a chain verification but the host's read, as one fixed-shape step driven by
    the device verdict ([n, t_1 .. t_W], `verify.verify_greedy`): the draft is fed the target's
    features of pending and the n accepted drafts with the tokens that follow them (t_1 .. t_n+1),
    at the committed entries `past` (0-d), then drafts the next K greedily. Returns (the drafts,
    the feed's last logits and hidden)."""
    width = features.shape[0]
    meta = torch.cat([verdict[1:1 + width], past.view(1), (verdict[0] + 1).view(1)])
    logits, hidden = feed_in_place(draft, cache, features[None], meta)
    return chain_in_place(draft, cache, logits[0], hidden[0], meta, k=k), logits, hidden


def tree_in_place(draft: Eagle3Draft, cache: Eagle3StaticCache, logits, hidden, root, meta, *, depth: int,
                  topk: int, nodes: int) -> DynamicTree:
    """`grow_dynamic_tree` on the static cache as one fixed-shape step: the levels' entries go
    after the committed ones, whose count the last feed's `meta` holds (start + count)."""
    width = meta.shape[0] - 2
    start = meta[width] + meta[width + 1]

    def level(d, h, tokens, mask):
        positions = (start + d - 1).expand(1, tokens.shape[1])
        return draft.step_in_place(cache, h, tokens, positions, start, mask)

    return grow_dynamic_tree(draft, level, logits, hidden, root, depth=depth, topk=topk, nodes=nodes)


def chain_in_place(draft: Eagle3Draft, cache: Eagle3StaticCache, logits, hidden, meta, *, k: int) -> torch.Tensor:
    """`greedy_chain` on the static cache as one fixed-shape step (entries after the committed
    ones, whose count the last feed's `meta` holds)."""
    width = meta.shape[0] - 2
    start = meta[width] + meta[width + 1]
    one = torch.ones(1, 1, dtype=torch.bool, device=meta.device)

    def step(j, h, token):
        return draft.step_in_place(cache, h, token, (start + j).view(1, 1), start + j, one)

    return greedy_chain(draft, step, logits, hidden, k)


def greedy_chain(draft: Eagle3Draft, step, logits: torch.Tensor, hidden: torch.Tensor, k: int) -> torch.Tensor:
    """K greedy drafts: each the draft's argmax (draft ids ascend with target ids, so it is the
    argmax over the target's vocabulary too), mapped to the target's id and fed back with the
    draft's own hidden state: `step(j, hidden [1, 1, H], token [1, 1])` at position committed + j."""
    tokens = []
    for j in range(k):
        token = draft.to_target_ids(logits.argmax(dim=-1))
        tokens.append(token)
        if j + 1 < k:
            out_logits, out_hidden = step(j, hidden.view(1, 1, -1), token.view(1, 1))
            logits, hidden = out_logits[0], out_hidden[0]
    return torch.cat(tokens)


def _eager_chain_step(cached: CachedEagle3Draft, committed: int, j: int, hidden, token):
    positions = torch.full((1, 1), committed + j, dtype=torch.long, device=token.device)
    return cached.draft.step(cached.cache, hidden, token, positions)


def _eager_level(cached: CachedEagle3Draft, committed: int, d: int, hidden, tokens, mask):
    """One level of the dynamic tree on an eager (growing) cache, at position committed + d - 1."""
    positions = torch.full(tokens.shape, committed + d - 1, dtype=torch.long, device=tokens.device)
    return cached.draft.step(cached.cache, hidden, tokens, positions, tree_mask=mask)


def as_cached_draft(draft) -> CachedEagle3Draft:
    """A decoder's EAGLE-3 draft: a cached draft as given, or a plain draft on the eager engine."""
    return draft if isinstance(draft, CachedEagle3Draft) else CachedEagle3Draft(draft)
