"""`--num-draft-tokens auto` end to end on tiny models: acceptance from a calibration file or
the export's record, never from the evaluated prompts; bad input is one error line; the plan's
K is the K that decodes, losslessly."""

import json
import shutil

import pytest
import torch
from eval_helpers import cli, one_error_line, write_jsonl
from tiny import noisy_copy, save_pair, tiny_lm, tiny_tokenizer

from drafttrain.cli import main
from drafttrain.evaluation.config import PLAN_MAX_K
from drafttrain.evaluation.plan import CALIBRATION_PROMPTS, LOOKUP_CALIBRATION_PROMPTS

PROMPTS = [{"prompt": "w5 w9 w13 w7"}, {"prompt": "w40 w41 w40 w41"}]
CALIBRATION = [{"prompt": "w3 w4 w5 w6"}, {"prompt": "w30 w31 w30 w31"}, {"prompt": "w12 w13 w14"}]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("plan")
    target = tiny_lm(0, max_positions=64)
    tok = tiny_tokenizer()
    dirs = {"target": save_pair(root / "target", target, tok), "draft": save_pair(root / "draft", noisy_copy(target), tok),
            "prompts": write_jsonl(root / "p.jsonl", PROMPTS), "calibration": write_jsonl(root / "c.jsonl", CALIBRATION)}
    recorded = root / "recorded"
    shutil.copytree(dirs["draft"], recorded)
    (recorded / "drafttrain.json").write_text(json.dumps(
        {"held_out": {"prompts": 8, "num_draft_tokens": 3, "tau": 2.5, "per_position_acceptance": [0.8, 0.5, 0.2]}}))
    dirs["recorded"] = str(recorded)
    return dirs


def argv(setup, out, *extra, drafter=("--draft",)):
    return ["eval", "--target", setup["target"], *drafter, "--prompts", setup["prompts"], "--max-new-tokens", "12",
            "--dtype", "float64", "--num-draft-tokens", "auto", "--out", str(out), "--quiet", *extra]


def test_auto_without_an_acceptance_source_is_one_error_naming_calibration(setup, tmp_path, capsys):
    one_error_line(*cli(capsys, argv(setup, tmp_path / "o", drafter=("--draft", setup["draft"]))),
                   "--calibration-prompts", "drafttrain.json")
    assert not (tmp_path / "o").exists()


def test_calibration_is_refused_without_auto_and_on_the_evaluated_prompts(setup, tmp_path, capsys):
    line = argv(setup, tmp_path / "o", "--calibration-prompts", setup["prompts"], drafter=("--draft", setup["draft"]))
    one_error_line(*cli(capsys, line), "evaluated prompt file")
    fixed = [*line[:line.index("auto")], "3", *line[line.index("auto") + 1:]]
    fixed[fixed.index(setup["prompts"], fixed.index("--calibration-prompts"))] = setup["calibration"]
    one_error_line(*cli(capsys, fixed), "--num-draft-tokens auto")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("drafter", ["draft", "ngram"])
def test_a_calibrated_plan_decodes_with_its_k_and_equals_the_target(setup, tmp_path, drafter):
    spec = ("--draft", setup["draft"]) if drafter == "draft" else ("--method", "ngram")
    assert main(argv(setup, tmp_path / "o", "--calibration-prompts", setup["calibration"], drafter=spec)) == 0
    report = json.loads((tmp_path / "o" / "report.json").read_text())
    plan = report["plan"]
    k = plan["num_draft_tokens"]
    assert 0 <= k <= PLAN_MAX_K and report["config"]["num_draft_tokens"] == k
    assert len(report["overall"]["per_position_acceptance"]) == k
    assert plan["source"].startswith("3 calibration prompts")
    assert len(plan["costs"]["verify_seconds"]) == PLAN_MAX_K + 1 and all(s > 0 for s in plan["costs"]["verify_seconds"])
    assert [c["num_draft_tokens"] for c in plan["candidates"]] == list(range(PLAN_MAX_K + 1))
    best = max(plan["candidates"], key=lambda c: c["planned_speedup"])
    assert plan["planned_speedup"] == pytest.approx(best["planned_speedup"])
    assert plan["measured_speedup"] == report["overall"]["speedup"]
    assert report["overall"]["outputs_match_baseline"] == 1.0
    if drafter == "ngram":  # planned with the acceptance walked at each K
        assert plan["costs"]["draft_seconds"] == [0.0] * (PLAN_MAX_K + 1) and plan["proposal_rates"] is not None
        walked = plan["walked"]
        assert sorted(walked, key=int) == [str(k) for k in range(1, PLAN_MAX_K + 1)]
        assert walked[str(PLAN_MAX_K)]["acceptance"] == pytest.approx(plan["acceptance"])  # the decode's own K
        for c in plan["candidates"][1:]:
            assert c["expected_tokens"] == pytest.approx(1 + sum(walked[str(c["num_draft_tokens"])]["acceptance"]))
    else:
        assert plan["walked"] is None


