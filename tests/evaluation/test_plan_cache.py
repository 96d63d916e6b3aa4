"""Plans remembered (`evaluation.plan_cache`): a second identical compare plans from the cache with
the same choices and measures nothing; a changed drafter checkpoint, calibration file or target is
measured afresh (and only what it changes); `--replan` measures afresh; a damaged cache is one
warning and measured again; a cache that cannot be written is one warning, and the plan is made;
each drafter's plan is a progress line saying what it measures."""

import json
import os
from pathlib import Path

import pytest
from eval_helpers import cli, one_error_line, write_jsonl
from tiny import noisy_copy, save_pair, tiny_lm, tiny_tokenizer

from drafttrain.cli import main
from drafttrain.evaluation import calibration as calibrating
from drafttrain.evaluation import plan as planner
from drafttrain.kinds.medusa.export import save_medusa
from drafttrain.kinds.medusa.model import MedusaHeads

PROMPTS = [{"prompt": "w5 w9 w13 w7"}, {"prompt": "w40 w41 w40 w41"}]
CALIBRATION = [{"prompt": "w3 w4 w5 w6"}, {"prompt": "w30 w31 w30 w31"}, {"prompt": "w12 w13 w14"}]
CALIBRATED_TREE = [[0], [0, 0], [1], [0, 0, 0], [0, 1], [2], [1, 0]]
DRAFTERS = ("draft", "ngram", "heads")
PLANNED = ("num_draft_tokens", "tree_nodes", "tree_topk", "planned_speedup", "expected_tokens", "costs", "acceptance",
           "candidates")


@pytest.fixture
def setup(tmp_path):
    target = tiny_lm(0, max_positions=64)
    tok = tiny_tokenizer()
    heads = MedusaHeads.from_target(target, num_heads=3, num_layers=1)
    save_medusa(heads, tmp_path / "heads", extra={"drafttrain": {"kind": "medusa-1", "target": "t",
                                                                 "tree": CALIBRATED_TREE}})
    return {"target": save_pair(tmp_path / "target", target, tok),
            "draft": save_pair(tmp_path / "draft", noisy_copy(target), tok), "heads": str(tmp_path / "heads"),
            "prompts": write_jsonl(tmp_path / "p.jsonl", PROMPTS),
            "calibration": write_jsonl(tmp_path / "c.jsonl", CALIBRATION), "tokenizer": tok}


@pytest.fixture(autouse=True)
def plausible_costs(monkeypatch):
    """Costs are trusted here: on a loaded machine a tiny model's timings can look impossible
    (`planning.implausible`), and such costs are measured again whatever the cache holds
    (`plan.trusted_chain_costs`), which is right, and not what these tests are about."""
    monkeypatch.setattr(planner, "implausible", lambda *args, **kwargs: [])


def compare(setup, out, *extra):
    return ["compare", "--target", setup["target"], "--drafter", f"draft=draft:{setup['draft']}", "--drafter",
            "ngram=ngram", "--drafter", f"heads=heads:{setup['heads']}", "--prompts", setup["prompts"],
            "--max-new-tokens", "10", "--dtype", "float64", "--num-draft-tokens", "auto", "--tree-nodes", "auto",
            "--calibration-prompts", setup["calibration"], "--out", str(out), "--quiet", *extra]


def plans(out) -> dict:
    return {name: json.loads((out / name / "report.json").read_text())["plan"] for name in DRAFTERS}


@pytest.fixture
def measurements(monkeypatch):
    """Every measurement a plan can make, counted: the target's forwards and steps, a drafter's
    step, the target's continuations, and a drafter's calibration decodes."""
    calls = []

    def counted(module, name):
        real = getattr(module, name)

        def wrapper(*args, **kwargs):
            calls.append(name)
            return real(*args, **kwargs)

        monkeypatch.setattr(module, name, wrapper)

    for name in ("forward_curve", "tree_step_seconds", "loop_overhead", "drafter_seconds"):
        counted(planner, name)
    for name in ("recorded_trees", "calibrated_acceptance", "walked_acceptance", "teacher_forced"):
        counted(calibrating, name)
    for name in ("_decode_batched", "_decode_alone"):
        counted(calibrating.Calibration, name)
    return calls


def test_a_second_identical_run_plans_from_the_cache_and_chooses_the_same(setup, tmp_path, measurements):
    assert main(compare(setup, tmp_path / "first")) == 0
    first = plans(tmp_path / "first")
    assert all(not p["cached"] for p in first.values()) and measurements
    measurements.clear()
    assert main(compare(setup, tmp_path / "second")) == 0
    second = plans(tmp_path / "second")
    assert measurements == []  # nothing measured: a plan read whole from the cache
    for name in DRAFTERS:
        assert second[name]["cached"] and second[name]["measured_at"] == first[name]["measured_at"]
        assert {k: second[name].get(k) for k in PLANNED} == {k: first[name].get(k) for k in PLANNED}
    assert "plan cache" in (tmp_path / "second" / "heads" / "report.md").read_text()
    assert main(compare(setup, tmp_path / "third", "--replan")) == 0
    assert all(not p["cached"] for p in plans(tmp_path / "third").values()) and measurements


