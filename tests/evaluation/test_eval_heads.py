"""`drafttrain eval --heads DIR`: Medusa heads in vLLM's format, greedy output equal to the target's."""

import json

import pytest
import torch
from eval_helpers import cli, damaged_copy, one_error_line, snapshot
from tiny import save_pair, tiny_lm, tiny_tokenizer

from drafttrain.cli import main
from drafttrain.kinds.medusa.export import save_medusa
from drafttrain.kinds.medusa.model import MedusaHeads


def test_eval_with_heads(tmp_path, capsys):
    tok = tiny_tokenizer(64)
    target = tiny_lm(0, dtype=torch.float64)
    save_pair(tmp_path / "target", target, tok)
    heads = MedusaHeads.from_target(target, num_heads=3, num_layers=1)
    save_medusa(heads, tmp_path / "heads", extra={"drafttrain": {"kind": "medusa-1", "target": "t"}})
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": " ".join(f"w{j}" for j in range(i, i + 6))}) + "\n"
                               for i in range(5, 9)))
    out = tmp_path / "out"
    code = main(["eval", "--target", str(tmp_path / "target"), "--heads", str(tmp_path / "heads"),
                 "--prompts", str(prompts), "--out", str(out), "--max-new-tokens", "16", "--dtype", "float64",
                 "--num-draft-tokens", "2", "--quiet"])
    assert code == 0
    report = json.loads((out / "report.json").read_text())
    overall = report["overall"]
    assert overall["outputs_match_baseline"] == 1.0
    assert len(overall["per_head_acceptance"]) == 2  # K=2 caps the tree at depth 2 of 3 heads
    assert overall["per_head_acceptance"] == overall["per_position_acceptance"]
    assert report["heads"] == {"kind": "medusa-1", "target": "t"}
    assert overall["predicted"]["cost_ratio"] == 0.0  # heads cost next to nothing beside a target forward
    assert overall["divergences"] == 0 and report["drafter"] == "heads"
    rows = [json.loads(line) for line in (out / "outputs.jsonl").read_text().splitlines()]
    for row in rows:
        assert row["speculative_token_ids"] == row["baseline_token_ids"]
        assert all(0 <= a <= 2 for a in row["accepted_lengths"])
    assert sum(len(r["accepted_lengths"]) for r in rows) == overall["target_forwards"]


