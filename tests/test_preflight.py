"""Draft/target agreement checks and `drafttrain preflight` on tiny models saved to disk."""

import copy
import json
from pathlib import Path

import pytest
import torch
from tiny import save_pair, tiny_lm, tiny_tokenizer
from transformers import LlamaForCausalLM

from drafttrain.cli import main
from drafttrain.errors import UserError
from drafttrain.preflight import compatibility_checks, first_vocab_difference, require_compatible

CHECKS = ["token-to-id map", "special tokens", "EOS", "target output vocabulary covers the tokenizer",
          "draft output vocabulary covers the tokenizer"]


def padded_copy(model):
    """The target itself with 128 extra output rows [10 W; -10 W]: whatever the hidden state, some
    padded id has the largest logit, so a draft used without cutting its logits to the
    tokenizer's ids would propose only ids the target cannot have produced."""
    real = model.config.vocab_size
    cfg = copy.deepcopy(model.config)
    cfg.vocab_size = 3 * real
    padded = LlamaForCausalLM(cfg).to(torch.float64).eval()
    state = model.state_dict()
    with torch.no_grad():
        for name, p in padded.named_parameters():
            src = state[name]
            if p.shape == src.shape:
                p.copy_(src)
            else:
                p.zero_()
                p[:real].copy_(src)
        w = model.lm_head.weight
        padded.lm_head.weight[real:] = torch.cat([10 * w, -10 * w])
    return padded


def swap_token_ids(model_dir, a="w10", b="w11"):
    path = Path(model_dir) / "tokenizer.json"
    spec = json.loads(path.read_text())
    vocab = spec["model"]["vocab"]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    path.write_text(json.dumps(spec))


@pytest.fixture(scope="module")
def target():
    return tiny_lm(0)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory, target):
    root = tmp_path_factory.mktemp("preflight")
    tok = tiny_tokenizer()
    out = {
        "target": save_pair(root / "target", target, tok),
        "draft": save_pair(root / "draft", tiny_lm(1, layers=1), tok),
        "padded": save_pair(root / "padded", padded_copy(target), tok),
        "swapped": save_pair(root / "swapped", tiny_lm(1, layers=1), tok),
    }
    swap_token_ids(out["swapped"])
    return out


def cli(capsys, argv):
    capsys.readouterr()
    code = main(argv)
    return (code, *capsys.readouterr())


def test_preflight_prints_every_check_for_a_compatible_pair(dirs, capsys):
    code, out, err = cli(capsys, ["preflight", "--target", dirs["target"], "--draft", dirs["draft"]])
    assert code == 0 and err == ""
    lines = out.splitlines()
    assert [line.split("]")[0] for line in lines[:-1]] == ["[ok"] * len(CHECKS)
    for name, line in zip(CHECKS, lines):
        assert line.startswith(f"[ok] {name}: ")
    assert lines[-1] == "draft and target are compatible"
    assert "64 tokens" in lines[0] and "eos_token=<|im_end|>" in lines[1] and "[2]" in lines[2]


def test_padded_draft_passes_preflight(dirs, capsys):
    code, out, err = cli(capsys, ["preflight", "--target", dirs["target"], "--draft", dirs["padded"]])
    assert code == 0 and err == ""
    assert "[ok] draft output vocabulary covers the tokenizer: 192 logits for 64 tokens" in out.splitlines()


def test_padded_draft_drafts_only_real_ids(dirs, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "w5 w9 w13 w7"}\n{"prompt": "w3 w4 w5 w6 w7 w3 w4"}\n')
    out = tmp_path / "out"
    assert main(["eval", "--target", dirs["target"], "--draft", dirs["padded"], "--prompts", str(prompts),
                 "--num-draft-tokens", "3", "--max-new-tokens", "10", "--dtype", "float64",
                 "--out", str(out), "--quiet"]) == 0
    overall = json.loads((out / "report.json").read_text())["overall"]
    # The padded draft is the target on the tokenizer's ids: every draft is accepted.
    assert overall["draft_tokens"] > 0 and overall["acceptance_rate"] == 1.0
    assert overall["outputs_match_baseline"] == 1.0
    rows = [json.loads(line) for line in (out / "outputs.jsonl").read_text().splitlines()]
    assert all(0 <= t < 64 for r in rows for t in r["speculative_token_ids"])


