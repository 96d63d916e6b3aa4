"""DFlash export: names, shapes, dtypes and config keys against what vLLM 0.32's `qwen3_dflash.py`
reads (written out by hand below), a bit-identical round trip, and one error line per bad input."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from drafttrain.errors import UserError
from drafttrain.kinds.dflash.export import attach_target_head, load_dflash, save_dflash
from dflash_helpers import BLOCK, LAYERS, VOCAB, target_hidden_states, tiny_draft, tiny_target

REDUCED = 40


def vllm_checkpoint_shapes(cfg: dict) -> dict[str, tuple[tuple[int, ...], torch.dtype | None]]:
    """The tensors vLLM's `DFlashQwen3ForCausalLM.load_weights` takes, by hand from its modules: per layer
    a Qwen3 attention (`self_attn.{q,k,v}_proj` stacked into its qkv_proj: q heads * head_dim rows, k and
    v kv_heads * head_dim; `o_proj`; per-head RMSNorms `q_norm`/`k_norm` of head_dim), a Qwen2 MLP
    (`mlp.{gate,up}_proj` stacked into gate_up_proj, `mlp.down_proj`) and the two RMSNorms;
    fc = Linear(target_hidden_size * len(target_layer_ids), hidden) (`_get_dflash_fc_input_size`),
    `hidden_norm`, `norm`. With a draft vocabulary smaller than the target's: lm_head =
    ParallelLMHead(draft_vocab_size, hidden) and d2t -> `draft_id_to_target_id` (torch.long); t2d is
    skipped. With the full vocabulary it has no `draft_id_to_target_id` to load into and shares the
    target's head. dtype None: the checkpoint's float dtype."""
    H, I, hd = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    shapes = {"fc.weight": ((H, cfg["target_hidden_size"] * len(cfg["dflash_config"]["target_layer_ids"])), None),
              "hidden_norm.weight": ((H,), None), "norm.weight": ((H,), None)}
    for i in range(cfg["num_hidden_layers"]):
        shapes.update({
            f"layers.{i}.self_attn.q_proj.weight": ((q, H), None),
            f"layers.{i}.self_attn.k_proj.weight": ((kv, H), None),
            f"layers.{i}.self_attn.v_proj.weight": ((kv, H), None),
            f"layers.{i}.self_attn.o_proj.weight": ((H, q), None),
            f"layers.{i}.self_attn.q_norm.weight": ((hd,), None),
            f"layers.{i}.self_attn.k_norm.weight": ((hd,), None),
            f"layers.{i}.mlp.gate_proj.weight": ((I, H), None),
            f"layers.{i}.mlp.up_proj.weight": ((I, H), None),
            f"layers.{i}.mlp.down_proj.weight": ((H, I), None),
            f"layers.{i}.input_layernorm.weight": ((H,), None),
            f"layers.{i}.post_attention_layernorm.weight": ((H,), None),
        })
    if cfg.get("draft_vocab_size", cfg["vocab_size"]) < cfg["vocab_size"]:
        shapes.update({"lm_head.weight": ((cfg["draft_vocab_size"], H), None),
                       "d2t": ((cfg["draft_vocab_size"],), torch.int64), "t2d": ((cfg["vocab_size"],), torch.bool)})
    return shapes


def vllm_parameter_names(checkpoint_names, cfg: dict) -> set[str]:
    """The parameters vLLM loads the checkpoint's tensors into, as its `load_weights` renames them: t2d
    skipped, d2t -> draft_id_to_target_id, `model.` before every name but lm_head's, then
    `hf_to_vllm_mapper`'s stacking of q/k/v into qkv_proj and gate/up into gate_up_proj."""
    stacked = {".q_proj": ".qkv_proj", ".k_proj": ".qkv_proj", ".v_proj": ".qkv_proj", ".gate_proj": ".gate_up_proj",
               ".up_proj": ".gate_up_proj"}
    names = set()
    for name in checkpoint_names:
        if name == "t2d":
            continue
        name = "draft_id_to_target_id" if name == "d2t" else name if name.startswith("lm_head") else "model." + name
        for old, new in stacked.items():
            name = name.replace(old, new)
        names.add(name)
    return names


def vllm_parameters(cfg: dict) -> set[str]:
    """`DFlashQwen3ForCausalLM`'s own parameters, but the shared ones (embed_tokens; lm_head with the full
    vocabulary) and the mask embedding (from mask_embedding.pt)."""
    layers = {f"model.layers.{i}.{p}.weight" for i in range(cfg["num_hidden_layers"])
              for p in ("self_attn.qkv_proj", "self_attn.o_proj", "self_attn.q_norm", "self_attn.k_norm",
                        "mlp.gate_up_proj", "mlp.down_proj", "input_layernorm", "post_attention_layernorm")}
    own_head = cfg.get("draft_vocab_size", cfg["vocab_size"]) < cfg["vocab_size"]
    return layers | {"model.fc.weight", "model.hidden_norm.weight", "model.norm.weight"} | \
        ({"lm_head.weight", "draft_id_to_target_id"} if own_head else set())


