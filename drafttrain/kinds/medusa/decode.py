"""Medusa decoding (batch size 1): the target drafts for itself through its Medusa heads.

The heads read the target's final hidden state at the last cached position t: head i guesses
the token at t + 2 + i, i.e. the token i + 1 places after `pending` (the target itself predicts
the one right after `pending`, inside the verification pass). Both decoders below ask the target
for that state (`hidden_layers = (L,)`) in the passes they run anyway.

Greedy (Medusa-1): `MedusaDrafter` fills a static candidate tree with the heads' top-k tokens and
`TreeDecoder` verifies it in ONE target forward (see `decoding.tree`). On the static engine with
compiled steps, what follows a verification is ONE more graph (`keep_and_draft`): the accepted
path's cache entries moved into place, the heads at the path's last node and the next step's
candidates, rooted at the bonus token; the next `draft` just returns them. A step is then two
graph launches (verify, keep) and the few copies into their buffers.

Sampling (the rule a `verify.Sampled`): `MedusaProposer` drafts a chain of one token per head,
d_i ~ q_i = head i's distribution at the rule's temperature and top-p, which `ChainDecoder`
verifies with the standard rejection rule (lossless; q_i ignores the earlier drafts, which the
rule allows).

Either way every emitted token comes out of a verification forward (prefill covers prompt[:-1]
and emits nothing): a step emits its accepted drafts plus one target token, so `Generation`'s
accepted_lengths count head tokens accepted per target forward, and tau = new tokens / steps.
`proposed_lengths` counts draft *positions* (the depth of the tree used), not tree nodes, so
acceptance_rate and per-position acceptance compare with chain drafters: position i is head
i - 1's token, so per-position acceptance is per-head acceptance. The tree's node count (what
the target verifies per step besides the root) is `num_tree_nodes - 1`.
"""

from __future__ import annotations

import functools

import torch

from ...decoding.chain import ChainDecoder, Proposer
from ...decoding.engines import as_cached_lm
from ...decoding.engines.base import device_tensor
from ...decoding.engines.compiled import WARMUP_RUNS, CompiledStep, timed_warmup
from ...decoding.engines.static import StaticLM, move_entries
from ...decoding.timing import timed
from ...decoding.tree import TreeDecoder, TreeDrafter, Verified
from ...decoding.verify import Greedy, Sampled
from ...errors import UserError
from ...trees import Path, StaticTree, best_first, chain_tree, default_tree, static_tree
from .model import MedusaHeads


def tree_candidates(root_token, head_topk_tokens: torch.Tensor, tree: StaticTree) -> torch.Tensor:
    """The token of every node, LongTensor [N]: the root token, then head_topk_tokens[depth-1, k]."""
    num_heads, k = head_topk_tokens.shape
    if num_heads < tree.max_depth or k < tree.topk:
        raise ValueError(f"the tree needs top-{tree.topk} tokens from {tree.max_depth} heads, "
                         f"got top-{k} from {num_heads}")
    root = torch.as_tensor(root_token, device=head_topk_tokens.device).reshape(1)
    return torch.cat([root, head_topk_tokens[tree.head_index[1:], tree.topk_index[1:]]])


def head_logits(heads: MedusaHeads, hidden: torch.Tensor, num: int, device) -> torch.Tensor:
    """Logits [num, V] of the first `num` heads at one position (hidden [H], on the heads' device,
    the target's: no copy in a decode step)."""
    hidden = hidden.to(heads.lm_heads[0].weight.dtype)
    with torch.inference_mode():
        return torch.stack([heads.forward_head(i, hidden) for i in range(num)])


def keep_and_draft(cache, heads: MedusaHeads, head_index: list[int], topk_index: list[int], depth: int, k: int,
                   path: torch.Tensor, past: torch.Tensor, hidden: torch.Tensor, argmax: torch.Tensor) -> torch.Tensor:
    """After a verification, as one graph: the accepted path's K/V entries moved to slots past ..
    past + n - 1 (`path` [D + 1], padded by repeating its last node, so n = the distinct nodes:
    the padding moves the last entry onto itself), the first `depth` heads at the target's hidden
    state of the path's last node (`hidden` [W, H]), and the next step's candidate tokens [N]: the
    bonus token (`argmax` [W] at that node) as the root, then head_index[i]'s top-`k` token
    topk_index[i] for every other node. `past`: 0-d, on the device."""
    width = path.shape[0]
    last = path[-1:]
    n = (path != last).sum() + 1
    slots = torch.arange(width, device=path.device)
    move_entries(cache, past + path, past + torch.minimum(slots, n - 1))
    state = hidden.index_select(0, last)[0].to(heads.lm_heads[0].weight.dtype)
    topk = torch.stack([heads.forward_head(i, state) for i in range(depth)]).topk(k, dim=-1).indices
    flat = [h * k + j for h, j in zip(head_index, topk_index)]
    return torch.cat([argmax.index_select(0, last), topk.flatten()[flat]])


