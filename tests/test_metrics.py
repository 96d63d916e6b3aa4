"""METRICS (SPEC §2) from hand-built decode records, against hand-computed values."""

import numpy as np
import pytest

from drafttrain.decoding import Generation
from drafttrain.metrics import (
    PromptResult,
    compute_metrics,
    expected_tokens_per_step,
    metrics_by_category,
    percentile,
    predicted_speedup,
    token_latencies_ms,
)


def gen(tokens, accepted, proposed, seconds=None, step_tokens=None):
    step_tokens = step_tokens or [a + 1 for a in accepted]
    return Generation(tokens=list(tokens), accepted_lengths=list(accepted), proposed_lengths=list(proposed),
                      step_seconds=seconds or [0.01] * len(accepted), step_tokens=step_tokens)


def test_expected_tokens_per_step_hand_values():
    assert expected_tokens_per_step(0.5, 3) == pytest.approx(1.875)  # 1 + .5 + .25 + .125
    assert expected_tokens_per_step(0.0, 3) == pytest.approx(1.0)
    assert expected_tokens_per_step(1.0, 3) == 4.0
    for alpha in (0.1, 0.37, 0.9, 0.999):
        for k in (1, 2, 5):
            assert expected_tokens_per_step(alpha, k) == pytest.approx(sum(alpha**i for i in range(k + 1)))


def test_predicted_speedup_hand_values():
    assert predicted_speedup(0.5, 3, 0.1) == pytest.approx(1.875 / 1.3)
    assert predicted_speedup(0.5, 3, 0.0) == pytest.approx(1.875)
    assert predicted_speedup(1.0, 4, 0.25) == pytest.approx(5 / 2)


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
