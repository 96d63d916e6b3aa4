"""`drafttrain eval --eagle3 DIR` and `compare NAME=eagle3:DIR`: an exported EAGLE-3 draft is read
back, decodes losslessly with a chain and a dynamic tree, and is reported like any drafter."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from drafttrain.cli import main
from drafttrain.evaluation.config import PLAN_MAX_K
from drafttrain.kinds.eagle3.export import save_eagle3
from eagle3_helpers import tiny_target
from tiny import greedy_reference, save_pair, tiny_tokenizer

PROMPTS = [{"id": "a", "prompt": "w5 w9 w13 w7 w5 w9"}, {"id": "b", "prompt": "w40 w41 w40"},
           {"id": "c", "prompt": "w3 w4 w5 w6 w7 w8 w9 w10 w11 w12 w3 w4 w5"}]
MAX_NEW = 16


@pytest.fixture(scope="module")
def files(trained_pair, tmp_path_factory):
    target, draft = trained_pair
    root = tmp_path_factory.mktemp("eagle3-eval")
    tok = tiny_tokenizer()
    save_pair(root / "target", target, tok)
    save_eagle3(draft, root / "eagle3", base_info={"target": str(root / "target")})
    (root / "p.jsonl").write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    references = [greedy_reference(target, tok(p["prompt"])["input_ids"], MAX_NEW, eos=2) for p in PROMPTS]
    return root, references


def run(argv):
    assert main(argv) == 0
    out = Path(argv[argv.index("--out") + 1])
    return (json.loads((out / "report.json").read_text()),
            [json.loads(line) for line in (out / "outputs.jsonl").read_text().splitlines()])


@pytest.mark.parametrize("tree", ["auto", "chain", "default"])
def test_eval_eagle3_is_lossless_and_reported(files, tree, tmp_path):
    root, references = files
    report, rows = run(["eval", "--target", str(root / "target"), "--eagle3", str(root / "eagle3"),
                        "--prompts", str(root / "p.jsonl"), "--max-new-tokens", str(MAX_NEW), "--dtype", "float64",
                        "--num-draft-tokens", "3", "--tree", tree, "--tree-nodes", "10", "--out",
                        str(tmp_path / "out"), "--quiet"])
    assert [r["speculative_token_ids"] for r in rows] == references
    assert [r["baseline_token_ids"] for r in rows] == references
    overall = report["overall"]
    assert overall["outputs_match_baseline"] == 1.0
    assert overall["accepted_tokens"] > 0 and overall["mean_accepted_length"] > 1.0
    # --tree-nodes 10 keeps a static tree's first 9 paths: the default tree's are 1 and 2 deep
    assert len(overall["per_position_acceptance"]) == {"auto": 3, "chain": 3, "default": 2}[tree]
    assert report["config"]["eagle3"] == str(root / "eagle3") and report["drafter"] == "eagle3"
    assert report["eagle3"]["aux_layer_ids"] == [2, 3, 4]
    assert overall["tree"] == {"auto": "dynamic (10 nodes, top-4)", "chain": "chain",
                               "default": "default, its first 10 nodes"}[tree]
    assert overall["predicted"]["cost_ratio"] > 0  # the draft layer's measured cost


def test_compare_eagle3_beside_ngram(files, tmp_path):
    """...and beside itself with n-gram lookup as one more branch of its tree (`+ngram`)."""
    root, references = files
    assert main(["compare", "--target", str(root / "target"), "--drafter", f"e3=eagle3:{root / 'eagle3'}",
                 "--drafter", "ng=ngram", "--drafter", f"e3ng=eagle3:{root / 'eagle3'}+ngram", "--prompts",
                 str(root / "p.jsonl"), "--max-new-tokens", str(MAX_NEW), "--dtype", "float64", "--out",
                 str(tmp_path / "cmp"), "--quiet"]) == 0
    table = {r["drafter"]: r for r in json.loads((tmp_path / "cmp" / "comparison.json").read_text())["drafters"]}
    assert set(table) == {"e3", "ng", "e3ng"}
    assert table["e3"]["outputs_match_baseline"] == table["e3ng"]["outputs_match_baseline"] == 1.0
    hybrid = json.loads((tmp_path / "cmp" / "e3ng" / "report.json").read_text())
    assert hybrid["config"]["ngram"] and hybrid["overall"]["tree"].endswith("+ n-gram chain (up to 4 nodes)")


@pytest.mark.parametrize("nodes", ["257", "100000"])
def test_tree_nodes_past_their_bound_are_one_error_line(files, tmp_path, capsys, nodes):
    """Issue 40 (I): --tree-nodes 100000 was accepted, recorded as 100000 and sized the caches of
    every step for it, while the tree decoded was far smaller. Bounded as other settings are."""
    root, _ = files
    capsys.readouterr()
    assert main(["eval", "--target", str(root / "target"), "--eagle3", str(root / "eagle3"), "--prompts",
                 str(root / "p.jsonl"), "--max-new-tokens", str(MAX_NEW), "--tree-nodes", nodes, "--out",
                 str(tmp_path / "out"), "--quiet"]) == 2
    captured = capsys.readouterr()
    assert captured.err.splitlines() == [f"error: --tree-nodes must be in [2, 256], got {nodes}"], captured.err
    assert captured.out == "" and not (tmp_path / "out").exists()


def test_damaged_or_foreign_eagle3_is_one_error_line(files, tmp_path, capsys):
    root, _ = files
    broken = tmp_path / "broken"
    broken.mkdir()
    for name in ("config.json", "README.md"):
        (broken / name).write_bytes((root / "eagle3" / name).read_bytes())
    data = (root / "eagle3" / "model.safetensors").read_bytes()
    (broken / "model.safetensors").write_bytes(data[: len(data) // 2])
    other = tmp_path / "other"
    save_pair(other, tiny_target(seed=5, hidden=48), tiny_tokenizer())
    for target, words in ((root / "target", ["damaged", str(broken)]), (other, ["hidden size"])):
        capsys.readouterr()
        code = main(["eval", "--target", str(target), "--eagle3", str(broken if target != other else root / "eagle3"),
                     "--prompts", str(root / "p.jsonl"), "--out", str(tmp_path / "out"), "--quiet"])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and err[0].startswith("error:"), err
        assert all(w in err[0] for w in words), err[0]
        assert not (tmp_path / "out").exists()


def test_replay_reproduces_a_chain_reports_steps(files, tmp_path):
    """`drafttrain replay --draft NAME=eagle3:DIR`: one target forward and one unroll per prompt
    give the chain decoder's accepted and proposed lengths, step for step."""
    from drafttrain.evaluation.replay import ReplayConfig, run_replay

    root, _ = files
    run(["eval", "--target", str(root / "target"), "--eagle3", str(root / "eagle3"), "--prompts",
         str(root / "p.jsonl"), "--max-new-tokens", str(MAX_NEW), "--dtype", "float64", "--num-draft-tokens", "3",
         "--tree", "chain", "--out", str(tmp_path / "out"), "--quiet"])
    rows = [json.loads(line) for line in (tmp_path / "out" / "outputs.jsonl").read_text().splitlines()]
    cfg = ReplayConfig(target=str(root / "target"), prompts=[str(root / "p.jsonl")],
                       outputs=str(tmp_path / "out" / "outputs.jsonl"), draft=[f"e3=eagle3:{root / 'eagle3'}"],
                       num_draft_tokens=3, dtype="float64")
    (result,) = run_replay(cfg, progress=False)
    assert result.accepted == [r["accepted_lengths"] for r in rows]
    assert result.proposed == [r["proposed_lengths"] for r in rows]
    assert len({a for r in rows for a in r["accepted_lengths"]}) >= 3  # not vacuous: several lengths occurred
    overall = json.loads((tmp_path / "out" / "report.json").read_text())["overall"]
    assert result.tau == pytest.approx(overall["mean_accepted_length"], abs=1e-12)


