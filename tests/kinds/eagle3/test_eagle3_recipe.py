"""recipes/train_eagle3.py end to end on a tiny target: the draft learns (tau rises), the export
loads in drafttrain eval and decodes losslessly, a second run resumes (exactly, with the features kept in
memory), and two CPU processes (DDP, and DeepSpeed ZeRO-3 over gloo) end with the weights of one."""

from __future__ import annotations

import json
import os
import random
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import recipes.train_eagle3 as eagle3_recipe
from drafttrain.cli import main as cli_main
from eagle3_helpers import tiny_target
from tiny import save_pair, tiny_tokenizer

REPO = Path(__file__).resolve().parents[3]
CONFIG = REPO / "recipes" / "configs" / "tiny_eagle3_test.yaml"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle3-recipe")
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
    out = tmp_path_factory.mktemp("eagle3-run") / "run"
    assert eagle3_recipe.main(args(setup, out)) == 0
    return out


def test_the_draft_learns_and_exports_in_the_serving_layout(trained):
    initial = json.loads((trained / "eval" / "initial.json").read_text())
    final = json.loads((trained / "eval" / "final.json").read_text())
    assert final["tau"] > initial["tau"] + 0.2, (initial["tau"], final["tau"])
    config = json.loads((trained / "final" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == 48
    names = set(load_file(str(trained / "final" / "model.safetensors")))
    assert {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"} <= names
    assert all(n.startswith(("midlayer.", "fc.", "norm.", "lm_head.", "d2t", "t2d")) for n in names)
    card = (trained / "final" / "README.md").read_text()
    assert "chain" in card and "dynamic" in card  # the acceptance table, both ways
    dynamic = json.loads((trained / "eval" / "final_dynamic.json").read_text())
    assert dynamic["tau"] >= final["tau"] - 0.05  # a tree never does much worse than its own chain
    # drafttrain.json: the chain's held-out acceptance and the plans it implies, with launch settings
    record = json.loads((trained / "final" / "drafttrain.json").read_text())
    assert record["held_out"]["per_position_acceptance"] == final["per_position_acceptance"]  # eval.tree: chain
    plans, k = record["plans"], max(record["plans"]["gpu_batch1"]["num_draft_tokens"], 1)
    assert plans == json.loads((trained / "eval" / "plans.json").read_text())
    assert plans["vllm_speculative_config"] == {"method": "eagle3", "model": str(trained / "final"),
                                                "num_speculative_tokens": k}
    assert plans["sglang_server_args"]["speculative_algorithm"] == "EAGLE3"
    assert plans["sglang_server_args"]["speculative_num_draft_tokens"] == k + 1
    assert "planned K (drafttrain.json)" in card


def test_the_export_decodes_losslessly_in_eval(setup, trained, tmp_path, capsys):
    code = cli_main(["eval", "--target", str(setup / "target"), "--eagle3", str(trained / "final"), "--prompts",
                     str(trained / "heldout.jsonl"), "--max-new-tokens", "24", "--num-draft-tokens", "3",
                     "--tree", "chain", "--out", str(tmp_path / "eval"), "--quiet"])
    assert code == 0, capsys.readouterr().err
    report = json.loads((tmp_path / "eval" / "report.json").read_text())
    assert report["overall"]["outputs_match_baseline"] == 1.0
    final = json.loads((trained / "eval" / "final.json").read_text())
    assert report["overall"]["mean_accepted_length"] == pytest.approx(final["tau"], abs=1e-9)


def test_a_finished_run_started_again_changes_nothing(setup, trained):
    before = (trained / "final" / "model.safetensors").read_bytes()
    assert eagle3_recipe.main(args(setup, trained)) == 0
    assert (trained / "final" / "model.safetensors").read_bytes() == before


def test_features_kept_in_memory_resume_exactly(setup, tmp_path, capsys):
    """The memo starts empty after a resume; the run still ends with the uninterrupted run's weights."""
    out = tmp_path / "run"
    overrides = ("features.keep_in_memory=true", "train.max_steps=20", "train.eval_every=10",
                 "train.checkpoint_every=10", "eval.num_prompts=2")
    assert eagle3_recipe.main(args(setup, out, *overrides)) == 0
    uninterrupted = (out / "final" / "model.safetensors").read_bytes()
    best = json.loads((out / "eval" / "final.json").read_text())
    shutil.rmtree(out / "checkpoints" / "step-20")
    shutil.rmtree(out / "final")
    capsys.readouterr()
    assert eagle3_recipe.main(args(setup, out, *overrides)) == 0
    assert "resuming from" in capsys.readouterr().out
    assert (out / "final" / "model.safetensors").read_bytes() == uninterrupted
    assert json.loads((out / "eval" / "final.json").read_text())["tau"] == best["tau"]


@pytest.mark.parametrize("override, needle", [("loss.ttt_steps=0", "loss.ttt_steps"),
                                              ("draft.aux_layer_ids=[1,1,2]", "aux_layer_ids"),
                                              ("loss.teacher=topk", "data.store_topk"),
                                              ("features.shard_target=true", "ZeRO-3 launch"),
                                              ("features.shard_target=true features.keep_in_memory=true",
                                               "features.keep_in_memory=false")])
def test_bad_config_is_one_error_line(setup, tmp_path, capsys, override, needle):
    capsys.readouterr()
    assert eagle3_recipe.main(args(setup, tmp_path / "run", *override.split())) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and needle in err[0], err


@pytest.mark.slow
@pytest.mark.parametrize("launch_config, shard", [("ddp.yaml", False), ("deepspeed_zero3.yaml", False),
                                                  ("deepspeed_zero3.yaml", True)])
@pytest.mark.slow
def test_two_processes_end_with_the_weights_of_one(setup, tmp_path, launch_config, shard):
    """Two ranks train the same draft as one process with twice the accumulation; with the target
    itself sharded (ZeRO-3, features.shard_target) too, its features and evaluations included."""
    common = ["train.max_steps=6", "train.micro_batch_size=2", "train.checkpoint_every=3", "eval.num_prompts=2",
              # sharded: evaluations at steps 0, 3, 6 on every rank, and best/ handed from the main rank to all
              *(["train.eval_every=3", "train.keep_best=true"] if shard else ["train.eval_every=0",
                                                                             "train.keep_best=false"])]
    one, two = tmp_path / "one", tmp_path / "two"
    script = str(REPO / "recipes" / "train_eagle3.py")
    run = subprocess.run([sys.executable, script, *args(setup, one, *common, "train.gradient_accumulation_steps=2")],
                         capture_output=True, text=True, env=subprocess_env(), timeout=300, cwd=REPO)
    assert run.returncode == 0, run.stderr[-3000:]
    run = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                          str(REPO / "recipes" / "accelerate" / launch_config), "--num_processes", "2",
                          "--main_process_port", str(free_port()), script,
                          *args(setup, two, *common, f"features.shard_target={str(shard).lower()}")],
                         capture_output=True, text=True, env=subprocess_env(), timeout=300, cwd=REPO)
    assert run.returncode == 0, run.stderr[-3000:]
    assert ("the target is sharded across 2 ranks (each holds 50%" in run.stdout) == shard, run.stdout[-2000:]
    def evals(out):
        return [(e["step"], e["tau"], e["best_step"]) for e in map(json.loads, (out / "train_log.jsonl").open())
                if e["type"] == "eval"]

    assert evals(two) == evals(one) and [e[0] for e in evals(one)] == ([0, 3, 6] if shard else [0, 6])
    for name in ("initial", "final", "final_dynamic"):  # every rank decoded, the same numbers as one process
        assert json.loads((two / "eval" / f"{name}.json").read_text())["tau"] == \
            json.loads((one / "eval" / f"{name}.json").read_text())["tau"], name
    a, b = [load_file(str(d / "final" / "model.safetensors")) for d in (one, two)]
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def subprocess_env() -> dict:
    env = dict(os.environ)
    env.update(PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""), TOKENIZERS_PARALLELISM="false",
               HF_HUB_OFFLINE="1", WANDB_MODE="offline", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