def test_preflight_names_the_first_differing_token(dirs, capsys):
    code, out, err = cli(capsys, ["preflight", "--target", dirs["target"], "--draft", dirs["swapped"]])
    assert code == 2
    assert any(line.startswith("[FAIL] token-to-id map:") and "'w10'" in line for line in out.splitlines())
    assert "compatible" not in out
    (line,) = err.splitlines()
    assert line.startswith("error:") and "'w10'" in line and "token-to-id map" in line


def test_preflight_missing_draft(dirs, tmp_path, capsys):
    code, out, err = cli(capsys, ["preflight", "--target", dirs["target"], "--draft", str(tmp_path / "gone")])
    assert code == 2 and out == ""
    (line,) = err.splitlines()
    assert line.startswith("error:") and "draft" in line and "gone" in line


def damage_weights(model_dir, damage):
    from safetensors.torch import load_file, save_file

    path = Path(model_dir) / "model.safetensors"
    if damage == "truncated":
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    elif damage == "empty":
        path.write_bytes(b"")
    else:
        state = load_file(str(path))
        name = sorted(state)[0]
        state[name] = state[name].clone()
        state[name].view(-1)[:4] = float("nan")
        save_file(state, str(path), metadata={"format": "pt"})


@pytest.mark.parametrize("who", ["target", "draft"])
@pytest.mark.parametrize("damage, word", [("truncated", "damaged"), ("empty", "damaged"), ("nan", "non-finite")])
def test_preflight_damaged_weights_are_one_error_line(dirs, tmp_path, capsys, who, damage, word):
    import shutil

    paths = {"target": dirs["target"], "draft": dirs["draft"]}
    paths[who] = shutil.copytree(paths[who], tmp_path / who)
    damage_weights(paths[who], damage)
    code, out, err = cli(capsys, ["preflight", "--target", str(paths["target"]), "--draft", str(paths["draft"])])
    assert code == 2 and out == ""
    (line,) = err.splitlines()
    assert line.startswith(f"error: cannot load the {who}" if word == "damaged" else f"error: the {who}")
    assert word in line and str(tmp_path / who) in line


def failed(checks):
    return [c.name for c in checks if not c.ok]


def test_short_output_vocabulary_fails(target):
    tok = tiny_tokenizer()
    checks = compatibility_checks(target, tok, tiny_lm(2, vocab_size=48, layers=1), tok)
    assert failed(checks) == ["draft output vocabulary covers the tokenizer"]
    with pytest.raises(UserError, match="48 logits for 64 tokens"):
        require_compatible(checks)


def test_different_special_tokens_fail(target):
    tok = tiny_tokenizer()
    other = tiny_tokenizer()
    other.pad_token = "<unk>"
    checks = compatibility_checks(target, tok, target, other)
    assert failed(checks) == ["special tokens"]
    with pytest.raises(UserError, match="pad_token"):
        require_compatible(checks)


def test_different_eos_fails(target):
    tok = tiny_tokenizer()
    draft = tiny_lm(1, layers=1, eos_token_id=7)
    checks = compatibility_checks(target, tok, draft, tok)
    assert failed(checks) == ["EOS"]
    assert "target [2], draft [2, 7]" in checks[2].detail


def test_first_vocab_difference():
    vocab = {"a": 0, "b": 1, "c": 2}
    assert first_vocab_difference(vocab, dict(vocab)) is None
    message = first_vocab_difference(vocab, {"a": 0, "b": 2, "c": 1})
    assert "'b'" in message and "1" in message and "2" in message
    assert "'c'" in first_vocab_difference(vocab, {"a": 0, "b": 1}) and "missing" in first_vocab_difference(
        vocab, {"a": 0, "b": 1})
    assert "'d'" in first_vocab_difference(vocab, {**vocab, "d": 3})
