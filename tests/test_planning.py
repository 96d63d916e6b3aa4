"""The planner against independent references: a Monte-Carlo simulation of chain decoding under
the same acceptance and cost model picks the same K and the same speedup; for trees, every
smaller tree built and verified by the decoder's own greedy verdict, and a brute-force search."""

import dataclasses
import math
import random

import pytest
import torch

from drafttrain.decoding.verify import greedy_tree_verdict
from drafttrain.planning import (Costs, HybridStep, TreeCosts, TreeStep, accepted_within, as_hybrid_steps, enough_prompts,
                                 expected_tokens,
                                 interpolate, lookup_beside, lookup_first_seconds, lookup_first_table, noisy, plan_chain,
                                 plan_hybrid_chain, plan_tree, plan_tree_measured, step_seconds,
                                 tokens_per_step, tree_expected_tokens, tree_node_limit, tree_seconds, tree_table,
                                 walk_chain, walked_rates)
from drafttrain.trees import tree_from_parents


def simulate(acceptance, costs, k, proposal_rates=None, steps=40_000, seed=0):
    """Tokens per second of K-draft chain decoding, drawn step by step: position j is proposed
    with probability rates[j]/rates[j-1] given j-1 were, and accepted with a_j/a_{j-1} given the
    ones before it were (so P(first j accepted) = a_j); the step then costs V(1 + proposed) plus
    the drafter's k-token cost plus the overhead."""
    rng = random.Random(seed)
    tokens = seconds = 0.0
    for _ in range(steps):
        proposed = 0
        for j in range(k):
            previous = proposal_rates[j - 1] if j and proposal_rates else 1.0
            rate = proposal_rates[j] if proposal_rates else 1.0
            if rng.random() >= rate / previous:
                break
            proposed += 1
        accepted = 0
        for j in range(proposed):
            given = acceptance[j] / (acceptance[j - 1] if j else 1.0)
            given /= (proposal_rates[j] / (proposal_rates[j - 1] if j else 1.0)) if proposal_rates else 1.0
            if rng.random() >= given:
                break
            accepted += 1
        tokens += accepted + 1
        seconds += (costs.verify[proposed] if k else costs.verify[0]) + costs.draft[k] + costs.overhead
    return tokens / seconds


def brute_force(acceptance, costs, max_k, proposal_rates=None):
    plain = 1.0 / (costs.verify[0] + costs.overhead)
    speeds = [simulate(acceptance, costs, k, proposal_rates) / plain for k in range(max_k + 1)]
    return max(range(max_k + 1), key=lambda k: speeds[k]), speeds


