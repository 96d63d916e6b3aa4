"""Report rendering (SPEC §2 report.md and plots) from hand-built records: what the figures say,
read back from the matplotlib Figure objects the report builds (no pixels compared)."""

import pytest

from drafttrain.decoding import Generation
from drafttrain.evaluation.compare import comparison_figures, comparison_rows, render_comparison
from drafttrain.evaluation.metrics import PromptResult, compute_metrics, metrics_by_category
from drafttrain.evaluation.report import output_rows, render_markdown, report_figures
from drafttrain.evaluation.run import Evaluation

K = 3


def gen(tokens, accepted, proposed, margins=None):
    return Generation(tokens=list(tokens), accepted_lengths=list(accepted), proposed_lengths=list(proposed),
                      step_seconds=[0.01] * len(accepted), step_tokens=[a + 1 for a in accepted], margins=margins)


def results(categories=("x", "y", "x")):
    base = lambda tokens, margins: gen(tokens, [0] * len(tokens), [0] * len(tokens), margins)
    return [
        PromptResult("a", categories[0], gen(range(8), [3, 0, 2], [3, 3, 3]), 0.5,
                     base(range(8), [1.0] * 8), 1.0),
        # differs from its baseline at index 1, where the baseline's margin is a near-tie (0.25 <= 0.5)
        PromptResult("b", categories[1], gen([0, 9, 2, 3, 4], [3, 0], [3, 1]), 0.25,
                     base(range(5), [1.0, 0.25, 1.0, 1.0, 1.0]), 0.5),
        # differs at index 0 with a margin of 3.0: a defect
        PromptResult("c", categories[2], gen([7, 1], [1], [3]), 0.25, base([9, 9], [3.0, 1.0]), 0.5),
    ]


def make_report(rs, name="mydraft"):
    kwargs = {"cost_ratio": 0.2, "near_tie_tolerance": 0.5}
    return {
        "drafter": name,
        "config": {"target": "T", "draft": "D", "num_draft_tokens": K, "temperature": 0.0, "top_p": 1.0,
                   "max_new_tokens": 8, "dtype": "auto", "engine": "auto", "prompts": ["p.jsonl"],
                   "limit": None},
        "environment": {"device": "cuda (NVIDIA H100)", "torch": "2.x", "transformers": "5.x"},
        "numerics": {"dtype": "bfloat16", "near_tie_tolerance": 0.5},
        "engine": {"requested": "auto", "used": "eager", "compile_seconds": 0.0},
        "backend": {"name": "drafttrain", "version": "0.1.0"},
        "overall": compute_metrics(rs, K, True, **kwargs),
        "by_category": metrics_by_category(rs, K, True, **kwargs),
    }


def texts(ax):
    return [t.get_text() for t in ax.texts]


def check_subtitle(fig, prompts):
    sub = fig._suptitle.get_text()
    for part in ("cuda (NVIDIA H100)", "bfloat16", f"K={K}", "temperature 0.0", f"{prompts} prompts"):
        assert part in sub, (part, sub)


def test_two_category_report_figures():
    report = make_report(results())
    figures = report_figures(report)
    assert set(figures) == {"per_position_acceptance.png", "speedup_by_category.png"}

    ax = figures["per_position_acceptance.png"].axes[0]
    assert "mydraft" in ax.get_title()
    check_subtitle(figures["per_position_acceptance.png"], 3)
    assert list(ax.get_xticks()) == [1, 2, 3]  # whole draft positions only
    assert [line.get_label() for line in ax.get_lines()] == ["overall", "x", "y"]
    assert list(ax.get_lines()[0].get_ydata()) == pytest.approx(report["overall"]["per_position_acceptance"])

    ax = figures["speedup_by_category.png"].axes[0]
    assert "mydraft" in ax.get_title()
    check_subtitle(figures["speedup_by_category.png"], 3)
    speedups = [report["overall"]["speedup"], report["by_category"]["x"]["speedup"],
                report["by_category"]["y"]["speedup"]]
    assert texts(ax) == [f"{v:.3f}" for v in speedups]  # a value label on every bar
    assert [t.get_text() for t in ax.get_xticklabels()] == ["overall", "x", "y"]


def test_one_category_report_has_no_overall_vs_category_pair():
    report = make_report(results(categories=("x", "x", "x")))
    figures = report_figures(report)
    assert set(figures) == {"per_position_acceptance.png"}
    ax = figures["per_position_acceptance.png"].axes[0]
    assert [line.get_label() for line in ax.get_lines()] == ["overall"]
    md = render_markdown(report)
    assert "speedup_by_category" not in md and "| x |" not in md and "## Overall\n" in md


def test_markdown_states_predicted_and_divergences():
    report = make_report(results())
    md = render_markdown(report)
    assert md.startswith("# Acceptance report: mydraft\n")
    pred = report["overall"]["predicted"]
    assert f"| overall | {pred['alpha']:.3f} | {pred['expected_tokens_per_step']:.3f} | " in md
    assert "acceptance alpha" not in md and "(1 − α^(m+1))/(1 − α)" in md
    sentence = next(line for line in md.splitlines() if "greedy outputs differ" in line)
    assert sentence.startswith("2 of 3 greedy outputs differ from the target alone's; 1 of these divergences are "
                               "at near-ties")
    for part in ("at most 0.5 in bfloat16", "different rounding of a k-token and a 1-token forward in low precision, "
                 "not from the decoder", "the other 1 are not near-ties and point to a decoder defect"):
        assert part in sentence
    assert sentence.count(". ") == 0  # one sentence


def test_outputs_rows_carry_the_divergence():
    rows = output_rows(results(), with_divergence=True)
    assert [(r["first_divergence"], r["divergence_margin"]) for r in rows] == [(None, None), (1, 0.25), (0, 3.0)]
    assert "first_divergence" not in output_rows(results(), with_divergence=False)[0]


def test_comparison_figures_overlay_every_drafter():
    evaluations = [Evaluation(None, make_report(results(), name), results()) for name in ("alpha-draft", "ng")]
    evaluations[1].report["overall"]["speedup"] = 1.5
    evaluations[1].report["overall"]["per_position_acceptance"] = [0.5, 0.25]  # a shorter series
    rows = comparison_rows(evaluations)
    figures = comparison_figures(rows, "cuda (NVIDIA H100), bfloat16, K=3, temperature 0.0, 3 prompts")
    assert set(figures) == {"tau.png", "per_position_acceptance.png", "speedup.png", "tau_vs_speedup.png"}
    ax = figures["per_position_acceptance.png"].axes[0]
    assert [line.get_label() for line in ax.get_lines()] == ["alpha-draft", "ng"]
    assert list(ax.get_xticks()) == [1, 2, 3]
    ax = figures["tau_vs_speedup.png"].axes[0]
    assert [t.split(" (")[0] for t in texts(ax)] == ["alpha-draft", "ng"]
    offsets = [tuple(c.get_offsets()[0]) for c in ax.collections]
    assert offsets == [pytest.approx((r["tau"], r["speedup"])) for r in rows]
    assert texts(figures["speedup.png"].axes[0]) == [f"{r['speedup']:.2f}" for r in rows]
    assert texts(figures["tau.png"].axes[0]) == [f"{r['tau']:.3f}" for r in rows]
    md = render_comparison(rows, evaluations[0].report, figures)
    for name in figures:
        assert f"]({name})" in md
    assert "alpha-draft 1 of 2 at near-ties" in md
