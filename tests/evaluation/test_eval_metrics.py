"""METRICS (SPEC §2 and rev 2) from hand-built decode records, against hand-computed values."""

import numpy as np
import pytest
from scipy.optimize import brentq

from drafttrain.decoding import Generation
from drafttrain.evaluation.metrics import (
    NEAR_TIE_TOLERANCE,
    PromptResult,
    compute_metrics,
    defects,
    divergence,
    estimate_alpha,
    expected_tokens_per_step,
    first_divergence,
    mean_expected_tokens,
    metrics_by_category,
    percentile,
    predicted_speedup,
    token_latencies_ms,
)


def gen(tokens, accepted, proposed, seconds=None, step_tokens=None, margins=None):
    step_tokens = step_tokens or [a + 1 for a in accepted]
    return Generation(tokens=list(tokens), accepted_lengths=list(accepted), proposed_lengths=list(proposed),
                      step_seconds=seconds or [0.01] * len(accepted), step_tokens=step_tokens, margins=margins)


def leviathan_sum(alpha, m):
    """The expectation written as the plain sum 1 + a + ... + a^m, independent of the closed form."""
    return sum(alpha**j for j in range(m + 1))


def test_expected_tokens_per_step_hand_values():
    assert expected_tokens_per_step(0.5, 3) == pytest.approx(1.875)  # 1 + .5 + .25 + .125
    assert expected_tokens_per_step(0.0, 3) == pytest.approx(1.0)
    assert expected_tokens_per_step(1.0, 3) == 4.0
    for alpha in (0.1, 0.37, 0.9, 0.999):
        for k in (1, 2, 5):
            assert expected_tokens_per_step(alpha, k) == pytest.approx(sum(alpha**i for i in range(k + 1)))


def test_predicted_speedup_hand_values():
    assert predicted_speedup(1.875, 3, 0.1) == pytest.approx(1.875 / 1.3)
    assert predicted_speedup(1.875, 3, 0.0) == pytest.approx(1.875)
    assert predicted_speedup(5.0, 4, 0.25) == pytest.approx(5 / 2)


# ---------------------------------------------------------------------------------------------
# alpha: the per-token acceptance probability whose expectation, averaged over the run's steps
# with each step's own number of drafts, equals the measured tau.


def test_estimate_alpha_hand_values():
    # m = 2 twice: 1 + a + a^2 = 1.75 at a = 0.5.
    assert estimate_alpha([2, 2], [1, 0], 1.75) == pytest.approx(0.5, abs=1e-12)
    # Mixed lengths: mean(1 + a, 1 + a + a^2 + a^3) = (1.5 + 1.875) / 2 at a = 0.5.
    assert estimate_alpha([1, 3], [1, 0], 1.6875) == pytest.approx(0.5, abs=1e-12)
    # Steps without drafts count as one token whatever alpha is: (2 * 1.33203125 + 1) / 3 at a = 0.25.
    assert estimate_alpha([4, 4, 0], [0, 1, 0], (2 * 1.33203125 + 1) / 3) == pytest.approx(0.25, abs=1e-12)


def test_estimate_alpha_extremes():
    assert estimate_alpha([3, 3, 3], [0, 0, 0], 1.0) == 0.0                # nothing accepted: tau 1
    assert estimate_alpha([3, 3], [3, 3], 4.0) == 1.0                       # everything accepted
    # Everything accepted, but the last step stopped at an EOS it accepted (emitting 2 of 3 tokens),
    # so tau falls short of mean(m + 1): still alpha 1.
    assert estimate_alpha([3, 2], [3, 2], 3.0) == 1.0
    assert estimate_alpha([0, 0], [0, 0], 1.0) is None                      # nothing drafted: no alpha
    assert estimate_alpha([], [], 0.0) is None


@pytest.mark.parametrize("alpha", [0.2, 0.55, 0.9])
def test_estimate_alpha_recovers_iid_acceptance(alpha):
    """Simulated i.i.d. acceptance with mixed proposal lengths (n-gram lookups and the last steps
    propose fewer than K): the fitted alpha converges to the true one, accepted/proposed does not."""
    rng = np.random.default_rng(0)
    k, steps = 5, 40_000
    proposed = rng.integers(0, k + 1, size=steps)
    accepted = []
    for m in proposed:
        a = 0
        while a < m and rng.random() < alpha:
            a += 1
        accepted.append(a)
    tau = float(np.mean(np.array(accepted) + 1))
    estimate = estimate_alpha(proposed.tolist(), accepted, tau)
    assert estimate == pytest.approx(alpha, abs=0.01)
    rate = sum(accepted) / proposed.sum()
    assert abs(rate - alpha) > 0.05  # the old "alpha = acceptance_rate" is not Leviathan's alpha
    assert mean_expected_tokens(estimate, proposed.tolist()) == pytest.approx(tau, rel=1e-9)