def rewrite_draft(setup):
    save_pair(setup["draft"], noisy_copy(tiny_lm(0, max_positions=64), seed=11), setup["tokenizer"])


def rewrite_calibration(setup):
    write_jsonl(setup["calibration"], [*CALIBRATION[:2], {"prompt": "w12 w13 w15"}])


def rewrite_target(setup):
    save_pair(setup["target"], tiny_lm(1, max_positions=64), setup["tokenizer"])


@pytest.mark.parametrize("change, remeasured", [(rewrite_draft, {"draft"}), (rewrite_calibration, set(DRAFTERS)),
                                                (rewrite_target, set(DRAFTERS))])
def test_a_changed_checkpoint_calibration_file_or_target_is_measured_afresh(setup, tmp_path, change, remeasured):
    """Keys are contents, not paths: the same paths, rewritten, are other keys. A new draft
    checkpoint leaves the other drafters' plans cached; a calibration file or a target touches all."""
    assert main(compare(setup, tmp_path / "first")) == 0
    change(setup)
    assert main(compare(setup, tmp_path / "second")) == 0
    second = plans(tmp_path / "second")
    assert {name for name in DRAFTERS if not second[name]["cached"]} == remeasured


def test_another_machine_measures_its_own_costs_and_reads_the_acceptance(setup, tmp_path, monkeypatch, measurements):
    """Costs are the machine's (CPU model, GPU, threads, torch): another machine re-times them, and
    reads the acceptance and the target's continuations measured on the first (they are the models')."""
    from drafttrain.evaluation import plan_cache

    assert main(compare(setup, tmp_path / "first")) == 0
    monkeypatch.setattr(plan_cache, "cpu_model", lambda: "another CPU")
    measurements.clear()
    assert main(compare(setup, tmp_path / "second")) == 0
    assert all(not p["cached"] for p in plans(tmp_path / "second").values())
    assert {"forward_curve", "tree_step_seconds"} <= set(measurements)
    assert not {"recorded_trees", "calibrated_acceptance", "walked_acceptance", "_decode_batched",
                "_decode_alone"} & set(measurements)


def test_a_damaged_cache_is_one_warning_and_measured_again(setup, tmp_path, capsys, monkeypatch):
    assert main(compare(setup, tmp_path / "first")) == 0
    files = sorted(Path(os.environ["DRAFTTRAIN_HOME"]).glob("plans/*/*.json"))
    assert len(files) >= 1 + 1 + len(DRAFTERS)  # the target's costs and continuations, each drafter's acceptance
    for f in files:
        f.write_text("{\"key\": 3, \"entr")
    code, _, err = cli(capsys, compare(setup, tmp_path / "second"))
    assert code == 0
    warnings = [line for line in err.splitlines() if "plan cache" in line]
    assert len(warnings) == len(files) and all(w.startswith("warning:") and "damaged" in w for w in warnings)
    assert all(not p["cached"] for p in plans(tmp_path / "second").values())
    assert all(json.loads(f.read_text())["entries"] for f in files)  # measured again, and kept


def test_a_cache_that_cannot_be_written_is_one_warning(setup, tmp_path, capsys, monkeypatch):
    home = tmp_path / "home-is-a-file"
    home.write_text("")
    monkeypatch.setenv("DRAFTTRAIN_HOME", str(home))
    code, _, err = cli(capsys, compare(setup, tmp_path / "out"))
    assert code == 0
    warnings = [line for line in err.splitlines() if "plan cache" in line]
    assert len(warnings) == 1 and warnings[0].startswith("warning:") and "cannot be written" in warnings[0], err
    assert all(not p["cached"] and p["measured_at"] for p in plans(tmp_path / "out").values())


def test_replan_without_a_plan_is_one_error(setup, tmp_path, capsys):
    line = [a for a in compare(setup, tmp_path / "o", "--replan")]
    for flag in ("--num-draft-tokens", "--tree-nodes"):
        line[line.index(flag) + 1] = "2"
    line = line[:line.index("--calibration-prompts")] + line[line.index("--calibration-prompts") + 2:]
    one_error_line(*cli(capsys, line), "--replan", "auto")
    assert not (tmp_path / "o").exists()


def test_each_plan_is_a_progress_line_saying_what_it_measures(setup, tmp_path, capsys):
    line = compare(setup, tmp_path / "out")
    line.remove("--quiet")
    code, _, err = cli(capsys, line)
    assert code == 0
    for name in DRAFTERS:
        shown = [part for part in err.replace("\r", "\n").splitlines() if part.startswith(f"plan {name}:")]
        assert shown, err
        assert any("<" in part and "step" in part for part in shown)  # tqdm's elapsed<left
        assert any("target" in part or "calibration" in part or "trees" in part for part in shown)
        assert "K = " in shown[-1]  # the line ends on the plan
