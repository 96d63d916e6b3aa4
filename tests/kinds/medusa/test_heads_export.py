"""Export in vLLM's Medusa format: exact key names, shapes and config keys; lossless round trip."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from drafttrain.errors import UserError
from drafttrain.kinds.medusa.export import load_medusa, save_medusa
from drafttrain.kinds.medusa.model import MedusaConfig, MedusaHeads
from tiny import vllm_medusa_shapes

H, V = 8, 13


def random_heads(num_heads=3, num_layers=2, dtype=torch.float32, seed=0) -> MedusaHeads:
    heads = MedusaHeads(MedusaConfig(hidden_size=H, vocab_size=V, num_heads=num_heads, num_layers=num_layers))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in heads.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    return heads.to(dtype)


def vllm_config_view(cfg: dict) -> dict:
    """What vLLM's MedusaConfig.from_pretrained makes of config.json (its key folding + defaults)."""
    cfg = dict(cfg)
    for k in list(cfg):
        if "num" in k:
            if "heads" in k:
                cfg["num_heads"] = cfg.pop(k)
            elif "layers" in k:
                cfg["num_hidden_layers"] = cfg.pop(k)
    cfg.setdefault("truncated_vocab_size", cfg["vocab_size"])
    return cfg


def test_export_writes_vllm_keys_shapes_and_config(tmp_path):
    heads = random_heads(num_heads=3, num_layers=2)
    out = save_medusa(heads, tmp_path / "heads", extra={"base_model": "tiny-llama"})
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "model.safetensors"]
    assert [p.name for p in tmp_path.iterdir()] == ["heads"]  # no temp dirs left behind

    with safe_open(str(out / "model.safetensors"), "pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    expected = vllm_medusa_shapes(H, V, num_heads=3, num_layers=2)
    assert shapes == expected

    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["MedusaModel"]
    assert cfg["model_type"] == "medusa"
    assert (cfg["hidden_size"], cfg["vocab_size"], cfg["num_heads"], cfg["num_hidden_layers"]) == (H, V, 3, 2)
    assert cfg["medusa_fc_bias"] is True  # else vLLM builds bias-free Linears and drops our biases
    assert cfg["truncated_vocab_size"] == V and cfg["original_lm_head"] is False
    assert cfg["torch_dtype"] == "float32" and cfg["base_model"] == "tiny-llama"
    view = vllm_config_view(cfg)
    assert (view["num_heads"], view["num_hidden_layers"]) == (3, 2)
    card = (out / "README.md").read_text()
    assert '"method": "medusa"' in card and "tiny-llama" in card


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_round_trip_identical(tmp_path, dtype):
    heads = random_heads(dtype=dtype)
    save_medusa(heads, tmp_path / "h")
    loaded = load_medusa(tmp_path / "h")
    assert loaded.config == heads.config
    assert next(loaded.parameters()).dtype == dtype
    for (k1, v1), (k2, v2) in zip(heads.state_dict().items(), loaded.state_dict().items()):
        assert k1 == k2 and torch.equal(v1, v2)
    x = torch.randn(4, H).to(dtype)
    with torch.no_grad():
        assert torch.equal(heads(x), loaded(x))
    as32 = load_medusa(tmp_path / "h", device="cpu", dtype=torch.float32)
    assert next(as32.parameters()).dtype == torch.float32


def test_fresh_heads_round_trip_to_lm_head(tmp_path):
    lm = torch.randn(V, H, dtype=torch.float64)
    heads = MedusaHeads(MedusaConfig(hidden_size=H, vocab_size=V, num_heads=2), lm_head_weight=lm)
    loaded = load_medusa(save_medusa(heads, tmp_path / "h"))
    x = torch.randn(5, H, dtype=torch.float64)
    with torch.no_grad():
        out = loaded(x)
    for i in range(2):
        torch.testing.assert_close(out[i], x @ lm.T, rtol=0, atol=1e-12)


def test_overwrite_and_extra_guards(tmp_path):
    save_medusa(random_heads(seed=0), tmp_path / "h")
    second = random_heads(seed=1)
    save_medusa(second, tmp_path / "h")
    assert torch.equal(load_medusa(tmp_path / "h").lm_heads[0].weight, second.lm_heads[0].weight)
    with pytest.raises(ValueError, match="num_heads"):
        save_medusa(second, tmp_path / "x", extra={"target_num_attention_heads": 4})
    with pytest.raises(ValueError, match="overwrite"):
        save_medusa(second, tmp_path / "x", extra={"hidden_size": 4})
    assert not (tmp_path / "x").exists()


def test_load_errors(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        load_medusa(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="no config.json"):
        load_medusa(tmp_path / "empty")
    llama = tmp_path / "llama"
    llama.mkdir()
    (llama / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8}))
    with pytest.raises(UserError, match="not a Medusa config.*model_type 'medusa'"):
        load_medusa(llama)
    save_medusa(random_heads(), tmp_path / "h")
    (tmp_path / "h" / "model.safetensors").unlink()
    with pytest.raises(UserError, match="no model.safetensors"):
        load_medusa(tmp_path / "h")
    save_medusa(random_heads(num_layers=2), tmp_path / "h")
    cfg = json.loads((tmp_path / "h" / "config.json").read_text())
    cfg["num_hidden_layers"] = 1
    (tmp_path / "h" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError, match="do not match"):
        load_medusa(tmp_path / "h")
    with pytest.raises(UserError) as info:
        load_medusa(tmp_path / "empty")
    assert "\n" not in str(info.value)  # one-line messages, as entry points print them