def test_predicted_block_against_an_independent_root():
    rs = results()  # steps accepted [3, 0, 2, 3, 0, 1], proposed [3, 3, 3, 3, 1, 3], tau 15 / 6
    m = compute_metrics(rs, k=3, greedy=True, cost_ratio=0.1)
    proposed = [3, 3, 3, 3, 1, 3]
    alpha = brentq(lambda a: np.mean([leviathan_sum(a, p) for p in proposed]) - 2.5, 0.0, 1.0, xtol=1e-14)
    pred = m["predicted"]
    assert set(pred) == {"alpha", "expected_tokens_per_step", "cost_ratio", "speedup", "efficiency"}
    assert pred["alpha"] == pytest.approx(alpha, abs=1e-9)
    assert pred["alpha"] != pytest.approx(m["acceptance_rate"], abs=0.05)
    assert pred["expected_tokens_per_step"] == pytest.approx(2.5)  # equals the measured tau
    assert pred["cost_ratio"] == 0.1
    assert pred["speedup"] == pytest.approx(2.5 / (3 * 0.1 + 1))
    assert pred["efficiency"] == pytest.approx(2.0 / (2.5 / 1.3))  # measured speedup 2.0
    by = metrics_by_category(rs, k=3, greedy=True, cost_ratio=0.1)
    # category y: one prompt, steps accepted [3, 0] of proposed [3, 1], tau 5 / 2
    alpha_y = brentq(lambda a: (leviathan_sum(a, 3) + leviathan_sum(a, 1)) / 2 - 2.5, 0.0, 1.0, xtol=1e-14)
    assert by["y"]["predicted"]["alpha"] == pytest.approx(alpha_y, abs=1e-9)
    assert by["y"]["predicted"]["efficiency"] == pytest.approx(by["y"]["speedup"] / by["y"]["predicted"]["speedup"])


def test_predicted_without_baseline_or_cost():
    rs = results()
    for r in rs:
        r.baseline = r.baseline_seconds = None
    pred = compute_metrics(rs, k=3, greedy=True, cost_ratio=0.0)["predicted"]
    assert pred["efficiency"] is None and pred["speedup"] == pytest.approx(2.5)
    assert "predicted" not in compute_metrics(rs, k=3, greedy=True)  # no cost measured: no prediction
    assert "predicted" not in compute_metrics(rs, k=0, greedy=True, cost_ratio=0.0)  # plain decoding


# ---------------------------------------------------------------------------------------------
# Greedy divergences from the baseline and their near-tie margins.


def test_first_divergence():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2      # a length difference counts at the shorter length
    assert first_divergence([1, 2, 3, 4], [1, 2]) == 2
    assert first_divergence([], [7]) == 0
    assert first_divergence([], []) is None


def divergence_results():
    base = lambda tokens, margins: gen(tokens, [0] * len(tokens), [0] * len(tokens), margins=margins)
    spec = lambda tokens: gen(tokens, [0] * len(tokens), [1] * len(tokens))
    return [
        PromptResult("same", "a", spec([4, 5, 6]), 0.1, base([4, 5, 6], [2.0, 3.0, 1.0]), 0.1),
        PromptResult("tie", "a", spec([4, 9, 6]), 0.1, base([4, 5, 6], [2.0, 0.25, 1.0]), 0.1),
        PromptResult("real", "b", spec([7, 8]), 0.1, base([3, 8], [4.5, 1.0]), 0.1),
        PromptResult("longer", "b", spec([4, 5, 6]), 0.1, base([4, 5], [2.0, 3.0]), 0.1),
    ]


def test_divergence_and_margin_of_each_prompt():
    rs = divergence_results()
    assert [divergence(r) for r in rs] == [(None, None), (1, 0.25), (0, 4.5), (2, None)]


def test_divergence_counts_and_defects():
    rs = divergence_results()
    m = compute_metrics(rs, k=1, greedy=True, near_tie_tolerance=0.5)
    assert m["divergences"] == 3 and m["divergences_at_near_ties"] == 1
    assert m["outputs_match_baseline"] == pytest.approx(1 / 4)
    assert defects(rs, 0.5) == [("real", 0, 4.5), ("longer", 2, None)]  # no margin: not a near-tie
    assert compute_metrics(rs, k=1, greedy=True, near_tie_tolerance=5.0)["divergences_at_near_ties"] == 2
    by = metrics_by_category(rs, k=1, greedy=True, near_tie_tolerance=0.5)
    assert (by["a"]["divergences"], by["a"]["divergences_at_near_ties"]) == (1, 1)
    assert (by["b"]["divergences"], by["b"]["divergences_at_near_ties"]) == (2, 0)
    sampled = compute_metrics(rs, k=1, greedy=False, near_tie_tolerance=0.5)
    assert sampled["divergences"] is None and sampled["divergences_at_near_ties"] is None
    for r in rs:
        r.baseline = None
    alone = compute_metrics(rs, k=1, greedy=True, near_tie_tolerance=0.5)
    assert alone["divergences"] is None and alone["divergences_at_near_ties"] is None


