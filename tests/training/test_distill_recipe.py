"""recipes/distill.py on tiny models: config errors, acceptance gains, kill-and-resume, the export."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from training_helpers import (RECIPE, assert_same_weights, load_recipe, load_weights, recipe_args,
                              run_python_recipe, subprocess_env)

from recipes.distill import DistillConfig

from drafttrain.config import dump_config_yaml, load_config, undocumented_fields
from drafttrain.data import TrainingCollator, onpolicy_batch, onpolicy_step, response_window
from drafttrain.losses import distill_loss, topk_teacher_logits

EOS = 2  # tests/tiny.py: <|im_end|>
VOCAB = 64  # tests/tiny.py: tiny_lm and tiny_tokenizer


# ----------------------------------------------------------------------------- configs and errors


def test_every_config_key_is_documented_and_listed_by_help(capsys):
    assert undocumented_fields(DistillConfig) == []
    with pytest.raises(SystemExit) as exit_info:
        load_recipe().main(["--help"])
    assert exit_info.value.code == 0
    listing = capsys.readouterr().out
    assert listing.startswith("usage: recipes/distill.py --config FILE.yaml [--overwrite] [key=value ...]")
    assert "\n--overwrite\n" in listing
    for key in ("draft.from_target_layers", "loss.kind", "onpolicy.fraction", "optim.warmup_steps",
                "train.checkpoint_every", "data.store_topk", "eval.num_draft_tokens"):
        assert f"\n{key}:" in listing


BAD_CONFIGS = {
    "unknown key": (["loss.knd=jsd"], "unknown config key 'loss.knd'"),
    "missing target": (["target={missing}"], "is not a directory"),
    "draft vocabulary": (["draft.path={foreign}"], "token-to-id map"),
    "bad loss kind": (["loss.kind=kl"], "'loss.kind' must be one of"),
    "two draft sources": (["draft.from_target_layers=every:2"], "exactly one of draft.path"),
    "bad layer spec": (["draft.path=null", "draft.from_target_layers=every:x"], "every:x"),
    "on-policy with ce": (["loss.kind=ce", "onpolicy.fraction=0.5"], "onpolicy.fraction"),
    "no held-out prompts": (["data.heldout_size=0"], "held-out"),
    "negative prompt weight": (["data.prompt_loss_weight=-1"], "prompt_loss_weight must be >= 0"),
}


@pytest.mark.parametrize("case", list(BAD_CONFIGS))
def test_a_bad_config_is_one_error_line_and_writes_nothing(case, assets, tmp_path, capfd):
    overrides, message = BAD_CONFIGS[case]
    overrides = [o.format(missing=tmp_path / "missing", foreign=assets["foreign"]) for o in overrides]
    out = tmp_path / "run"
    assert load_recipe().main(recipe_args(assets, out, *overrides)) == 2
    lines = [line for line in capfd.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    assert message in lines[0]
    assert not out.exists()


def test_the_script_exits_2_with_one_error_line(assets, tmp_path):
    out = tmp_path / "run"
    result = run_python_recipe(recipe_args(assets, out, f"draft.path={assets['foreign']}"))
    assert result.returncode == 2
    assert [line for line in result.stderr.splitlines() if line.strip()] == [
        line for line in result.stderr.splitlines() if line.startswith("error: draft and target disagree")]
    assert result.stderr.count("error:") == 1 and not out.exists()


# ----------------------------------------------------------------------------- teacher and on-policy pieces


def test_topk_teacher_keeps_the_top_k_and_spreads_the_rest_evenly():
    torch.manual_seed(0)
    V, k = 10, 3
    logits = torch.randn(2, 4, V, dtype=torch.float64) * 3
    logprobs = logits.log_softmax(-1)
    top, ids = logprobs.topk(k, dim=-1)
    probs = topk_teacher_logits(ids, top, V).double().softmax(-1)
    rest = (1 - top.exp().sum(-1)) / (V - k)
    for b in range(2):
        for t in range(4):
            for v in range(V):
                want = logprobs[b, t, v].exp() if v in ids[b, t] else rest[b, t]
                assert probs[b, t, v].item() == pytest.approx(want.item(), rel=1e-5)
    # With k = V nothing is approximated: the loss equals the exact one.
    full_top, full_ids = logprobs.topk(V, dim=-1)
    student = torch.randn(2, 4, V, dtype=torch.float64)
    mask = torch.ones(2, 4, dtype=torch.bool)
    for kind in ("forward_kl", "reverse_kl", "tvd"):
        exact = distill_loss(student, logits, mask, kind=kind)
        approx = distill_loss(student.float(), topk_teacher_logits(full_ids, full_top, V), mask, kind=kind)
        assert approx.item() == pytest.approx(exact.item(), rel=1e-4, abs=1e-6)


def test_onpolicy_batch_continues_each_prompt_like_generate_alone():
    from tiny import tiny_lm

    draft = tiny_lm(seed=3, layers=1)  # float64
    collator = TrainingCollator(max_seq_len=32, pad_id=EOS)
    rows = [{"prompt_ids": [5, 9, 11, 4], "response_ids": [7, 7, EOS]},
            {"prompt_ids": [12, 30], "response_ids": [8, 8, 8, 8, 8]},
            {"prompt_ids": [40, 41, 42, 43, 44, 45], "response_ids": [9]}]
    batch = collator(rows)
    got = onpolicy_batch(draft, batch, collator, temperature=0.0, max_new_tokens=6, eos_ids=[EOS], pad_id=EOS, seed=0)
    for i, row in enumerate(rows):
        ids = torch.tensor([row["prompt_ids"]])
        ref = draft.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=6,
                             eos_token_id=EOS, pad_token_id=EOS)[0, ids.shape[1]:].tolist()
        ref = ref[:ref.index(EOS) + 1] if EOS in ref else ref
        n = int(got["attention_mask"][i].sum())
        start = int(got["loss_mask"][i].int().argmax()) + 1
        assert got["input_ids"][i, :start].tolist() == row["prompt_ids"]
        assert got["input_ids"][i, start:n].tolist() == ref
    assert draft.training is False  # left as it was

    sampled = [onpolicy_batch(draft, batch, collator, temperature=1.0, max_new_tokens=6, eos_ids=[EOS], pad_id=EOS,
                              seed=s)["input_ids"] for s in (1, 1, 2)]
    assert torch.equal(sampled[0], sampled[1]) and not torch.equal(sampled[0], sampled[2])


def test_onpolicy_draws_are_per_step_and_reproducible():
    draws = [onpolicy_step(0.3, 0, s) for s in range(400)]
    assert draws == [onpolicy_step(0.3, 0, s) for s in range(400)]
    assert 0.2 < sum(draws) / 400 < 0.4
    assert not any(onpolicy_step(0.0, 0, s) for s in range(50)) and all(onpolicy_step(1.0, 0, s) for s in range(50))


# ----------------------------------------------------------------------------- a whole run


def brute_force_tau(target, draft, prompt: list[int], k: int, max_new: int) -> tuple[int, int]:
    """(tokens, target passes) of greedy speculative decoding, from full forward passes only."""
    def greedy_next(model, ids):
        return int(model(torch.tensor([ids])).logits[0, -1].argmax())

    out = []  # the target's greedy continuation, up to and including EOS
    while len(out) < max_new and (not out or out[-1] != EOS):
        out.append(greedy_next(target, prompt + out))
    pos = passes = 0
    while pos < len(out):
        drafts = []
        for _ in range(min(k, max_new - pos - 1)):
            drafts.append(greedy_next(draft, prompt + out[:pos] + drafts))
        n = 0
        while n < len(drafts) and drafts[n] == out[pos + n]:
            n += 1
        pos = min(pos + n + 1, len(out))
        passes += 1
    return len(out), passes


def test_distillation_raises_acceptance_on_held_out_prompts(distilled, assets):
    from transformers import AutoModelForCausalLM

    from drafttrain.prompts import encode_prompt, read_prompt_file
    from drafttrain.models import load_tokenizer

    initial = json.loads((distilled / "eval" / "initial.json").read_text())
    final = json.loads((distilled / "eval" / "final.json").read_text())
    assert initial["step"] == 0 and final["step"] > 0
    assert final["tau"] >= initial["tau"] + 0.5, (initial["tau"], final["tau"])

    # The recipe's tau is what a brute-force simulation of greedy speculative decoding gives.
    cfg = load_config(DistillConfig, distilled / "config.yaml")
    tokenizer = load_tokenizer(assets["target"])
    prompts = [encode_prompt(r, tokenizer) for r in read_prompt_file(distilled / "heldout.jsonl")][:cfg.eval.num_prompts]
    assert len(prompts) == final["prompts"] == cfg.eval.num_prompts
    target = AutoModelForCausalLM.from_pretrained(assets["target"], dtype=torch.float64).eval()
    for name, metrics in (("initial", initial), ("final", final)):
        draft = AutoModelForCausalLM.from_pretrained(distilled / name, dtype=torch.float64).eval()
        with torch.no_grad():
            counts = [brute_force_tau(target, draft, p, cfg.eval.num_draft_tokens, cfg.eval.max_new_tokens)
                      for p in prompts]
        assert metrics["tau"] == pytest.approx(sum(t for t, _ in counts) / sum(n for _, n in counts))

    card = (distilled / "final" / "README.md").read_text()
    assert f"| initial (before training) | {cfg.eval.num_draft_tokens} | {initial['tau']:.2f} |" in card
    assert f"| final (step {final['step']}) | {cfg.eval.num_draft_tokens} | {final['tau']:.2f} |" in card
    # The export records that held-out acceptance for --num-draft-tokens auto (drafttrain.json).
    record = json.loads((distilled / "final" / "drafttrain.json").read_text())["held_out"]
    assert record["per_position_acceptance"] == final["per_position_acceptance"]
    assert (record["tau"], record["num_draft_tokens"], record["prompts"]) == (final["tau"], cfg.eval.num_draft_tokens,
                                                                             cfg.eval.num_prompts)
    plans = json.loads((distilled / "final" / "drafttrain.json").read_text())["plans"]
    assert plans["vllm_speculative_config"]["num_speculative_tokens"] == max(plans["gpu_batch1"]["num_draft_tokens"], 1)
    assert 0 <= plans["this_machine"]["num_draft_tokens"] <= cfg.eval.num_draft_tokens
    assert f"{plans['gpu_batch1']['num_draft_tokens']} on a GPU at batch 1" in card
    # The best-tau evaluation is what was exported.
    log = [json.loads(line) for line in (distilled / "train_log.jsonl").read_text().splitlines()]
    evals = [e for e in log if e["type"] == "eval"]
    assert final["tau"] == max(e["tau"] for e in evals)
    assert final["step"] == min(e["step"] for e in evals if e["tau"] == final["tau"])


def test_the_run_directory_is_complete(distilled):
    for name in ("config.yaml", "heldout.jsonl", "train_log.jsonl", "initial/config.json", "final/README.md",
                 "eval/initial.json", "eval/final.json", "best/model.safetensors"):
        assert (distilled / name).is_file(), name
    saved = (distilled / "config.yaml").read_text()
    assert dump_config_yaml(load_config(DistillConfig, distilled / "config.yaml")) == saved
    assert [p.name for p in sorted((distilled / "checkpoints").iterdir())] == ["step-50", "step-60"]


def test_the_exported_draft_gives_the_targets_greedy_output_in_transformers(distilled, assets):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from drafttrain.prompts import encode_prompt, read_prompt_file

    tokenizer = AutoTokenizer.from_pretrained(distilled / "final")
    assert tokenizer.get_vocab() == AutoTokenizer.from_pretrained(assets["target"]).get_vocab()
    target = AutoModelForCausalLM.from_pretrained(assets["target"], dtype=torch.float64).eval()
    draft = AutoModelForCausalLM.from_pretrained(distilled / "final", dtype=torch.float64).eval()
    assert draft.generation_config.eos_token_id == EOS
    exported = load_weights(distilled / "final")
    best = load_weights(distilled / "best")
    assert_same_weights(exported, {k: v for k, v in best.items() if k in exported})

    for record in read_prompt_file(distilled / "heldout.jsonl"):
        ids = torch.tensor([encode_prompt(record, tokenizer)])
        kwargs = dict(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=24,
                      pad_token_id=EOS)
        plain = target.generate(**kwargs)
        assisted = target.generate(**kwargs, assistant_model=draft)
        assert assisted.tolist() == plain.tolist()


def test_onpolicy_and_stored_topk_batches_train(assets, tmp_path):
    out = tmp_path / "run"
    args = recipe_args(assets, out, "train.max_steps=8", "train.eval_every=0", "train.log_every=1",
                       "onpolicy.fraction=0.5", "onpolicy.max_new_tokens=8", "data.store_topk=8",
                       "eval.num_prompts=2")
    assert load_recipe().main(args) == 0
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    on = [e["onpolicy"] for e in log if e["type"] == "train"]
    assert on == [float(onpolicy_step(0.5, 0, s)) for s in range(8)]
    assert 0.0 in on and 1.0 in on
    assert all(math.isfinite(e["loss"]) and e["loss"] > 0 for e in log if e["type"] == "train")


# ----------------------------------------------------------------------------- a real interruption


@pytest.mark.slow
def test_a_killed_run_resumes_to_the_weights_of_an_uninterrupted_one(assets, tmp_path, capfd):
    common = ["train.max_steps=30", "train.checkpoint_every=5", "train.keep_checkpoints=3", "train.eval_every=1",
              "train.log_every=1", "eval.num_prompts=4"]
    whole = tmp_path / "whole"
    assert run_python_recipe(recipe_args(assets, whole, *common)).returncode == 0

    out = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, str(RECIPE), *recipe_args(assets, out, *common)], env=subprocess_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 120
    lock = out / ".lock"
    while not (lock.is_file() and lock.read_text().strip() == str(proc.pid)):
        assert proc.poll() is None and time.monotonic() < deadline, "the run never took its lock"
        time.sleep(0.01)
    # While it runs, the output directory is its own: a second run is refused, naming its pid.
    capfd.readouterr()
    assert load_recipe().main(recipe_args(assets, out, *common)) == 2
    assert [line for line in capfd.readouterr().err.splitlines() if line.strip()] == [
        f"error: {out} is in use by another run (pid {proc.pid}); wait for it to end, or pick another output_dir"]
    while not (out / "checkpoints" / "step-10").is_dir():
        assert proc.poll() is None, "the run ended before it could be interrupted"
        assert time.monotonic() < deadline, "no checkpoint appeared"
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (out / "final").exists(), "killed too late: the run had finished"
    # Whatever the kill left half-written must be ignored; make sure there is something.
    partial = out / "checkpoints" / ".step-25.tmp"
    partial.mkdir(exist_ok=True)
    (partial / "model.safetensors").write_bytes(b"half a file")
    (out / ".best.x1y2.tmp").mkdir()

    resumed = run_python_recipe(recipe_args(assets, out, *common))
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resuming from" in resumed.stdout
    assert f"locked by a run (pid {proc.pid}) that ended without releasing it" in resumed.stdout  # taken over
    assert not partial.exists() and not (out / ".best.x1y2.tmp").exists()
    for name in ("final", "checkpoints/step-30"):
        assert_same_weights(load_weights(out / name), load_weights(whole / name), rtol=1e-6, atol=1e-7)
    assert json.loads((out / "eval" / "final.json").read_text())["tau"] == \
        json.loads((whole / "eval" / "final.json").read_text())["tau"]


@pytest.mark.parametrize("name", ["tiny_test.yaml", "smollm2_distill_demo.yaml"])
def test_shipped_configs_load(name):
    from training_helpers import REPO

    cfg = load_config(DistillConfig, REPO / "recipes" / "configs" / name, ["output_dir=x", "target=y"])
    assert cfg.loss.kind == "forward_kl" and cfg.train.max_steps > 0


# ----------------------------------------------------------------------------- cheaper steps


def test_response_window_starts_at_the_first_trained_position():
    mask = torch.zeros(3, 10, dtype=torch.bool)
    mask[0, 6:9] = True
    mask[1, 4:7] = True   # the earliest response: position 4
    assert response_window(mask) == 4
    assert response_window(torch.zeros(2, 5, dtype=torch.bool)) == 0  # nothing to train: keep everything


def test_aligned_prompts_and_windowed_logits_give_the_plain_loss():
    from tiny import tiny_lm

    student, teacher = tiny_lm(seed=3), tiny_lm(seed=4)
    rows = [{"prompt_ids": [5, 6, 7, 8, 9, 10], "response_ids": [11, 12, EOS]},
            {"prompt_ids": [5, 6], "response_ids": [13, 14, 15, 16, EOS]},
            {"prompt_ids": [20, 21, 22], "response_ids": [23]}]
    plain = TrainingCollator(64, EOS)(rows)  # right padding, logits everywhere: the reference
    kw = dict(input_ids=plain["input_ids"], attention_mask=plain["attention_mask"])
    reference = distill_loss(student(**kw).logits, teacher(**kw).logits, plain["loss_mask"], kind="jsd")

    batch = TrainingCollator(64, EOS, align_prompts=True)(rows)
    start = response_window(batch["loss_mask"])
    assert start == 5  # every response starts after the longest prompt (6 tokens)
    assert batch["loss_mask"][:, :start].sum() == 0 and batch["loss_mask"].sum() == plain["loss_mask"].sum()
    assert batch["position_ids"][1].tolist()[4:11] == [0, 1, 2, 3, 4, 5, 6]
    keep = batch["input_ids"].shape[1] - start
    kw = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids")}
    windowed = distill_loss(student(**kw, logits_to_keep=keep).logits, teacher(**kw, logits_to_keep=keep).logits,
                            batch["loss_mask"][:, start:], kind="jsd")
    torch.testing.assert_close(windowed, reference, rtol=1e-10, atol=0)


def test_frozen_embeddings_stay_the_targets_while_the_layers_train(assets, tmp_path):
    out = tmp_path / "run"
    args = recipe_args(assets, out, "draft.path=null", "draft.from_target_layers=first:1",
                       "draft.freeze_embeddings=true", "train.max_steps=4", "train.eval_every=0", "train.keep_best=false",
                       "eval.num_prompts=2")
    assert load_recipe().main(args) == 0
    before, after = load_weights(out / "initial"), load_weights(out / "final")
    target = load_weights(assets["target"])
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        torch.testing.assert_close(after[name], target[name], rtol=0, atol=0)
    trained = [k for k in before if "layers" in k and not torch.equal(before[k], after[k])]
    assert trained, "no decoder-layer weight changed"


def test_prompt_positions_add_their_weighted_loss_with_either_teacher(assets, tmp_path):
    """Step 1's logged losses (before any update, on the same first batch): the stored top-k teacher
    with k = vocabulary size is exact, so it must agree with the target run on the fly, and the
    total must be the response-only loss plus weight x the prompt loss."""
    def first_step(name, *overrides):
        out = tmp_path / name
        args = recipe_args(assets, out, "train.max_steps=1", "train.eval_every=0", "train.log_every=1",
                           "train.keep_best=false", "eval.num_prompts=2", *overrides)
        assert load_recipe().main(args) == 0
        return next(json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()
                    if json.loads(line)["type"] == "train")

    stored = first_step("stored", "data.prompt_loss_weight=0.5", f"data.store_topk={VOCAB}")
    live = first_step("live", "data.prompt_loss_weight=0.5")
    response_only = first_step("response_only")
    assert stored["prompt_tokens"] > 0 and stored["tokens"] > 0
    assert stored["prompt_loss"] > 0
    for key in ("loss", "prompt_loss", "prompt_tokens", "tokens"):
        assert stored[key] == pytest.approx(live[key], rel=1e-5)
    assert "prompt_loss" not in response_only
    assert stored["loss"] == pytest.approx(response_only["loss"] + 0.5 * stored["prompt_loss"], rel=1e-5)


def vllm_parallel_drafting_token(hf_config: dict, num_speculative_tokens: int) -> int:
    """What vLLM's parallel drafting reads from a draft's config.json (v1/spec_decode
    `_init_parallel_drafting_params`, and config/speculative.py's n_predict rule), in its order."""
    dflash = hf_config.get("dflash_config") or {}
    if "mask_token_id" in dflash:
        token = dflash["mask_token_id"]
    elif hf_config.get("mask_token_id") is not None:
        token = hf_config["mask_token_id"]
    elif "dspark_noise_token_id" in hf_config:
        token = hf_config["dspark_noise_token_id"]
    elif "pard_token" in hf_config:
        token = hf_config["pard_token"]
    elif "ptd_token_id" in hf_config:
        token = hf_config["ptd_token_id"]
    else:
        raise ValueError("For parallel drafting, the draft model config must have ... specified in its config.json.")
    n_predict = hf_config.get("n_predict")
    if n_predict is not None and num_speculative_tokens > n_predict and num_speculative_tokens % n_predict:
        raise ValueError("num_speculative_tokens must be divisible by n_predict")
    return token


def test_a_parallel_draft_trains_exports_its_mask_and_is_measured_with_one_forward_per_step(assets, tmp_path):
    """draft.parallel_tokens=K (SPEC §7): every depth trains in one forward, the held-out tau that
    picks the weights comes from the parallel proposer, and config.json names the mask for vLLM."""
    out = tmp_path / "parallel"
    args = recipe_args(assets, out, "train.max_steps=40", "train.eval_every=20", "data.store_topk=8",
                       "draft.parallel_tokens=3", "draft.mask_token=1", "eval.num_draft_tokens=3")
    assert load_recipe().main(args) == 0
    config = json.loads((out / "final" / "config.json").read_text())
    assert config["pard_token"] == 1 and config["spd_type"] == "pard"
    assert config["drafttrain"]["parallel_tokens"] == 3
    assert "n_predict" not in config and "mask_token_id" not in config  # vLLM would read those first
    token = vllm_parallel_drafting_token(config, num_speculative_tokens=3)
    assert token == 1 and isinstance(token, int) and 0 <= token < config["vocab_size"]
    assert config["architectures"] == ["LlamaForCausalLM"]  # a draft_model vLLM serves as it is
    initial = json.loads((out / "eval" / "initial.json").read_text())
    final = json.loads((out / "eval" / "final.json").read_text())
    for metrics in (initial, final):  # one draft forward per drafting step, not one per draft token
        assert metrics["draft_forwards"] <= metrics["target_forwards"] < metrics["draft_tokens"]
    assert final["tau"] > initial["tau"], (initial["tau"], final["tau"])


def test_a_parallel_draft_with_another_recipe_setting_it_cannot_train_is_refused(assets, tmp_path, capfd):
    args = recipe_args(assets, tmp_path / "x", "draft.parallel_tokens=3", "onpolicy.fraction=0.5")
    assert load_recipe().main(args) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "parallel" in err[0] and not (tmp_path / "x").exists()


def test_parallel_tokens_past_the_bound_are_refused_with_the_reason_before_the_run_is_claimed(assets, tmp_path,
                                                                                               capfd):
    """Issue 30 (E): draft.parallel_tokens=100000 was still in its first step after 120 s (K-1 mask
    blocks per sequence), its run directory claimed. Now one line that states the bound and why."""
    args = recipe_args(assets, tmp_path / "x", "draft.parallel_tokens=100000")
    assert load_recipe().main(args) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "draft.parallel_tokens=100000" in err[0] and "at most 16" in err[0], err
    assert "mask" in err[0] and not (tmp_path / "x").exists()


def test_a_parallel_draft_trains_with_each_depth_weighing_the_same(assets, tmp_path):
    """draft.parallel_loss=depths (`parallel.depth_balanced`) runs through the recipe: step 1's
    logged loss (same batch, same weights) differs from the plain mean over rows, and it trains."""
    def first_step(name, *overrides):
        out = tmp_path / name
        args = recipe_args(assets, out, "train.max_steps=2", "train.eval_every=0", "train.log_every=1",
                           "train.keep_best=false", "eval.num_prompts=2", "data.store_topk=8",
                           "draft.parallel_tokens=3", "draft.mask_token=1", "draft.parallel_keep=0.5", *overrides)
        assert load_recipe().main(args) == 0
        logs = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
        return [entry["loss"] for entry in logs if entry["type"] == "train"], out

    rows, _ = first_step("rows")
    depths, out = first_step("depths", "draft.parallel_loss=depths")
    assert rows[0] != pytest.approx(depths[0], rel=1e-4)
    before, after = load_weights(out / "initial"), load_weights(out / "final")
    assert any(not torch.equal(before[k], after[k]) for k in before if "layers" in k)
