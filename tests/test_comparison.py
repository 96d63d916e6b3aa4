"""`drafttrain compare`: drafters side by side with one shared baseline."""

import json

import pytest
import torch
from tiny import save_pair, tiny_lm, tiny_tokenizer

from drafttrain.cli import main
from drafttrain.comparison import parse_drafter
from drafttrain.errors import UserError


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("cmp")
    tok = tiny_tokenizer(64)
    save_pair(root / "target", tiny_lm(0, dtype=torch.float64), tok)
    save_pair(root / "draft", tiny_lm(1, dtype=torch.float64), tok)
    (root / "p.jsonl").write_text("".join(
        json.dumps({"id": i, "prompt": " ".join(f"w{j}" for j in range(5 + i, 12 + i)), "category": "ab"[i % 2]}) + "\n"
        for i in range(4)))
    return root


def test_parse_drafter():
    assert parse_drafter("a=draft:/x") == ("a", {"draft": "/x"})
    assert parse_drafter("h=heads:d") == ("h", {"heads": "d"})
    assert parse_drafter("n=ngram") == ("n", {"method": "ngram"})
    for bad in ("nodash", "a=draft", "a=ngram:x", "a=magic", "=ngram"):
        with pytest.raises(UserError):
            parse_drafter(bad)


def test_compare_shares_one_baseline(models, tmp_path, capsys):
    out = tmp_path / "cmp"
    code = main(["compare", "--target", str(models / "target"), "--drafter", f"rand=draft:{models / 'draft'}",
                 "--drafter", f"self=draft:{models / 'target'}", "--drafter", "ng=ngram",
                 "--prompts", str(models / "p.jsonl"), "--max-new-tokens", "12", "--dtype", "float64",
                 "--out", str(out), "--quiet"])
    assert code == 0
    table = json.loads((out / "comparison.json").read_text())["drafters"]
    assert [r["drafter"] for r in table] == ["rand", "self", "ng"]
    reports = {r["drafter"]: json.loads((out / r["drafter"] / "report.json").read_text()) for r in table}
    base = {r["overall"]["baseline_tokens_per_s"] for r in reports.values()}
    assert len(base) == 1  # one baseline timing, shared
    outputs = {name: [json.loads(line) for line in (out / name / "outputs.jsonl").read_text().splitlines()]
               for name in reports}
    for name, rows in outputs.items():
        assert all(r["speculative_token_ids"] == r["baseline_token_ids"] for r in rows), name
    assert reports["self"]["overall"]["acceptance_rate"] == 1.0
    for row in table:
        assert row["tau"] == reports[row["drafter"]]["overall"]["mean_accepted_length"]
    assert (out / "tau.png").exists() and "| self |" in (out / "comparison.md").read_text()


def test_compare_rejects_duplicate_names(models, tmp_path, capsys):
    capsys.readouterr()
    code = main(["compare", "--target", str(models / "target"), "--drafter", "a=ngram", "--drafter", "a=none",
                 "--prompts", str(models / "p.jsonl"), "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "unique" in err[0]
