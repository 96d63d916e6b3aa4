"""`drafttrain compare`: drafters side by side with one shared baseline, one report directory."""

import json
import os

import pytest
import torch
from eval_helpers import cli, damaged_copy, one_error_line, snapshot
from tiny import save_pair, tiny_lm, tiny_tokenizer

from drafttrain.cli import main
from drafttrain.errors import UserError
from drafttrain.evaluation.compare import parse_drafter
from drafttrain.evaluation.config import EvalConfig


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("cmp")
    tok = tiny_tokenizer(64)
    save_pair(root / "target", tiny_lm(0, dtype=torch.float64), tok)
    save_pair(root / "draft", tiny_lm(1, dtype=torch.float64), tok)
    damaged_copy(root / "draft", root / "truncated-draft", "truncated")
    (root / "p.jsonl").write_text("".join(
        json.dumps({"id": i, "prompt": " ".join(f"w{j}" for j in range(5 + i, 12 + i)), "category": "ab"[i % 2]}) + "\n"
        for i in range(4)))
    return root


def compare_argv(models, out, *drafters):
    return ["compare", "--target", str(models / "target"), *[x for d in drafters for x in ("--drafter", d)],
            "--prompts", str(models / "p.jsonl"), "--max-new-tokens", "12", "--dtype", "float64",
            "--out", str(out), "--quiet"]


def test_parse_drafter():
    assert parse_drafter("a=draft:/x") == ("a", {"draft": "/x"})
    assert parse_drafter("a=draft:/x+ngram") == ("a", {"draft": "/x", "ngram": True})
    assert parse_drafter("a=draft:/x+suffix") == ("a", {"draft": "/x", "suffix": True})
    assert parse_drafter("s=suffix") == ("s", {"method": "suffix"})
    assert parse_drafter("h=heads:d") == ("h", {"heads": "d"})
    assert parse_drafter("h=heads:d+ngram") == ("h", {"heads": "d", "ngram": True})
    assert parse_drafter("e=eagle3:E+ngram@vllm") == ("e", {"eagle3": "E", "ngram": True, "backend": "vllm"})
    assert parse_drafter("n=ngram") == ("n", {"method": "ngram"})
    for bad in ("nodash", "a=draft", "a=ngram:x", "a=magic", "=ngram", "a/b=ngram", ".a=ngram", "a=ngram+ngram",
                "a=none+ngram", "a=eagle3:+ngram", "a=heads+ngram"):
        with pytest.raises(UserError, match=r"NAME=heads:DIR\+ngram, NAME=eagle3:DIR\+ngram|NAME names"):
            parse_drafter(bad)


@pytest.mark.parametrize("drafter", [dict(draft="D"), dict(heads="H"), dict(eagle3="E")])
def test_ngram_joins_any_drafter_with_weights_greedily(drafter):
    cfg = EvalConfig(target="T", prompts=["p.jsonl"], out="o", ngram=True, **drafter)
    cfg.validate()
    assert cfg.drafter_name == next(iter(drafter.values())) + "+ngram"
    assert cfg.decode_settings().lookup == "ngram"
    with pytest.raises(UserError, match="greedy"):
        EvalConfig(target="T", prompts=["p.jsonl"], out="o", ngram=True, temperature=0.5, **drafter).validate()
    for method in ("ngram", "none"):
        with pytest.raises(UserError, match="--draft DIR, --heads DIR, --eagle3 DIR or --dflash DIR"):
            EvalConfig(target="T", prompts=["p.jsonl"], out="o", ngram=True, method=method).validate()


@pytest.fixture(scope="module")
def comparison(models, tmp_path_factory):
    out = tmp_path_factory.mktemp("run") / "cmp"
    assert main(compare_argv(models, out, f"rand=draft:{models / 'draft'}", f"self=draft:{models / 'target'}",
                             "ng=ngram")) == 0
    return out


def test_compare_shares_one_baseline(comparison):
    out = comparison
    table = json.loads((out / "comparison.json").read_text())["drafters"]
    assert [r["drafter"] for r in table] == ["rand", "self", "ng"]
    reports = {r["drafter"]: json.loads((out / r["drafter"] / "report.json").read_text()) for r in table}
    base = {r["overall"]["baseline_tokens_per_s"] for r in reports.values()}
    assert len(base) == 1  # one baseline timing, shared
    outputs = {name: [json.loads(line) for line in (out / name / "outputs.jsonl").read_text().splitlines()]
               for name in reports}
    for name, rows in outputs.items():
        assert all(r["speculative_token_ids"] == r["baseline_token_ids"] for r in rows), name
        assert all(r["first_divergence"] is None for r in rows), name
    assert reports["self"]["overall"]["acceptance_rate"] == 1.0
    assert reports["self"]["overall"]["predicted"]["alpha"] == 1.0
    for row in table:
        report = reports[row["drafter"]]
        assert report["drafter"] == row["drafter"]  # each report is titled with its drafter's name
        assert row["tau"] == report["overall"]["mean_accepted_length"]
        assert row["predicted_speedup"] == report["overall"]["predicted"]["speedup"]
        assert row["efficiency"] == report["overall"]["predicted"]["efficiency"]
        assert report["config"]["out"] == str(out / row["drafter"])


