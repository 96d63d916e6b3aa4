"""Acceptance by output window (SPEC §9 `by_window`): windows that add up to the report's own
counts, the same windows from `replay`, and the plots and tables that show them."""

import json

import pytest
import torch
from eval_helpers import cli, write_jsonl
from tiny import noisy_copy, save_pair, tiny_lm, tiny_tokenizer

from drafttrain.cli import main
from drafttrain.decoding import Generation
from drafttrain.evaluation.windows import acceptance_by_window, placed_steps, window_prompts

K, MAX_NEW, WINDOW = 3, 40, 8


def test_windows_by_hand():
    # Steps emit 3, 1, 4, 2 tokens (10, cut to the 9-token output: vLLM counts past the end).
    gen = Generation(tokens=list(range(9)), accepted_lengths=[2, 0, 3, 1], proposed_lengths=[3, 3, 3, 3],
                     step_tokens=[3, 1, 4, 2])
    assert placed_steps(gen) == [(0, 3, 2, 3), (3, 1, 0, 3), (4, 4, 3, 3), (8, 1, 1, 3)]
    short = Generation(tokens=[1, 2], accepted_lengths=[1], proposed_lengths=[2], step_tokens=[2])
    windows = acceptance_by_window([gen, short], window=4, k=3)
    assert [(w["start"], w["end"]) for w in windows] == [(0, 4), (4, 8), (8, 12)]
    first, second, third = windows
    # window 0-4: gen's steps at 0 and 3, short's step at 0
    assert (first["steps"], first["tokens"], first["accepted"], first["proposed"], first["prompts"]) == (3, 6, 3, 8, 2)
    assert first["tau"] == pytest.approx(6 / 3)
    assert first["acceptance"] == pytest.approx(3 / 8)
    assert first["per_position_acceptance"] == pytest.approx([2 / 3, 1 / 3, 0.0])  # accepted 2, 0, 1
    assert (second["steps"], second["tokens"], second["prompts"], second["tau"]) == (1, 4, 1, 4.0)
    assert second["per_position_acceptance"] == [1.0, 1.0, 1.0]
    assert (third["steps"], third["tokens"], third["accepted"]) == (1, 1, 1)


def test_steps_out_of_order_are_left_out():
    ordered = Generation(tokens=[1, 2, 3], accepted_lengths=[2], proposed_lengths=[2], step_tokens=[3])
    unordered = Generation(tokens=[1, 2, 3], accepted_lengths=[0, 1, 0], proposed_lengths=[0, 2, 0],
                           step_tokens=[1, 2, 1], steps_in_order=False)
    (window,) = acceptance_by_window([ordered, unordered], window=128, k=2)
    assert (window["steps"], window["prompts"]) == (1, 1)
    assert window_prompts([ordered, unordered]) == 1
    with pytest.raises(ValueError):
        acceptance_by_window([ordered], window=0, k=2)


