"""DFlash decoding: K drafts from ONE draft forward over a block of the pending token and K masks.

The draft's cache holds, per draft layer, the context's keys and values: one entry per cached target
position, made from the target's features there (`write_context`; the feed of `FeatureDraftRuntime`,
after the prompt's prefill and after every verification). A step's block is the pending token at
position p (the count of committed entries) and K mask slots at p+1 .. p+K; every slot attends to the
whole context and to the block (non-causal), and mask slot j's argmax is the draft for position p + j
(`block_logits`). The block's own keys and values are never cached: they are concatenated inside the
step, so nothing drafted needs rolling back. K + 1 query slots, as vLLM's DFlash proposer runs them
(the block trained may be longer; a shorter one is what the served draft sees too).

- Greedy: the argmax of each slot, mapped to the target's ids. On the static engine with a feed of
  K + 1 entries, the feed of a verification's kept positions and the next block are one graph driven
  by the device verdict (`keep_and_draft_block`, through `DFlashProposer.keep`).
- Sampled: each slot's token drawn by the acceptance rule from its distribution (`rule.pick`), q per
  slot; the slots do not read each other's draws, so each q is the distribution its token came from,
  which is all the rejection rule (`verify.Sampled`) needs to keep the output the target's.
"""

from __future__ import annotations

import functools

import torch

from ...decoding.engines import device_tensor
from ..features import DraftKVCache, FeatureChainProposer, FeatureDraftRuntime
from .model import DFlashDraft, block_visible


def write_context(draft: DFlashDraft, cache: DraftKVCache, features: torch.Tensor, positions: torch.Tensor,
                  slots: torch.Tensor | None = None) -> None:
    """Every draft layer's context keys and values of `features` [1, n, F] at `positions` [1, n]
    (appended; or written at `slots`, a compiled step's write)."""
    context = draft.context(features)
    cos, sin = draft.rope(context, positions)
    for i, layer in enumerate(draft.layers):
        keys, values = layer.context_kv(context, cos, sin)
        cache.update(i, keys, values, slots=slots)


def context_in_place(draft: DFlashDraft, cache: DraftKVCache, features: torch.Tensor, meta: torch.Tensor) -> None:
    """The feed as one fixed-shape step: `features` [1, W, F] (padded), `meta` [W + 2] (the tokens that
    follow, unused here; the first slot; the real count). The padding rows land past the real ones and
    are never read (every mask stops at the committed count)."""
    width = features.shape[1]
    slots = meta[width] + torch.arange(width, device=meta.device)
    write_context(draft, cache, features, slots.view(1, width), slots=slots)


def block_logits(draft: DFlashDraft, cache: DraftKVCache, pending: torch.Tensor, committed, k: int) -> torch.Tensor:
    """Draft-vocabulary logits [k, Vd] of the k mask slots after `pending` [1] (at position `committed`,
    an int or a 0-d tensor), attending to the cache's first `committed` entries and to the block."""
    n = k + 1
    x = draft.embed_block(pending.view(1, 1), n)
    positions = (committed + torch.arange(n, device=x.device)).view(1, n)
    room = cache.keys[0].shape[2]
    context = cache.valid & (torch.arange(room, device=x.device) < committed)
    visible = block_visible(context[:, None, :], 1, n, draft.config.causal)
    return draft.logits(draft.blocks(x, positions, cache.keys, cache.values, visible)[0, 1:])


def block_in_place(draft: DFlashDraft, cache: DraftKVCache, pending: torch.Tensor, meta: torch.Tensor, *,
                   k: int) -> torch.Tensor:
    """`block_logits` as one fixed-shape step: the committed count is the last feed's start + count."""
    width = meta.shape[0] - 2
    return block_logits(draft, cache, pending, meta[width] + meta[width + 1], k)


def keep_and_draft_block(draft: DFlashDraft, cache: DraftKVCache, verdict: torch.Tensor, features: torch.Tensor,
                         past: torch.Tensor, *, k: int) -> torch.Tensor:
    """Everything after a greedy chain verification but the host's read, as one fixed-shape step driven
    by the device verdict ([n, t_1 .. t_W], `verify.verify_greedy`): the context of pending and the n
    accepted drafts is written at the committed entries `past` (0-d), and the next block drafts after
    the bonus token t_{n+1}. Returns the K greedy drafts in the target's ids."""
    width = features.shape[0]
    meta = torch.cat([verdict[1:1 + width], past.view(1), (verdict[0] + 1).view(1)])
    context_in_place(draft, cache, features[None], meta)
    pending = verdict.index_select(0, (verdict[0] + 1).view(1))
    return draft.to_target_ids(block_in_place(draft, cache, pending, meta, k=k).argmax(dim=-1))