@pytest.fixture(scope="module")
def target():
    return tiny_target()


@pytest.mark.parametrize("draft_vocab", [VOCAB, REDUCED])
def test_export_matches_what_vllm_reads(tmp_path, target, draft_vocab):
    draft = tiny_draft(target, draft_vocab_size=draft_vocab).to(torch.bfloat16)
    out = save_dflash(draft, tmp_path / "dflash", base_info={"target": "tiny-llama"},
                      acceptance_table=[{"drafter": "dflash", "tau": 2.5, "acceptance_rate": 0.4}])
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "mask_embedding.pt",
                                                     "model.safetensors"]
    assert [p.name for p in tmp_path.iterdir()] == ["dflash"]  # no temporary directory left behind
    cfg = json.loads((out / "config.json").read_text())
    c = draft.config
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["target_hidden_size"], cfg["vocab_size"]) == \
        (2, 32, 32, VOCAB)
    assert cfg.get("draft_vocab_size", VOCAB) == draft_vocab and ("draft_vocab_size" in cfg) == (draft_vocab < VOCAB)
    assert cfg["tie_word_embeddings"] is False and cfg["attention_bias"] is False
    assert cfg["rope_theta"] == 10000.0 and cfg["rope_scaling"] is None
    assert cfg["rope_parameters"] == {"rope_type": "default", "rope_theta": 10000.0}
    assert cfg["block_size"] == BLOCK and cfg["torch_dtype"] == "bfloat16"
    assert cfg["dflash_config"] == {"mask_token_id": VOCAB - 1, "target_layer_ids": list(c.target_layer_ids),
                                    "causal": False}
    # vLLM captures the input of layer i + 1 for DFlash's i (`get_eagle3_aux_layers_from_config` adds 1):
    # the hidden states the draft was trained on, and nothing overrides it.
    assert [i + 1 for i in cfg["dflash_config"]["target_layer_ids"]] == list(c.hidden_layers)
    assert "eagle_aux_hidden_state_layer_ids" not in cfg and "target_layer_ids" not in cfg
    assert cfg["drafttrain"]["target_num_layers"] == LAYERS

    with safe_open(str(out / "model.safetensors"), "pt") as f:
        found = {k: (tuple(f.get_slice(k).get_shape()), f.get_tensor(k).dtype) for k in f.keys()}
    expected = vllm_checkpoint_shapes(cfg)
    assert set(found) == set(expected)
    for key, (shape, dtype) in expected.items():
        assert found[key] == (shape, dtype or torch.bfloat16), key
    assert vllm_parameter_names(found, cfg) == vllm_parameters(cfg)

    mask = torch.load(out / "mask_embedding.pt", weights_only=True)  # as vLLM's `_read_mask_embedding` reads it
    assert mask["mask_token_id"] == cfg["dflash_config"]["mask_token_id"]
    assert torch.equal(mask["embedding"], draft.mask_embedding.detach())
    card = (out / "README.md").read_text()
    assert "| dflash |" in card and "2.50" in card and '"method": "dflash"' in card and "tiny-llama" in card
    assert f'"num_speculative_tokens": {BLOCK - 1}' in card and "mask_embedding.pt" in card


def test_transformers_reads_the_config_as_qwen3(tmp_path, target):
    """vLLM builds the draft's config with transformers' AutoConfig: a Qwen3Config with DFlash's keys."""
    from transformers import AutoConfig

    out = save_dflash(tiny_draft(target, draft_vocab_size=REDUCED), tmp_path / "d")
    cfg = AutoConfig.from_pretrained(out)
    assert cfg.model_type == "qwen3" and cfg.num_hidden_layers == 2 and cfg.draft_vocab_size == REDUCED
    assert cfg.head_dim == target.config.head_dim and cfg.dflash_config["mask_token_id"] == VOCAB - 1
    assert set(cfg.layer_types) == {"full_attention"}  # no sliding window: vLLM's plain DFlash layers


def block_logits(draft, target, ids: torch.Tensor) -> torch.Tensor:
    """Every mask slot's logits for two anchors per row of `ids`."""
    features = draft.target_features(target_hidden_states(target, ids))
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    with torch.no_grad():
        return draft(features, ids, torch.tensor([[2, 5], [3, 6]]), position_ids=positions,
                     attention_mask=torch.ones_like(ids))