CASES = {
    # a GPU at batch 1: verification is nearly free, drafting cheap: draft deep
    "gpu": ([0.8, 0.64, 0.51, 0.41, 0.33, 0.26], Costs((1.0, 1.01, 1.02, 1.03, 1.04, 1.05, 1.06), (0, .05, .1, .15, .2, .25, .3), 0.02)),
    # 2 CPU cores: every extra token costs, a draft LM costs a third of a target forward per token
    "cpu draft": ([0.5, 0.27, 0.2, 0.11], Costs((1.0, 1.2, 1.35, 1.45, 1.6), (0, .33, .66, 1.0, 1.33), 0.05)),
    # an untrained draft: nothing pays, plain decoding wins
    "untrained": ([0.05, 0.0, 0.0, 0.0], Costs((1.0, 1.2, 1.3, 1.4, 1.5), (0, .3, .6, .9, 1.2), 0.05)),
    # a parallel draft: one forward whatever K
    "parallel": ([0.55, 0.3, 0.15, 0.05], Costs((1.0, 1.15, 1.3, 1.4, 1.6), (0, .3, .32, .34, .36), 0.05)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_plan_is_the_best_k_of_a_simulated_decode(case):
    acceptance, costs = CASES[case]
    plan = plan_chain(acceptance, costs)
    best, speeds = brute_force(acceptance, costs, len(acceptance))
    assert plan.num_draft_tokens == best or speeds[plan.num_draft_tokens] == pytest.approx(speeds[best], rel=0.01)
    assert plan.planned_speedup == pytest.approx(speeds[plan.num_draft_tokens], rel=0.02)
    assert plan.expected_tokens == pytest.approx(expected_tokens(acceptance, plan.num_draft_tokens))


def test_plans_follow_the_hardware():
    assert plan_chain(*CASES["gpu"]).num_draft_tokens == 6
    assert plan_chain(*CASES["untrained"]).num_draft_tokens == 0
    assert plan_chain(*CASES["untrained"]).planned_speedup == 1.0


def test_a_drafter_that_often_proposes_nothing_is_planned_with_its_cheaper_steps():
    acceptance = [0.35, 0.23, 0.19, 0.17]
    rates = [0.5, 0.45, 0.42, 0.4]          # n-gram lookup: no match in half the steps
    costs = Costs((1.0, 1.3, 1.5, 1.6, 1.7), (0, 0, 0, 0, 0), 0.05)
    with_rates = plan_chain(acceptance, costs, rates)
    best, speeds = brute_force(acceptance, costs, 4, rates)
    assert with_rates.num_draft_tokens == best
    assert with_rates.planned_speedup == pytest.approx(speeds[best], rel=0.02)
    assert with_rates.planned_speedup > plan_chain(acceptance, costs).planned_speedup
    assert step_seconds(costs, 2, rates) == pytest.approx(0.5 * 1.0 + 0.05 * 1.3 + 0.45 * 1.5 + 0.05)


def test_a_chain_hybrids_lookup_is_priced_by_the_steps_it_proposes_in():
    """A chain hybrid's lookup proposes all of its K tokens or none: a step verifies K + 1 nodes or
    2K + 1. On a lumpy curve (Gemma-3 on 2 cores: 4 tokens cheaper than 3, 5 dearer by a third) the
    cost of the mean size is not the mean cost; the plan prices each K at what the steps, drawn one
    by one, cost on average, and plans the K fastest at those costs."""
    verify = (36.8, 38.6, 46.9, 44.7, 59.1, 74.5, 89.7, 88.0, 104.6, 115.7, 127.4, 150.0, 152.5)
    costs = Costs(verify, (0, 2.3, 2.6, 2.6, 2.9, 4.0, 4.8), 0.1)
    acceptance, max_k, proposing = [0.72, 0.51, 0.4, 0.31, 0.23, 0.19], 6, 0.59
    rng = random.Random(0)
    for k in range(1, max_k + 1):
        draws = [k + 1 + (k if rng.random() < proposing else 0) for _ in range(20_000)]
        mean_cost = sum(verify[n - 1] for n in draws) / len(draws)
        extra = proposing * k
        assert step_seconds(costs, k, extra_tokens=extra) == pytest.approx(mean_cost + costs.draft[k] + 0.1, rel=0.01)
    plan = plan_chain(acceptance, costs, max_k=max_k, extra_tokens=proposing * max_k)
    truth = {k: expected_tokens(acceptance, k) * (verify[0] + 0.1) /
             ((1 - proposing) * verify[k] + proposing * verify[2 * k] + costs.draft[k] + 0.1) for k in range(1, max_k + 1)}
    best = max(truth, key=truth.get)
    assert plan.num_draft_tokens == best and plan.planned_speedup == pytest.approx(truth[best])
    at_the_mean = step_seconds(Costs(verify, costs.draft, 0.1), 2) - verify[2] + interpolate(verify, 3 + 2 * proposing)
    assert step_seconds(costs, 2, extra_tokens=2 * proposing) > 1.1 * at_the_mean  # what the mean size misprices


def hybrid_walks(lookup_tokens: int, both_tokens: int, model_tokens: int, k: int = 3) -> dict:
    """Half the steps find a lookup continuation (lookup first: `lookup_tokens` emitted; both:
    `both_tokens`, the model's branch going further on some), half find none (the model's K:
    `model_tokens`)."""
    return {(k, True): [HybridStep(k, False, lookup_tokens)] * 5 + [HybridStep(k, True, model_tokens)] * 5,
            (k, False): [HybridStep(2 * k, True, both_tokens)] * 5 + [HybridStep(k, True, model_tokens)] * 5}


def test_a_chain_hybrid_verifies_the_lookup_alone_where_nodes_cost_and_both_where_they_are_free():
    """Each walked step priced by its own nodes (and the hybrid's drafting share where the model
    drafted, the lookup's alone where it did not), summed against the tokens: on a CPU-like curve (a
    node a fifth of a step) the lookup's chain alone wins, on a GPU-like flat one verifying both, which
    emits more; the speedups as computed by hand."""
    walks = hybrid_walks(lookup_tokens=4, both_tokens=4.5, model_tokens=2)
    lookup = [0.0, 1e-4, 1e-4, 1e-4]
    cpu = Costs(tuple(0.040 + 0.008 * n for n in range(7)), (0.0, 0.006, 0.007, 0.008), 0.001)
    gpu = Costs((0.010,) * 7, (0.0, 0.001, 0.001, 0.001), 0.001)
    for costs, first in ((cpu, True), (gpu, False)):
        plain = costs.verify[0] + costs.overhead
        v, d, o, lk = costs.verify, costs.draft[3], costs.overhead, lookup[3]
        # a model step pays the hybrid's measured drafting share (its model's and its lookup's), a lookup step the lookup's
        truth = {True: (5 * 4 + 5 * 2) * plain / (5 * (v[3] + lk + o) + 5 * (v[3] + d + o)),
                 False: (5 * 4.5 + 5 * 2) * plain / (5 * (v[6] + d + o) + 5 * (v[3] + d + o))}
        plan = plan_hybrid_chain(walks, costs, lookup)
        assert (plan.num_draft_tokens, plan.lookup_first) == (3, first)
        assert plan.planned_speedup == pytest.approx(truth[first]) and truth[first] > truth[not first]
    nothing = plan_hybrid_chain(hybrid_walks(1, 1, 1), cpu, lookup)  # no step accepts a draft: the target alone
    assert (nothing.num_draft_tokens, nothing.lookup_first, nothing.planned_speedup) == (0, None, 1.0)


def test_k_is_capped_by_what_was_measured():
    acceptance, costs = CASES["gpu"]
    assert plan_chain(acceptance[:3], costs).num_draft_tokens <= 3
    assert plan_chain(acceptance, costs, max_k=2).num_draft_tokens <= 2
    assert len(plan_chain(acceptance, costs, max_k=2).candidates) == 3


def test_a_busy_machine_is_named_and_a_quiet_one_is_not():
    quiet = [[1.0, 1.01, 0.99, 1.0, 1.02], [1.2, 1.21, 1.19, 1.2, 1.2], [1.3, 1.31, 1.3, 1.29, 1.3]]
    assert noisy(quiet) == []
    spread = [[1.0, 1.01, 2.5, 3.0, 0.99], *quiet[1:]]
    assert any(line.startswith("1 tokens") for line in noisy(spread))
    backwards = [quiet[0], [2.3, 2.3, 2.31, 2.29, 2.3], [1.3, 1.31, 1.3, 1.29, 1.3]]
    assert any("less than 2 tokens'" in line for line in noisy(backwards))


# ---------------------------------------------------------------------------------------- trees


def random_step(rng: random.Random, size: int = 30, vocab: int = 5, max_depth: int = 5) -> TreeStep:
    """A tree step as EAGLE-2 records it: candidates with cumulative scores (a child never above
    its parent), listed best first, and a greedy continuation that often runs along them."""
    nodes = [(-1, 0, 0.0, None)]  # (parent, depth, score, token) of every node drafted, the root first
    for _ in range(size):
        parent = rng.randrange(len(nodes))
        if nodes[parent][1] == max_depth:
            continue
        used = {t for p, _, _, t in nodes if p == parent}
        free = [t for t in range(vocab) if t not in used]
        if free:
            nodes.append((parent, nodes[parent][1] + 1, nodes[parent][2] - rng.random(), rng.choice(free)))
    order = sorted(range(1, len(nodes)), key=lambda n: (-nodes[n][2], nodes[n][1], n))
    rank = {n: i for i, n in enumerate(order)}
    walk, continuation = 0, []
    for _ in range(max_depth + 1):  # along the tree while it lasts, then the target's own tokens
        children = [n for n in range(1, len(nodes)) if nodes[n][0] == walk]
        if children and rng.random() < 0.8:
            walk = rng.choice(children)
            continuation.append(nodes[walk][3])
        else:
            continuation.append(rng.randrange(vocab))
            break
    return TreeStep(tuple(nodes[n][3] for n in order), tuple(rank.get(nodes[n][0], -1) for n in order),
                    tuple(nodes[n][1] for n in order), tuple(continuation),
                    tuple(rng.randrange(vocab) for _ in range(rng.randrange(0, 4))))


def verified_length(step: TreeStep, depth: int, nodes: int) -> int:
    """What the decoder itself accepts: the sub-tree built as a `Tree`, verified by
    `greedy_tree_verdict` against a target whose argmax at each node is the continuation's next
    token where the node lies on it (anything else elsewhere), and the n-gram chain checked token
    by token."""
    kept = [i for i, d in enumerate(step.depths) if d <= depth][:nodes - 1]
    index = {i: n for n, i in enumerate(kept, start=1)}
    tree = tree_from_parents([-1] + [index.get(step.parents[i], 0) for i in kept])
    tokens = torch.tensor([99] + [step.tokens[i] for i in kept])
    argmax = torch.full((len(tokens),), 98)
    for n in range(len(tokens)):
        depth_n = len(tree.path_to(n)) - 1
        path_tokens = [int(tokens[m]) for m in tree.path_to(n)[1:]]
        if list(step.continuation[:depth_n]) == path_tokens and depth_n < len(step.continuation):
            argmax[n] = step.continuation[depth_n]
    best = int(greedy_tree_verdict(argmax, tokens, tree)[0])
    model = len(tree.path_to(best)) - 1
    lookup = 0
    for a, b in zip(step.lookup[:depth], step.continuation):
        if a != b:
            break
        lookup += 1
    return max(model, lookup)


def test_what_a_smaller_tree_accepts_is_what_the_decoder_verifies():
    rng = random.Random(0)
    for _ in range(300):
        step = random_step(rng)
        for depth in (1, 2, 3, 5):
            for nodes in (2, 3, 5, 8, 16, 40):
                assert accepted_within(step, depth, nodes) == verified_length(step, depth, nodes), (step, depth, nodes)


SIZES = (1, 2, 4, 8, 16, 24)


def true_costs(verify, draft, dearer_small=0.0):
    """A machine's whole tree steps: drafting `draft` a level, the verification curve `verify` at
    SIZES, and `dearer_small` more below 5 nodes (a lumpy curve's narrow kernels)."""
    curve = TreeCosts(SIZES, verify, 1.0)
    return lambda k, d, n: 1.0 + draft * d + curve.verify_seconds(n) - 1.0 + (dearer_small if n <= 4 else 0.0)


def fastest_tree(steps, depths, budgets, seconds, verify):
    """(speedup, depth, nodes, top-k) of the fastest tree under `seconds(k, d, n)` (its model's step
    alone), decoded step by step with the decoder's own verdict, each step verifying its n-gram chain
    cut to the depth beside the tree (the curve `verify` at SIZES at its own node count), or the
    target alone."""
    curve = TreeCosts(SIZES, verify, 1.0)
    best = (1.0, 0, None, None)
    for k, recorded in steps.items():
        for d in depths:
            for n in budgets:
                n = min(n, tree_node_limit(k, d))
                spent = sum(seconds(k, d, n) - curve.verify_seconds(n) + curve.verify_seconds(n + len(s.lookup[:d]))
                            for s in recorded)
                speed = sum(1 + verified_length(s, d, n) for s in recorded) / spent
                if speed > best[0] + 1e-9:
                    best = (speed, d, n, k)
    return best


def searched(steps, depths, budgets, seconds, verify, limit=100, tie=0.0, sizes=SIZES):
    """`plan_tree_measured` on the recorded steps with the true step costs as its measurements and
    the curve `verify` at `sizes`: (plan, the trees it measured)."""
    measured = []

    def measure(k, d, n):
        measured.append((k, d, n))
        return seconds(k, d, n)

    costs = TreeCosts(tuple(sizes), tuple(verify), 1.0)
    plan, _ = plan_tree_measured(tree_table(steps, depths, budgets), costs, measure, limit=limit, tie=tie)
    return plan, measured


def test_the_tree_plan_is_the_best_setting_of_a_brute_force_search():
    """Every (top-k, depth, nodes) decoded step by step on the recorded steps with the decoder's
    own verdict, and charged its true cost; the planner, measuring only the trees its bounds could
    not rule out, picks the fastest (and plain decoding when no tree pays) at its true speedup."""
    rng = random.Random(1)
    steps = {k: [random_step(rng, size=10 * k) for _ in range(60)] for k in (1, 4)}
    depths, budgets = [1, 2, 3, 4], [2, 4, 8, 16]
    trees = len(tree_table(steps, depths, budgets))
    for verify, draft in (((1.0, 1.02, 1.05, 1.1, 1.2, 1.3), 0.05), ((1.0, 1.4, 2.0, 3.2, 6.0, 9.0), 0.3),
                          ((1.0, 3.0, 5.0, 9.0, 17.0, 25.0), 0.9)):
        seconds = true_costs(verify, draft)
        plan, measured = searched(steps, depths, budgets, seconds, verify)
        best = fastest_tree(steps, depths, budgets, seconds, verify)
        assert plan.planned_speedup == pytest.approx(best[0])
        assert (plan.num_draft_tokens, plan.tree_nodes, plan.tree_topk) == best[1:]
        assert len(measured) == len(set(measured)) < trees  # what the decision needed, not every tree
    assert plan.num_draft_tokens == 0 and measured == []  # verification as dear as on a busy CPU: no tree measured


def test_a_tree_plan_is_priced_by_its_own_measured_step():
    """Small trees cost more than the curve says (Gemma-3 on 2 cores: a 4-node tree planned 1.83x,
    measured 1.17x): the leader is measured whole until the leader is a measured tree, and the plan
    is what a search over every tree's true cost plans, at that cost. The model's trees alone: no
    n-gram chain beside them."""
    rng = random.Random(1)
    steps = {k: [dataclasses.replace(random_step(rng, size=10 * k), lookup=()) for _ in range(60)] for k in (1, 4)}
    depths, budgets = [1, 2, 3, 4], [2, 4, 8, 16]
    verify = (1.0, 1.02, 1.05, 1.6, 2.4, 3.2)
    seconds = true_costs(verify, 0.05, dearer_small=0.5)
    by_curve = plan_tree(tree_table(steps, depths, budgets), TreeCosts(SIZES, verify, 1.0))
    truth = fastest_tree(steps, depths, budgets, seconds, verify)
    assert by_curve.tree_nodes <= 4 and by_curve.planned_speedup > 1.15 * truth[0]  # the curve alone misplans
    plan, measured = searched(steps, depths, budgets, seconds, verify)
    assert (plan.num_draft_tokens, plan.tree_nodes, plan.tree_topk) == truth[1:]
    assert plan.planned_speedup == pytest.approx(truth[0])
    assert (plan.tree_topk, plan.num_draft_tokens, plan.tree_nodes) in measured and len(measured) > 1
    chosen = next(c for c in plan.candidates if (c.num_draft_tokens, c.tree_nodes, c.tree_topk) == truth[1:])
    assert chosen.measured


def test_after_its_measurement_limit_the_plan_is_the_best_measured_tree():
    rng = random.Random(1)
    steps = {k: [random_step(rng, size=10 * k) for _ in range(60)] for k in (1, 4)}
    verify = (1.0, 1.02, 1.05, 1.6, 2.4, 3.2)
    seconds = true_costs(verify, 0.05, dearer_small=0.5)
    plan, measured = searched(steps, [1, 2, 3, 4], [2, 4, 8, 16], seconds, verify, limit=1)
    assert len(measured) == 1
    k, d, n = measured[0]
    only = fastest_tree({k: steps[k]}, [d], [n], seconds, verify)
    assert (plan.num_draft_tokens, plan.tree_nodes, plan.tree_topk, plan.planned_speedup) == \
        ((only[1], only[2], only[3], pytest.approx(only[0])) if only[1] else (0, None, None, 1.0))


def test_a_leader_within_the_tie_of_a_measured_tree_is_not_measured():
    """Step timings spread by a few percent: a tree whose bound beats the best measured tree by
    less than `tie` could not be told from it, so the search settles on the measured one."""
    rng = random.Random(1)
    steps = {k: [random_step(rng, size=10 * k) for _ in range(60)] for k in (1, 4)}
    verify = (1.0, 1.02, 1.05, 1.1, 1.2, 1.3)
    seconds = true_costs(verify, 0.05)
    exact, every = searched(steps, [1, 2, 3, 4], [2, 4, 8, 16], seconds, verify)
    tied, fewer = searched(steps, [1, 2, 3, 4], [2, 4, 8, 16], seconds, verify, tie=0.5)
    assert len(fewer) < len(every) and all(c.measured for c in tied.candidates
                                           if (c.num_draft_tokens, c.tree_nodes, c.tree_topk) ==
                                           (tied.num_draft_tokens, tied.tree_nodes, tied.tree_topk))
    assert tied.planned_speedup * 1.5 >= exact.planned_speedup


def test_the_curve_is_measured_as_far_as_a_leader_needs():
    """A verification curve measured a size at a time, further only while a leader verifies more
    nodes than it reaches: on dear verification (a CPU's) the large trees are ruled out before the
    curve reaches them, on cheap verification (a GPU's) it is measured to its end; either way the
    plan is the full curve's."""
    rng = random.Random(1)
    steps = {k: [random_step(rng, size=10 * k) for _ in range(60)] for k in (1, 4)}
    depths, budgets, sizes = [1, 2, 3, 4], [2, 4, 8, 16, 32, 64], (1, 2, 4, 8, 16, 32, 64)
    reached = {}
    for machine, verify, draft in (("cpu", (1.0, 1.4, 2.0, 3.2, 6.0, 11.0, 21.0), 0.3),
                                   ("gpu", (1.0, 1.01, 1.02, 1.03, 1.04, 1.05, 1.06), 0.01)):
        curve = TreeCosts(sizes, verify, 1.0)
        seconds = lambda k, d, n: draft * d + curve.verify_seconds(n)  # noqa: E731
        full, _ = searched(steps, depths, budgets, seconds, verify, sizes=sizes)

        def extend(costs):
            reach = len(costs.sizes) + 1
            return None if reach > len(sizes) else TreeCosts(sizes[:reach], verify[:reach], costs.plain,
                                                            exact=costs.exact)

        plan, costs = plan_tree_measured(tree_table(steps, depths, budgets), TreeCosts(sizes[:2], verify[:2], 1.0),
                                         seconds, extend, limit=100, tie=0.0)
        assert (plan.num_draft_tokens, plan.tree_nodes, plan.tree_topk) == \
            (full.num_draft_tokens, full.tree_nodes, full.tree_topk)
        reached[machine] = costs.sizes[-1]
    assert reached["cpu"] < reached["gpu"] == 64


def test_a_deeper_setting_of_a_capped_tree_is_weighed_once():
    """EAGLE-2's tree of n nodes is at most n - 1 deep: (k, 3, 2) is (k, 1, 2), the same tree at
    the same tokens a step, so the table keeps the shallow one only."""
    rng = random.Random(2)
    steps = {4: [dataclasses.replace(random_step(rng, size=40), lookup=()) for _ in range(30)]}  # no hybrid
    full = tree_table(steps, [1, 2, 3], [2, 3, 8])
    capped = tree_table(steps, [1, 2, 3], [2, 3, 8], depth_capped=True)
    assert set(full) - set(capped) == {(4, 2, 2), (4, 3, 2), (4, 3, 3)}
    assert full[(4, 3, 2)] == full[(4, 1, 2)] and full[(4, 3, 3)] == full[(4, 2, 3)]


def test_a_hybrid_step_accepts_the_longer_of_its_tree_and_its_ngram_chain():
    step = TreeStep(tokens=(5, 6, 7), parents=(-1, 0, 1), depths=(1, 2, 3), continuation=(5, 9, 9, 9, 1),
                    lookup=(5, 9, 9, 9))
    assert accepted_within(step, 4, 4) == 4     # the n-gram chain runs furthest
    assert accepted_within(step, 2, 4) == 2     # cut to the depth
    no_lookup = TreeStep(step.tokens, step.parents, step.depths, step.continuation)
    assert accepted_within(no_lookup, 4, 4) == 1
    assert tree_expected_tokens([step, no_lookup], 4, 4) == pytest.approx(1 + (4 + 1) / 2)


def test_a_hybrids_ngram_nodes_are_charged_cut_to_each_depth():
    """The hybrid's n-gram chains are recorded with the deepest tree (4 nodes here); a depth-1 tree
    verifies one of them. A step of 2 model nodes is its model's measured step alone moved along the
    verification curve by the step's own n-gram count: from 2 to 3 nodes, not to 6 (dear), which
    priced Gemma-3's depth-1 hybrid step below a plain step (planned 1.82x, measured 1.28x)."""
    step = TreeStep(tokens=(5, 6), parents=(-1, -1), depths=(1, 1), continuation=(5, 9, 9, 9, 1), lookup=(5, 9, 9, 9))
    fresh = TreeStep(step.tokens, step.parents, step.depths, step.continuation)
    assert lookup_beside([step], 1) == ((1, 1.0),) and lookup_beside([step], 4) == ((4, 1.0),)
    assert lookup_beside([step, fresh], 3) == ((0, 0.5), (3, 0.5)) and lookup_beside([fresh], 3) == ()
    costs = TreeCosts((1, 2, 3, 4, 5, 6, 7), (1.0, 1.0, 2.0, 2.0, 3.0, 5.0, 7.0), 1.0, exact={(2, 1, 2): 1.5})
    table = tree_table({2: [step]}, [1], [2])
    plan = plan_tree(table, costs)
    depth1 = next(c for c in plan.candidates if c.num_draft_tokens == 1)
    assert depth1.tree_nodes == 2 and table[(2, 1, 2)][1] == ((1, 1.0),)
    assert depth1.planned_speedup == pytest.approx(tree_expected_tokens([step], 1, 2) * 1.0 / (1.5 - 1.0 + 2.0))
    assert plan.num_draft_tokens == 0  # 2 tokens a step for 2.5 plain steps: the target alone wins


def test_a_lookup_first_tree_hybrid_is_read_off_the_steps_that_verified_both():
    """A hybrid's recorded steps (the model's tree and the lookup's chain verified together) read as a
    lookup-first hybrid: where the lookup proposed, its own acceptance cut to the depth (even where the
    model's branch went further); elsewhere the model's tree. Each priced by hand: the lookup's chain
    and a plain step's loop, or the model's step alone as measured. On a curve where nodes cost,
    lookup first wins; on a flat one, both verified (which accepts more)."""
    copy = TreeStep(tokens=(5, 6), parents=(-1, 0), depths=(1, 2), continuation=(5, 6, 9, 1), lookup=(5, 6, 9))
    model_wins = TreeStep(tokens=(7, 8), parents=(-1, 0), depths=(1, 2), continuation=(7, 8, 3), lookup=(7, 2, 2))
    fresh = TreeStep(tokens=(4, 3), parents=(-1, 0), depths=(1, 2), continuation=(4, 1))
    steps = {2: [copy, model_wins, fresh]}
    table = tree_table(steps, [2], [3])
    first = lookup_first_table(steps, table)
    assert first[(2, 2, 3)] == pytest.approx(1 + (2 + 1 + 1) / 3)  # the lookup's 2, its 1 where the model took 2, the model's 1
    assert table[(2, 2, 3)] == (pytest.approx(1 + (2 + 2 + 1) / 3), ((0, pytest.approx(1 / 3)), (2, pytest.approx(2 / 3))))
    for curve, winner in (((1.0, 1.2, 1.4, 1.6, 1.8), True), ((1.0, 1.0, 1.0, 1.0, 1.0), False)):
        model = curve[2] + 0.3  # the model's step alone: its 3 nodes and 0.3 beyond
        costs = TreeCosts((1, 2, 3, 4, 5), curve, 1.1, exact={(2, 2, 3): model})
        lookup = curve[2] + 0.1  # 1 + 2 nodes, and the loop beyond a plain step's forward
        alone_seconds = 2 / 3 * lookup + 1 / 3 * model
        both_seconds = 0.3 + curve[2] / 3 + 2 / 3 * curve[4]  # 3 nodes, and 2 more in two steps of three
        assert lookup_first_seconds(table, costs, (2, 2, 3)) == (pytest.approx(alone_seconds), True)
        assert tree_seconds(table, costs, (2, 2, 3)) == (pytest.approx(both_seconds), True)
        plan = plan_tree(table, costs, first=first, modes=(False, True))
        both, alone = (c for c in plan.candidates if c.num_draft_tokens == 2)
        assert (both.lookup_first, alone.lookup_first) == (False, True)
        assert alone.planned_speedup == pytest.approx(first[(2, 2, 3)] * 1.1 / alone_seconds)
        assert both.planned_speedup == pytest.approx(table[(2, 2, 3)][0] * 1.1 / both_seconds)
        assert plan.lookup_first is winner
    assert {c.lookup_first for c in plan_tree(table, costs, first=first, modes=(True,)).candidates} == {None, True}


def test_a_tree_step_between_measured_sizes_is_interpolated():
    costs = TreeCosts((1, 2, 4, 8), (1.0, 1.2, 1.6, 2.4), 1.0, exact={(4, 2, 8): 3.0})
    table = {(4, 2, 4): (2.0, ()), (4, 2, 8): (2.5, ())}
    assert costs.verify_seconds(3) == pytest.approx(1.4)
    assert costs.verify_seconds(100) == pytest.approx(2.4) and costs.least_verify_seconds(100) == pytest.approx(1.92)
    assert tree_seconds(table, costs, (4, 2, 8)) == (3.0, True)
    assert tree_seconds(table, costs, (4, 2, 4)) == (pytest.approx(1.6 + (3.0 - 2.4)), False)
    hybrid = {(4, 2, 4): (2.0, ((1, 1.0),)), (4, 2, 8): (2.5, ((1, 1.0),))}  # a node of n-gram lookup beside either
    assert tree_seconds(hybrid, costs, (4, 2, 4))[0] == pytest.approx(1.8 + (3.0 - 2.4))


def test_a_hybrids_step_is_its_models_alone_with_the_calibrations_lookup_nodes_on_the_curve():
    """A hybrid's whole step timed over a short decode of the probe counted the lookup nodes that
    decode found (Gemma-3's EAGLE-3 + n-gram: 95 ms a step at the probe, 143 ms in the run). Its
    model's step is timed alone and each recorded step's lookup nodes verified beside its tree: the
    curve at each count, not at their mean (a lumpy curve: 4 nodes cheaper than 3), plus the
    lookup's host time; lookup first, the lookup's chain alone in the steps it found one."""
    curve = (1.0, 1.2, 2.0, 1.6, 2.2, 2.4, 2.6)  # 1 .. 7 nodes; 3 dearer than 4
    costs = TreeCosts((1, 2, 3, 4, 5, 6, 7), curve, 1.1, exact={(1, 4, 2): 1.5}, lookup=(0.0, 0.01, 0.02, 0.03, 0.04))
    beside = ((0, 0.5), (4, 0.5))  # half the steps verify 4 n-gram nodes beside the 2-node tree
    hybrid = {(1, 4, 2): (2.8, beside)}
    both = 1.5 - curve[1] + 0.5 * curve[1] + 0.5 * curve[5] + 0.04
    assert tree_seconds(hybrid, costs, (1, 4, 2)) == (pytest.approx(both), True)
    assert both != pytest.approx(1.5 - curve[1] + curve[3] + 0.04)  # not the curve at the mean count
    assert tree_seconds({(1, 4, 2): (2.8, ())}, costs, (1, 4, 2)) == (1.5, True)  # no lookup: as measured
    assert next(c for c in plan_tree(hybrid, costs).candidates
                if c.num_draft_tokens == 4).planned_speedup == pytest.approx(2.8 * 1.1 / both)
    first = 0.5 * (curve[4] + (1.1 - 1.0)) + 0.5 * 1.5 + 0.04  # 1 + 4 nodes and the loop, or the model alone
    assert lookup_first_seconds(hybrid, costs, (1, 4, 2)) == (pytest.approx(first), True)
    unmeasured = TreeCosts(costs.sizes, costs.verify, costs.plain, lookup=costs.lookup)
    assert tree_seconds(hybrid, unmeasured, (1, 4, 2)) == (pytest.approx(0.1 + 0.5 * curve[1] + 0.5 * curve[5] + 0.04),
                                                           False)  # the loop beyond the verification, at least


def test_a_wider_siblings_measured_step_settles_a_narrower_trees_price():
    """A step of the same depth and nodes measured at a wider top-k is the most a narrower one costs
    (the same verification, fewer candidates drafted): the narrowest wider one, a hybrid's moved along
    the curve by its n-gram nodes; a narrower sibling's step says nothing of a wider tree."""
    costs = TreeCosts((1, 2, 4, 8), (1.0, 1.2, 1.6, 2.4), 1.0, exact={(8, 2, 4): 2.3, (4, 2, 4): 2.1})
    table = {(k, 2, 4): (2.0, ()) for k in (1, 2, 4, 8, 16)}
    assert tree_seconds(table, costs, (2, 2, 4)) == (pytest.approx(2.1), True)  # top-4's, not top-8's
    assert tree_seconds(table, costs, (4, 2, 4)) == (2.1, True)  # its own
    assert tree_seconds(table, costs, (16, 2, 4))[1] is False  # no wider sibling: a bound
    hybrid = {(2, 2, 4): (2.0, ((2, 1.0),)), (4, 2, 4): (2.0, ()), (8, 2, 4): (2.0, ())}  # 2 n-gram nodes beside top-2
    assert tree_seconds(hybrid, costs, (2, 2, 4))[0] == pytest.approx(2.1 - 1.6 + costs.verify_seconds(6))


def test_a_narrower_tree_is_not_measured_once_its_wider_sibling_settles_it():
    """Gemma-3's EAGLE-3 plan measured top-8 then top-4 at 2 deep and 4 nodes (54.8 and 53.0 ms):
    the narrower one, bounded only by its verification, led until measured. Priced at its measured
    wider sibling's step, the most it can cost, it is settled: one whole step decides between them."""
    costs = TreeCosts((1, 2, 4, 8), (1.0, 1.1, 1.2, 1.4), 1.0)
    table = {(1, 2, 4): (1.9, ()), (4, 2, 4): (2.0, ())}
    truth = {(1, 2, 4): 1.30, (4, 2, 4): 1.35}
    measured = []

    def measure(k, d, n):
        measured.append((k, d, n))
        return truth[(k, d, n)]

    plan, _ = plan_tree_measured(table, costs, measure, limit=100, tie=0.0)
    assert measured == [(4, 2, 4)]
    assert (plan.tree_topk, plan.num_draft_tokens, plan.tree_nodes) == (4, 2, 4)
    assert plan.planned_speedup == pytest.approx(2.0 / 1.35)
    narrow = next(c for c in plan.candidates if c.tree_topk == 1)
    assert narrow.measured and narrow.planned_speedup == pytest.approx(1.9 / 1.35)  # its true 1.46: a few % off


def test_a_bound_is_the_verification_and_the_least_a_cheaper_tree_spent_beyond_it():
    """Unmeasured: its verification plus the plain step's loop, or more, what a measured tree no
    wider, no deeper and no smaller spent beyond its own verification. A narrower tree's spend is
    no bound for a wider one, nor a smaller tree's for a larger one (the curve underprices small
    trees' verification: their spend beyond it looks larger than a large tree's)."""
    costs = TreeCosts((1, 2, 4, 8), (1.0, 1.2, 1.6, 2.4), 1.1, exact={(2, 2, 4): 2.6})
    table = {(k, d, n): (2.0, ()) for k in (1, 2, 4) for d in (1, 2, 3) for n in (2, 4, 8)}
    assert tree_seconds(table, costs, (4, 3, 4)) == (pytest.approx(1.6 + 1.0), False)  # spent 2.6 - 1.6 beyond
    assert tree_seconds(table, costs, (4, 3, 2)) == (pytest.approx(1.2 + 1.0), False)
    assert tree_seconds(table, costs, (4, 3, 8)) == (pytest.approx(2.4 + 0.1), False)  # only the loop's 0.1
    assert tree_seconds(table, costs, (1, 3, 4)) == (pytest.approx(1.6 + 0.1), False)
    assert tree_seconds(table, costs, (2, 1, 4)) == (pytest.approx(1.6 + 0.1), False)


# ------------------------------------------------------------------------- calibration's size


def test_the_interval_covers_tokens_a_step_as_often_as_it_says():
    """Prompts whose own tokens a step spread from 1.2 to 2.8 around 2.0, each of 20 to 60 steps:
    over 2000 calibration sets of 12 prompts, the 95% interval of `tokens_per_step` covers the
    population's 2.0 about 95% of the time (the delta method's normal interval, counted)."""
    rng = random.Random(0)
    covered, sets = 0, 2000
    for _ in range(sets):
        prompts = []
        for _ in range(12):
            steps = rng.randint(20, 60)
            prompts.append(((2.0 + rng.uniform(-0.8, 0.8)) * steps, steps))
        ratio, half_width = tokens_per_step(prompts)
        covered += abs(ratio - 2.0) <= half_width
    assert 0.91 <= covered / sets <= 0.98


def test_calibration_stops_once_the_interval_is_tight_and_not_before():
    """A model drafter's acceptance, about the same on every prompt, is known after the minimum
    of prompts; n-gram lookup's copying (tau 1.02 to 3.31 per prompt on HumanEval) is not."""
    steady = [(81.0, 40), (79.0, 40), (80.5, 40), (80.0, 40)]
    assert not enough_prompts(steady[:2]) and enough_prompts(steady[:3])
    bursty = [(41.0, 40), (132.0, 40), (60.0, 40), (110.0, 40), (45.0, 40), (90.0, 40)]
    assert not enough_prompts(bursty * 4) and enough_prompts(bursty * 40)  # 24 prompts, and 240
    assert tokens_per_step([(10.0, 5)]) == (2.0, math.inf)


# ------------------------------------------------------------------ chains walked at every K


def test_a_walk_takes_the_steps_the_decoder_takes_at_every_k():
    """`walk_chain` against the real decoder: n-gram lookup on a tiny float64 target, every K,
    the same (proposed, accepted) step after step (the last step's proposal may be trimmed at EOS
    by the decoder's count)."""
    from tiny import tiny_lm

    from drafttrain.decoding import DecodeSettings
    from drafttrain.kinds.base import Drafter
    from drafttrain.kinds.factory import build_decoder
    from drafttrain.kinds.ngram.decode import ngram_lookup

    target = tiny_lm(seed=3, vocab_size=24, sharpness=12.0)  # a small vocabulary: the text repeats itself
    prompts = [[5, 6, 7, 8, 5, 6, 7, 9, 10], [11, 12, 13, 11, 12, 14], [3, 4, 3, 4, 3, 4, 15]]
    accepted_somewhere = 0
    for k in (1, 2, 3, 5):
        decoder = build_decoder(target, Drafter("ngram"), DecodeSettings(num_draft_tokens=k, eos_token_ids={2}))
        for prompt in prompts:
            gen = decoder.generate(prompt, 40)
            walked = walk_chain(prompt, gen.tokens, lambda seq, n: ngram_lookup(seq, n, 3), k, 40)
            assert [a for _, a in walked] == gen.accepted_lengths
            assert [m for m, _ in walked][:-1] == gen.proposed_lengths[:-1]
            accepted_somewhere += sum(gen.accepted_lengths)
    assert accepted_somewhere > 20  # the prompts copy: the walk is checked where it matters


def test_bursty_copying_is_planned_with_each_ks_own_acceptance():
    """Spans copied whole and text that copies nothing: the deepest K's per-position acceptance
    understates a smaller K's tokens per step, and the walk gets each K right."""
    span = list(range(100, 130))
    prompt = span + [1]
    continuation = [50, 51, 52, 53] + span + [60, 61, 62, 63, 64, 65] + span[:12]
    lookup = lambda seq, n: next((seq[i + 1:i + 1 + n] for i in range(len(seq) - 2, -1, -1)  # noqa: E731
                                  if seq[i] == seq[-1]), [])
    steps = {k: walk_chain(prompt, continuation, lookup, k, 96) for k in (2, 6)}
    tau = {k: len(continuation) / len(s) for k, s in steps.items()}
    deepest, _ = walked_rates(steps[6], 6)
    assert tau[2] == pytest.approx(expected_tokens(walked_rates(steps[2], 2)[0], 2), rel=0.05)
    assert expected_tokens(deepest, 2) < 0.85 * tau[2]  # what the deepest K's rates would have planned


def test_a_plan_with_acceptance_by_k_is_the_best_k_of_a_simulated_decode():
    costs = Costs((1.0, 1.3, 1.5, 1.6, 1.7), (0, 0, 0, 0, 0), 0.05)
    by_k = {1: ([0.5], [0.6]), 2: ([0.45, 0.4], [0.55, 0.5]), 3: ([0.3, 0.25, 0.2], [0.5, 0.45, 0.4]),
            4: ([0.25, 0.2, 0.18, 0.15], [0.5, 0.45, 0.42, 0.4])}
    plan = plan_chain(by_k[4][0], costs, by_k[4][1], by_k=by_k)
    plain = 1.0 / (costs.verify[0] + costs.overhead)
    speeds = [1.0] + [simulate(by_k[k][0], costs, k, by_k[k][1]) / plain for k in range(1, 5)]
    best = max(range(5), key=lambda k: speeds[k])
    assert plan.num_draft_tokens == best == 2
    assert plan.planned_speedup == pytest.approx(speeds[best], rel=0.02)
    assert plan_chain(by_k[4][0], costs, by_k[4][1]).num_draft_tokens != best  # the deepest K's rates alone miss it


def test_costs_that_cannot_be_the_machines_are_named():
    """Issue 30 (J): the demo's plan block, a 2.15 s plain-step overhead and a 0.448 s draft
    forward beside a 39 ms target forward, is refused by name; the same draft at a third of the
    target's cost, with a millisecond of overhead, is not."""
    from drafttrain.planning import fallback_plan, implausible

    verify = (0.039, 0.045, 0.05, 0.055)
    demo = Costs(verify, (0, 0.448, 0.896, 1.344), 2.15)
    reasons = implausible(demo, [(k, 1) for k in range(1, 4)])
    assert len(reasons) == 2 and "overhead of 2150.0 ms" in reasons[0] and "drafting 1 cost 448.0 ms" in reasons[1]
    assert implausible(Costs(verify, (0, 0.013, 0.026, 0.039), 0.001), [(k, 1) for k in range(1, 4)]) == []
    assert implausible(Costs(verify, (0, 0.0, 0.0, 0.0), float("nan"))) != []
    assert fallback_plan().num_draft_tokens == 0 and fallback_plan().planned_speedup == 1.0


def test_a_hybrids_steps_read_off_its_models_recording_are_weighed_as_the_hybrid_takes_them():
    """A replayed model drafts the same tree at a position whoever decodes, so its hybrid's steps can
    be read off the model's recording with the lookup's chain at each step's start; but the hybrid
    crosses copied text in fewer, longer steps, so the model's step positions over-sample copying.
    Reference: the hybrid's own decode walked step by step over a text of copied spans and fresh
    text, each position's model draft and lookup chain fixed. Weighed (`as_hybrid_steps`), the read-off
    tokens a step come within 5% of the walk's (a copying step that starts at a span's end reaches into
    the fresh text after it: 2-3% here, spans of 33 tokens); unweighted, they overshoot it by a third."""
    rng = random.Random(3)
    depth, length = 4, 6000
    text = [rng.randrange(50) for _ in range(length + depth + 2)]
    model_right = [min(depth, int(rng.expovariate(1.2))) for _ in range(length)]  # a model's drafts right at p
    copying, lookup_right = False, []
    for _ in range(length):  # spans of copied text, where the lookup's chain runs deep, and fresh text
        copying = copying if rng.random() < 0.97 else not copying
        lookup_right.append(depth if copying else 0)

    def drafted(p, right):  # `right` tokens of the text after p, then a wrong one (within the depth)
        return tuple(text[p:p + right]) + ((999,) if right < depth else ())

    def chain(p):
        return drafted(p, lookup_right[p]) if lookup_right[p] else ()

    steps, p = [], 0  # the model alone, replayed
    while p < length:
        tokens = drafted(p, model_right[p])
        steps.append(TreeStep(tokens, tuple(range(-1, len(tokens) - 1)), tuple(range(1, len(tokens) + 1)),
                              tuple(text[p:p + model_right[p] + 1])))
        p += model_right[p] + 1
    walked, p = [], 0  # the hybrid's own decode
    while p < length:
        walked.append(1 + max(model_right[p], lookup_right[p]))
        p += walked[-1]
    truth = sum(walked) / len(walked)
    hybrid = as_hybrid_steps({1: steps}, 1, text, chain, depth)[1]
    assert [s.lookup for s in hybrid[:3]] == [chain(0), chain(len(steps[0].continuation)),
                                              chain(len(steps[0].continuation) + len(steps[1].continuation))]
    weighed = tree_expected_tokens(hybrid, depth, depth + 1)
    unweighed = tree_expected_tokens([dataclasses.replace(s, weight=1.0) for s in hybrid], depth, depth + 1)
    assert weighed == pytest.approx(truth, rel=0.05)
    assert unweighed > 1.25 * truth
    with pytest.raises(ValueError, match="replayed"):
        as_hybrid_steps({1: steps}, 1, [t + 1 for t in text], chain, depth)