def test_compare_plots_and_markdown(comparison):
    out = comparison
    md = (out / "comparison.md").read_text()
    for name in ("tau.png", "speedup.png", "per_position_acceptance.png", "tau_vs_speedup.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
        assert f"]({name})" in md, name
    assert "| self |" in md and "| rand |" in md and "| ng |" in md
    assert "# Acceptance report: self" in (out / "self" / "report.md").read_text()
    assert not [p.name for p in out.parent.iterdir() if p.name.startswith(".")]  # no staging folder left


def test_compare_refuses_an_earlier_report_and_replaces_it_whole_with_overwrite(models, tmp_path, capsys):
    out = tmp_path / "cmp"
    assert main(compare_argv(models, out, "a=ngram", "b=none")) == 0
    assert {p.name for p in out.iterdir()} >= {"a", "b", "comparison.json"}
    before = snapshot(tmp_path)
    one_error_line(*cli(capsys, compare_argv(models, out, "c=ngram")), "--out", "not empty", "--overwrite")
    assert snapshot(tmp_path) == before
    assert main(compare_argv(models, out, "c=ngram") + ["--overwrite"]) == 0
    names = {p.name for p in out.iterdir()}
    assert "c" in names and "a" not in names and "b" not in names  # no folder of the earlier run remains
    assert [r["drafter"] for r in json.loads((out / "comparison.json").read_text())["drafters"]] == ["c"]
    assert sorted(os.listdir(tmp_path)) == ["cmp"]  # no staging or replaced folder left beside it


def test_compare_bad_inputs_are_one_error_line(models, tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    cases = [
        (compare_argv(models, tmp_path / "o1", "a=ngram", "a=none"), ["unique"]),
        (compare_argv(models, tmp_path / "o2", f"t=draft:{models / 'truncated-draft'}"), ["draft", "damaged"]),
        (compare_argv(models, tmp_path / "file", "a=ngram"), ["--out", "is a file"]),
        # the output path is checked before the damaged draft is read
        (compare_argv(models, tmp_path / "file" / "o", f"t=draft:{models / 'truncated-draft'}"), ["--out", "lies under"]),
    ]
    for argv, words in cases:
        before = snapshot(tmp_path)
        one_error_line(*cli(capsys, argv), *words)
        assert snapshot(tmp_path) == before


@pytest.mark.parametrize("name, words", [
    ("tau.png", ["tau.png", "another NAME"]),
    ("comparison.json", ["comparison.json"]),
    ("Comparison.MD", ["comparison.md"]),  # a case-insensitive file system makes these one name
    ("speedup.png", ["speedup.png"]),
    ("tau_by_window.png", ["tau_by_window.png"]),  # the newest figures are compare's files too
    ("load_speedup.png", ["load_speedup.png"]),
    # issue 40 (H): these made a folder that --out's readers take for a report (a report.json that is a folder)
    ("report.json", ["report.json", "another NAME"]),
    ("Bench.json", ["bench.json"]),
    ("outputs.jsonl", ["outputs.jsonl"]),
    ("report.md", ["report.md"]),
    ("a\\b", ["'\\'"]),
    ("x" * 256, ["255 bytes"]),
])
def test_compare_refuses_a_drafter_name_it_cannot_write_before_decoding(models, tmp_path, capsys, monkeypatch, name,
                                                                        words):
    """A NAME that is also a file compare writes, or no valid folder name, is refused before any model
    loads, not after every prompt was decoded."""
    import drafttrain.evaluation.compare as compare

    def no_decoding(*args, **kwargs):
        raise AssertionError("decoding started before the drafter names were checked")

    monkeypatch.setattr(compare, "evaluate", no_decoding)
    before = snapshot(tmp_path)
    one_error_line(*cli(capsys, compare_argv(models, tmp_path / "out", "a=ngram", f"{name}=none")), "--drafter", *words)
    assert snapshot(tmp_path) == before