class MedusaDrafter(TreeDrafter):
    """Medusa heads on a static tree (cut shallower near the token budget)."""

    name = "medusa"

    def __init__(self, heads: MedusaHeads, buffers: StaticTree, num_layers: int, device,
                 order: list[Path] | None = None, target=None):
        """`order`: the tree's paths best first (a calibrated tree's own order, which is what a
        smaller node budget keeps first: `candidates`); default the node order. `target`: the
        cached LM that verifies; a compiled `StaticLM` gets `keep_and_draft` once warmed up."""
        self.heads = heads
        self.target = target
        self._keep = None  # the compiled `keep_and_draft` (`warmup`)
        self._width = 0    # the verification's width it was compiled for (the full tree's bucket)
        self._next: torch.Tensor | None = None  # the next draft's tokens on the full tree, made ahead
        self.buffers = buffers
        self.rank = {p: i for i, p in enumerate(best_first(order or buffers.paths))}  # path -> its place
        self._last: tuple[torch.Tensor, StaticTree] | None = None
        self.max_depth, self.max_nodes, self.paths = buffers.max_depth, buffers.num_nodes, list(buffers.paths)
        self.hidden_layers = (num_layers,)
        self.device = torch.device(device)
        self.hidden = None  # the target's last hidden state at the last cached position
        # the tree cut to each depth (prefix-closed), on the device before the first step, so no step
        # drafts past max_new_tokens nor copies a tree over
        self._trees = [static_tree([p for p in buffers.paths if len(p) <= depth]).to(self.device)
                       for depth in range(buffers.max_depth + 1)]
        # each cut tree's nodes among the full tree's (whose tokens a compiled `keep` makes)
        node = {p: n for n, p in enumerate(self._trees[-1].paths, start=1)}
        self._within = [torch.tensor([0] + [node[p] for p in tree.paths]).to(self.device) for tree in self._trees]

    def _tree(self, depth: int) -> StaticTree:
        return self._trees[min(depth, self.buffers.max_depth)]

    def _candidates(self, root, tree: StaticTree) -> torch.Tensor:
        """The tree's tokens from the heads at `self.hidden`, eagerly."""
        topk = head_logits(self.heads, self.hidden, tree.max_depth, self.device).topk(tree.topk, dim=-1).indices
        return tree_candidates(root, topk, tree)

    def reset(self, prompt, hidden=None):
        self.hidden = hidden[-1] if hidden is not None and len(hidden) else None
        self._next = None
        if self._keep is not None and self.hidden is not None and self.max_depth > 0:
            # the first step's draft, made here (prefill's share): every step's then comes ahead
            root = device_tensor([prompt[-1]], self.device)
            self._next = self._candidates(root, self._tree(self.max_depth))

    def draft(self, root, depth):
        """The tree's tokens. After a compiled `keep`, the ones it made (its root is the bonus
        token, which is `root`): no work at full depth, a gather for a tree cut shallower."""
        self._last = None
        tree = self._tree(depth)
        made, self._next = self._next, None
        if made is not None:
            if tree.max_depth == 0:
                self._last = (root.reshape(1), tree)
                return root.reshape(1), tree
            self.forwards += 1
            tokens = made if tree.max_depth == self.max_depth else made.index_select(0, self._within[tree.max_depth])
            self._last = (tokens, tree)
            return tokens, tree
        if self.hidden is None:  # a one-token prompt: nothing for the heads to read yet
            tree = self._tree(0)
        if tree.max_depth == 0:
            self._last = (root.reshape(1), tree)
            return root.reshape(1), tree
        self.forwards += 1
        tokens = self._candidates(root, tree)
        self._last = (tokens, tree)
        return tokens, tree

    def candidates(self):
        """The last tree's nodes best first, in the order of the paths as given (a calibrated tree
        lists them by expected acceptance)."""
        if self._last is None:
            return None
        tokens, tree = self._last
        nodes = sorted(range(1, tree.num_nodes), key=lambda n: self.rank[tree.paths[n - 1]])
        position = {n: i for i, n in enumerate(nodes)}
        values = tokens.tolist()
        return ([values[n] for n in nodes], [position.get(tree.parents[n], -1) for n in nodes],
                [len(tree.paths[n - 1]) for n in nodes])

    def commit(self, nodes, accepted, bonus, hidden=None):
        self.hidden = hidden[-1]
        self._next = None

    def keep(self, target, verified: Verified) -> None:
        """On a compiled static target (warmed up), one graph (`keep_and_draft`): the cache keeps
        the accepted path and the next full-depth draft is made; the target's length is set here.
        Elsewhere (the eager engine, a step of another width) the default: compaction, `commit`."""
        hidden = verified.hidden
        if (self._keep is None or target is not self.target or hidden is None or hidden.shape[0] != self._width
                or verified.path.numel() != self.max_depth + 1):
            return super().keep(target, verified)
        past = verified.past
        self._next = self._keep(verified.path, target.at(past), hidden, verified.argmax)
        self.hidden = None  # read by the graph: the next draft is made
        target.rollback(past + len(verified.nodes))

    def warmup(self) -> float:
        """Compile `keep_and_draft` for the full tree's verification (after the target's warm-up,
        which registered its width), on a compiled `StaticLM` target; 0 elsewhere."""
        target = self.target
        if not (isinstance(target, StaticLM) and target.compile and self.max_depth > 0):
            return 0.0
        # the width the full tree is verified at: its bucket among the sizes the target registered
        width = min((s for s in target.sizes.get(tuple(self.hidden_layers), ()) if s >= self.max_nodes), default=None)
        if width is None:
            return 0.0
        if self._keep is None or self._width != width:
            tree = self._tree(self.max_depth)
            paths = tree.paths
            step = functools.partial(keep_and_draft, target.cache, self.heads, [len(p) - 1 for p in paths],
                                     [p[-1] for p in paths], tree.max_depth, tree.topk)
            self._keep, self._width = CompiledStep(step, target.device), width
        dtype = target.model.get_output_embeddings().weight.dtype
        path = torch.zeros(self.max_depth + 1, dtype=torch.long, device=target.device)
        hidden = torch.zeros(width, self.heads.config.hidden_size, dtype=dtype, device=target.device)
        argmax = torch.zeros(width, dtype=torch.long, device=target.device)
        keep = self._keep
        return timed_warmup(target, [lambda: keep(path, target.at(0), hidden, argmax)], runs=WARMUP_RUNS)