def test_the_exports_record_is_the_acceptance_source(setup, tmp_path):
    assert main(argv(setup, tmp_path / "o", drafter=("--draft", setup["recorded"]))) == 0
    plan = json.loads((tmp_path / "o" / "report.json").read_text())["plan"]
    assert "drafttrain.json" in plan["source"] and plan["acceptance"] == [0.8, 0.5, 0.2]
    assert plan["num_draft_tokens"] <= 3 and len(plan["candidates"]) == 4


def test_a_damaged_record_is_one_error(setup, tmp_path, capsys):
    bad = tmp_path / "bad"
    shutil.copytree(setup["recorded"], bad)
    (bad / "drafttrain.json").write_text("{\"held_out\": 3}")
    one_error_line(*cli(capsys, argv(setup, tmp_path / "o", drafter=("--draft", str(bad)))), "damaged", "re-export")


def test_a_hybrid_eval_is_lossless_and_names_its_tree(setup, tmp_path):
    line = [a for a in argv(setup, tmp_path / "o", "--ngram", drafter=("--draft", setup["draft"]))]
    line[line.index("auto")] = "3"
    assert main(line) == 0
    report = json.loads((tmp_path / "o" / "report.json").read_text())
    assert report["drafter"] == "draft+ngram" and report["overall"]["tree"].startswith("model chain + n-gram")
    assert report["overall"]["outputs_match_baseline"] == 1.0


def test_a_planned_hybrid_counts_its_ngram_nodes(setup, tmp_path):
    assert main(argv(setup, tmp_path / "o", "--ngram", "--calibration-prompts", setup["calibration"],
                     drafter=("--draft", setup["draft"]))) == 0
    plan = json.loads((tmp_path / "o" / "report.json").read_text())["plan"]
    assert len(plan["costs"]["verify_seconds"]) == 2 * PLAN_MAX_K + 1
    assert plan["extra_tokens"] >= 0 and plan["proposal_rates"] is None


@pytest.mark.parametrize("extra, words", [(("--ngram",), ["--draft DIR"]),
                                          (("--ngram", "--temperature", "0.5"), ["greedy"])])
def test_bad_hybrids_are_one_error(setup, tmp_path, capsys, extra, words):
    spec = ("--method", "ngram") if words == ["--draft DIR"] else ("--draft", setup["draft"])
    line = argv(setup, tmp_path / "o", *extra, drafter=spec)
    line[line.index("auto")] = "3"
    one_error_line(*cli(capsys, line), *words)


def test_compare_takes_plus_ngram_on_a_draft_only(setup, tmp_path, capsys):
    from drafttrain.evaluation.compare import parse_drafter

    assert parse_drafter(f"h=draft:{setup['draft']}+ngram") == ("h", {"draft": setup["draft"], "ngram": True})
    assert parse_drafter(f"d=draft:{setup['draft']}") == ("d", {"draft": setup["draft"], "ngram": False})
    code, out, err = cli(capsys, ["compare", "--target", setup["target"], "--drafter", "x=ngram+ngram",
                                  "--prompts", setup["prompts"], "--out", str(tmp_path / "c")])
    one_error_line(code, out, err, "NAME=draft:DIR+ngram")


def test_lookup_reads_more_calibration_prompts_than_a_model(setup, tmp_path):
    """n-gram's acceptance varies the most from prompt to prompt, and its calibration is a walk:
    it reads LOOKUP_CALIBRATION_PROMPTS, a model drafter CALIBRATION_PROMPTS."""
    many = write_jsonl(tmp_path / "many.jsonl", [dict(c, id=f"c{i}") for i, c in
                                                  enumerate(CALIBRATION * (LOOKUP_CALIBRATION_PROMPTS + 2))])
    read = {}
    for name, spec in (("draft", ("--draft", setup["draft"])), ("ngram", ("--method", "ngram"))):
        assert main(argv(setup, tmp_path / name, "--calibration-prompts", many, drafter=spec)) == 0
        read[name] = json.loads((tmp_path / name / "report.json").read_text())["plan"]["source"]
    assert read["draft"].startswith(f"{CALIBRATION_PROMPTS} calibration prompts")
    assert read["ngram"].startswith(f"{LOOKUP_CALIBRATION_PROMPTS} calibration prompts")
