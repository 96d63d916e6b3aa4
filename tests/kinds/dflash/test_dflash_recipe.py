"""recipes/train_dflash.py end to end on a tiny target: the draft learns (tau rises), the export is
in vLLM's DFlash layout and decodes losslessly in drafttrain eval with the held-out tau it was picked
by, a second run resumes exactly, bad settings are one error line, and two CPU processes (DDP) end with
the weights of one."""

from __future__ import annotations

import json
import random
import shutil
import sys
from pathlib import Path

import pytest
import torch
from dflash_helpers import tiny_target
from safetensors.torch import load_file

import recipes.train_dflash as dflash_recipe
from drafttrain.cli import main as cli_main
from tiny import save_pair, tiny_tokenizer

REPO = Path(__file__).resolve().parents[3]
CONFIG = REPO / "recipes" / "configs" / "tiny_dflash_test.yaml"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("dflash-recipe")
    save_pair(root / "target", tiny_target(seed=0, dtype=torch.float32, sharpness=6.0), tiny_tokenizer(64))
    rng = random.Random(0)
    lines = [json.dumps({"prompt": " ".join(f"w{rng.randrange(3, 64)}" for _ in range(rng.randrange(3, 8)))})
             for _ in range(120)]
    (root / "prompts.jsonl").write_text("\n".join(lines) + "\n")
    return root


def args(setup, out, *overrides):
    return ["--config", str(CONFIG), f"output_dir={out}", f"target={setup / 'target'}",
            f"data.sources=[{{kind: jsonl, path: {setup / 'prompts.jsonl'}}}]", f"data.cache_dir={setup / 'cache'}",
            *overrides]


@pytest.fixture(scope="module")
def trained(setup, tmp_path_factory):
    out = tmp_path_factory.mktemp("dflash-run") / "run"
    assert dflash_recipe.main(args(setup, out)) == 0
    return out


def test_the_draft_learns_and_exports_in_vllms_layout(trained):
    initial = json.loads((trained / "eval" / "initial.json").read_text())
    final = json.loads((trained / "eval" / "final.json").read_text())
    assert final["tau"] > initial["tau"] + 0.2, (initial["tau"], final["tau"])
    config = json.loads((trained / "final" / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["block_size"] == 5
    assert config["dflash_config"]["mask_token_id"] == 3 and config["dflash_config"]["target_layer_ids"] == [1, 2, 4]
    names = set(load_file(str(trained / "final" / "model.safetensors")))
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.0.self_attn.q_proj.weight"} <= names
    assert (trained / "final" / "mask_embedding.pt").is_file()
    record = json.loads((trained / "final" / "drafttrain.json").read_text())
    assert record["held_out"]["per_position_acceptance"] == final["per_position_acceptance"]
    plans, k = record["plans"], max(record["plans"]["gpu_batch1"]["num_draft_tokens"], 1)
    assert plans["vllm_speculative_config"] == {"method": "dflash", "model": str(trained / "final"),
                                                "num_speculative_tokens": k}
    assert k <= 4  # at most block_size - 1


def test_the_export_decodes_losslessly_in_eval(setup, trained, tmp_path, capsys):
    code = cli_main(["eval", "--target", str(setup / "target"), "--dflash", str(trained / "final"), "--prompts",
                     str(trained / "heldout.jsonl"), "--max-new-tokens", "24", "--num-draft-tokens", "4",
                     "--out", str(tmp_path / "eval"), "--quiet"])
    assert code == 0, capsys.readouterr().err
    report = json.loads((tmp_path / "eval" / "report.json").read_text())
    assert report["overall"]["outputs_match_baseline"] == 1.0
    assert report["dflash"]["block_size"] == 5
    final = json.loads((trained / "eval" / "final.json").read_text())
    assert report["overall"]["mean_accepted_length"] == pytest.approx(final["tau"], abs=1e-9)


def test_a_resumed_run_ends_with_the_uninterrupted_runs_weights(setup, tmp_path, capsys):
    out = tmp_path / "run"
    overrides = ("features.keep_in_memory=true", "train.max_steps=20", "train.eval_every=10",
                 "train.checkpoint_every=10", "eval.num_prompts=2")
    assert dflash_recipe.main(args(setup, out, *overrides)) == 0
    uninterrupted = (out / "final" / "model.safetensors").read_bytes()
    shutil.rmtree(out / "checkpoints" / "step-20")
    shutil.rmtree(out / "final")
    capsys.readouterr()
    assert dflash_recipe.main(args(setup, out, *overrides)) == 0
    assert "resuming from" in capsys.readouterr().out
    assert (out / "final" / "model.safetensors").read_bytes() == uninterrupted


@pytest.mark.parametrize("override, needle", [("draft.block_size=1", "draft.block_size"),
                                              ("eval.num_draft_tokens=5", "draft.block_size - 1"),
                                              ("draft.target_layer_ids=[2,1]", "target_layer_ids"),
                                              ("draft.target_layer_ids=[6]", "target_layer_ids"),
                                              ("draft.vocab_size=100", "draft.vocab_size"),
                                              ("loss.anchors=0", "loss.anchors")])
def test_bad_config_is_one_error_line(setup, tmp_path, capsys, override, needle):
    capsys.readouterr()
    assert dflash_recipe.main(args(setup, tmp_path / "run", override)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and needle in err[0], err
    assert not (tmp_path / "run" / "final").exists()


@pytest.mark.slow
def test_two_processes_end_with_the_weights_of_one(setup, tmp_path):
    """Two DDP ranks train the same draft as one process with twice the accumulation."""
    sys.path.insert(0, str(REPO / "tests" / "training"))
    from training_helpers import run_launched_recipe, run_python_recipe

    common = ["train.max_steps=6", "train.micro_batch_size=2", "train.checkpoint_every=3", "eval.num_prompts=2",
              "train.eval_every=0", "train.keep_best=false"]
    one, two = tmp_path / "one", tmp_path / "two"
    script = REPO / "recipes" / "train_dflash.py"
    run = run_python_recipe(args(setup, one, *common, "train.gradient_accumulation_steps=2"), 300, recipe=script)
    assert run.returncode == 0, run.stderr[-3000:]
    run = run_launched_recipe("ddp.yaml", 2, args(setup, two, *common), recipe=script)
    assert run.returncode == 0, run.stderr[-3000:]
    a, b = [load_file(str(d / "final" / "model.safetensors")) for d in (one, two)]
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def test_a_planned_block_stays_within_the_block_trained_and_decodes_losslessly(setup, trained, tmp_path, capsys):
    """`--num-draft-tokens auto` plans K from this machine's costs (one block forward whatever K) and the
    export's held-out acceptance, never past block_size - 1 (the depth limit), and decodes with it."""
    code = cli_main(["eval", "--target", str(setup / "target"), "--dflash", str(trained / "final"), "--prompts",
                     str(trained / "heldout.jsonl"), "--max-new-tokens", "16", "--num-draft-tokens", "auto",
                     "--out", str(tmp_path / "eval"), "--quiet"])
    assert code == 0, capsys.readouterr().err
    report = json.loads((tmp_path / "eval" / "report.json").read_text())
    plan = report["plan"]
    assert "drafttrain.json" in plan["source"]  # the export's held-out acceptance
    assert [c["num_draft_tokens"] for c in plan["candidates"]] == list(range(5))  # K = 0 .. block_size - 1
    assert report["config"]["num_draft_tokens"] == plan["num_draft_tokens"] <= 4
    assert report["overall"]["outputs_match_baseline"] == 1.0