def test_load_original_medusa_layout(tmp_path):
    """The FasterDecoding/Medusa repo's keys: `{i}.{j}.linear.weight|bias`, `{i}.{L}.weight`."""
    ref = random_heads(num_heads=2, num_layers=1)
    sd = ref.state_dict()
    original = {}
    for i in range(2):
        original[f"{i}.0.linear.weight"] = sd[f"blocks.{i}.layers.0.weight"]
        original[f"{i}.0.linear.bias"] = sd[f"blocks.{i}.layers.0.bias"]
        original[f"{i}.1.weight"] = sd[f"lm_heads.{i}.weight"]
    d = tmp_path / "orig"
    d.mkdir()
    save_file({k: v.contiguous() for k, v in original.items()}, str(d / "medusa_lm_head.safetensors"))
    (d / "config.json").write_text(json.dumps(
        {"medusa_num_heads": 2, "medusa_num_layers": 1, "base_model_name_or_path": "x"}))
    loaded = load_medusa(d)
    x = torch.randn(3, H)
    with torch.no_grad():
        assert torch.equal(loaded(x), ref(x))


def test_load_vllm_heads_without_bias(tmp_path):
    """vLLM's default medusa_fc_bias=false: no bias tensors, i.e. h + SiLU(W h)."""
    ref = random_heads(num_heads=2, num_layers=1)
    sd = {k: v for k, v in ref.state_dict().items() if not k.endswith(".bias")}
    d = tmp_path / "nobias"
    d.mkdir()
    save_file(sd, str(d / "model.safetensors"))
    (d / "config.json").write_text(json.dumps({"architectures": ["MedusaModel"], "model_type": "medusa",
                                               "hidden_size": H, "vocab_size": V, "num_heads": 2,
                                               "num_hidden_layers": 1}))
    loaded = load_medusa(d)
    x = torch.randn(3, H)
    for i in range(2):
        z = x @ sd[f"blocks.{i}.layers.0.weight"].T
        expected = (x + torch.nn.functional.silu(z)) @ sd[f"lm_heads.{i}.weight"].T
        with torch.no_grad():
            torch.testing.assert_close(loaded(x)[i], expected)


def test_shared_lm_head_is_one_tensor_as_vllm_reads_it(tmp_path):
    """shared_lm_head: one `lm_heads.0.weight` and `original_lm_head: true` (vLLM then builds one
    `lm_head` behind every block); it loads back shared, computing the same logits."""
    lm = torch.randn(V, H, dtype=torch.float64)
    heads = MedusaHeads(MedusaConfig(hidden_size=H, vocab_size=V, num_heads=3, num_layers=1, shared_lm_head=True),
                        lm_head_weight=lm)
    randomize_blocks(heads)
    out = save_medusa(heads, tmp_path / "h")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["original_lm_head"] is True and cfg["num_heads"] == 3
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert sorted(k for k in f.keys() if "lm_head" in k) == ["lm_heads.0.weight"]
    loaded = load_medusa(out)
    assert loaded.config.shared_lm_head and len(loaded.lm_heads) == 1
    x = torch.randn(4, H, dtype=torch.float64)
    with torch.no_grad():
        assert torch.equal(loaded(x), heads(x))


