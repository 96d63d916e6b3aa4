"""Medusa heads training (recipes/train_heads.py): the per-head alignment, Medusa-1, Medusa-2, bad configs."""

import copy
import json
import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from tiny import save_pair, tiny_lm, tiny_tokenizer

import recipes.train_heads as heads_recipe
from recipes.train_heads import HeadsLoraConfig, add_lora

from drafttrain.cli import main as cli_main
from drafttrain.data.collate import TrainingCollator
from drafttrain.kinds.medusa.calibrate import head_topk_accuracy
from drafttrain.kinds.medusa.loss import JointObjective, medusa_heads_loss
from drafttrain.kinds.medusa.model import MedusaHeads
from drafttrain.trees import tree_from_accuracies
import drafttrain.training.recipe as recipe_skeleton

ROOT = Path(__file__).resolve().parents[3]
CONFIG = ROOT / "recipes" / "configs" / "tiny_heads_test.yaml"


def recipe_main(argv):
    return heads_recipe.main(argv)


# ----------------------------------------------------------------------------- (a) alignment


ROWS = [  # (prompt, response): a one-token prompt, a one-token response, one cut by max_seq_len
    ([5], [9, 12, 7, 30, 41]),
    ([8, 3, 17, 22], [40]),
    ([11, 6, 9], [13, 50, 21, 33, 8, 19, 27, 44]),
    ([7, 7, 31, 25, 4, 60], [15, 16, 3]),
]
MAX_SEQ_LEN = 10


def brute_force_head_losses(target, heads, kind):
    """Per head, the mean over (row, t) of the loss of head i at t against token s = t + 2 + i,
    for every response token s, computed from scratch: the hidden state from a forward over
    seq[:t + 1], the teacher from a forward over seq[:s] (the target's distribution for token s)."""
    losses = []
    for i in range(heads.config.num_heads):
        terms = []
        for prompt, response in ROWS:
            seq = (prompt + response)[:MAX_SEQ_LEN]
            for s in range(len(prompt), len(seq)):
                t = s - 2 - i
                if t < 0:
                    continue
                with torch.no_grad():
                    prefix = torch.tensor([seq[:t + 1]])
                    hidden = target(input_ids=prefix, output_hidden_states=True).hidden_states[-1][0, -1]
                    teacher = target(input_ids=torch.tensor([seq[:s]])).logits[0, -1]
                    logq = F.log_softmax(heads.forward_head(i, hidden), -1)
                if kind == "kl":
                    logp = F.log_softmax(teacher, -1)
                    terms.append((logp.exp() * (logp - logq)).sum())
                else:
                    terms.append(-logq[seq[s]])
        losses.append(torch.stack(terms).mean())
    return losses


@pytest.mark.parametrize("kind", ["kl", "ce"])
def test_heads_loss_alignment_matches_brute_force(kind):
    target = tiny_lm(0, dtype=torch.float64)
    heads = MedusaHeads.from_target(target, num_heads=3, num_layers=1)  # float64, like the target
    torch.manual_seed(1)
    with torch.no_grad():  # distinct heads, so a head swapped for another would show
        for p in heads.parameters():
            p.add_(0.3 * torch.randn_like(p))
    batch = TrainingCollator(MAX_SEQ_LEN, pad_id=2)([{"prompt_ids": p, "response_ids": r} for p, r in ROWS])
    with torch.no_grad():
        out = target(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], output_hidden_states=True)
    loss, logs = medusa_heads_loss(heads, out.hidden_states[-1], batch["loss_mask"], batch["labels"], kind=kind,
                                   decay=0.7, teacher_logits=out.logits if kind == "kl" else None)

    expected = brute_force_head_losses(target, heads, kind)
    for i, e in enumerate(expected):
        assert float(logs[f"head{i}_loss"]) == pytest.approx(float(e), rel=1e-9, abs=1e-12)
    weights = [0.7 ** i for i in range(3)]
    assert loss.item() == pytest.approx(float(sum(w * e for w, e in zip(weights, expected)) / sum(weights)), rel=1e-9)
    loss.backward()  # every head gets a gradient
    assert all(heads.lm_heads[i].weight.grad.abs().sum() > 0 for i in range(3))


