"""EAGLE-3 decoding: a one-layer draft that reads the target's own features.

The target's verification forward also returns its hidden states at the draft's three layers
(`hidden_layers` = the draft's aux layers). The draft's KV cache (`kinds/features.py`'s
`DraftKVCache`, one layer) mirrors the target's: for an engine whose target cache holds the whole
sequence but its last ("pending") token, with c tokens in the sequence, the draft cache holds
step-0 entries for indices 0..c-2 (length c-1), each made from the target's features at p and the
token at p + 1. The cache writes its own entries: each step hands it the new keys and values
(`cache.update`) and attends to what it returns. The draft's steps, as functions of the model:
1. `prefill(draft, cache, features, next_tokens, positions)` after the prompt's prefill (features
   of prompt[:-1], next_tokens = prompt[1:]) and after every verification (first
   `cache.rollback(c-1)` to drop the drafted entries, then the features the target just computed
   for the pending token and the accepted drafts, next_tokens = the accepted drafts and the
   emitted bonus token). The logits at the last index give the first draft token; the hidden
   state there seeds step 1.
2. Chain: `draft_step(draft, cache, hidden, token, positions=pos_last + j)` for j = 1..K-1, feeding
   the draft's own last output hidden state and the token just drafted.
3. Tree (one level at a time): `draft_step(draft, cache, parents' hidden, node tokens, root position
   + depth, tree_mask=...)` where tree_mask[i, :] says which of the tree nodes appended so far
   (this level last) node i may see: its ancestors and itself. The committed prefix is always visible.
4. `step_in_place`: a step on the static cache with every length a tensor, one graph per shape.

The draft, its cache, its compiled steps and its last output live on one `Eagle3Runtime` (a
`FeatureDraftRuntime`): eager, or static and compiled beside a static target. Three fixed-shape
steps on the static engine, each one `CompiledStep` with `compile` (default on CUDA): a chain's
drafting step (one token), the feed of the target's features after a verification (padded to
K + 1 entries; the count a tensor) and EAGLE-2's whole dynamic tree (`grow_dynamic_tree`: every
depth in one graph); after a greedy verification the feed runs in one graph with the next chain
(`keep_and_draft_chain`) or tree (`keep_path_and_grow_tree`). The prompt's features are fed
uncompiled. The proposer and the tree drafter below are views on the runtime.

- Chain (`Eagle3Proposer`, any acceptance rule): K drafts in a row. Sampling, q is the draft's
  distribution over its reduced vocabulary mapped into the target's (tokens outside it have
  q = 0), and the rejection rule (`verify.Sampled`) keeps the output exactly the target's.
- Tree (`Eagle3TreeDrafter`, greedy): a static tree of top-k choices per depth, as Medusa's
  paths, or EAGLE-2's dynamic tree: expand the `topk` most likely nodes of each depth (by the
  draft's cumulative log-probability), then keep the `nodes - 1` most likely of everything drafted.
  A child is never more likely than its parent, so that set is a tree (prefix-closed). One target
  pass verifies it; each depth costs one draft forward over the nodes it expands.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from ...decoding.chain import ChainDecoder
from ...decoding.dynamic_tree import (DYNAMIC_TREE_NODES, DYNAMIC_TREE_TOPK, DynamicTree, candidate_count,
                                      grow_dynamic_forest, grow_dynamic_tree)
from ...decoding.engines import StaticLM, as_cached_lm, device_tensor
from ...decoding.engines.static import move_entries
from ...decoding.timing import timed
from ...decoding.tree import TreeDecoder, TreeDrafter
from ...decoding.verify import Greedy, Sampled
from ...trees import Path, Tree, best_first, check_paths, static_tree, tree_from_parents
from ..features import DraftKVCache, FeatureChainProposer, FeatureDraftRuntime, RuntimeView
from .model import Eagle3Draft, attend


class DraftStep(NamedTuple):
    """The draft's output at n positions: what the next draft is picked from and what the next step reads."""

    logits: torch.Tensor  # [B, n, draft_vocab_size]: map ids with `to_target_ids`
    hidden: torch.Tensor  # [B, n, H]: the layer's output before `norm`, fed to the next step


# --- the draft's steps on a KV cache (functions of the model: decoding is no part of training) ---


def prefill(draft: Eagle3Draft, cache: DraftKVCache, features: torch.Tensor, next_tokens: torch.Tensor,
            positions: torch.Tensor, attention_mask: torch.Tensor | None = None) -> DraftStep:
    """Append step-0 entries for new indices: the target's features there [B, n, 3·H], the
    token that follows each index [B, n], and the indices' positions [B, n]. Each new index
    sees the cache's valid entries and the new ones up to itself (`attention_mask` marks
    left padding of a batch)."""
    return _decode(draft, cache, draft.fc(features.to(draft.fc.weight.dtype)), next_tokens, positions,
                   attention_mask, tree_mask=None)


