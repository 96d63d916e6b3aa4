"""Tree speculative decoding (greedy, `verify.Greedy.tree`; the rule is the decoder's `rule`): verify a whole tree of candidates in ONE target pass.

Each step a `TreeDrafter` proposes the step's candidates as a tree rooted at `pending` (a static
tree such as Medusa's, or a new one per step such as EAGLE-2's). The target scores every node
in one forward pass (tree mask, per-depth positions); the longest root-to-node path whose tokens
equal the target's argmax is accepted, the cache keeps only that path (`CachedLM.compact`), and the
target's argmax at the path's end is the bonus token, the next `pending`. The drafter is then
told the accepted path and handed the target's hidden states along it, if it asked for any.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..planning import TreeStep
from ..trees import Tree
from .loop import Decoder, Step
from .verify import GreedyVerdict, top2_margins


@dataclass
class Verified:
    """What one tree verification decided: on the host (after the step's one sync) the accepted
    path's nodes, its draft tokens and the bonus token; on the device the path padded by repeating
    its last node (`path`, [max_depth + 1]), the target's argmax at every verified row and the
    target's hidden states there (None if the drafter reads none)."""

    past: int                     # the target's cache length before the verification
    nodes: list[int]
    accepted: list[int]
    bonus: int
    path: torch.Tensor
    argmax: torch.Tensor
    hidden: torch.Tensor | None


class TreeDrafter:
    """Where a tree decoder's candidates come from. Besides the methods below, a drafter sets
    `max_depth` (the deepest tree it drafts: K, for per-position acceptance), `max_nodes` (the
    largest tree, root included: the static engine's bucket) and, for a static tree, `paths`
    (Medusa paths; None for a tree grown anew every step)."""

    name = "tree"
    hidden_layers: tuple[int, ...] = ()
    max_depth: int
    max_nodes: int
    paths: list | None = None
    forwards = 0  # the drafter's model forwards so far (SPEC §7 draft_forwards)
    wraps = None  # the drafter this one drafts through, if any (the hybrids' `ChainAsTree`, `HybridDrafter`)

    def reset(self, prompt: list[int], hidden: torch.Tensor | None = None) -> None:
        """A new sequence; `hidden`: the target's hidden states of prompt[:-1] (None if empty)."""

    def draft(self, root: torch.Tensor, depth: int) -> tuple[torch.Tensor, Tree]:
        """Candidate tokens [N] (node 0 = `root`, the pending token) and their tree, at most
        `depth` deep (on the target's device)."""
        raise NotImplementedError

    def commit(self, nodes: list[int], accepted: list[int], bonus: int, hidden: torch.Tensor | None = None) -> None:
        """The accepted path (node indices, root first), its draft tokens, the bonus token, and the
        target's hidden states at the path's nodes ([len(nodes), D])."""

    def keep(self, target, verified: Verified) -> None:
        """After a verification: the target's cache keeps the accepted path (`CachedLM.compact`)
        and the drafter is told it (`commit`, with the target's hidden states along it). A drafter
        that runs both, and its next draft, in one graph of its own overrides this."""
        target.compact(verified.past, verified.nodes, path=verified.path)
        hidden = verified.hidden
        kept = hidden.index_select(0, verified.path)[:len(verified.nodes)] if hidden is not None else None
        self.commit(verified.nodes, verified.accepted, verified.bonus, hidden=kept)

    def warmup(self) -> float:
        """Compile/capture whatever the drafter runs; returns the seconds spent. Here: the warm-up
        of the drafter it wraps, if any."""
        return self.wraps.warmup() if self.wraps is not None else 0.0

    def candidates(self) -> tuple[list[int], list[int], list[int]] | None:
        """The last draft's candidates best first, every node drafted whether the tree kept it or
        not: (tokens, each one's parent among them or -1 for the root, depths), a parent always
        before its children, so that a planner can tell what a smaller tree would have accepted
        (`planning.TreeStep`). None: this drafter does not rank its candidates."""
        return None

    def grow_beside(self, topks: tuple[int, ...]) -> bool:
        """Also grow the trees of these top-ks below every step's root, the one verified unchanged,
        for a planner's recording (`candidates_beside`); False where this drafter cannot (its trees
        are not EAGLE-2's, or not grown on the eager engine). Here: the wrapped drafter's answer."""
        return isinstance(self.wraps, TreeDrafter) and self.wraps.grow_beside(topks)

    def candidates_beside(self) -> dict[int, tuple[list[int], list[int], list[int]]]:
        """The last draft's trees grown beside it (`grow_beside`), by top-k, as `candidates` lists them."""
        return self.wraps.candidates_beside() if isinstance(self.wraps, TreeDrafter) else {}


class TreeDecoder(Decoder):
    name = "tree"

    def __init__(self, target, drafter: TreeDrafter, *, eos_token_ids: set[int] = frozenset(),
                 record_margins: bool = False, rule=None):
        super().__init__(target, eos_token_ids=eos_token_ids, record_margins=record_margins, rule=rule)
        self.drafter = drafter
        self.verdict = GreedyVerdict(tree=True, margins=record_margins)  # computed in the verification graph
        self.recorded: list[TreeStep] | None = None  # a list: every step's candidates are recorded there
        self.recorded_beside: dict[int, list[TreeStep]] = {}  # the trees grown beside (`TreeDrafter.grow_beside`)

    def record(self, accepted: list[int], bonus: int, past: int) -> None:
        """Keep this step's candidates and the target's verdict on them (planning only: reading the
        candidates costs a host sync), and those of the trees grown beside, with the target's own
        continuation as deep as they go (`CachedLM.known_continuation`: the verdict covers the
        verified tree's path only)."""
        ranked = self.drafter.candidates()
        if ranked is None:
            return
        lookup = tuple(getattr(self.drafter, "last_lookup", ()))
        self.recorded.append(TreeStep(*(tuple(r) for r in ranked), (*accepted, bonus), lookup))
        beside = self.drafter.candidates_beside()
        known = self.target.known_continuation(past, self.drafter.max_depth + 1) if beside else None
        if beside and known is None:
            raise ValueError("trees grown beside the verified one are recorded against a known continuation "
                             "(a teacher-forced target) only")
        for topk, listed in beside.items():
            self.recorded_beside.setdefault(topk, []).append(TreeStep(*(tuple(r) for r in listed), tuple(known),
                                                                      lookup))

    @property
    def num_draft_tokens(self) -> int:
        return self.drafter.max_depth

    @property
    def num_tree_nodes(self) -> int:
        return self.drafter.max_nodes

    def drafting(self) -> TreeDrafter:
        return self.drafter

    @property
    def tree(self):
        """The drafter's static tree as Medusa paths (None for a drafter without one)."""
        return self.drafter.paths

    def step_sizes(self) -> list[int]:
        return sorted({1, self.drafter.max_nodes})

    def target_shapes(self) -> dict:
        return dict(keep_width=self.drafter.max_depth + 1, tree_depth=self.drafter.max_depth)

    def _start(self, prompt, hidden):
        self.drafter.reset(prompt, hidden)

    def verify(self, tokens: torch.Tensor, tree: Tree, depth: int):
        """(verdict, hidden): in the target's verification graph, unless the token budget cuts
        this step shallower than the tree (the verdict then stops at `depth`). A tree cut shallower
        by its drafter is verified as the full depth's (its path padded further), one graph."""
        if depth >= tree.max_depth:
            full = tree if tree.max_depth == self.drafter.max_depth else replace(tree, max_depth=self.drafter.max_depth)
            return self.target.verify(tokens, self.verdict, tree=full, hidden_layers=self.hidden_layers)
        logits, hidden = self.target.forward(tokens, tree=tree, hidden_layers=self.hidden_layers)
        verdict = self.rule.tree(logits, tokens, tree, depth)
        return (torch.cat([verdict.double(), top2_margins(logits)]) if self.record_margins else verdict), hidden

    def _step(self, budget: int) -> Step:
        # At most `depth` drafts + 1 target token per step: never draft past the budget.
        depth = min(self.drafter.max_depth, budget - 1)
        tokens, tree = self.drafter.draft(self.pending, depth)
        past = self.target.length
        verdict, hidden = self.verify(tokens, tree, depth)
        width = (self.drafter.max_depth if depth >= tree.max_depth else tree.max_depth) + 1  # the verdict's path
        values = verdict.tolist()  # the one host sync of the step
        best = int(values[0])
        nodes = [int(n) for n in values[1:1 + width]]
        nodes = nodes[:nodes.index(best) + 1]
        rows = (len(values) - 1 - width) // (2 if self.record_margins else 1)  # verified rows, padding included
        argmax = values[1 + width:1 + width + rows]
        path = verdict[1:1 + width]  # on the device, padded: fixed-size gathers below
        argmax_rows = verdict[1 + width:1 + width + rows]
        if self.record_margins:
            path, argmax_rows = path.long(), argmax_rows.long()
        accepted = [int(argmax[p]) for p in nodes[:-1]]
        if self.recorded is not None:
            self.record(accepted, int(argmax[best]), past)
        self.drafter.keep(self.target, Verified(past, nodes, accepted, int(argmax[best]), path, argmax_rows, hidden))
        self.pending = argmax_rows[best:best + 1]  # stays on the device
        margins = [values[1 + width + rows + p] for p in nodes] if self.record_margins else None
        return Step(accepted=accepted, bonus=int(argmax[best]), proposed=min(tree.max_depth, depth), margins=margins)