def test_joint_loss_is_kl_to_the_original_target():
    """Medusa-2: lm loss = KL(original || adapted) at response positions; the heads' teacher is the original."""
    target = tiny_lm(0, dtype=torch.float64)
    original = copy.deepcopy(target)
    heads = MedusaHeads.from_target(target, num_heads=2)
    lora = HeadsLoraConfig(enabled=True, r=4, dropout=0.0)
    module = JointObjective(add_lora(target, lora), heads, kind="kl", decay=0.8, lm_loss="kl", lm_loss_weight=1.0)
    torch.manual_seed(2)
    with torch.no_grad():
        for name, p in module.target.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.2)
    adapted = copy.deepcopy(module.target).merge_and_unload()
    batch = TrainingCollator(MAX_SEQ_LEN, pad_id=2)([{"prompt_ids": p, "response_ids": r} for p, r in ROWS])
    module.eval()
    _, logs = module(batch["input_ids"], batch["attention_mask"], batch["loss_mask"], batch["labels"])

    args = dict(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    with torch.no_grad():
        p_logits = original(**args).logits
        q_out = adapted(**args, output_hidden_states=True)
    mask = batch["loss_mask"]
    logp, logq = F.log_softmax(p_logits[mask], -1), F.log_softmax(q_out.logits[mask], -1)
    kl = (logp.exp() * (logp - logq)).sum(-1).mean()
    assert float(kl) > 1e-3  # the adapters really change the target
    assert float(logs["lm_loss"]) == pytest.approx(float(kl), rel=1e-8)
    with torch.no_grad():
        expected_heads, _ = medusa_heads_loss(heads, q_out.hidden_states[-1], mask, batch["labels"], kind="kl",
                                              decay=0.8, teacher_logits=p_logits)
    assert float(logs["heads_loss"]) == pytest.approx(expected_heads.item(), rel=1e-8)


# ----------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny target and 120 random prompts; the target's own answers give the heads structure to learn."""
    root = tmp_path_factory.mktemp("heads")
    save_pair(root / "target", tiny_lm(0, dtype=torch.float32), tiny_tokenizer(64))
    rng = random.Random(0)
    lines = [json.dumps({"prompt": " ".join(f"w{rng.randrange(3, 64)}" for _ in range(rng.randrange(3, 8)))})
             for _ in range(120)]
    (root / "prompts.jsonl").write_text("\n".join(lines) + "\n")
    return root


def run_recipe(setup, out, *overrides):
    return recipe_main(["--config", str(CONFIG), f"output_dir={out}", f"target={setup / 'target'}",
                        f"data.sources=[{{kind: jsonl, path: {setup / 'prompts.jsonl'}}}]",
                        f"data.cache_dir={setup / 'cache'}", *overrides])


def run_eval(target, heads, prompts, out, capsys, dtype="float32", tree="auto"):
    capsys.readouterr()
    code = cli_main(["eval", "--target", str(target), "--heads", str(heads), "--prompts", str(prompts),
                     "--max-new-tokens", "24", "--num-draft-tokens", "3", "--dtype", dtype, "--out", str(out),
                     "--tree", tree, "--quiet"])
    assert code == 0, capsys.readouterr().err
    return json.loads((out / "report.json").read_text())


@pytest.mark.parametrize("kind", ["kl", "ce"])
def test_medusa1_raises_tau_and_leaves_the_target_alone(setup, tmp_path, monkeypatch, capsys, kind):
    loaded = []
    real_load = recipe_skeleton.load_causal_lm  # the frozen target is loaded by the shared skeleton
    monkeypatch.setattr(recipe_skeleton, "load_causal_lm", lambda *a, **k: loaded.append(real_load(*a, **k)) or loaded[-1])
    out = tmp_path / "run"
    assert run_recipe(setup, out, f"loss.kind={kind}") == 0

    for name in ("config.yaml", "heldout.jsonl", "train_log.jsonl", "checkpoints/step-40/trainer_state.json",
                 "final/config.json", "final/model.safetensors", "final/README.md"):
        assert (out / name).is_file(), name
    assert not (out / "final" / "target").exists()
    initial = json.loads((out / "eval" / "initial.json").read_text())
    final = json.loads((out / "eval" / "final.json").read_text())
    assert final["tau"] > initial["tau"] + 0.2, (initial["tau"], final["tau"])

    # The frozen target that trained the heads is bit-for-bit the one on disk.
    (trained_with,) = loaded
    on_disk = real_load(str(setup / "target"), torch.float32, torch.device("cpu"))
    for name, value in on_disk.state_dict().items():
        assert torch.equal(trained_with.state_dict()[name], value), name

    info = json.loads((out / "final" / "config.json").read_text())["drafttrain"]
    calibrated = json.loads((out / "eval" / "calibrated.json").read_text())
    assert info == {"kind": "medusa-1", "target": str(setup / "target"), "tree": calibrated["tree"],
                    "topk_accuracy": calibrated["topk_accuracy"]}
    assert [tuple(p) for p in info["tree"]] == tree_from_accuracies(info["topk_accuracy"], 22)
    # drafttrain.json: the heads' held-out acceptance as a chain (what vLLM serves) and the plans it implies
    record = json.loads((out / "final" / "drafttrain.json").read_text())
    heads = json.loads((out / "final" / "config.json").read_text())["num_heads"]
    assert len(record["held_out"]["per_position_acceptance"]) == heads
    plans = record["plans"]
    assert plans["vllm_speculative_config"] == {"method": "medusa", "model": str(out / "final"),
                                                "num_speculative_tokens": max(plans["gpu_batch1"]["num_draft_tokens"], 1)}
    assert "sglang_server_args" not in plans  # SGLang serves no Medusa heads
    assert 0 <= plans["this_machine"]["num_draft_tokens"] <= heads
    assert "planned K (drafttrain.json)" in (out / "final" / "README.md").read_text()
    # The export is what was evaluated: drafttrain eval measures the same tau, lossless, with the
    # calibrated tree by default and with the default tree on request.
    report = run_eval(setup / "target", out / "final", out / "heldout.jsonl", tmp_path / "eval", capsys)
    assert report["overall"]["outputs_match_baseline"] == 1.0
    assert report["overall"]["tree"] == "calibrated"
    assert report["overall"]["mean_accepted_length"] == pytest.approx(calibrated["tau"], abs=1e-9)
    report = run_eval(setup / "target", out / "final", out / "heldout.jsonl", tmp_path / "eval-default", capsys,
                      tree="default")
    assert report["overall"]["tree"] == "default"
    assert report["overall"]["mean_accepted_length"] == pytest.approx(final["tau"], abs=1e-9)


def test_medusa2_exports_the_adapted_target_as_verifier(setup, tmp_path, capsys):
    out = tmp_path / "run"
    assert run_recipe(setup, out, "lora.enabled=true", "lora.r=4", "target_dtype=float64",
                      "train.max_steps=20", "train.eval_every=10", "train.checkpoint_every=0") == 0

    final_dir = out / "final"
    info = json.loads((final_dir / "config.json").read_text())["drafttrain"]
    assert info["kind"] == "medusa-2" and info["verifier"] == str((final_dir / "target").resolve())
    assert "verifier is the adapted target" in (final_dir / "README.md").read_text()

    from safetensors.torch import load_file

    before = load_file(str(setup / "target" / "model.safetensors"))
    after = load_file(str(final_dir / "target" / "model.safetensors"))
    assert set(after) == set(before)  # a plain HF model: LoRA merged away
    changed = {k for k in before if not torch.equal(before[k].double(), after[k])}
    assert changed and all(k.rsplit(".", 2)[-2] in ("q_proj", "k_proj", "v_proj", "o_proj") for k in changed)

    calibrated = json.loads((out / "eval" / "calibrated.json").read_text())
    report = run_eval(final_dir / "target", final_dir, out / "heldout.jsonl", tmp_path / "eval", capsys, "float64")
    assert report["overall"]["outputs_match_baseline"] == 1.0
    assert report["heads"]["verifier"] == info["verifier"]
    assert report["overall"]["mean_accepted_length"] == pytest.approx(calibrated["tau"], abs=1e-9)


def test_head_topk_accuracy_against_a_position_by_position_count():
    target = tiny_lm(seed=5, dtype=torch.float64)
    torch.manual_seed(1)
    heads = MedusaHeads.from_target(target, num_heads=3, num_layers=1).double()
    with torch.no_grad():
        for block in heads.blocks:  # fresh heads copy the target's LM head; make them differ
            for p in block.parameters():
                p.normal_(0, 0.5)
    prompts = [[5, 9, 11], [7, 8, 9, 10, 12], [30]]
    k, new = 4, 10
    acc = head_topk_accuracy(target, heads, prompts, topk=k, max_new_tokens=new, eos_token_ids=[2], batch_size=2)

    hits = [[0] * k for _ in range(3)]
    counts = [0] * 3
    for prompt in prompts:
        seq = list(prompt)
        while len(seq) < len(prompt) + new and (len(seq) == len(prompt) or seq[-1] != 2):  # greedy, one at a time
            seq.append(int(target(input_ids=torch.tensor([seq])).logits[0, -1].argmax()))
        states = target(input_ids=torch.tensor([seq]), output_hidden_states=True).hidden_states[-1][0]
        for t in range(len(prompt) - 1, len(seq)):
            for i in range(3):
                if t + 2 + i < len(seq):
                    ranking = heads.forward_head(i, states[t]).argsort(descending=True).tolist()
                    rank = ranking.index(seq[t + 2 + i])
                    counts[i] += 1
                    if rank < k:
                        hits[i][rank] += 1
    expected = [[h / counts[i] for h in hits[i]] for i in range(3)]
    assert [a for row in acc for a in row] == pytest.approx([e for row in expected for e in row], abs=1e-12)
    assert any(a > 0 for row in acc for a in row)


# ----------------------------------------------------------------------------- bad configs


@pytest.mark.parametrize("overrides, needle", [
    (["heads.num_head=3"], "heads.num_heads"),
    (["target=MISSING"], "target"),
    (["lora.r=4"], "lora.enabled"),
    (["lora.enabled=true", "lora.target_modules=[qkv]"], "qkv"),
    (["eval.tree_depth=5"], "tree_depth"),
    (["eval.tree_nodes=-1"], "tree_nodes"),
    (["loss.kind=mse"], "loss.kind"),
    (["data.prompt_loss_weight=0.5"], "prompt_loss_weight"),
])
def test_bad_config_is_one_error_line(setup, tmp_path, capsys, overrides, needle):
    argv = ["--config", str(CONFIG), f"output_dir={tmp_path / 'run'}", f"target={setup / 'target'}",
            f"data.sources=[{{kind: jsonl, path: {setup / 'prompts.jsonl'}}}]", *overrides]
    if overrides == ["target=MISSING"]:
        argv = [a for a in argv if not a.startswith("target=")]
    capsys.readouterr()
    assert recipe_main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and needle in err[0], err
    assert not (tmp_path / "run").exists()


def test_with_vllm_the_card_shows_the_served_chain_beside_drafttrains_chain(setup, tmp_path, monkeypatch, capsys):
    """vLLM serves Medusa heads as one top-1 chain of num_heads, not as the calibrated tree: the
    card then shows that chain as drafttrain decodes it (checked against `drafttrain eval --tree
    chain`) beside vLLM's row (a stand-in engine here: the real one is test_vllm_served.py)."""
    from types import SimpleNamespace

    from drafttrain.evaluation import vllm_backend

    served = []

    def serve(export, kind, target, prompts, *, k, **kw):
        served.append((kind, k))  # every prompt: 7 tokens, the prefill's and two steps accepting 1 and 3 of 3
        return [vllm_backend.served_generation(list(range(7)), SimpleNamespace(per_step_accepted=[1, 3],
                                                                              per_step_drafted=[3, 3]), None)
                for _ in prompts]

    monkeypatch.setattr(vllm_backend, "vllm_version", lambda: "9.9")
    monkeypatch.setattr(vllm_backend, "serve_export", serve)
    out = tmp_path / "run"
    assert run_recipe(setup, out, "train.max_steps=20", "train.eval_every=10", "train.checkpoint_every=0") == 0
    assert served == [("medusa", 3)]
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in (out / "final" / "README.md").read_text().splitlines() if line.startswith("| ")}
    assert rows["served: vllm 9.9, chain of 3"][:2] == ["3", "2.33"]  # 7 tokens in 3 token-emitting forwards
    report = run_eval(setup / "target", out / "final", out / "heldout.jsonl", tmp_path / "eval", capsys, tree="chain")
    assert report["overall"]["tree"] == "chain"
    assert rows["trained, chain of 3 (what vLLM serves)"][1] == f"{report['overall']['mean_accepted_length']:.2f}"