def draft_step(draft: Eagle3Draft, cache: DraftKVCache, hidden: torch.Tensor, tokens: torch.Tensor,
               positions: torch.Tensor, tree_mask: torch.Tensor | None = None) -> DraftStep:
    """One drafting step from the draft's own hidden states [B, n, H] and the tokens just
    drafted [B, n]. Chain (tree_mask None): like prefill. Tree level: tree_mask, bool [n, m]
    or [B, n, m], says which of the last m cache entries after this append (the tree's nodes
    so far, these n last) each new node sees; everything before them is the committed
    prefix, always visible."""
    return _decode(draft, cache, hidden, tokens, positions, None, tree_mask)


def _new_entries(draft: Eagle3Draft, h_in, tokens, positions):
    """The attention input of new positions, their rotary tables and keys/values."""
    x = draft.midlayer.attention_input(draft.embed(tokens), h_in)
    cos, sin = draft.rope(x, positions)
    return (x, cos, sin, *draft.midlayer.self_attn.keys_values(x, cos, sin))


def _decode(draft: Eagle3Draft, cache: DraftKVCache, h_in, tokens, positions, attention_mask, tree_mask) -> DraftStep:
    layer, attn = draft.midlayer, draft.midlayer.self_attn
    B, n = tokens.shape
    x, cos, sin, k, v = _new_entries(draft, h_in, tokens, positions)
    past = cache.length
    keys, values, valid = cache.update(0, k, v, attention_mask)  # the cache writes its own entries (one layer)
    S, W = past + n, keys.shape[2]  # W > S: a static cache's unwritten tail, never visible
    new = torch.arange(past, S, device=k.device)[:, None]
    key = torch.arange(W, device=k.device)[None, :]
    if tree_mask is None:
        visible = ((key <= new) & valid[:, None, :]) | (key == new)
    else:
        m = tree_mask.shape[-1]
        if not n <= m <= S:
            raise ValueError(f"tree_mask covers {m} entries; it needs the {n} new nodes and at most the {S} cached")
        prefix = valid[:, None, :S - m].expand(B, n, S - m)
        tail = torch.zeros(B, n, W - S, dtype=torch.bool, device=k.device)
        visible = torch.cat([prefix, tree_mask.to(torch.bool).expand(B, n, m), tail], dim=-1)
    h = layer.finish(h_in, attend(attn.queries(x, cos, sin), keys, values, visible))
    return DraftStep(draft.compute_logits(h), h)


