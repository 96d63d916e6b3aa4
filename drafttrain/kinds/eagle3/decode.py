"""EAGLE-3 decoding: a one-layer draft that reads the target's own features.

The target's verification forward also returns its hidden states at the draft's three layers
(`hidden_layers` = the draft's aux layers). The draft's KV cache mirrors the target's: it holds
one entry per cached target position p, made from the target's features at p and the token at
p + 1 (`Eagle3Draft.prefill`). Its output at the last cached position predicts the token after
`pending`, which is the first draft; the next drafts feed the draft's own output hidden state
back with the token just drafted (`Eagle3Draft.step`). After a verification the drafted entries
are dropped (`rollback`) and the target's features of the kept positions are fed instead. The
draft, its cache, its steps and its last output live on one `CachedEagle3Draft`
(`cache.py`): eager, or static and compiled beside a static target; the proposer and the
tree drafter below hold it directly.

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

import torch

from ...decoding.chain import ChainDecoder, Proposer
from ...decoding.dynamic_tree import DYNAMIC_TREE_NODES, DYNAMIC_TREE_TOPK, DynamicTree, candidate_count
from ...decoding.engines import StaticLM, as_cached_lm, device_tensor
from ...decoding.timing import timed
from ...decoding.tree import TreeDecoder, TreeDrafter
from ...decoding.verify import Greedy, Sampled
from ...trees import Path, Tree, best_first, check_paths, static_tree, tree_from_parents
from .cache import CachedEagle3Draft, as_cached_draft
from .model import DraftStep, Eagle3Draft


class Eagle3Proposer(Proposer):
    """A chain of K drafts: greedy, or (`rule` a `verify.Sampled`) each picked by the rule from the
    draft's distribution (`rule.pick`: a draw at the rule's temperature and top-p)."""

    name = "eagle3"

    def __init__(self, draft: Eagle3Draft | CachedEagle3Draft, device, rule: Greedy | Sampled | None = None,
                 max_k: int = 1, target_lm=None):
        """`draft`: an Eagle3Draft (eager engine) or a `CachedEagle3Draft`; `rule`: the decoder's
        acceptance rule (None: greedy); `max_k`: the K of the decoder (greedy chains are drafted K
        long, one shape, and cut)."""
        self.cached = as_cached_draft(draft)
        self.max_k = max_k
        self.target_lm = target_lm  # a static target: its steps after a verification are warmed up with it
        self.hidden_layers = self.cached.hidden_layers
        self.rule = rule or Greedy()
        self.device = torch.device(device)
        self.empty = torch.empty(0, dtype=torch.long, device=self.device)
        self._next: torch.Tensor | None = None  # the next step's drafts, made by `keep`

    @property
    def forwards(self) -> int:
        return self.cached.forwards

    def reset(self, prompt, hidden=None):
        self.cached.reset(prompt, hidden)
        self._next = None
        if self._fused and self.cached.last is not None:  # the first chain, drafted with the prefill
            self._next = self._greedy_chain()

    def _greedy_chain(self) -> torch.Tensor:
        """K drafts in one go (one compiled step on the static engine)."""
        self.cached.forwards += self.max_k - 1  # the draft layer ran for every draft after the first
        return self.cached.greedy_chain(self.cached.last, self.max_k)

    @property
    def _fused(self) -> bool:
        """Greedy on the static engine: `keep` feeds and drafts the next chain in one graph."""
        return self.rule.greedy and self.cached._padded()

    def keep(self, n_accepted, emitted, verdict, hidden):
        width = self.cached.feed_width
        if not (self._fused and hidden is not None and hidden.shape[0] == width and verdict.shape[0] == 1 + width):
            return super().keep(n_accepted, emitted, verdict, hidden)  # a step the token budget cut short
        self._next = self.cached.keep_chain(verdict, hidden, self.cached.committed + n_accepted + 1, self.max_k)

    def propose(self, k, sequence):
        cached = self.cached
        last = cached.last
        if last is None or k == 0:  # a one-token prompt: no feature to draft from yet
            return self.empty, None
        if self._next is not None:  # drafted by the last step's `keep`
            drafts, self._next = self._next, None
            return drafts[:k], None
        if self.rule.greedy:  # K drafts, cut to k
            return self._greedy_chain()[:k], None
        logits, hidden = last.logits[:, -1:], last.hidden[:, -1:]
        tokens, dists = [], []
        for j in range(k):
            token, q = self.rule.pick(cached.draft.to_target_logits(logits[0, -1]))
            token = token.view(1)
            dists.append(q)
            tokens.append(token)
            if j + 1 < k:  # the draft at position committed + j reads its own last output
                position = torch.full((1, 1), cached.committed + j, dtype=torch.long, device=self.device)
                out = cached.step(hidden, token.view(1, 1), position)
                logits, hidden = out.logits, out.hidden
        return torch.cat(tokens), torch.stack(dists)

    def commit(self, n_accepted, emitted, hidden=None):
        self.cached.commit(hidden, emitted)

    def warmup(self) -> float:
        if self.rule.greedy:
            return self.cached.warmup(chain=self.max_k, target_lm=self.target_lm)
        return self.cached.warmup(levels=[(1, 1)])  # every sampled drafting step is one token


class Eagle3TreeDrafter(TreeDrafter):
    """Greedy tree drafting: `paths` (a static tree, Medusa-style top-k choices per depth) or,
    with `paths=None`, EAGLE-2's dynamic tree of `nodes` nodes (root included), `depth` deep (at
    most nodes - 1), expanding the `topk` most likely nodes of each depth, grown on the device
    (`decoding/dynamic_tree.py`)."""

    name = "eagle3"

    def __init__(self, draft: Eagle3Draft | CachedEagle3Draft, device, *, paths: list[Path] | None = None,
                 depth: int = 4, topk: int = DYNAMIC_TREE_TOPK, nodes: int = DYNAMIC_TREE_NODES, target_lm=None):
        """`target_lm`: a static target, whose cache the step after a verification compacts (warmed up with it)."""
        self.cached = as_cached_draft(draft)
        self.target_lm = target_lm
        self.hidden_layers = self.cached.hidden_layers
        self.device = torch.device(device)
        if paths is not None:
            self.buffers = static_tree(check_paths(paths))
            self.rank = {p: i for i, p in enumerate(best_first(paths))}  # path -> its place, best first
            self.max_depth, self.max_nodes, self.topk = self.buffers.max_depth, self.buffers.num_nodes, self.buffers.topk
            self.paths = list(self.buffers.paths)
        else:
            vocab = self.cached.draft.config.draft_vocab_size
            if depth < 1 or not 1 <= topk <= vocab or nodes < 2:
                raise ValueError(f"a dynamic tree needs depth >= 1, 1 <= topk <= the draft's vocabulary ({vocab}) "
                                 f"and nodes >= 2, got {depth}, {topk}, {nodes}")
            self.buffers = None
            # `nodes` nodes reach at most nodes - 1 deep: deeper levels would be drafted and never kept
            self.max_depth, self.topk = min(depth, nodes - 1), topk
            self.max_nodes = min(nodes, candidate_count(self.max_depth, topk))
        self._ranked = None  # the last draft's candidates, for `candidates`
        self._next: DynamicTree | None = None  # the next step's tree, grown by `keep` (or `reset`)
        self._root_only = tree_from_parents([-1], self.device)  # built once: no copy in a step

    @property
    def forwards(self) -> int:
        return self.cached.forwards

    def reset(self, prompt, hidden=None):
        self.cached.reset(prompt, hidden)
        self._next = None
        if self._fused and self.cached.last is not None:  # the first tree, grown with the prefill
            self._next = self._grow(device_tensor(prompt[-1:], self.device))

    def commit(self, nodes, accepted, bonus, hidden=None):
        self.cached.commit(hidden, list(accepted) + [bonus])

    @property
    def _fused(self) -> bool:
        """A dynamic tree on the static engine: `keep` runs in one graph with the next tree."""
        return self.buffers is None and self.cached._padded()

    def keep(self, target, verified):
        """On the static engine (dynamic trees), the target's compaction, the draft's feed and
        the next tree are one compiled call driven by the device verdict; else the default."""
        if not (self._fused and isinstance(target, StaticLM) and verified.argmax.shape[0] == self.max_nodes):
            return super().keep(target, verified)  # a root-only step, where the token budget ends
        self._next = self.cached.keep_tree(target, verified.path, verified.argmax, verified.hidden, verified.past,
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
            return self.cached.warmup(levels=self.level_shapes())
        return self.cached.warmup(tree=dict(depth=self.max_depth, topk=self.topk, nodes=self.max_nodes),
                                  target_lm=self.target_lm)

    def draft(self, root, depth):
        last = self.cached.last
        depth = min(depth, self.max_depth)
        self._ranked = ([], [], [], [])  # nothing drafted, until a tree is
        if last is None or depth == 0:
            return root.reshape(1), self._root_only
        if self.buffers is not None:
            return self._static(root, depth)
        return self._dynamic(root)

    def _grow(self, root) -> DynamicTree:
        grown = self.cached.dynamic_tree(self.cached.last, root, depth=self.max_depth, topk=self.topk,
                                         nodes=self.max_nodes)
        self.cached.forwards += self.max_depth - 1
        return grown

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
            ranked, tokens, parents, depths = (t.tolist() for t in self._ranked[4:])
        else:
            ranked, tokens, parents, depths = self._ranked
            tokens = torch.stack([tokens[n] for n in ranked]).tolist() if ranked else []
            tokens = dict(zip(ranked, tokens))
        rank = {n: i for i, n in enumerate(ranked)}
        return [tokens[n] for n in ranked], [rank.get(parents[n], -1) for n in ranked], [depths[n] for n in ranked]

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
        step = self.cached.step(
            torch.cat([hidden_of[parents[node]] for node in level], dim=1),
            torch.stack([tokens[node] for node in level]).view(1, n),
            torch.full((1, n), self.cached.committed + depth_of_level - 1, dtype=torch.long, device=self.device),
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
        outputs = {0: self.cached.last}
        hidden_of = {0: self.cached.last.hidden[:, -1:]}
        expanded: list[int] = []
        topk_of: dict[int, torch.Tensor] = {}
        for d in range(1, depth + 1):
            level = [n for n in keep if depths[n] == d]
            for node in level:
                parent = parents[node]
                if parent not in topk_of:
                    logits = self.cached.draft.to_target_logits(outputs[parent].logits[0, -1])
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


def eagle3_decoder(target, draft: Eagle3Draft | CachedEagle3Draft, *, num_draft_tokens: int,
                   tree: str | list[Path] = "chain", tree_nodes: int = DYNAMIC_TREE_NODES,
                   tree_topk: int = DYNAMIC_TREE_TOPK, rule: Greedy | Sampled | None = None,
                   eos_token_ids: set[int] = frozenset(), record_margins: bool = False):
    """The decoder for an EAGLE-3 draft. `tree`: "chain" (K drafts in a row; the only choice when
    sampling), "dynamic" (EAGLE-2, `tree_nodes` nodes, K deep, expanding `tree_topk` nodes per
    depth), or a static tree as Medusa paths. `rule`: the acceptance rule (`verify.Greedy`, the
    default, or `verify.Sampled`: a sampled chain). `target`: a cached LM or an HF model."""
    lm = as_cached_lm(target)
    rule = rule or Greedy()
    static = lm if isinstance(lm, StaticLM) else None
    if static is not None and not isinstance(draft, CachedEagle3Draft):
        draft = cached_draft_for(lm, draft, num_draft_tokens=num_draft_tokens, tree_nodes=tree_nodes,
                                 tree_topk=tree_topk)
    if not rule.greedy or tree == "chain":
        proposer = Eagle3Proposer(draft, lm.device, rule, max_k=num_draft_tokens, target_lm=static)
        return ChainDecoder(lm, proposer, num_draft_tokens=num_draft_tokens, rule=rule, eos_token_ids=eos_token_ids,
                            record_margins=record_margins)
    if tree == "dynamic":
        drafter = Eagle3TreeDrafter(draft, lm.device, depth=num_draft_tokens, topk=tree_topk, nodes=tree_nodes,
                                    target_lm=static)
    else:
        drafter = Eagle3TreeDrafter(draft, lm.device, paths=[p for p in tree if len(p) <= num_draft_tokens])
    return TreeDecoder(lm, drafter, rule=rule, eos_token_ids=eos_token_ids, record_margins=record_margins)


def cached_draft_for(target_lm, draft: Eagle3Draft, *, num_draft_tokens: int, tree_nodes: int = 0,
                     tree_topk: int = 0, compile: bool | None = None) -> CachedEagle3Draft:
    """The draft on the target's engine: static beside a static target (compiled with it), with
    room for the target's cache plus the most entries one drafting pass adds (a bound for any tree)."""
    if not isinstance(target_lm, StaticLM):
        return CachedEagle3Draft(draft)
    extra = num_draft_tokens + 1 + max(tree_nodes, 0) + num_draft_tokens * max(tree_topk, 0)
    return CachedEagle3Draft(draft, "static", capacity=target_lm.max_length + extra, feed_width=num_draft_tokens + 1,
                             compile=target_lm.compile if compile is None else compile)


def eagle3_step_seconds(draft: Eagle3Draft | CachedEagle3Draft, target_lm, prompt: list[int],
                        repeats: int = 10) -> float:
    """Median time of one EAGLE-3 chain drafting step (one token through the draft layer and its
    head, on the draft's engine), after feeding the prompt's target features: the draft's share
    of a chain step."""
    cached = as_cached_draft(draft)
    cached.warmup([(1, 1)])
    target_lm.reset()
    _, hidden = target_lm.forward(device_tensor(prompt[:-1], target_lm.device), hidden_layers=cached.hidden_layers)
    cached.reset(prompt, hidden)
    token = device_tensor(prompt[-1:], target_lm.device).view(1, 1)
    position = torch.full((1, 1), cached.length, dtype=torch.long, device=target_lm.device)

    def step():
        out = cached.step(cached.last.hidden[:, -1:], token, position)
        cached.draft.to_target_logits(out.logits[0, -1]).argmax()

    return timed(step, repeats, target_lm.device, after=lambda: cached.rollback(cached.length - 1))