@pytest.mark.parametrize("tree, extra, words", [
    ("[[100]]", [], ["choice 100", "48 tokens"]),
    ("[[0], [47], [50]]", [], ["choice 50", "EAGLE-3 draft's vocabulary has 48"]),  # in the target's 64, not the draft's
    ("[]", [], ["empty"]),
    (None, ["--tree-topk", "49"], ["--tree-topk 49", "48"]),
])
def test_eagle3_tree_that_cannot_fit_the_draft_vocabulary_is_one_error_line(files, tmp_path, capsys, tree, extra,
                                                                             words):
    """A tree choice past the draft's vocabulary crashed the first step ("selected index out of
    range"); an empty tree silently ran plain decoding."""
    root, _ = files
    argv = ["eval", "--target", str(root / "target"), "--eagle3", str(root / "eagle3"), "--prompts",
            str(root / "p.jsonl"), "--max-new-tokens", "4", "--dtype", "float64", "--out", str(tmp_path / "out"),
            "--quiet", *extra]
    if tree is not None:
        (tmp_path / "tree.json").write_text(tree)
        argv += ["--tree", str(tmp_path / "tree.json")]
    capsys.readouterr()
    code = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error:"), err
    assert all(w in err[0] for w in words), err[0]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("extra", [[], ["--num-draft-tokens", "auto"], ["--engine", "static"]],
                         ids=["K", "auto", "static"])