def step_in_place(draft: Eagle3Draft, cache: DraftKVCache, hidden: torch.Tensor, tokens: torch.Tensor,
                  positions: torch.Tensor, tree_start: torch.Tensor, tree_mask: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """`draft_step` on a static cache with every length a tensor, so it compiles to one graph per
    (n, m) whatever the cache holds. The n new entries are the last of the m tree entries
    starting at slot `tree_start` (0-d); each sees the valid entries before `tree_start` and
    the tree entries `tree_mask` [n, m] allows. A chain step is a tree of one node: n = m = 1,
    tree_mask [[True]]. Returns (logits, hidden) [B, n, ...]; the caller moves `cache.length`."""
    layer, attn = draft.midlayer, draft.midlayer.self_attn
    n, m = tokens.shape[1], tree_mask.shape[-1]
    x, cos, sin, k, v = _new_entries(draft, hidden, tokens, positions)
    slots = tree_start + (m - n) + torch.arange(n, device=tokens.device)
    keys, values, valid = cache.update(0, k, v, slots=slots)  # in place at `slots`; the length unmoved
    key = torch.arange(keys.shape[2], device=tokens.device)
    rel = key - tree_start
    in_tree = (rel >= 0) & (rel < m)
    tree_part = tree_mask.to(torch.bool)[:, rel.clamp(0, m - 1)] & in_tree  # [n, W]
    visible = ((key < tree_start) & valid)[:, None, :] | tree_part
    h = layer.finish(hidden, attend(attn.queries(x, cos, sin), keys, values, visible))
    return draft.compute_logits(h), h


# --- the static engine's fixed-shape steps (each one compiled graph) -----------------------------


def feed_in_place(draft: Eagle3Draft, cache: DraftKVCache, features: torch.Tensor, meta: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The feed as one fixed-shape step: `features` [1, W, 3H] (padded), `meta` [W + 2]: the W
    tokens that follow, the first entry's slot (its position too) and the real count n. The
    padding rows are written past the n real ones and never read. Returns the output at the n-th."""
    width = features.shape[1]
    tokens, start, n = meta[:width].view(1, width), meta[width], meta[width + 1]
    positions = (start + torch.arange(width, device=meta.device)).view(1, width)
    causal = torch.ones(width, width, dtype=torch.bool, device=meta.device).tril()
    logits, hidden = step_in_place(draft, cache, draft.fc(features.to(draft.fc.weight.dtype)), tokens, positions,
                                   start, causal)
    last = (n - 1).view(1)
    return logits.index_select(1, last), hidden.index_select(1, last)


def keep_path_and_grow_tree(draft: Eagle3Draft, cache: DraftKVCache, target_cache, path: torch.Tensor,
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


def keep_and_draft_chain(draft: Eagle3Draft, cache: DraftKVCache, verdict: torch.Tensor, features: torch.Tensor,
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


def tree_in_place(draft: Eagle3Draft, cache: DraftKVCache, logits, hidden, root, meta, *, depth: int,
                  topk: int, nodes: int) -> DynamicTree:
    """`grow_dynamic_tree` on the static cache as one fixed-shape step: the levels' entries go
    after the committed ones, whose count the last feed's `meta` holds (start + count)."""
    width = meta.shape[0] - 2
    start = meta[width] + meta[width + 1]

    def level(d, h, tokens, mask):
        positions = (start + d - 1).expand(1, tokens.shape[1])
        return step_in_place(draft, cache, h, tokens, positions, start, mask)

    return grow_dynamic_tree(draft, level, logits, hidden, root, depth=depth, topk=topk, nodes=nodes)


def chain_in_place(draft: Eagle3Draft, cache: DraftKVCache, logits, hidden, meta, *, k: int) -> torch.Tensor:
    """`greedy_chain` on the static cache as one fixed-shape step (entries after the committed
    ones, whose count the last feed's `meta` holds)."""
    width = meta.shape[0] - 2
    start = meta[width] + meta[width + 1]
    one = torch.ones(1, 1, dtype=torch.bool, device=meta.device)

    def step(j, h, token):
        return step_in_place(draft, cache, h, token, (start + j).view(1, 1), start + j, one)

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


def _eager_chain_step(draft: Eagle3Draft, cache: DraftKVCache, committed: int, j: int, hidden, token):
    positions = torch.full((1, 1), committed + j, dtype=torch.long, device=token.device)
    return draft_step(draft, cache, hidden, token, positions)


def _eager_level(draft: Eagle3Draft, cache: DraftKVCache, committed: int, d: int, hidden, tokens, mask):
    """One level of the dynamic tree on an eager (growing) cache, at position committed + d - 1."""
    positions = torch.full(tokens.shape, committed + d - 1, dtype=torch.long, device=tokens.device)
    return draft_step(draft, cache, hidden, tokens, positions, tree_mask=mask)


# --- the run time: the draft on its engine ------------------------------------------------------


class Eagle3Runtime(FeatureDraftRuntime):
    """An EAGLE-3 draft bound to its own one-layer KV cache on an engine (`FeatureDraftRuntime`):
    the one object the EAGLE-3 proposer and tree drafter are views on. `last` is a `DraftStep`.
    Its steps beyond the feed: `step` (a chain's or a static tree's drafting step), `greedy_chain`,
    `dynamic_tree` and, on the static engine, `keep_chain` and `keep_tree` (a verification's feed
    in one graph with the next drafts)."""

    def __init__(self, draft: Eagle3Draft, engine: str = "eager", *, capacity: int | None = None,
                 compile: bool | None = None, feed_width: int = 0):
        """`capacity`, `compile`, `feed_width`: `FeatureDraftRuntime`'s."""
        c = draft.config
        super().__init__(draft, engine, kv_heads=c.num_key_value_heads, head_dim=c.head_dim,
                         dtype=draft.fc.weight.dtype, capacity=capacity, compile=compile, feed_width=feed_width)
        self._one = torch.ones(1, 1, dtype=torch.bool, device=self.device)

    @property
    def hidden_layers(self) -> tuple[int, ...]:
        """The target layers whose features the draft reads: its aux layers."""
        return tuple(self.draft.config.aux_layer_ids)

    def feed_as_written(self, features: torch.Tensor, next_tokens: list[int], start: int) -> DraftStep:
        """`prefill` of n entries; the output at the last one."""
        n = len(next_tokens)
        tokens = device_tensor(next_tokens, self.device).view(1, n)
        out = prefill(self.draft, self.cache, features.view(1, n, -1), tokens,
                      torch.arange(start, start + n, device=self.device).view(1, n))
        return DraftStep(out.logits[:, -1:], out.hidden[:, -1:])

    def feed_padded(self, features: torch.Tensor, meta: torch.Tensor) -> DraftStep:
        """`feed_in_place`, compiled."""
        return DraftStep(*self._fn("feed", functools.partial(feed_in_place, self.draft, self.cache))(features, meta))

    def step(self, hidden: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
             tree_mask: torch.Tensor | None = None) -> DraftStep:
        """`draft_step` on this engine's cache (tree_mask [n, m], or None for a chain)."""
        self.forwards += 1
        with torch.inference_mode():
            return self._step(hidden, tokens, positions, tree_mask)

    def _step(self, hidden: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
              tree_mask: torch.Tensor | None = None) -> DraftStep:
        n = tokens.shape[1]
        if self.engine == "eager" or (tree_mask is None and n != 1):
            return draft_step(self.draft, self.cache, hidden, tokens, positions, tree_mask=tree_mask)
        mask = self._one if tree_mask is None else tree_mask.to(torch.bool)
        m = mask.shape[-1]
        cache = self.cache
        cache.check_room(n)
        if not n <= m <= cache.length + n:
            raise ValueError(f"tree_mask covers {m} entries; it needs the {n} new nodes and at most the "
                             f"{cache.length + n} cached")
        tree_start = device_tensor(cache.length + n - m, self.device)  # 0-d, without a host sync
        step = self._fn("step", functools.partial(step_in_place, self.draft, cache))
        logits, hidden = step(hidden, tokens, positions, tree_start, mask)
        cache.length += n
        return DraftStep(logits, hidden)

    def dynamic_tree(self, last: DraftStep, root: torch.Tensor, *, depth: int, topk: int, nodes: int) -> DynamicTree:
        """EAGLE-2's tree from the draft's output at the last committed entry (`last`) below the
        pending token `root` [1] (`grow_dynamic_tree`). The drafted levels are scratch entries
        past the committed ones: the next feed overwrites them (static) or a rollback drops them."""
        shape = dict(depth=depth, topk=topk, nodes=nodes)
        if not self.padded:
            level = functools.partial(_eager_level, self.draft, self.cache, self.cache.length)
            return grow_dynamic_tree(self.draft, level, last.logits[0, -1:], last.hidden[0, -1:], root, **shape)
        self.cache.check_room((depth - 1) * topk)
        grow = self._fn(f"tree{depth},{topk},{nodes}",
                        functools.partial(tree_in_place, self.draft, self.cache, **shape))
        return grow(last.logits[0, -1:], last.hidden[0, -1:], root.view(1), self.meta)

    def dynamic_forest(self, last: DraftStep, root: torch.Tensor, *, depth: int, topks: tuple[int, ...],
                       nodes: int) -> list[DynamicTree]:
        """`dynamic_tree` for each top-k of `topks` in one forward a level (`grow_dynamic_forest`): a
        planner's recording, on the eager engine (its levels are scratch entries a rollback drops)."""
        if self.padded:
            raise ValueError("a forest of dynamic trees is grown on the eager engine only")
        level = functools.partial(_eager_level, self.draft, self.cache, self.cache.length)
        return grow_dynamic_forest(self.draft, level, last.logits[0, -1:], last.hidden[0, -1:], root, depth=depth,
                                   topks=topks, nodes=nodes)

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
        drafts, logits, last_hidden = self._keep_chain_step(k)(verdict, hidden, self.at(self.committed))
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
        if not self.padded:
            step = functools.partial(_eager_chain_step, self.draft, self.cache, self.cache.length)
            return greedy_chain(self.draft, step, last.logits[0, -1:], last.hidden[0, -1:], k)
        self.cache.check_room(k)
        chain = self._fn(f"chain{k}", functools.partial(chain_in_place, self.draft, self.cache, k=k))
        return chain(last.logits[0, -1:], last.hidden[0, -1:], self.meta)

    def warmup(self, levels=(), tree: dict | None = None, chain: int = 0, target_lm=None) -> float:
        """Compile and capture the steps a decoder will run (`_warm`), so no timed step compiles:
        the feed, drafting steps of these (n new, m tree entries) shapes (a chain's is (1, 1)) and
        the dynamic tree of `tree` (depth, topk, nodes); `chain`: the K of greedy chains; with
        `target_lm` (static) the steps after a verification that grow the next tree (`keep_tree`),
        or draft the next chain (`keep_chain`). Counts no forward; leaves the cache empty."""
        return self._warm(functools.partial(self._every_step, levels, tree, chain, target_lm))

    def _every_step(self, levels, tree: dict | None, chain: int, target_lm) -> None:
        """One call of each step `warmup` names, on zeros, after one committed entry."""
        H, dtype, width = self.draft.config.hidden_size, self.draft.fc.weight.dtype, self.feed_width
        zeros = functools.partial(torch.zeros, device=self.device)
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
            self._every_keep_step(tree, chain, target_lm)

    def _every_keep_step(self, tree: dict | None, chain: int, target_lm) -> None:
        """One call of each step after a verification `warmup` names, on zeros."""
        H, width = self.draft.config.hidden_size, self.feed_width
        zeros = functools.partial(torch.zeros, device=self.device)
        features = zeros(width, 3 * H, dtype=target_lm.cache.keys[0].dtype)
        if chain:
            self._keep_chain_step(chain)(zeros(1 + width, dtype=torch.long), features, self.at(1))
        if tree:
            rows = zeros(tree["nodes"], dtype=torch.long)
            self._keep_tree_step(target_lm, **tree)(rows[:tree["depth"] + 1], rows, features.new_zeros(
                tree["nodes"], 3 * H), target_lm.at(1))


# --- the decoders' views on the run time -------------------------------------------------------


class Eagle3Proposer(FeatureChainProposer):
    """A chain of K drafts: greedy, or (`rule` a `verify.Sampled`) each picked by the rule from the
    draft's distribution (`rule.pick`: a draw at the rule's temperature and top-p)."""

    name = "eagle3"
    runtime: Eagle3Runtime

    def __init__(self, runtime: Eagle3Runtime, rule: Greedy | Sampled | None = None, max_k: int = 1,
                 target_lm=None):
        """`runtime`: the draft on its engine; `rule`: the decoder's acceptance rule (None: greedy);
        `max_k`: the K of the decoder; `target_lm`: a static target, whose steps after a verification
        are warmed up with it."""
        super().__init__(runtime, rule, max_k)
        self.target_lm = target_lm

    def first_drafts(self, prompt: list[int]) -> torch.Tensor:
        return self._greedy_chain()

    def _greedy_chain(self) -> torch.Tensor:
        """K drafts in one go (one compiled step on the static engine)."""
        self.runtime.forwards += self.max_k - 1  # the draft layer ran for every draft after the first
        return self.runtime.greedy_chain(self.runtime.last, self.max_k)

    @property
    def fused(self) -> bool:
        """Greedy on the static engine: `keep` feeds and drafts the next chain in one graph."""
        return self.rule.greedy and self.runtime.padded

    def keep_and_draft(self, verdict, hidden, kept):
        return self.runtime.keep_chain(verdict, hidden, kept, self.max_k)

    def draft(self, k, sequence):
        if self.rule.greedy:  # K drafts, cut to k
            return self._greedy_chain()[:k], None
        runtime = self.runtime
        logits, hidden = runtime.last.logits[:, -1:], runtime.last.hidden[:, -1:]
        tokens, dists = [], []
        for j in range(k):
            token, q = self.rule.pick(runtime.draft.to_target_logits(logits[0, -1]))
            token = token.view(1)
            dists.append(q)
            tokens.append(token)
            if j + 1 < k:  # the draft at position committed + j reads its own last output
                position = torch.full((1, 1), runtime.committed + j, dtype=torch.long, device=self.device)
                out = runtime.step(hidden, token.view(1, 1), position)
                logits, hidden = out.logits, out.hidden
        return torch.cat(tokens), torch.stack(dists)

    def warmup(self) -> float:
        if self.rule.greedy:
            return self.runtime.warmup(chain=self.max_k, target_lm=self.target_lm)
        return self.runtime.warmup(levels=[(1, 1)])  # every sampled drafting step is one token


class Eagle3TreeDrafter(RuntimeView, TreeDrafter):
    """Greedy tree drafting: `paths` (a static tree, Medusa-style top-k choices per depth) or,
    with `paths=None`, EAGLE-2's dynamic tree of `nodes` nodes (root included), `depth` deep (at
    most nodes - 1), expanding the `topk` most likely nodes of each depth, grown on the device
    (`decoding/dynamic_tree.py`)."""

    name = "eagle3"

    def __init__(self, runtime: Eagle3Runtime, device, *, paths: list[Path] | None = None, depth: int = 4,
                 topk: int = DYNAMIC_TREE_TOPK, nodes: int = DYNAMIC_TREE_NODES, target_lm=None):
        """`runtime`: the draft on its engine; `target_lm`: a static target, whose cache the step after a
        verification compacts (warmed up with it)."""
        self.runtime = runtime
        self.target_lm = target_lm
        self.hidden_layers = self.runtime.hidden_layers
        self.device = torch.device(device)
        if paths is not None:
            self.buffers = static_tree(check_paths(paths))
            self.rank = {p: i for i, p in enumerate(best_first(paths))}  # path -> its place, best first
            self.max_depth, self.max_nodes, self.topk = self.buffers.max_depth, self.buffers.num_nodes, self.buffers.topk
            self.paths = list(self.buffers.paths)
        else:
            vocab = self.runtime.draft.config.draft_vocab_size
            if depth < 1 or not 1 <= topk <= vocab or nodes < 2:
                raise ValueError(f"a dynamic tree needs depth >= 1, 1 <= topk <= the draft's vocabulary ({vocab}) "
                                 f"and nodes >= 2, got {depth}, {topk}, {nodes}")
            self.buffers = None
            # `nodes` nodes reach at most nodes - 1 deep: deeper levels would be drafted and never kept
            self.max_depth, self.topk = min(depth, nodes - 1), topk
            self.max_nodes = min(nodes, candidate_count(self.max_depth, topk))
        self._ranked = None  # the last draft's candidates, for `candidates`
        self._beside: tuple[int, ...] = ()  # top-ks grown beside each tree (`grow_beside`)
        self._grown_beside: dict[int, DynamicTree] = {}
        self._next: DynamicTree | None = None  # the next step's tree, grown by `keep` (or `reset`)
        self._skipped = False  # the last draft was asked for no depth: its commit defers the feed
        self._root_only = tree_from_parents([-1], self.device)  # built once: no copy in a step

    def first_drafts(self, prompt: list[int]) -> DynamicTree:
        return self._grow(device_tensor(prompt[-1:], self.device))

    def commit(self, nodes, accepted, bonus, hidden=None):
        """Feeds the accepted path, or, after a step it was not asked to draft (depth 0: a hybrid's
        lookup drafted it alone, `HybridDrafter.lookup_first`), keeps it for the feed before its next
        tree; a tree grown ahead (`reset`'s) is below a root now passed."""
        self.runtime.commit(hidden, list(accepted) + [bonus], defer=self._skipped)
        self._next = None

    @property
    def fused(self) -> bool:
        """A dynamic tree on the static engine: `keep` runs in one graph with the next tree."""
        return self.buffers is None and self.runtime.padded

    def keep(self, target, verified):
        """On the static engine (dynamic trees), the target's compaction, the draft's feed and
        the next tree are one compiled call driven by the device verdict; else the default."""
        if not (self.fused and isinstance(target, StaticLM) and verified.argmax.shape[0] == self.max_nodes):
            return super().keep(target, verified)  # a root-only step, where the token budget ends
        self._next = self.runtime.keep_tree(target, verified.path, verified.argmax, verified.hidden, verified.past,
                                           verified.past + len(verified.nodes), depth=self.max_depth,
                                           topk=self.topk, nodes=self.max_nodes)

    def level_shapes(self) -> list[tuple[int, int]]:
        """(nodes expanded, tree entries so far) of each drafting forward of a static tree's
        full-depth pass: the shapes the static engine compiles."""
        depths, parents = self.buffers.depths.tolist(), self.buffers.parent.tolist()
        shapes, expanded = [], 0
        for d in range(1, self.max_depth):
            n = len({parents[c] for c in range(1, len(depths)) if depths[c] == d + 1})
            if n:
                expanded += n
                shapes.append((n, expanded))
        return shapes

    def warmup(self) -> float:
        if self.buffers is not None:  # a static tree's levels run as draft steps of these shapes
            return self.runtime.warmup(levels=self.level_shapes())
        return self.runtime.warmup(tree=dict(depth=self.max_depth, topk=self.topk, nodes=self.max_nodes),
                                  target_lm=self.target_lm)

    def draft(self, root, depth):
        depth = min(depth, self.max_depth)
        self._skipped = depth == 0
        if depth:
            self.runtime.flush()
        last = self.runtime.last
        self._ranked = ([], [], [], [])  # nothing drafted, until a tree is
        if last is None or depth == 0:
            self._grown_beside = {}
            return root.reshape(1), self._root_only
        if self.buffers is not None:
            return self._static(root, depth)
        return self._dynamic(root)

    def _grow(self, root) -> DynamicTree:
        self.runtime.forwards += self.max_depth - 1
        if not self._beside:
            return self.runtime.dynamic_tree(self.runtime.last, root, depth=self.max_depth, topk=self.topk,
                                             nodes=self.max_nodes)
        grown, *beside = self.runtime.dynamic_forest(self.runtime.last, root, depth=self.max_depth,
                                                     topks=(self.topk, *self._beside), nodes=self.max_nodes)
        self._grown_beside = dict(zip(self._beside, beside))
        return grown

    def grow_beside(self, topks):
        """A dynamic tree on the eager engine grows other top-ks' trees in its own forwards
        (`Eagle3Runtime.dynamic_forest`)."""
        if self.buffers is not None or self.runtime.padded:
            return False
        self._beside = tuple(k for k in topks if k != self.topk)
        return True

    def candidates_beside(self):
        return {k: listed_candidates(tree) for k, tree in self._grown_beside.items()}

    def _dynamic(self, root):
        """EAGLE-2's tree, always grown `max_depth` deep (one shape, one graph): a step that may go
        less deep is cut by the verdict (`greedy_tree_verdict(depth=...)`). Where the last step's
        `keep` grew it already, below the same root (its bonus token), it is taken as it is."""
        grown, self._next = (self._next, None) if self._next is not None else (self._grow(root), None)
        self._ranked = grown
        return grown.tokens, Tree(parent=grown.parent, depths=grown.depths, attention_mask=grown.mask,
                                  max_depth=self.max_depth)

    def candidates(self):
        """Every node drafted, best first: EAGLE-2's rank (cumulative log-probability; a smaller
        budget keeps the first ones), or a static tree's node order. Reads them on the host: for
        planning runs only."""
        if self._ranked is None:
            return None
        if isinstance(self._ranked, DynamicTree):
            return listed_candidates(self._ranked)
        ranked, tokens, parents, depths = self._ranked
        tokens = torch.stack([tokens[n] for n in ranked]).tolist() if ranked else []
        return ranked_lists(ranked, dict(zip(ranked, tokens)), parents, depths)

    def _expand(self, level: list[int], tokens: list[torch.Tensor], parents: list[int], expanded: list[int],
                outputs: dict[int, DraftStep], hidden_of: dict[int, torch.Tensor], depth_of_level: int) -> None:
        """One draft forward over the nodes of `level` (their tokens known): each reads its
        parent's output hidden state and sees the committed prefix, its expanded ancestors and
        itself. Fills outputs[node] with its logits and hidden state."""
        n = len(level)
        expanded.extend(level)
        slot = {node: i for i, node in enumerate(expanded)}
        mask = torch.zeros(n, len(expanded), dtype=torch.bool)
        for row, node in enumerate(level):
            a = node
            while a > 0:
                mask[row, slot[a]] = True
                a = parents[a]
        step = self.runtime.step(
            torch.cat([hidden_of[parents[node]] for node in level], dim=1),
            torch.stack([tokens[node] for node in level]).view(1, n),
            torch.full((1, n), self.runtime.committed + depth_of_level - 1, dtype=torch.long, device=self.device),
            tree_mask=mask.to(self.device))
        for row, node in enumerate(level):
            outputs[node] = DraftStep(step.logits[:, row:row + 1], step.hidden[:, row:row + 1])
            hidden_of[node] = step.hidden[:, row:row + 1]

    def _static(self, root, depth):
        """The static tree cut to `depth`: depth d's nodes take the top-k ranks of their parent's output."""
        buffers = self.buffers
        keep = [0] + [n for n in range(1, buffers.num_nodes) if int(buffers.depths[n]) <= depth]
        parents = [int(p) for p in buffers.parent.tolist()]
        ranks = buffers.topk_index.tolist()
        depths = buffers.depths.tolist()
        tokens: list[torch.Tensor] = [root.reshape(())]
        outputs = {0: self.runtime.last}
        hidden_of = {0: self.runtime.last.hidden[:, -1:]}
        expanded: list[int] = []
        topk_of: dict[int, torch.Tensor] = {}
        for d in range(1, depth + 1):
            level = [n for n in keep if depths[n] == d]
            for node in level:
                parent = parents[node]
                if parent not in topk_of:
                    logits = self.runtime.draft.to_target_logits(outputs[parent].logits[0, -1])
                    topk_of[parent] = logits.topk(self.topk).indices
                tokens.append(topk_of[parent][ranks[node]])
            has_children = {parents[n] for n in keep if depths[n] == d + 1}
            to_expand = [n for n in level if n in has_children]
            if to_expand:
                self._expand(to_expand, tokens, parents, expanded, outputs, hidden_of, d)
        index = {node: i for i, node in enumerate(keep)}
        tree = tree_from_parents([-1] + [index[parents[n]] for n in keep[1:]], self.device)
        ranked = sorted(range(1, len(keep)), key=lambda i: self.rank[buffers.paths[keep[i] - 1]])
        self._ranked = (ranked, tokens, tree.parents, [depths[n] for n in keep])
        return torch.stack(tokens), tree


def listed_candidates(tree: DynamicTree) -> tuple[list[int], list[int], list[int]]:
    """A dynamic tree's candidates as `TreeDrafter.candidates` lists them (read on the host)."""
    ranked, tokens, parents, depths = (t.tolist() for t in tree[4:])
    return ranked_lists(ranked, tokens, parents, depths)


def ranked_lists(ranked, tokens, parents, depths) -> tuple[list[int], list[int], list[int]]:
    """(tokens, parents, depths) of the candidates `ranked` best first, parents by their rank (-1: the root)."""
    rank = {n: i for i, n in enumerate(ranked)}
    return [tokens[n] for n in ranked], [rank.get(parents[n], -1) for n in ranked], [depths[n] for n in ranked]


def eagle3_decoder(target, runtime: Eagle3Runtime, *, num_draft_tokens: int, tree: str | list[Path] = "chain",
                   tree_nodes: int = DYNAMIC_TREE_NODES, tree_topk: int = DYNAMIC_TREE_TOPK,
                   rule: Greedy | Sampled | None = None, eos_token_ids: set[int] = frozenset(),
                   record_margins: bool = False):
    """The decoder of an EAGLE-3 draft on its engine (`runtime`: `eagle3_runtime` binds one beside
    the target). `tree`: "chain" (K drafts in a row; the only choice when sampling), "dynamic"
    (EAGLE-2, `tree_nodes` nodes, K deep, expanding `tree_topk` nodes per depth), or a static tree
    as Medusa paths. `rule`: the acceptance rule (`verify.Greedy`, the default, or
    `verify.Sampled`: a sampled chain). `target`: a cached LM or an HF model."""
    lm = as_cached_lm(target)
    rule = rule or Greedy()
    static = lm if isinstance(lm, StaticLM) else None
    if not rule.greedy or tree == "chain":
        proposer = Eagle3Proposer(runtime, rule, max_k=num_draft_tokens, target_lm=static)
        return ChainDecoder(lm, proposer, num_draft_tokens=num_draft_tokens, rule=rule, eos_token_ids=eos_token_ids,
                            record_margins=record_margins)
    if tree == "dynamic":
        drafter = Eagle3TreeDrafter(runtime, lm.device, depth=num_draft_tokens, topk=tree_topk, nodes=tree_nodes,
                                    target_lm=static)
    else:
        drafter = Eagle3TreeDrafter(runtime, lm.device, paths=[p for p in tree if len(p) <= num_draft_tokens])
    return TreeDecoder(lm, drafter, rule=rule, eos_token_ids=eos_token_ids, record_margins=record_margins)


def eagle3_runtime(target_lm, draft: Eagle3Draft, *, num_draft_tokens: int, tree_nodes: int = 0, tree_topk: int = 0,
                   compile: bool | None = None) -> Eagle3Runtime:
    """The draft on the target's engine: static beside a static target (compiled with it), with
    room for the target's cache plus the most entries one drafting pass adds (a bound for any
    tree); eager beside any other target (a cached LM or an HF model)."""
    if not isinstance(target_lm, StaticLM):
        return Eagle3Runtime(draft)
    extra = num_draft_tokens + 1 + max(tree_nodes, 0) + num_draft_tokens * max(tree_topk, 0)
    return Eagle3Runtime(draft, "static", capacity=target_lm.max_length + extra, feed_width=num_draft_tokens + 1,
                         compile=target_lm.compile if compile is None else compile)


def eagle3_step_seconds(runtime: Eagle3Runtime, target_lm, prompt: list[int], repeats: int = 10) -> float:
    """Median time of one EAGLE-3 chain drafting step (one token through the draft layer and its
    head, on the draft's engine), after feeding the prompt's target features: the draft's share
    of a chain step."""
    runtime.warmup([(1, 1)])
    target_lm.reset()
    hidden = target_lm.prefill(device_tensor(prompt[:-1], target_lm.device), hidden_layers=runtime.hidden_layers)
    runtime.reset(prompt, hidden)
    token = device_tensor(prompt[-1:], target_lm.device).view(1, 1)
    position = torch.full((1, 1), runtime.length, dtype=torch.long, device=target_lm.device)

    def step():
        out = runtime.step(runtime.last.hidden[:, -1:], token, position)
        runtime.draft.to_target_logits(out.logits[0, -1]).argmax()

    return timed(step, repeats, target_lm.device, after=lambda: runtime.rollback(runtime.length - 1))