class DFlashRuntime(FeatureDraftRuntime):
    """A DFlash draft bound to its context cache on an engine: the feed writes context entries (the
    draft's feed has no output of its own), `block` drafts, `keep_and_draft` fuses both after a
    greedy verification on the static engine."""

    def __init__(self, draft: DFlashDraft, engine: str = "eager", *, capacity: int | None = None,
                 compile: bool | None = None, feed_width: int = 0):
        c = draft.config
        super().__init__(draft, engine, kv_heads=c.num_key_value_heads, head_dim=c.head_dim,
                         dtype=draft.fc.weight.dtype, layers=c.num_hidden_layers, capacity=capacity, compile=compile,
                         feed_width=feed_width)

    @property
    def hidden_layers(self) -> tuple[int, ...]:
        return self.draft.config.hidden_layers

    def feed_as_written(self, features: torch.Tensor, next_tokens: list[int], start: int) -> None:
        n = features.shape[0]
        positions = torch.arange(start, start + n, device=self.device).view(1, n)
        write_context(self.draft, self.cache, features.view(1, n, -1), positions)

    def feed_padded(self, features: torch.Tensor, meta: torch.Tensor) -> None:
        self._fn("feed", functools.partial(context_in_place, self.draft, self.cache))(features, meta)

    @torch.inference_mode()
    def block(self, pending: torch.Tensor, k: int) -> torch.Tensor:
        """The k mask slots' draft-vocabulary logits [k, Vd] after `pending` [1]: one draft forward."""
        self.forwards += 1
        return self._block(pending, k)

    def _block(self, pending: torch.Tensor, k: int) -> torch.Tensor:
        if not self.padded:
            return block_logits(self.draft, self.cache, pending, self.cache.length, k)
        step = self._fn(f"block{k}", functools.partial(block_in_place, self.draft, self.cache, k=k))
        return step(pending, self.meta)

    @torch.inference_mode()
    def keep_and_draft(self, verdict: torch.Tensor, hidden: torch.Tensor, kept: int, k: int) -> torch.Tensor:
        """The static engine's step after a greedy verification (`keep_and_draft_block`): one call feeds
        the kept positions and drafts the next K. `kept`: the target's cached length now."""
        self.cache.check_room(self.feed_width)
        drafts = self._keep_step(k)(verdict, hidden, self.at(self.committed))
        self.forwards += 2  # the feed and the block
        self.cache.length = self.committed = kept
        return drafts

    def _keep_step(self, k: int):
        return self._fn(f"keep{k}", functools.partial(keep_and_draft_block, self.draft, self.cache, k=k))

    def warmup(self, k: int, fused: bool = False) -> float:
        """Compile the feed, the block of `k` and (`fused`) the step after a verification, so no timed
        step compiles. Counts no forward; leaves the cache empty."""
        width, F = self.feed_width, self.draft.fc.in_features
        zeros = functools.partial(torch.zeros, device=self.device)

        def every_step():
            self.cache.length = 1
            if width:
                self._feed(zeros(width, F, dtype=self.draft.fc.weight.dtype), [0] * width, 1)
            self.cache.length = 1 + width
            self._block(zeros(1, dtype=torch.long), k)
            if fused and width:
                self._keep_step(k)(zeros(1 + width, dtype=torch.long), zeros(width, F, dtype=self.draft.fc.weight.dtype),
                                   self.at(1))

        return self._warm(every_step)


class DFlashProposer(FeatureChainProposer):
    """A chain of K drafts from one block forward: greedy, or (`rule` a `verify.Sampled`) each slot's
    token picked by the rule from its distribution (`rule.pick`)."""

    name = "dflash"
    runtime: DFlashRuntime

    @property
    def fused(self) -> bool:
        """Greedy on the static engine: `keep` feeds and drafts the next block in one graph."""
        return self.rule.greedy and self.runtime.padded

    def first_drafts(self, prompt: list[int]) -> torch.Tensor:
        return self._greedy_block(prompt[-1])

    def _greedy_block(self, pending: int) -> torch.Tensor:
        """K greedy drafts after `pending` in the target's ids: one block forward."""
        logits = self.runtime.block(device_tensor([pending], self.device), self.max_k)
        return self.runtime.draft.to_target_ids(logits.argmax(dim=-1))

    def keep_and_draft(self, verdict, hidden, kept):
        return self.runtime.keep_and_draft(verdict, hidden, kept, self.max_k)

    def draft(self, k, sequence):
        if self.rule.greedy:
            return self._greedy_block(sequence[-1])[:k], None
        logits = self.runtime.block(device_tensor([sequence[-1]], self.device), self.max_k)[:k]
        return self.rule.pick(self.runtime.draft.to_target_logits(logits))

    def warmup(self) -> float:
        return self.runtime.warmup(self.max_k, fused=self.fused)


__all__ = ["DFlashProposer", "DFlashRuntime", "block_logits", "keep_and_draft_block", "write_context"]