def reference_windows(rows: list[dict], window: int) -> dict[int, list[int]]:
    """Independent of `windows`: walk each output's steps, a+1 tokens each (the last one cut),
    and add (steps, tokens, accepted, proposed) to the window of the step's first token."""
    out: dict[int, list[int]] = {}
    for row in rows:
        position, length = 0, len(row["speculative_token_ids"])
        for a, m in zip(row["accepted_lengths"], row["proposed_lengths"]):
            emitted = min(a + 1, length - position)
            counts = out.setdefault(position // window, [0, 0, 0, 0])
            for i, v in enumerate((1, emitted, a, m)):
                counts[i] += v
            position += emitted
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("windows")
    tok = tiny_tokenizer(64)
    target = tiny_lm(0, dtype=torch.float64)
    save_pair(root / "target", target, tok)
    save_pair(root / "draft", noisy_copy(target, scale=0.15), tok)
    write_jsonl(root / "p.jsonl", [{"id": f"p{i}", "prompt": f"w{5 + i} w{9 + 2 * i} w{13 + i} w7"} for i in range(4)])
    common = ["--target", str(root / "target"), "--prompts", str(root / "p.jsonl"), "--num-draft-tokens", str(K),
              "--max-new-tokens", str(MAX_NEW), "--dtype", "float64", "--acceptance-window", str(WINDOW), "--quiet"]
    assert main(["eval", "--draft", str(root / "draft"), *common, "--out", str(root / "eval")]) == 0
    assert main(["compare", "--drafter", f"noisy=draft:{root / 'draft'}", "--drafter", "ng=ngram", *common,
                 "--out", str(root / "cmp")]) == 0
    return root


@pytest.mark.parametrize("report", ["eval", "cmp/noisy", "cmp/ng"])
def test_windows_add_up_to_the_reports_counts(runs, report):
    folder = runs / report
    data = json.loads((folder / "report.json").read_text())
    rows = [json.loads(line) for line in (folder / "outputs.jsonl").read_text().splitlines()]
    windows, overall = data["by_window"], data["overall"]
    assert data["by_window_prompts"] == overall["prompts"] == len(rows)
    assert len(windows) == -(-MAX_NEW // WINDOW)  # every window of the 40-token outputs
    assert sum(w["steps"] for w in windows) == overall["target_forwards"]
    assert sum(w["tokens"] for w in windows) == overall["new_tokens"]
    assert sum(w["accepted"] for w in windows) == overall["accepted_tokens"]
    assert sum(w["proposed"] for w in windows) == overall["draft_tokens"]
    expected = reference_windows(rows, WINDOW)
    assert {w["start"] // WINDOW: [w["steps"], w["tokens"], w["accepted"], w["proposed"]] for w in windows} == expected
    for w in windows:
        assert w["end"] - w["start"] == WINDOW
        assert w["tau"] == pytest.approx(w["tokens"] / w["steps"])
        assert len(w["per_position_acceptance"]) == K
    md = (folder / "report.md").read_text()
    assert f"## Acceptance by output window ({WINDOW} tokens)" in md
    assert (folder / "tau_by_window.png").read_bytes()[:4] == b"\x89PNG"


def test_comparison_shows_tau_by_window(runs):
    md = (runs / "cmp" / "comparison.md").read_text()
    assert f"## tau by output window ({WINDOW} tokens)" in md
    assert "](tau_by_window.png)" in md
    assert (runs / "cmp" / "tau_by_window.png").read_bytes()[:4] == b"\x89PNG"
    rows = json.loads((runs / "cmp" / "comparison.json").read_text())["drafters"]
    assert [len(r["by_window"]) for r in rows] == [-(-MAX_NEW // WINDOW)] * 2


def test_replay_gives_the_reports_windows(runs, capsys):
    report = json.loads((runs / "eval" / "report.json").read_text())
    code, out, err = cli(capsys, ["replay", "--target", str(runs / "target"), "--prompts", str(runs / "p.jsonl"),
                                  "--outputs", str(runs / "eval" / "outputs.jsonl"), "--draft",
                                  f"noisy={runs / 'draft'}", "--num-draft-tokens", str(K), "--dtype", "float64",
                                  "--acceptance-window", str(WINDOW), "--quiet"])
    assert code == 0, err
    lines = out.splitlines()[1:]
    assert lines == [f"  output tokens {w['start']}-{w['end']}: tau {w['tau']:.3f}, acceptance "
                     f"{w['acceptance']:.3f} ({w['prompts']} prompts, {w['steps']} steps)" for w in report["by_window"]]


def test_replay_plots_the_reports_and_the_replayed_windows(runs, capsys):
    from drafttrain.evaluation.replay import ReplayConfig, read_outputs, run_replay, window_series

    cfg = ReplayConfig(target=str(runs / "target"), prompts=[str(runs / "p.jsonl")],
                       outputs=str(runs / "cmp" / "ng" / "outputs.jsonl"), draft=[f"noisy={runs / 'draft'}"],
                       num_draft_tokens=K, acceptance_window=WINDOW, dtype="float64", plot=str(runs / "w.png"))
    results = run_replay(cfg, progress=False)
    series = window_series(read_outputs(cfg.outputs), results)
    decoded = json.loads((runs / "cmp" / "noisy" / "report.json").read_text())["by_window"]
    lookup = json.loads((runs / "cmp" / "ng" / "report.json").read_text())["by_window"]
    # The lookup's own windows as its report has them; the draft's, replayed over the lookup's (greedy,
    # identical) outputs, are the windows the draft's own decode recorded.
    assert series == {f"ng (report, K={K})": lookup, f"noisy (replayed, K={K})": decoded}
    assert (runs / "w.png").read_bytes()[:4] == b"\x89PNG"
    before = (runs / "w.png").read_bytes()
    code, out, err = cli(capsys, ["replay", "--target", str(runs / "target"), "--prompts", str(runs / "p.jsonl"),
                                  "--outputs", cfg.outputs, "--draft", f"noisy={runs / 'draft'}", "--plot",
                                  str(runs / "w.png"), "--quiet"])
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("error: --plot") and "--overwrite" in err
    assert (runs / "w.png").read_bytes() == before
    code, _, err = cli(capsys, ["replay", "--target", str(runs / "target"), "--prompts", str(runs / "p.jsonl"),
                                "--outputs", cfg.outputs, "--draft", f"noisy={runs / 'draft'}", "--plot",
                                str(runs / "w.jpg"), "--quiet"])
    assert code == 2 and err.startswith("error: --plot") and not (runs / "w.jpg").exists()