def test_near_tie_tolerances_grow_as_precision_falls():
    t = NEAR_TIE_TOLERANCE
    assert set(t) == {"float64", "float32", "float16", "bfloat16"}
    assert 0 < t["float64"] < t["float32"] < t["float16"] < t["bfloat16"] <= 1.0


def test_percentile_hand_list():
    xs = [3.0, 1.0, 4.0, 2.0]
    assert percentile(xs, 0) == 1.0
    assert percentile(xs, 50) == pytest.approx(2.5)
    assert percentile(xs, 90) == pytest.approx(3.7)  # position 0.9 * 3 = 2.7 between 3 and 4
    assert percentile(xs, 100) == 4.0
    assert percentile([7.0], 99) == 7.0
    assert percentile([], 50) is None
    rng = np.random.default_rng(0)
    values = rng.normal(size=37).tolist()
    for q in (1, 25, 50, 90, 99):
        assert percentile(values, q) == pytest.approx(np.percentile(values, q))


def test_token_latencies_share_a_step_among_its_tokens():
    g = gen([5, 6, 7, 8, 9], [3, 0], [3, 3], seconds=[0.02, 0.01], step_tokens=[4, 1])
    assert token_latencies_ms([g]) == pytest.approx([5.0, 5.0, 5.0, 5.0, 10.0])


def results():
    # prompt a: 3 steps, K=3; prompt b: 2 steps (the last proposes one draft); prompt c: 1 step.
    a = gen(range(8), [3, 0, 2], [3, 3, 3])        # 4 + 1 + 3 = 8 tokens
    b = gen(range(5), [3, 0], [3, 1])               # 4 + 1 = 5 tokens
    c = gen(range(2), [1], [3])                      # 2 tokens
    base_a, base_b = gen(range(8), [0] * 8, [0] * 8), gen(range(5), [0] * 5, [0] * 5)
    base_c = gen([9, 9], [0, 0], [0, 0])  # differs from c's tokens
    return [
        PromptResult("a", "x", a, 0.5, base_a, 1.0),
        PromptResult("b", "y", b, 0.25, base_b, 0.5),
        PromptResult("c", "x", c, 0.25, base_c, 0.5),
    ]


def test_compute_metrics_hand_values():
    m = compute_metrics(results(), k=3, greedy=True)
    assert m["prompts"] == 3
    assert m["new_tokens"] == 15
    assert m["target_forwards"] == 6
    assert m["draft_tokens"] == 16
    assert m["accepted_tokens"] == 9
    assert m["acceptance_rate"] == pytest.approx(9 / 16)
    assert m["mean_accepted_length"] == pytest.approx(15 / 6)
    # steps accepted [3, 0, 2, 3, 0, 1]: >=1 in 4, >=2 in 3, >=3 in 2 of 6 steps
    assert m["per_position_acceptance"] == pytest.approx([4 / 6, 3 / 6, 2 / 6])
    # position 1 proposed in all 6 steps, positions 2 and 3 in 5 of them
    assert m["per_position_acceptance_when_proposed"] == pytest.approx([4 / 6, 3 / 5, 2 / 5])
    assert m["speculative_tokens_per_s"] == pytest.approx(15 / 1.0)
    assert m["baseline_tokens_per_s"] == pytest.approx(15 / 2.0)
    assert m["speedup"] == pytest.approx(2.0)
    assert m["outputs_match_baseline"] == pytest.approx(2 / 3)  # c's baseline differs


def test_sampling_and_missing_baseline_give_nulls():
    rs = results()
    assert compute_metrics(rs, k=3, greedy=False)["outputs_match_baseline"] is None
    for r in rs:
        r.baseline = r.baseline_seconds = None
    m = compute_metrics(rs, k=3, greedy=True)
    assert m["baseline_tokens_per_s"] is None and m["speedup"] is None and m["outputs_match_baseline"] is None
    assert m["speculative_tokens_per_s"] == pytest.approx(15.0)


def test_plain_decoding_has_tau_one_and_no_positions():
    g = gen(range(4), [0, 0, 0, 0], [0, 0, 0, 0])
    m = compute_metrics([PromptResult(0, "default", g, 0.1)], k=0, greedy=True)
    assert m["mean_accepted_length"] == 1.0
    assert m["per_position_acceptance"] == []
    assert m["draft_tokens"] == 0 and m["acceptance_rate"] == 0.0


def test_metrics_by_category_splits_the_prompts():
    by = metrics_by_category(results(), k=3, greedy=True)
    assert list(by) == ["x", "y"]
    assert by["x"]["prompts"] == 2 and by["x"]["new_tokens"] == 10 and by["x"]["target_forwards"] == 4
    assert by["x"]["per_position_acceptance"] == pytest.approx([3 / 4, 2 / 4, 1 / 4])
    assert by["y"]["prompts"] == 1 and by["y"]["accepted_tokens"] == 3 and by["y"]["draft_tokens"] == 4
    assert by["y"]["outputs_match_baseline"] == 1.0