class MedusaProposer(Proposer):
    """Sampling: one token per head, picked by `rule` (a `verify.Sampled`: the decoder's rule) from
    the head's own distribution (`rule.pick`: a draw at the rule's temperature and top-p)."""

    name = "medusa"

    def __init__(self, heads: MedusaHeads, num_layers: int, device, rule: Sampled):
        self.heads = heads
        self.hidden_layers = (num_layers,)
        self.device = torch.device(device)
        self.rule = rule
        self.hidden = None
        self.empty = torch.empty(0, dtype=torch.long, device=self.device)

    def reset(self, prompt, hidden=None):
        self.hidden = hidden[-1] if hidden is not None and len(hidden) else None

    def propose(self, k, sequence):
        if self.hidden is None or k == 0:
            return self.empty, None
        tokens, q = self.rule.pick(head_logits(self.heads, self.hidden, k, self.device))
        self.forwards += 1
        return tokens, q

    def commit(self, n_accepted, emitted, hidden=None):
        self.hidden = hidden[-1]


def check_heads(target, heads: MedusaHeads) -> None:
    vocab, hidden = target.get_output_embeddings().weight.shape
    cfg = heads.config
    if (cfg.vocab_size, cfg.hidden_size) != (vocab, hidden):
        raise UserError(f"the Medusa heads are for vocab {cfg.vocab_size} x hidden {cfg.hidden_size} but the "
                        f"target has vocab {vocab} x hidden {hidden}; use heads trained on this target")


def medusa_decoder(target, heads: MedusaHeads, *, tree: list[Path] | None = None,
                   rule: Greedy | Sampled | None = None, eos_token_ids: set[int] = frozenset(),
                   record_margins: bool = False):
    """The decoder for Medusa heads: a `TreeDecoder` (`rule` greedy, the default) or a
    `ChainDecoder` (`rule` a `verify.Sampled`).

    `tree`: Medusa paths (default: DEFAULT_TREE cut to the number of heads). Sampling, only its
    depth is used: the heads draft a chain that deep. `target`: a cached LM or an HF model.
    """
    rule = rule or Greedy()
    lm = as_cached_lm(target)
    check_heads(lm.model, heads)
    num_heads = heads.config.num_heads
    paths = default_tree(num_heads) if tree is None else [tuple(p) for p in tree]
    buffers = static_tree(paths)  # validates the paths
    if buffers.max_depth > num_heads:
        raise UserError(f"the Medusa tree is {buffers.max_depth} deep but the heads have only "
                        f"{num_heads}; pass a tree of depth <= {num_heads}")
    if not rule.greedy:
        proposer = MedusaProposer(heads, lm.num_layers, lm.device, rule)
        return ChainDecoder(lm, proposer, num_draft_tokens=buffers.max_depth, rule=rule, eos_token_ids=eos_token_ids,
                            record_margins=record_margins)
    if buffers.paths != chain_tree(buffers.max_depth) and not lm.supports_trees:
        attn = getattr(lm.model.config, "_attn_implementation", None)
        raise UserError(f"tree decoding needs an attention kernel that accepts custom masks, but the target "
                        f"uses {attn!r}; load it with attn_implementation='sdpa' or use a chain tree")
    return TreeDecoder(lm, MedusaDrafter(heads, buffers, lm.num_layers, lm.device, order=paths, target=lm), rule=rule,
                       eos_token_ids=eos_token_ids, record_margins=record_margins)


def medusa_heads_seconds(heads, k: int, device, repeats: int = 10) -> float:
    """Median time of the first k Medusa heads reading one hidden state: a sampling chain's draft."""
    hidden = torch.randn(heads.config.hidden_size, device=device)
    return timed(lambda: head_logits(heads, hidden, k, device).argmax(dim=-1), repeats, device)
