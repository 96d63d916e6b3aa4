"""How many tokens to draft on this machine: a cost model and the plan that maximises tokens/s.

A chain step with K drafts emits on average E(K) = 1 + a_1 + ... + a_K tokens, where a_j is the
probability that the first j drafts are all accepted (the reports' per-position acceptance).
Read off a decode at the deepest K, a_j is taken to hold for every K, which is right when
acceptance is about the same wherever a step starts (a model's drafts). Copying is bursty: a
lookup's drafts are all right inside a copied span and all wrong outside it, and a deep K crosses
a span in few steps, so most of its steps start outside one; at a smaller K more steps fall
inside, and a_j measured at the deepest K understates E(K) (n-gram on SmolLM2's HumanEval answers
at K=3: 1.68 read off K=6, 1.84 walked and measured). For a drafter whose proposal is a function of the tokens so far
(n-gram lookup) greedy decoding at any K is walked exactly over the target's continuation
(`walk_chain`) and planned with the acceptance of each K (`plan_chain(..., by_k=...)`).
It costs the target's verification of the drafts and the pending token, V(n), n = K + 1 tokens
(less where a drafter, like n-gram lookup, proposes fewer than K: `proposal_rates`), plus the
drafter's own step, plus a fixed overhead per step (sampling, bookkeeping, the host sync). Plain
decoding (K = 0) emits one token for V(1) plus the same overhead, without the drafter. The plan
is the K, from 0 (no speculation) to the deepest measured position, with the most tokens per
second. On a GPU at batch 1, V(n) barely grows with n and K comes out large; on 2 CPU cores a
5-token forward costs about 1.5 one-token forwards, and a draft LM's own forwards cost a third
of the target's each, so the plan is short or empty.

Trees (Medusa heads, EAGLE-3) are planned the same way over (top-k, depth, nodes): a step's
expected tokens are read off recorded steps of the largest tree (`TreeStep`: its candidates in
the order a smaller budget keeps them, and the target's greedy continuation, which decides what
any sub-tree would have accepted; `tree_table`), and a step's cost is measured whole, but only for
the trees the decision needs (`plan_tree_measured`): a tree not measured is priced at the least it
can cost (its verification, from the target's measured cost of verifying n tree nodes, plus what
a measured tree no wider and no deeper spent beyond its own), the leader is measured, and when the
leader is a measured tree no other can beat it. The tree a plan chooses is always priced by its
own measured step. A hybrid (a model's tree and a lookup's chain verified together) is priced as
its model's measured step with the lookup's nodes verified beside it, as many as each recorded
step verified (`lookup_beside`, `tree_seconds`): the probe's short decode finds as many as it
happens to.

Acceptance must come from other prompts than the ones being timed (the drafter's recorded
held-out acceptance, or a calibration file), or the plan would be fitted to the test; and from as
many of them as its confidence needs (`enough_prompts`).
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class Costs:
    """Measured seconds: `verify[n-1]` is one target forward of n tokens after a cached prefix;
    `draft[k]` is the drafter's share of a step that drafts k tokens (draft[0] = 0); `overhead`
    is what a step costs beyond its forwards."""

    verify: tuple[float, ...]
    draft: tuple[float, ...]
    overhead: float = 0.0
    warnings: tuple[str, ...] = field(default=())

    def as_dict(self) -> dict:
        return {"verify_seconds": list(self.verify), "draft_seconds": list(self.draft),
                "overhead_seconds": self.overhead}


@dataclass(frozen=True)
class Candidate:
    """One setting the planner weighed: K drafts a step (a tree's depth), and for trees its node
    budget (pending included) and top-k; its expected tokens per step and planned speedup."""

    num_draft_tokens: int
    expected_tokens: float
    planned_speedup: float
    tree_nodes: int | None = None
    tree_topk: int | None = None
    measured: bool | None = None  # a tree: priced by its own measured step (else an estimate); None: a chain
    lookup_first: bool | None = None  # a hybrid: its lookup's chain alone where it finds one; None: no hybrid


@dataclass(frozen=True)
class Plan:
    """The chosen setting (K = 0: the target alone), its expected tokens per step and its speedup
    over plain decoding under the cost model, and every setting weighed, for the report."""

    num_draft_tokens: int
    expected_tokens: float
    planned_speedup: float
    candidates: tuple[Candidate, ...]
    tree_nodes: int | None = None
    tree_topk: int | None = None
    lookup_first: bool | None = None

    def as_dict(self) -> dict:
        return asdict(self)


def best_plan(candidates: list[Candidate]) -> Plan:
    """The candidate with the most tokens per second; ties go to the cheaper setting (fewer drafts,
    then fewer nodes, then fewer top-k)."""
    best = max(candidates, key=lambda c: (round(c.planned_speedup, 12), -c.num_draft_tokens, -(c.tree_nodes or 0),
                                          -(c.tree_topk or 0)))
    return Plan(best.num_draft_tokens, best.expected_tokens, best.planned_speedup, tuple(candidates),
                best.tree_nodes, best.tree_topk, best.lookup_first)


def expected_tokens(acceptance: list[float], k: int) -> float:
    """E(K): tokens per step with K drafts, from per-position acceptance a_1 .. a_K."""
    return 1.0 + sum(acceptance[:k])


def interpolate(curve: tuple[float, ...], tokens: float) -> float:
    """A cost curve (index n - 1: n tokens) at a fractional number of tokens, linear between sizes."""
    tokens = min(max(tokens, 1.0), float(len(curve)))
    low = int(tokens)
    high = min(low + 1, len(curve))
    return curve[low - 1] + (curve[high - 1] - curve[low - 1]) * (tokens - low)


def lookup_verify_seconds(verify: tuple[float, ...], k: int, extra_tokens: float) -> float:
    """A chain hybrid's verification: its K drafts and the pending token, and beside them a lookup's
    chain of `extra_tokens` nodes a step on average. A lookup proposes all of its K tokens or none
    (n-gram walked over Gemma-3's calibration answers at K = 3: a first token at 76% of steps, a third
    at 73%), so a step verifies K + 1 nodes or 2K + 1, in the share that gives the mean: the curve's mean
    over those steps, not the curve at the mean, which on a lumpy CPU curve (Gemma-3 on 2 cores: 4
    tokens 44.7 ms, 5 tokens 59.1) priced DFlash + n-gram's step at 50 ms against the 61 it took
    (planned 1.59x, measured 1.36x)."""
    share = min(1.0, max(0.0, extra_tokens) / k)
    return (1 - share) * interpolate(verify, k + 1) + share * interpolate(verify, 2 * k + 1)


def step_seconds(costs: Costs, k: int, proposal_rates: list[float] | None = None, extra_tokens: float = 0.0) -> float:
    """One step's cost with K drafts. `proposal_rates[j]`: how often the drafter proposes at least
    j + 1 tokens (1 for model drafters, which always propose K; n-gram lookup often proposes
    fewer, and the target then verifies fewer). `extra_tokens`: tokens verified beside the K
    drafts on average (a hybrid's n-gram branch), priced as `lookup_verify_seconds` does."""
    if k == 0:
        return costs.verify[0] + costs.overhead
    if proposal_rates is None:
        return lookup_verify_seconds(costs.verify, k, extra_tokens) + costs.draft[k] + costs.overhead
    at_least = [1.0, *proposal_rates[:k], 0.0]  # P(proposes >= n), n = 0 .. k + 1
    verify = sum((at_least[n] - at_least[n + 1]) * costs.verify[n] for n in range(k + 1))
    return verify + costs.draft[k] + costs.overhead


def plan_chain(acceptance: list[float], costs: Costs, proposal_rates: list[float] | None = None,
               max_k: int | None = None, extra_tokens: float = 0.0,
               by_k: dict[int, tuple[list[float], list[float] | None]] | None = None) -> Plan:
    """The K in 0 .. max_k (default: the deepest position both acceptance and costs cover) with
    the most expected tokens per second; ties go to the smaller K. `extra_tokens`: a hybrid's
    n-gram nodes per step at the deepest K (scaled down with K). `by_k[K]`: (acceptance,
    proposal rates) measured at that K (`walk_chain`), used in place of the deepest K's."""
    deepest = min(len(acceptance), len(costs.draft) - 1, len(costs.verify) - 1)
    if proposal_rates is not None:
        deepest = min(deepest, len(proposal_rates))
    max_k = deepest if max_k is None else min(max_k, deepest)
    plain = step_seconds(costs, 0)
    candidates = []
    for k in range(max_k + 1):
        a, rates = (by_k or {}).get(k, (acceptance, proposal_rates))
        e = expected_tokens(a, k)
        extra = extra_tokens * k / max(max_k, 1)
        candidates.append(Candidate(k, e, e * plain / step_seconds(costs, k, rates, extra)))
    return best_plan(candidates)


def agreed(draft: list[int], continuation: list[int]) -> int:
    """How many of `draft` greedy verification accepts: its longest prefix equal to `continuation`."""
    n = 0
    while n < len(draft) and n < len(continuation) and draft[n] == continuation[n]:
        n += 1
    return n


def walk_chain(prompt: list[int], continuation: list[int], propose, k: int,
               max_new_tokens: int) -> list[tuple[int, int]]:
    """(proposed, accepted) of every step a greedy chain decoder with K = k takes to emit
    `continuation`, the target's greedy continuation of `prompt`, when the drafter's proposal is
    a function of the tokens so far: `propose(sequence, k)` -> up to k tokens (n-gram lookup).
    Greedy verification accepts the longest draft prefix equal to the target's tokens, and those
    do not depend on K, so one decode tells every K's steps exactly. As the decoder does, a step
    drafts no more than can still be emitted."""
    steps, n = [], 0
    while n < len(continuation):
        draft = propose(prompt + continuation[:n], min(k, max_new_tokens - n - 1))
        accepted = agreed(draft, continuation[n:])
        steps.append((len(draft), accepted))
        n += accepted + 1
    return steps


def walked_rates(steps: list[tuple[int, int]], k: int) -> tuple[list[float], list[float]]:
    """Per-position acceptance a_1 .. a_k and proposal rates of walked steps (`walk_chain`)."""
    count = max(1, len(steps))
    return ([sum(a >= j for _, a in steps) / count for j in range(1, k + 1)],
            [sum(m >= j for m, _ in steps) / count for j in range(1, k + 1)])


@dataclass(frozen=True)
class HybridStep:
    """One step of a chain hybrid (a model's chain and a lookup's) walked over the target's greedy
    continuation: the nodes it verifies beside the pending token, whether the model drafted (its
    forward is paid), and the tokens it emits (accepted drafts and the bonus)."""

    nodes: int
    model: bool
    tokens: int


def walk_hybrid(prompt: list[int], continuation: list[int], lookup, drafts: list[list[int]], k: int,
                max_new_tokens: int, lookup_first: bool) -> list[HybridStep]:
    """The steps a greedy chain hybrid with K = k takes to emit `continuation`, the target's greedy
    continuation of `prompt`: `lookup(sequence, n)` -> up to n tokens (a function of the text),
    `drafts[i]`: the model's greedy drafts after the first i tokens of `continuation` (a function of
    the position: what a model keeps is made of the emitted text and the target's states along it,
    `decoding.hybrid`), at least k of them. Both (`lookup_first` False): the lookup's chain hangs from
    the root beside the model's (its nodes all verified, those it shares as twins: `hang_lookup`) and
    the longer acceptance wins; lookup first: the lookup's chain alone where it finds one, else the
    model's. As the decoder does, a step drafts no more than can still be emitted."""
    steps, n = [], 0
    while n < len(continuation):
        depth = min(k, max_new_tokens - n - 1)
        rest = continuation[n:]
        found = lookup(prompt + continuation[:n], depth) if depth > 0 else []
        if lookup_first and found:
            step = HybridStep(len(found), False, agreed(found, rest) + 1)
        else:
            model = drafts[n][:depth] if depth > 0 else []
            step = HybridStep(len(model) + len(found), bool(model), max(agreed(model, rest), agreed(found, rest)) + 1)
        steps.append(step)
        n += step.tokens
    return steps


def hybrid_step_seconds(costs: Costs, lookup: list[float], k: int, step: HybridStep) -> float:
    """A walked hybrid step's cost: the target's verification of its nodes and the pending token, the
    loop's overhead, and the drafting: where the model drafted, the hybrid's measured share of a step
    (`costs.draft[k]`: the model's and the lookup's), else the lookup's alone (`lookup[k]`)."""
    return costs.verify[step.nodes] + (costs.draft[k] if step.model else lookup[k]) + costs.overhead


def plan_hybrid_chain(walked: dict[tuple[int, bool], list[HybridStep]], costs: Costs, lookup: list[float]) -> Plan:
    """The K and mode (`lookup_first`) of a chain hybrid with the most tokens per second over its
    walked steps (`walk_hybrid`), each step priced by its own size (`hybrid_step_seconds`: a CPU's
    verification curve is lumpy, and a mean of step costs is not the cost at the mean size), or the
    target alone. On a GPU, where nodes cost almost nothing, verifying both wins; on a CPU, where each
    costs a share of a step, the lookup's chain alone where it finds one."""
    plain = step_seconds(costs, 0)
    candidates = [Candidate(0, 1.0, 1.0)]
    for (k, first), steps in sorted(walked.items()):
        if not steps or k >= len(costs.draft) or 2 * k >= len(costs.verify):
            continue
        tokens = sum(s.tokens for s in steps)
        seconds = sum(hybrid_step_seconds(costs, lookup, k, s) for s in steps)
        candidates.append(Candidate(k, tokens / len(steps), tokens * plain / seconds, lookup_first=first))
    return best_plan(candidates)


# ---------------------------------------------------------------------------------------- trees


@dataclass(frozen=True)
class TreeStep:
    """One verification step of a tree drafter's largest tree, enough to tell what any smaller
    tree would have accepted. Candidates are listed best first, so that a budget of N nodes keeps
    the first N - 1 of those deep enough (a parent always precedes its children: the kept set is
    a tree): EAGLE-2 ranks them by cumulative draft log-probability, a static tree by its path
    order. The target's greedy continuation (accepted drafts, then its own token) is fixed by the
    context, not by the tree, so any sub-tree accepts the longest of its paths along it."""

    tokens: tuple[int, ...]        # candidate tokens, best first (the root, pending, excluded)
    parents: tuple[int, ...]       # each candidate's parent among them; -1: the root
    depths: tuple[int, ...]        # 1 = a child of the root
    continuation: tuple[int, ...]  # the target's greedy tokens after pending, as far as verified
    lookup: tuple[int, ...] = ()   # a hybrid's n-gram chain, verified beside the candidates
    weight: float = 1.0            # its share in the means over steps (`as_hybrid_steps`; 1: as decoded)


def lookup_accepted(step: TreeStep, depth: int) -> int:
    """Drafts of the step's lookup chain, cut to `depth`, that the target accepts."""
    return agreed(step.lookup[:depth], step.continuation)


def accepted_within(step: TreeStep, depth: int, nodes: int) -> int:
    """Drafts the step would have accepted with a tree of `nodes` nodes (pending included) at most
    `depth` deep, plus a hybrid's n-gram chain cut to `depth`."""
    children: dict[int, dict[int, int]] = {}
    kept = 0
    for i, d in enumerate(step.depths):
        if kept == nodes - 1:
            break
        if d <= depth:
            children.setdefault(step.parents[i], {}).setdefault(step.tokens[i], i)
            kept += 1
    node, accepted = -1, 0
    for token in step.continuation[:depth]:
        node = children.get(node, {}).get(token)
        if node is None:
            break
        accepted += 1
    return max(accepted, lookup_accepted(step, depth))


def tree_expected_tokens(steps: list[TreeStep], depth: int, nodes: int) -> float:
    """E: tokens per step (accepted drafts + the target's own) of the tree (depth, nodes)."""
    if not steps:
        return 1.0
    return 1.0 + weighted_mean(steps, lambda s: accepted_within(s, depth, nodes))


def weighted_mean(steps: list[TreeStep], value) -> float:
    """`value(step)`'s mean over the steps, each counted by its `weight` (`as_hybrid_steps`)."""
    return sum(s.weight * value(s) for s in steps) / sum(s.weight for s in steps)


@dataclass(frozen=True)
class TreeCosts:
    """Measured seconds for tree plans. `verify[i]`: one target forward of `sizes[i]` tree nodes
    after a cached prefix (the sizes measured so far: the curve grows as a search needs it);
    `plain`: a plain decoding step; `exact[(topk, depth, nodes)]`: a whole decoding step (draft,
    verification, bookkeeping) of that tree, measured, its model's alone for a hybrid (`tree_seconds`
    adds the lookup's nodes); `lookup[k]`: a hybrid's host time looking up k tokens."""

    sizes: tuple[int, ...]
    verify: tuple[float, ...]
    plain: float
    warnings: tuple[str, ...] = field(default=())
    exact: dict[tuple[int, int, int], float] = field(default_factory=dict)
    lookup: tuple[float, ...] = field(default=())

    @property
    def loop(self) -> float:
        """A plain step's seconds beyond its one-token forward (sampling, bookkeeping, the sync)."""
        return max(0.0, self.plain - self.verify[0])

    def covers(self, nodes: float) -> bool:
        """Whether the measured curve reaches a verification of `nodes` nodes."""
        return nodes <= self.sizes[-1]

    def verify_seconds(self, nodes: float) -> float:
        """The verification curve at `nodes`, linear between measured sizes (the last one beyond)."""
        nodes = min(max(nodes, self.sizes[0]), self.sizes[-1])
        i = next(i for i, n in enumerate(self.sizes) if n >= nodes)
        if self.sizes[i] == nodes or i == 0:
            return self.verify[i]
        n0, n1 = self.sizes[i - 1], self.sizes[i]
        return self.verify[i - 1] + (self.verify[i] - self.verify[i - 1]) * (nodes - n0) / (n1 - n0)

    def least_verify_seconds(self, nodes: float) -> float:
        """The least a verification of `nodes` nodes can cost: the curve where it was measured,
        beyond it `BEYOND_CURVE` of its largest measured size (a curve may dip that much by noise,
        `noisy`'s own tolerance, but grows with the nodes)."""
        return self.verify_seconds(nodes) if self.covers(nodes) else BEYOND_CURVE * self.verify[-1]

    def lookup_seconds(self, depth: int) -> float:
        """A hybrid's host time looking up a chain `depth` deep (0 without a lookup measured)."""
        return self.lookup[min(depth, len(self.lookup) - 1)] if self.lookup else 0.0

    def as_dict(self) -> dict:
        measured = [{"tree_topk": k, "num_draft_tokens": d, "tree_nodes": n, "seconds": s}  # whole steps timed
                    for (k, d, n), s in sorted(self.exact.items())]
        return {"verify_sizes": list(self.sizes), "verify_seconds": list(self.verify),
                "step_seconds": measured, "plain_step_seconds": self.plain,
                **({"lookup_seconds": list(self.lookup)} if self.lookup else {})}


NODE_BUDGETS = (2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 20, 24, 32, 40, 48, 64)
BEYOND_CURVE = 0.8  # a verification of more nodes than measured costs at least this much of the largest measured one


def tree_node_limit(topk: int, depth: int) -> int:
    """The most nodes (pending included) a tree of this top-k and depth can hold."""
    return 1 + topk + (depth - 1) * topk * topk


Beside = tuple[tuple[int, float], ...]  # a hybrid's lookup nodes verified beside its tree: (nodes, share of steps)


def lookup_beside(steps: list[TreeStep], depth: int) -> Beside:
    """How many n-gram nodes a hybrid's steps verify beside a tree `depth` deep, as (nodes, share of
    the steps) pairs, read off the steps recorded with the deepest tree: its chain is cut to the
    depth, and every node of it is verified (`decoding.hybrid.hang_lookup` appends the whole chain,
    twins of the model's nodes included). () for a tree with no lookup beside it."""
    if not any(s.lookup for s in steps):
        return ()
    counts: Counter = Counter()
    for s in steps:
        counts[min(len(s.lookup), depth)] += s.weight
    total = sum(counts.values())
    return tuple((n, c / total) for n, c in sorted(counts.items()))


TreeTable = dict[tuple[int, int, int], tuple[float, Beside]]  # (top-k, depth, nodes) -> (tokens a step, lookup beside)


def tree_table(steps: dict[int, list[TreeStep]], depths: list[int], nodes: list[int], node_limit=tree_node_limit,
               depth_capped: bool = False) -> TreeTable:
    """Every tree a plan weighs, (top-k, depth, nodes), with its expected tokens a step and a
    hybrid's n-gram nodes verified beside it (`lookup_beside`), read off the recorded steps of the
    largest tree of each top-k (`steps[topk]`). Node budgets beyond what `node_limit(topk, depth)`
    can fill are cut to it (EAGLE-2's expansion, or a static tree's nodes that deep). `depth_capped`:
    a tree of n nodes is at most n - 1 deep (EAGLE-2's dynamic tree without a lookup), so a deeper
    setting of it is the same tree, weighed once (at n - 1 deep, where that depth is weighed)."""
    table = {}
    for topk, recorded in sorted(steps.items()):
        for depth in depths:
            beside = lookup_beside(recorded, depth)
            for n in sorted({min(n, node_limit(topk, depth)) for n in nodes}):
                if depth_capped and depth > n - 1 and n - 1 in depths:
                    continue
                table[(topk, depth, n)] = (tree_expected_tokens(recorded, depth, n), beside)
    return table


def verified_nodes(table: TreeTable, key: tuple[int, int, int]) -> int:
    """The most nodes a step of this tree verifies: its own and its lookup's longest chain beside."""
    return key[2] + max((n for n, _ in table[key][1]), default=0)


def beside_seconds(costs: TreeCosts, nodes: int, beside: Beside, least: bool = False) -> float:
    """A step's mean verification of its `nodes` tree nodes and the lookup's nodes beside them, over
    the calibration's steps: the curve at each step's count, not at their mean (Gemma-3's curve on 2
    cores is lumpy: 4 nodes 81 ms, 5 nodes 111 ms). `least`: `least_verify_seconds`."""
    curve = costs.least_verify_seconds if least else costs.verify_seconds
    return sum(share * curve(nodes + n) for n, share in beside) if beside else curve(nodes)


def beyond_verification(costs: TreeCosts, topk: int, depth: int, nodes: int) -> float:
    """The least a step of this tree spends beyond its verification: a plain step's loop (sampling,
    bookkeeping, the sync), or what any measured tree no wider, no deeper and no smaller spent.
    Drafting more levels of more nodes costs no less; and the verification curve (one tree shape
    per size) prices a small tree's verification no dearer than its own step finds it, relative to
    a larger tree's (Gemma-3 on 2 cores: a 4-node tree verified 12 ms above its curve, a 37-node one
    5 ms below), so a larger tree's spend bounds a smaller one's and not the other way round."""
    least = costs.loop
    for (k, d, n), seconds in costs.exact.items():
        if k <= topk and d <= depth and n >= nodes:
            least = max(least, seconds - costs.verify_seconds(n))
    return least


def wider_sibling_seconds(costs: TreeCosts, key: tuple[int, int, int]) -> float | None:
    """The most a step of this tree's model can cost, from a measured step of the same depth and nodes
    at a wider top-k (the narrowest measured); None where none is measured. Both verify the same
    nodes with the same layers; the wider drafts more candidates a level, so it costs no less
    (Gemma-3 on 2 cores, 4 nodes: 2 deep top-2 51.4 ms, top-4 53.0, top-8 54.8; 3 deep top-1 53.9,
    top-2 54.0, top-4 54.4). A plan leading at this price leads at its own: measuring it whole could
    not change the decision."""
    topk, depth, nodes = key
    wider = [(k, seconds) for (k, d, n), seconds in costs.exact.items() if (d, n) == (depth, nodes) and k > topk]
    return min(wider)[1] if wider else None


def model_step_seconds(costs: TreeCosts, key: tuple[int, int, int]) -> tuple[float, bool]:
    """The step of this tree's model alone, and whether a measurement settles it: its own measured
    step, else the most it can cost by a measured wider sibling (`wider_sibling_seconds`); else the
    least it can cost, never above the truth: its verification plus `beyond_verification`."""
    if key in costs.exact:
        return costs.exact[key], True
    seconds = wider_sibling_seconds(costs, key)
    if seconds is not None:
        return seconds, True
    topk, depth, nodes = key
    return costs.least_verify_seconds(nodes) + beyond_verification(costs, topk, depth, nodes), False


def tree_seconds(table: TreeTable, costs: TreeCosts, key: tuple[int, int, int]) -> tuple[float, bool]:
    """A tree's step seconds, and whether a measurement settles them (`model_step_seconds`). A
    hybrid's step verifying both is its model's step with the verification of its own nodes
    replaced by that of its own and the calibration's lookup nodes (`beside_seconds`), plus the
    lookup's host time. Its whole step timed over a short decode of the probe prompt priced the
    lookup's nodes as that decode found them, fewer than the calibration's and the run's: Gemma-3's
    EAGLE-3 + n-gram (2 cores, 2026-11-28) planned 2.08x, measured 1.51x, at 95 ms a step timed on
    the probe for 143 ms a step in the run."""
    model, settled = model_step_seconds(costs, key)
    beside = table[key][1]
    if not beside:
        return model, settled
    _, depth, nodes = key
    own = costs.verify_seconds(nodes) if settled else costs.least_verify_seconds(nodes)
    return (model - own + beside_seconds(costs, nodes, beside, least=not settled) + costs.lookup_seconds(depth),
            settled)


FirstTable = dict[tuple[int, int, int], float]  # (top-k, depth, nodes) -> tokens a step, lookup first


def lookup_first_table(steps: dict[int, list[TreeStep]], table: TreeTable) -> FirstTable:
    """Every tree of `table` as a lookup-first hybrid's model (`decoding.hybrid`: the lookup's chain
    alone where it finds one, the model's tree where it finds none), read off the same recorded steps
    of a hybrid verifying both: its tokens a step. The steps start where the recorded decode's did,
    the approximation every smaller tree read off the largest one makes."""
    out = {}
    for topk, depth, nodes in table:
        recorded = steps.get(topk) or []
        if not recorded:
            continue
        out[(topk, depth, nodes)] = 1.0 + weighted_mean(
            recorded, lambda s: lookup_accepted(s, depth) if s.lookup else accepted_within(s, depth, nodes))
    return out


def as_hybrid_steps(steps: dict[int, list[TreeStep]], widest: int, continuation: list[int], chain,
                    depth: int) -> dict[int, list[TreeStep]]:
    """A model's recorded steps of one prompt (a decode replayed on the target's greedy
    `continuation`, its trees of each top-k grown at the steps of the `widest`) as its hybrid's with
    a lookup beside them: each step's trees and the lookup's chain where the step starts (`chain(m)`:
    the chain, `depth` deep at most, after the first m tokens of the continuation), the continuation
    as deep as either reaches. What a replayed model keeps is made of the text and the target's
    states along it, so its tree at a position is the tree its hybrid drafts there. The hybrid
    crosses copied text in fewer, longer steps than the model alone: each step weighs the model's
    advance over the hybrid's widest tree's (steps a token of the hybrid's decode over the model's,
    where they start), so the means are over the steps the hybrid would take. Recorded for the
    hybrid itself, its own decode took 12-13 s of the Gemma-3 demo's plans on 2 cores."""
    out: dict[int, list[TreeStep]] = {k: [] for k in steps}
    read = {k: iter(recorded) for k, recorded in steps.items() if k != widest}
    emitted = 0
    for step in steps[widest]:
        known = tuple(continuation[emitted:emitted + depth + 1])
        if step.continuation != known[:len(step.continuation)]:
            raise ValueError("recorded steps read as a hybrid's come from a decode replayed on the continuation")
        drafted = bool(step.tokens)  # a step with no tree: the token budget's last, its lookup cut as short
        lookup = tuple(chain(emitted))[:depth] if drafted else ()
        advance = max(len(step.continuation), 1 + agreed(lookup, known))
        weight = len(step.continuation) / advance
        for k in steps:
            s = step if k == widest or not drafted else next(read[k])  # no tree grew beside a step with none
            out[k].append(TreeStep(s.tokens, s.parents, s.depths, known, lookup, weight))
        emitted += len(step.continuation)
    if any(next(rest, None) is not None for rest in read.values()):
        raise ValueError("trees grown beside the widest are recorded once for each step that drafted a tree")
    return out


def lookup_first_seconds(table: TreeTable, costs: TreeCosts, key: tuple[int, int, int]) -> tuple[float, bool]:
    """A lookup-first hybrid's step seconds with this tree, and whether a measurement settles them:
    where the lookup proposes (the calibration's share of steps, `lookup_beside`), the verification
    of its chain and a plain step's loop; elsewhere its model's step alone (`model_step_seconds`);
    and the lookup's host time every step. Priced at the tree's step timed beside the lookup on the
    probe, the model's steps cost what the probe's lookup nodes did: Gemma-3's EAGLE-3 + n-gram
    (2 cores, 2026-11-28) planned 1.52x, measured 1.82x."""
    model, settled = model_step_seconds(costs, key)
    found = [(n, share) for n, share in table[key][1] if n]
    share = sum(s for _, s in found)
    lookup = sum(s * costs.least_verify_seconds(1 + n) for n, s in found) / share + costs.loop if share else 0.0
    return share * lookup + (1 - share) * model + costs.lookup_seconds(key[1]), settled


def plan_tree(table: TreeTable, costs: TreeCosts, measured_only: bool = False, first: FirstTable | None = None,
              modes: tuple[bool, ...] = (False,)) -> Plan:
    """The (top-k, depth, nodes) of `table` with the most expected tokens per second, or the target
    alone, each tree priced by `tree_seconds` (`measured_only`: only trees it settles by a
    measurement). A tree not measured is planned at the most it could reach. A hybrid (`first`, its
    `lookup_first_table`) weighs each tree in `modes` (False: both branches verified each step; True:
    lookup first, `lookup_first_seconds`)."""
    candidates = [Candidate(0, 1.0, 1.0, measured=True)]
    hybrid = None if first is None else False
    for key, (expected, _) in sorted(table.items()):
        topk, depth, nodes = key
        if False in modes:
            seconds, measured = tree_seconds(table, costs, key)
            if measured or not measured_only:
                candidates.append(Candidate(depth, expected, expected * costs.plain / seconds, nodes, topk,
                                            measured=measured, lookup_first=hybrid))
        if first is not None and True in modes and key in first:
            seconds, measured = lookup_first_seconds(table, costs, key)
            if measured or not measured_only:
                tokens = first[key]
                candidates.append(Candidate(depth, tokens, tokens * costs.plain / seconds, nodes, topk,
                                            measured=measured, lookup_first=True))
    return best_plan(candidates)


MEASURED_TREES = 12  # trees a plan measures whole, at most, before it settles on the best of them
TIE = 0.03  # a tree within this much of the best measured one is not measured: repeated step timings spread as much


def plan_tree_measured(table: TreeTable, costs: TreeCosts, measure, extend=None, limit: int = MEASURED_TREES,
                       tie: float = TIE, first: FirstTable | None = None,
                       modes: tuple[bool, ...] = (False,)) -> tuple[Plan, TreeCosts]:
    """The plan that measuring every tree whole would give, measuring only what the decision needs, and the
    costs it measured (branch and bound). Each tree is priced as `tree_seconds` knows it: its own
    measured step, a wider sibling's (the most it can cost), else the least it can cost. While the
    leader is not settled so, it is measured whole (`measure(topk, depth, nodes)` -> seconds, into
    `costs.exact`), or, where it verifies more nodes than the curve reaches, the curve is measured
    further (`extend(costs)` -> wider costs, None when there is no more to measure), and the plan made
    again. A tree not measured never costs less than its price and a settled one never more, so when the
    leader is settled no other can beat it: that is the plan (a narrower tree priced by its wider
    sibling may be a few percent faster than its price, the spread between top-ks; in exchange, one
    measurement per depth and nodes, not one per top-k: Gemma-3's two EAGLE-3 plans measured 12 whole
    steps, not 20).
    Cut short (before it has measured the leader): after `limit` measurements, or when the leader's
    price is within `tie` of the best measured tree's (the noise of a step timing could not tell them
    apart), the best measured tree. A small tree priced from the deepest tree's measured step moved down
    the curve was off by half on Gemma-3's lumpy curve (a 4-node tree planned 1.83x, measured 1.17x): a
    chosen tree is always priced by a step measured whole, its own or a wider sibling's of its depth and
    nodes. A hybrid's trees are weighed in `modes` (`plan_tree`), each settled by its model's measured
    step alone (`measure` times the model without the lookup: `tree_seconds` prices the lookup's nodes)."""
    measured = 0
    while True:
        plan = plan_tree(table, costs, first=first, modes=modes)
        key = (plan.tree_topk, plan.num_draft_tokens, plan.tree_nodes)
        if plan.num_draft_tokens == 0 or tree_seconds(table, costs, key)[1]:
            return plan, costs
        if extend is not None and not costs.covers(verified_nodes(table, key)):
            wider = extend(costs)
            if wider is not None:
                costs = wider
                continue
        settled = plan_tree(table, costs, measured_only=True, first=first, modes=modes)
        if measured >= limit or plan.planned_speedup <= settled.planned_speedup * (1 + tie):
            return dataclasses.replace(settled, candidates=plan.candidates), costs  # every tree weighed, for the report
        costs.exact[key] = measure(*key)
        measured += 1


# ---------------------------------------------------------------------------------- calibration

CONFIDENCE_Z = 1.96  # a 95% confidence interval
CALIBRATION_TOLERANCE = 0.075  # its half-width, relative: half of the 15% a plan is to come within of its measurement
MIN_CALIBRATION_PROMPTS = 3


def tokens_per_step(per_prompt: list[tuple[float, int]]) -> tuple[float, float]:
    """(tokens a step, the half-width of its 95% confidence interval) over calibration prompts
    that emitted `tokens` in `steps` each: a ratio of sums, the prompts as the sampled units (the
    steps of one prompt are not independent: copying comes in spans, a hard prompt is hard
    throughout), its variance by the delta method. Fewer than 2 prompts: an infinite half-width."""
    tokens, steps = sum(t for t, _ in per_prompt), sum(s for _, s in per_prompt)
    ratio = tokens / steps if steps else 1.0
    n = len(per_prompt)
    if n < 2 or not steps:
        return ratio, math.inf
    variance = sum((t - ratio * s) ** 2 for t, s in per_prompt) / ((n - 1) * n * (steps / n) ** 2)
    return ratio, CONFIDENCE_Z * math.sqrt(variance)


def enough_prompts(per_prompt: list[tuple[float, int]], tolerance: float = CALIBRATION_TOLERANCE,
                   minimum: int = MIN_CALIBRATION_PROMPTS) -> bool:
    """Whether calibration may stop: at least `minimum` prompts, and tokens a step known to within
    `tolerance` of itself (`tokens_per_step`). A drafter whose acceptance varies little from prompt
    to prompt stops early; n-gram lookup, whose copying varies the most, reads its whole budget."""
    if len(per_prompt) < minimum:
        return False
    ratio, half_width = tokens_per_step(per_prompt)
    return half_width <= tolerance * ratio


OVERHEAD_LIMIT = 10.0  # a step's overhead beyond its forwards, in target forwards of one token, at most
DRAFT_LIMIT = 2.0  # a draft model's forward of n tokens, in the target's forwards of as many tokens, at most


def implausible(costs: Costs, draft_forwards: list[tuple[int, int]] | None = None) -> list[str]:
    """Why measured chain costs cannot be the machine's: a plain step's overhead beyond its forward
    of many forwards (sampling and bookkeeping cost a fraction of one), or a drafter's forwards
    dearer than the target's forwards of as many tokens (a drafter is the smaller model), with a
    margin for noise. Both come from a machine busy during one measurement and not another (the
    README's demo on a shared machine measured a 2.15 s overhead and a 0.448 s draft forward beside
    a 39 ms target forward), and both make every drafting option look cheap. `draft_forwards[k - 1]`:
    (forwards, tokens each) of drafting k (None: a drafter without forwards, as n-gram lookup)."""
    one = costs.verify[0]
    if one <= 0 or not all(math.isfinite(c) and c >= 0 for c in (*costs.verify, *costs.draft, costs.overhead)):
        return ["a cost that is not a positive number of seconds"]
    out = []
    if costs.overhead > OVERHEAD_LIMIT * one:
        out.append(f"a plain step's overhead of {costs.overhead * 1e3:.1f} ms is more than {OVERHEAD_LIMIT:g} target "
                   f"forwards of {one * 1e3:.1f} ms")
    for k, (forwards, tokens) in enumerate(draft_forwards or [], start=1):
        target = forwards * interpolate(costs.verify, tokens)
        if k < len(costs.draft) and costs.draft[k] > DRAFT_LIMIT * target:
            out.append(f"drafting {k} cost {costs.draft[k] * 1e3:.1f} ms, more than {DRAFT_LIMIT:g}x the target's "
                       f"{forwards} forward(s) of {tokens} token(s) ({target * 1e3:.1f} ms)")
            break
    return out


def fallback_plan() -> Plan:
    """The plan from costs that cannot be trusted: the target alone, which is never slower than
    itself, rather than speculation sized on noise."""
    return Plan(0, 1.0, 1.0, (Candidate(0, 1.0, 1.0),))


def noisy(seconds_by_size: list[list[float]], spread: float = 0.5) -> list[str]:
    """Why a measured cost curve looks like a busy machine rather than the model: a size whose
    repeats, less the fastest and the slowest, spread over more than `spread` of their median,
    or a forward of more tokens clearly cheaper than one of fewer (a cost curve is
    non-decreasing up to noise)."""
    from statistics import median

    meds = [median(s) for s in seconds_by_size]
    inner = [sorted(s)[1:-1] if len(s) > 3 else sorted(s) for s in seconds_by_size]
    out = [f"{n} tokens: {s[0] * 1e3:.1f}-{s[-1] * 1e3:.1f} ms around a median of {m * 1e3:.1f} ms"
           for n, (s, m) in enumerate(zip(inner, meds), start=1) if m > 0 and (s[-1] - s[0]) > spread * m]
    for n in range(1, len(meds)):
        if meds[n] < 0.8 * meds[n - 1]:
            out.append(f"{n + 1} tokens cost {meds[n] * 1e3:.1f} ms, less than {n} tokens' {meds[n - 1] * 1e3:.1f} ms")
    return out


__all__ = ["CALIBRATION_TOLERANCE", "MEASURED_TREES", "MIN_CALIBRATION_PROMPTS", "NODE_BUDGETS", "Candidate", "Costs",
           "FirstTable", "HybridStep", "Plan", "TreeCosts", "TreeStep", "TreeTable", "accepted_within", "agreed",
           "best_plan", "beyond_verification", "enough_prompts", "expected_tokens", "fallback_plan",
           "hybrid_step_seconds", "implausible", "interpolate", "lookup_accepted", "lookup_first_seconds",
           "lookup_first_table", "noisy", "plan_chain", "plan_hybrid_chain", "plan_tree", "plan_tree_measured",
           "step_seconds", "tokens_per_step", "tree_expected_tokens", "tree_node_limit", "tree_seconds", "tree_table",
           "walk_chain", "walk_hybrid", "walked_rates"]
