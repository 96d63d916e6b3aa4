"""The planner against an independent reference: a Monte-Carlo simulation of chain decoding
under the same acceptance and cost model picks the same K and the same speedup."""

import random

import pytest

from drafttrain.planning import Costs, expected_tokens, noisy, plan_chain, step_seconds


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