@pytest.mark.parametrize("draft_vocab, dtype", [(VOCAB, torch.float64), (REDUCED, torch.float64),
                                                (REDUCED, torch.float32), (VOCAB, torch.bfloat16)])
def test_round_trip_is_bit_identical(tmp_path, target, draft_vocab, dtype):
    draft = tiny_draft(target, draft_vocab_size=draft_vocab, causal=draft_vocab == REDUCED).to(dtype)
    save_dflash(draft, tmp_path / "d")
    head = target.get_output_embeddings().weight
    loaded, info = load_dflash(tmp_path / "d", target_config=target.config, target_lm_head=head)
    assert loaded.config == draft.config and info.target_layer_ids == draft.config.target_layer_ids
    assert (info.block_size, info.mask_token_id, info.draft_vocab_size, info.target_num_layers) == \
        (BLOCK, VOCAB - 1, draft_vocab, LAYERS)
    assert info.head_from_target == (draft_vocab == VOCAB)
    assert list(loaded.state_dict()) == list(draft.state_dict())
    for key, value in draft.state_dict().items():
        assert loaded.state_dict()[key].dtype == value.dtype and torch.equal(loaded.state_dict()[key], value), key
    assert not loaded.lm_head.weight.requires_grad
    if dtype == torch.float64:
        loaded.attach_embeddings(target.get_input_embeddings())
        ids = torch.tensor([[3, 8, 21, 5, 9, 30, 11, 4, 7], [12, 6, 40, 33, 9, 8, 2, 15, 19]])
        assert torch.equal(block_logits(loaded, target, ids), block_logits(draft, target, ids))
    assert next(load_dflash(tmp_path / "d", dtype=torch.float32)[0].parameters()).dtype == torch.float32


def test_a_full_vocabulary_head_is_the_targets_attached_later(tmp_path, target):
    """The file has no LM head (vLLM shares the target's): until the caller attaches the target's it is
    NaN, so a forgotten attach cannot pass for a draft."""
    draft = tiny_draft(target)
    loaded, info = load_dflash(save_dflash(draft, tmp_path / "d"), target_config=target.config)
    assert info.head_from_target and torch.isnan(loaded.lm_head.weight).all()
    attach_target_head(loaded, target.get_output_embeddings().weight)
    assert torch.equal(loaded.lm_head.weight, draft.lm_head.weight)
    with pytest.raises(UserError, match="LM head"):
        attach_target_head(loaded, torch.zeros(VOCAB + 1, 32))