def test_a_planned_tree_decodes_with_its_plan_and_equals_the_target(files, tmp_path, extra, monkeypatch):
    """--tree-nodes auto (with --num-draft-tokens auto: depth too): the calibration prompts decode
    the largest tree of each top-k up to --tree-topk (on the eager engine, replayed, the narrower
    grown beside the widest; on the static engine, against the target, a decode per top-k), every
    (top-k, depth) is weighed, the trees the decision needs are timed whole (the chosen one always),
    and the chosen setting is the one that decodes, losslessly."""
    from drafttrain.evaluation import calibration as calibrating

    root, references = files
    calibration = tmp_path / "c.jsonl"
    calibration.write_text("".join(json.dumps({"prompt": f"w{i} w{i + 1} w{i} w{i + 1} w{i + 2}"}) + "\n"
                                   for i in (5, 20, 33)))
    recordings, record = [], calibrating.record_trees
    monkeypatch.setattr(calibrating, "record_trees",
                        lambda *a: recordings.append((a[7], a[8])) or record(*a))  # (top-k decoded, grown beside)
    report, rows = run(["eval", "--target", str(root / "target"), "--eagle3", str(root / "eagle3"),
                        "--prompts", str(root / "p.jsonl"), "--max-new-tokens", str(MAX_NEW), "--dtype", "float64",
                        "--num-draft-tokens", "3", *extra, "--tree-nodes", "auto", "--tree-topk", "4",
                        "--calibration-prompts", str(calibration), "--out", str(tmp_path / "out"), "--quiet"])
    plan = report["plan"]
    assert [r["speculative_token_ids"] for r in rows] == references
    weighed = {(c["num_draft_tokens"], c["tree_topk"]) for c in plan["candidates"] if c["num_draft_tokens"]}
    depths = range(1, PLAN_MAX_K + 1) if "auto" in extra else [3]
    assert weighed == {(d, k) for d in depths for k in (1, 2, 4)}
    timed = {(s["num_draft_tokens"], s["tree_nodes"], s["tree_topk"]) for s in plan["costs"]["step_seconds"]}
    assert {(d, k) for d, _, k in timed} <= weighed
    best = max((c for c in plan["candidates"] if c["measured"]), key=lambda c: c["planned_speedup"])
    assert plan["planned_speedup"] == pytest.approx(best["planned_speedup"])
    assert not plan["num_draft_tokens"] or (plan["num_draft_tokens"], plan["tree_nodes"], plan["tree_topk"]) in timed
    assert report["config"]["num_draft_tokens"] == plan["num_draft_tokens"]
    if plan["num_draft_tokens"]:
        assert report["config"]["tree_nodes"] == plan["tree_nodes"] and report["config"]["tree_topk"] == plan["tree_topk"]
        assert overall_nodes(report) <= plan["tree_nodes"]
    assert plan["source"].startswith("3 calibration prompts") and "recorded tree steps" in plan["source"]
    assert recordings == ([(1, ()), (2, ()), (4, ())] if "static" in extra else [(4, (1, 2))])


def test_a_planned_hybrid_reads_its_trees_off_its_models_recording(files, tmp_path, monkeypatch):
    """EAGLE-3 and EAGLE-3 + n-gram planned in one compare: the calibration prompts are decoded once,
    by EAGLE-3's recording (replayed, its top-ks grown beside the widest); its hybrid reads its trees
    off it with the lookup's chain at each step (`calibration.hybrid_trees`), weighs every tree in
    both modes, and decodes losslessly."""
    from drafttrain.evaluation import calibration as calibrating

    root, references = files
    calibration = tmp_path / "c.jsonl"
    calibration.write_text("".join(json.dumps({"prompt": f"w{i} w{i + 1} w{i} w{i + 1} w{i + 2}"}) + "\n"
                                   for i in (5, 20, 33)))
    recordings, record = [], calibrating.record_trees
    monkeypatch.setattr(calibrating, "record_trees", lambda *a: recordings.append(a[0].hybrid) or record(*a))
    read, hybrid_trees = [], calibrating.hybrid_trees
    monkeypatch.setattr(calibrating, "hybrid_trees", lambda *a: read.append(a[0].hybrid) or hybrid_trees(*a))
    assert main(["compare", "--target", str(root / "target"), "--drafter", f"e3=eagle3:{root / 'eagle3'}",
                 "--drafter", f"e3ng=eagle3:{root / 'eagle3'}+ngram", "--prompts", str(root / "p.jsonl"),
                 "--max-new-tokens", str(MAX_NEW), "--dtype", "float64", "--num-draft-tokens", "auto",
                 "--tree-nodes", "auto", "--tree-topk", "4", "--calibration-prompts", str(calibration),
                 "--out", str(tmp_path / "cmp"), "--quiet"]) == 0
    assert recordings == [None] and read == ["ngram"]  # one decode: EAGLE-3's
    hybrid = json.loads((tmp_path / "cmp" / "e3ng" / "report.json").read_text())
    plan = hybrid["plan"]
    assert plan["source"].startswith("3 calibration prompts")
    modes = {c["lookup_first"] for c in plan["candidates"] if c["num_draft_tokens"]}
    assert modes == {False, True}
    rows = [json.loads(line) for line in (tmp_path / "cmp" / "e3ng" / "outputs.jsonl").read_text().splitlines()]
    assert [r["speculative_token_ids"] for r in rows] == references


def overall_nodes(report) -> int:
    return report["overall"].get("tree_nodes") or 0


def test_a_planned_tree_needs_calibration_prompts(files, tmp_path, capsys):
    root, _ = files
    code = main(["eval", "--target", str(root / "target"), "--eagle3", str(root / "eagle3"), "--prompts",
                 str(root / "p.jsonl"), "--tree-nodes", "auto", "--out", str(tmp_path / "out"), "--quiet"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error:") and "--calibration-prompts" in err[0]
    assert not (tmp_path / "out").exists()