def test_original_lm_head_checkpoints_from_elsewhere_load_shared(tmp_path):
    """vLLM's own names in that mode: `lm_head.weight` is the one head, extra `lm_heads.{i}` are ignored."""
    ref = random_heads(num_heads=2, num_layers=1, dtype=torch.float64)
    sd = ref.state_dict()
    d = tmp_path / "vllm"
    d.mkdir()
    save_file({**{k: v for k, v in sd.items() if k.startswith("blocks.")}, "lm_head.weight": sd["lm_heads.1.weight"],
               "lm_heads.0.weight": sd["lm_heads.0.weight"]}, str(d / "model.safetensors"))
    (d / "config.json").write_text(json.dumps({"model_type": "medusa", "hidden_size": H, "vocab_size": V,
                                               "num_heads": 2, "num_hidden_layers": 1, "medusa_fc_bias": True,
                                               "original_lm_head": True}))
    loaded = load_medusa(d)
    assert len(loaded.lm_heads) == 1 and torch.equal(loaded.lm_heads[0].weight, sd["lm_heads.1.weight"])


def randomize_blocks(heads: MedusaHeads, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in heads.blocks.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.5)


def heads_run_config(lora: bool):
    """The fields of recipes/train_heads.py's HeadsConfig that export_final reads."""
    from types import SimpleNamespace as NS

    return NS(kind="medusa-2" if lora else "medusa-1", target="tiny-target", export_dtype="bfloat16",
              lora=NS(enabled=lora, r=4, alpha=8.0, target_modules=["q_proj"], lm_loss="kl", lm_loss_weight=1.0),
              loss=NS(kind="kl", decay=0.8), heads=NS(train_lm_heads=True, share_lm_head=False),
              train=NS(keep_best=True))


def test_export_final_writes_the_heads_card_tree_and_medusa2_verifier(tmp_path):
    from types import SimpleNamespace

    from drafttrain.kinds.medusa.export import export_final

    class Adapted:  # the LoRA-adapted target: merged on export
        def merge_and_unload(self):
            return SimpleNamespace(to=lambda device: SimpleNamespace(
                save_pretrained=lambda d: (d.mkdir(parents=True, exist_ok=True), (d / "config.json").write_text("{}"))))

    tokenizer = SimpleNamespace(save_pretrained=lambda d: (d / "tokenizer.json").write_text("{}"))
    heads = random_heads(num_heads=2, num_layers=1)
    rows = [{"drafter": "trained", "tau": 1.5}, {"drafter": "served", "tau": 1.4}]
    calibrated = {"tree": [[0], [1], [0, 0]], "topk_accuracy": [[0.5, 0.6], [0.2, 0.3]]}
    for lora in (False, True):
        out = tmp_path / f"lora-{lora}"
        run = heads_run_config(lora)
        export_final(SimpleNamespace(heads=heads, target=Adapted()), run, tokenizer, out, 10, 8, rows, 5,
                     calibrated=calibrated, plans={"planned K": "3"}, record={"held_out": {}})
        assert load_medusa(out).lm_heads[0].weight.dtype == torch.bfloat16
        cfg = json.loads((out / "config.json").read_text())
        assert cfg["drafttrain"]["tree"] == calibrated["tree"] and cfg["drafttrain"]["kind"] == run.kind
        card = (out / "README.md").read_text()
        assert "| served |" in card and "- **planned K**: 3" in card and "step 8 (best held-out tau)" in card
        assert "5 held-out prompts" in card and json.loads((out / "drafttrain.json").read_text()) == {"held_out": {}}
        verifier = str((out / "target").resolve())
        assert (cfg["base_model"], cfg["drafttrain"].get("verifier")) == ((verifier, verifier) if lora else
                                                                          ("tiny-target", None))
        assert (out / "target").is_dir() == lora and ("verifier is the adapted target" in card) == lora
        if lora:
            assert sorted(p.name for p in (out / "target").iterdir()) == ["README.md", "config.json", "tokenizer.json"]
    assert heads.lm_heads[0].weight.dtype == torch.float32  # the trained heads are copied, not cast