def test_saving_again_replaces_the_directory_whole(tmp_path, target):
    save_dflash(tiny_draft(target, draft_vocab_size=REDUCED), tmp_path / "d")
    save_dflash(tiny_draft(target), tmp_path / "d")
    assert [p.name for p in tmp_path.iterdir()] == ["d"]
    with safe_open(str(tmp_path / "d" / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in f.keys()  # nothing of the reduced-vocabulary export is left


def test_bad_checkpoints_are_one_line_user_errors(tmp_path, target):
    good = save_dflash(tiny_draft(target, draft_vocab_size=REDUCED), tmp_path / "good")
    full = save_dflash(tiny_draft(target), tmp_path / "full")

    def broken(name, edit, source=good):
        d = tmp_path / name
        d.mkdir()
        for f in source.iterdir():
            (d / f.name).write_bytes(f.read_bytes())
        edit(d)
        return d

    def expect(path, words, **kw):
        with pytest.raises(UserError) as e:
            load_dflash(path, **kw)
        msg = str(e.value)
        assert "\n" not in msg and all(w in msg for w in words), msg

    expect(tmp_path / "nowhere", ["does not exist"])
    expect(broken("arch", lambda d: _edit_config(d, architectures=["LlamaForCausalLMEagle3"])),
           ["architectures", "DFlashDraftModel"])
    expect(broken("type", lambda d: _edit_config(d, model_type="llama")), ["model_type", "qwen3"])
    expect(broken("noweights", lambda d: (d / "model.safetensors").unlink()), ["no model.safetensors"])
    expect(broken("missing", lambda d: _drop_weight(d, "layers.1.mlp.down_proj.weight")),
           ["missing", "layers.1.mlp.down_proj.weight"])
    expect(broken("ournames", lambda d: _rename_weight(d, "layers.0.self_attn.q_proj.weight",
                                                       "layers.0.q_proj.weight")), ["unexpected", "layers.0.q_proj.weight"])
    expect(broken("shape", lambda d: _edit_weight(d, "fc.weight", torch.zeros(32, 64))), ["fc.weight", "shape"])
    expect(broken("nan", lambda d: _edit_weight(d, "layers.0.self_attn.k_norm.weight", torch.full((8,), float("nan")))),
           ["non-finite", "k_norm"])
    expect(broken("maps", lambda d: _edit_weight(d, "d2t", torch.full((REDUCED,), 60, dtype=torch.long))), ["d2t"])
    expect(broken("fullmaps", lambda d: _edit_weight(d, "d2t", torch.zeros(VOCAB, dtype=torch.long), add=True),
                  source=full), ["unexpected", "d2t"])
    expect(broken("nomask", lambda d: (d / "mask_embedding.pt").unlink()), ["no mask_embedding.pt"])
    expect(broken("maskid", lambda d: torch.save({"mask_token_id": 5, "embedding": torch.zeros(32)},
                                                 d / "mask_embedding.pt")), ["mask_token_id 5", "63"])
    expect(broken("maskshape", lambda d: torch.save({"mask_token_id": VOCAB - 1, "embedding": torch.zeros(31)},
                                                    d / "mask_embedding.pt")), ["mask embedding", "32 floats"])
    expect(broken("masknan", lambda d: torch.save(torch.full((32,), float("inf")), d / "mask_embedding.pt")),
           ["mask embedding", "non-finite"])
    expect(broken("maskdamaged", lambda d: (d / "mask_embedding.pt").write_bytes(b"PK\x03\x04oops")), ["damaged"])
    expect(good, ["hidden size 32", "48"], target_config=tiny_target(hidden=48).config)
    from tiny import tiny_lm

    expect(good, ["number of layers"], target_config=tiny_lm(layers=9, vocab_size=VOCAB).config)
    expect(good, ["vocabulary size"], target_config=tiny_lm(layers=LAYERS, vocab_size=VOCAB + 8).config)


@pytest.mark.parametrize("changes, words", [
    ({"dflash_config": None}, ["dflash_config", "JSON object"]),
    ({"dflash_config": {"mask_token_id": "63", "target_layer_ids": [1, 2, 4]}}, ["mask_token_id", "'63'"]),
    ({"dflash_config": {"mask_token_id": VOCAB, "target_layer_ids": [1, 2, 4]}}, ["mask_token_id", "[0, 64)"]),
    ({"dflash_config": {"mask_token_id": 63, "target_layer_ids": "1,2"}}, ["target_layer_ids", "'1,2'"]),
    ({"dflash_config": {"mask_token_id": 63, "target_layer_ids": [1, 6]}}, ["target_layer_ids", "[0, 5]"]),
    ({"dflash_config": {"mask_token_id": 63, "target_layer_ids": [1, 2, 4], "causal": "no"}}, ["causal"]),
    ({"block_size": 99}, ["block_size 99", "[2, 32]"]),
    ({"block_size": None}, ["block_size", "positive integer"]),
    ({"num_hidden_layers": 0}, ["num_hidden_layers"]),
    ({"draft_vocab_size": 10**6}, ["draft_vocab_size", "exceeds vocab_size"]),
    ({"target_hidden_size": 48}, ["hidden size"]),
    ({"attention_bias": True}, ["attention_bias"]),
    ({"hidden_act": "swishy"}, ["hidden_act", "'swishy'"]),
    ({"rms_norm_eps": -1.0}, ["rms_norm_eps"]),
    ({"rope_parameters": {"rope_type": "spiral", "rope_theta": 10000.0}}, ["rope type", "'spiral'"]),
    ({"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0}}, ["rope_parameters", "cannot build"]),
    ({"max_position_embeddings": None}, ["max_position_embeddings"]),
])
def test_malformed_config_fields_are_one_line_naming_field_and_file(tmp_path, target, changes, words):
    d = save_dflash(tiny_draft(target, draft_vocab_size=REDUCED), tmp_path / "draft")
    _edit_config(d, **changes)
    with pytest.raises(UserError) as e:
        load_dflash(d)
    msg = str(e.value)
    assert "\n" not in msg and str(d / "config.json") in msg and all(w in msg for w in words), msg


def _edit_config(d, **changes):
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))


def _edit_weight(d, key, value, add=False):
    state = load_file(str(d / "model.safetensors"))
    state[key] = value if add else value.to(state[key].dtype)
    save_file(state, str(d / "model.safetensors"))


def _drop_weight(d, key):
    state = load_file(str(d / "model.safetensors"))
    del state[key]
    save_file(state, str(d / "model.safetensors"))


def _rename_weight(d, key, new):
    state = load_file(str(d / "model.safetensors"))
    state[new] = state.pop(key)
    save_file(state, str(d / "model.safetensors"))