def test_eval_heads_bad_dir(tmp_path, capsys):
    tok = tiny_tokenizer(64)
    save_pair(tmp_path / "target", tiny_lm(0, dtype=torch.float32), tok)
    (tmp_path / "p.jsonl").write_text('{"prompt": "w5 w6"}\n')
    (tmp_path / "notheads").mkdir()
    capsys.readouterr()
    code = main(["eval", "--target", str(tmp_path / "target"), "--heads", str(tmp_path / "notheads"),
                 "--prompts", str(tmp_path / "p.jsonl"), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error:")
    assert not (tmp_path / "out" / "report.json").exists()


def test_eval_heads_wrong_target(tmp_path, capsys):
    tok = tiny_tokenizer(64)
    save_pair(tmp_path / "target", tiny_lm(0, dtype=torch.float32), tok)
    other = tiny_lm(1, hidden=48, dtype=torch.float32)
    save_medusa(MedusaHeads.from_target(other, num_heads=2), tmp_path / "heads")
    (tmp_path / "p.jsonl").write_text('{"prompt": "w5 w6"}\n')
    capsys.readouterr()
    code = main(["eval", "--target", str(tmp_path / "target"), "--heads", str(tmp_path / "heads"),
                 "--prompts", str(tmp_path / "p.jsonl"), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "hidden" in err[0]


def test_eval_heads_with_a_tree_file_and_bad_trees(tmp_path, capsys):
    tok = tiny_tokenizer(64)
    target = tiny_lm(0, dtype=torch.float64)
    save_pair(tmp_path / "target", target, tok)
    save_medusa(MedusaHeads.from_target(target, num_heads=2, num_layers=1), tmp_path / "heads")
    (tmp_path / "p.jsonl").write_text('{"prompt": "w5 w6 w7"}\n')
    argv = ["eval", "--target", str(tmp_path / "target"), "--heads", str(tmp_path / "heads"), "--prompts",
            str(tmp_path / "p.jsonl"), "--max-new-tokens", "8", "--dtype", "float64", "--quiet"]
    tree = tmp_path / "tree.json"
    tree.write_text("[[0], [1], [0, 0], [0, 1], [1, 0]]")
    assert main([*argv, "--tree", str(tree), "--out", str(tmp_path / "ok")]) == 0
    overall = json.loads((tmp_path / "ok" / "report.json").read_text())["overall"]
    assert overall["tree"] == str(tree) and overall["tree_nodes"] == 6 and overall["outputs_match_baseline"] == 1.0

    # [[100]]: a choice past the heads' 64-token vocabulary crashed the first step; []: plain decoding
    for name, text in [("orphan.json", "[[0, 0]]"), ("notjson.json", "[[0], "), ("missing.json", None),
                       ("wide.json", "[[0], [100]]"), ("wide64.json", "[[64]]"), ("empty.json", "[]")]:
        if text is not None:
            (tmp_path / name).write_text(text)
        capsys.readouterr()
        code = main([*argv, "--tree", str(tmp_path / name), "--out", str(tmp_path / f"out-{name}")])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and err[0].startswith("error: --tree"), (name, err)
        assert not (tmp_path / f"out-{name}").exists()
    assert "64 tokens" in err_of(main, capsys, [*argv, "--tree", str(tmp_path / "wide64.json"), "--out",
                                                str(tmp_path / "o")])
    (tmp_path / "edge.json").write_text("[[63]]")  # the last token of the vocabulary is a valid choice
    assert main([*argv, "--tree", str(tmp_path / "edge.json"), "--out", str(tmp_path / "edge")]) == 0


def err_of(fn, capsys, argv) -> str:
    capsys.readouterr()
    assert fn(argv) == 2
    return capsys.readouterr().err


def test_tree_for_a_drafter_without_one_is_an_error(tmp_path, capsys):
    """--tree shapes heads' and EAGLE-3's steps only: `--draft D --tree dynamic` used to be ignored."""
    tok = tiny_tokenizer(64)
    save_pair(tmp_path / "target", tiny_lm(0, dtype=torch.float32), tok)
    (tmp_path / "p.jsonl").write_text('{"prompt": "w5 w6 w7"}\n')
    base = ["--target", str(tmp_path / "target"), "--prompts", str(tmp_path / "p.jsonl"), "--quiet"]
    for argv, words in [(["eval", "--draft", str(tmp_path / "target"), "--tree", "dynamic"], ["--tree dynamic", "--draft"]),
                        (["eval", "--method", "ngram", "--tree", "chain"], ["--tree chain", "--method ngram"]),
                        (["compare", "--drafter", "a=ngram", "--drafter", "b=none", "--tree", "default"],
                         ["--tree default", "--method ngram", "--method none"])]:
        before = snapshot(tmp_path)
        one_error_line(*cli(capsys, [*argv, *base, "--out", str(tmp_path / "out")]), *words)
        assert snapshot(tmp_path) == before


@pytest.mark.parametrize("damage, words", [("truncated", ["Medusa heads", "damaged"]), ("empty", ["damaged"]),
                                           ("nan", ["Medusa heads", "non-finite"])])
def test_eval_damaged_heads_file_is_one_error_line(damage, words, tmp_path, capsys):
    tok = tiny_tokenizer(64)
    target = tiny_lm(0, dtype=torch.float32)
    save_pair(tmp_path / "target", target, tok)
    save_medusa(MedusaHeads.from_target(target, num_heads=2, num_layers=1), tmp_path / "good")
    heads = damaged_copy(tmp_path / "good", tmp_path / "heads", damage)
    (tmp_path / "p.jsonl").write_text('{"prompt": "w5 w6"}\n')
    before = snapshot(tmp_path)
    result = cli(capsys, ["eval", "--target", str(tmp_path / "target"), "--heads", heads, "--prompts",
                          str(tmp_path / "p.jsonl"), "--out", str(tmp_path / "out"), "--quiet"])
    one_error_line(*result, *words)
    assert snapshot(tmp_path) == before


def test_a_planned_heads_tree_is_cut_from_the_calibrated_one_and_lossless(tmp_path):
    """--tree-nodes auto with Medusa heads: one calibration decode with the whole calibrated tree,
    whole steps timed as the decision needs them (the chosen tree always), and the chosen depth and
    node count decode, losslessly; the node budgets weighed never exceed what the tree holds that
    deep."""
    tok = tiny_tokenizer(64)
    target = tiny_lm(0, dtype=torch.float64)
    save_pair(tmp_path / "target", target, tok)
    heads = MedusaHeads.from_target(target, num_heads=3, num_layers=1)
    calibrated = [[0], [0, 0], [1], [0, 0, 0], [0, 1], [2], [1, 0]]  # best first, as a calibration lists them
    save_medusa(heads, tmp_path / "heads", extra={"drafttrain": {"kind": "medusa-1", "target": "t", "tree": calibrated}})
    for name, start in (("p.jsonl", 5), ("c.jsonl", 30)):
        (tmp_path / name).write_text("".join(json.dumps({"prompt": " ".join(f"w{j}" for j in range(i, i + 6))}) + "\n"
                                             for i in range(start, start + 3)))
    out = tmp_path / "out"
    assert main(["eval", "--target", str(tmp_path / "target"), "--heads", str(tmp_path / "heads"),
                 "--prompts", str(tmp_path / "p.jsonl"), "--out", str(out), "--max-new-tokens", "12",
                 "--dtype", "float64", "--num-draft-tokens", "auto", "--tree-nodes", "auto",
                 "--calibration-prompts", str(tmp_path / "c.jsonl"), "--quiet"]) == 0
    report = json.loads((out / "report.json").read_text())
    plan = report["plan"]
    assert report["overall"]["outputs_match_baseline"] == 1.0
    holds = {d: 1 + sum(len(p) <= d for p in calibrated) for d in (1, 2, 3)}
    weighed = [c for c in plan["candidates"] if c["num_draft_tokens"]]
    assert {c["num_draft_tokens"] for c in weighed} == {1, 2, 3}
    assert all(c["tree_nodes"] <= holds[c["num_draft_tokens"]] for c in weighed)
    timed = {(s["num_draft_tokens"], s["tree_nodes"]) for s in plan["costs"]["step_seconds"]}
    assert timed <= {(c["num_draft_tokens"], c["tree_nodes"]) for c in weighed}
    assert not plan["num_draft_tokens"] or (plan["num_draft_tokens"], plan["tree_nodes"]) in timed
    assert plan["tree_topk"] is None and report["config"]["num_draft_tokens"] == plan["num_draft_tokens"]
    if plan["num_draft_tokens"]:
        assert report["overall"]["tree_nodes"] == plan["tree_nodes"]
