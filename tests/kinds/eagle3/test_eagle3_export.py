"""EAGLE-3 export: names, shapes, dtypes and config keys against what SGLang's and vLLM's
`llama_eagle3.py` read (written out by hand below), and a bit-identical round trip."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from drafttrain.kinds.eagle3.decode import prefill
from drafttrain.kinds.eagle3.export import load_eagle3, save_eagle3
from drafttrain.kinds.eagle3.model import Eagle3Draft
from drafttrain.kinds.features import DraftKVCache
from drafttrain.errors import UserError
from eagle3_helpers import LAYERS, VOCAB, target_hidden_states, tiny_draft, tiny_target


def serving_shapes(cfg: dict) -> dict[str, tuple[tuple[int, ...], torch.dtype | None]]:
    """The checkpoint tensors SGLang's and vLLM's `LlamaForCausalLMEagle3` load, by hand, from their
    module definitions: fc = Linear(3 * target_hidden_size, hidden_size, bias=False); the midlayer
    is a Llama decoder layer whose QKVParallelLinear takes 2 * hidden_size inputs (q: heads * head_dim
    rows, k and v: kv_heads * head_dim rows), o_proj heads * head_dim -> hidden, a LlamaMLP, and
    RMSNorms input_layernorm / hidden_norm / post_attention_layernorm; the final `norm`;
    lm_head = ParallelLMHead(draft_vocab_size, hidden_size); d2t -> vLLM's
    `draft_id_to_target_id` (torch.long, [draft_vocab_size]) / SGLang's hot_token_id; t2d is read by
    neither (skipped) but SpecForge stores it as a bool mask over the target's vocabulary.
    dtype None: the checkpoint's float dtype."""
    H, I, hd = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    return {
        "fc.weight": ((H, 3 * cfg["target_hidden_size"]), None),
        "midlayer.input_layernorm.weight": ((H,), None),
        "midlayer.hidden_norm.weight": ((H,), None),
        "midlayer.self_attn.q_proj.weight": ((q, 2 * H), None),
        "midlayer.self_attn.k_proj.weight": ((kv, 2 * H), None),
        "midlayer.self_attn.v_proj.weight": ((kv, 2 * H), None),
        "midlayer.self_attn.o_proj.weight": ((H, q), None),
        "midlayer.post_attention_layernorm.weight": ((H,), None),
        "midlayer.mlp.gate_proj.weight": ((I, H), None),
        "midlayer.mlp.up_proj.weight": ((I, H), None),
        "midlayer.mlp.down_proj.weight": ((H, I), None),
        "norm.weight": ((H,), None),
        "lm_head.weight": ((cfg["draft_vocab_size"], H), None),
        "d2t": ((cfg["draft_vocab_size"],), torch.int64),
        "t2d": ((cfg["vocab_size"],), torch.bool),
    }


def layers_vllm_captures(cfg: dict, num_layers: int) -> list[int]:
    """vLLM: `eagle_aux_hidden_state_layer_ids` (top level), else eagle_config's, else
    (2, L // 2, L - 3); layer idx's INPUT (`hidden_states + residual` before layer idx) is captured."""
    ids = cfg.get("eagle_aux_hidden_state_layer_ids") or (cfg.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids") or [2, num_layers // 2, num_layers - 3]
    return sorted(ids)  # inputs of these layers, in layer order


def layers_sglang_captures(cfg: dict, num_layers: int) -> list[int]:
    """SGLang: eagle_config's ids + 1 ("the ith layer takes the output of the (i-1)th layer"),
    else [2, L // 2, L - 3]; captured as the input of those layers."""
    ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    return sorted([i + 1 for i in ids] if ids else [2, num_layers // 2, num_layers - 3])


@pytest.fixture(scope="module")
def target():
    return tiny_target()


@pytest.mark.parametrize("aux", [None, (1, 3, 6)])
def test_export_matches_what_the_serving_engines_read(tmp_path, target, aux):
    draft = tiny_draft(target).to(torch.bfloat16)
    if aux is not None:
        draft = Eagle3Draft.from_target(target, _vocab_of(draft), aux_layer_ids=aux, dtype=torch.bfloat16)
    out = save_eagle3(draft, tmp_path / "eagle3", base_info={"target": "tiny-llama"},
                      acceptance_table=[{"drafter": "eagle3", "tau": 2.5, "acceptance_rate": 0.4}])
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "model.safetensors"]
    assert [p.name for p in tmp_path.iterdir()] == ["eagle3"]  # no temporary directory left behind
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["model_type"] == "llama"
    assert cfg["num_hidden_layers"] == 1 and cfg["tie_word_embeddings"] is False
    assert (cfg["hidden_size"], cfg["target_hidden_size"], cfg["vocab_size"], cfg["draft_vocab_size"]) == \
        (32, 32, VOCAB, 40)
    assert cfg["rope_theta"] == 10000.0 and cfg["rope_scaling"] is None
    assert cfg["rope_parameters"] == {"rope_type": "default", "rope_theta": 10000.0}
    assert cfg["torch_dtype"] == "bfloat16"
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        found = {k: (tuple(f.get_slice(k).get_shape()), f.get_tensor(k).dtype) for k in f.keys()}
    expected = serving_shapes(cfg)
    assert set(found) == set(expected)
    for key, (shape, dtype) in expected.items():
        assert found[key] == (shape, dtype or torch.bfloat16), key
    # Both engines capture the layers the draft was trained on.
    ours = list(draft.config.aux_layer_ids)
    assert layers_vllm_captures(cfg, LAYERS) == ours == layers_sglang_captures(cfg, LAYERS)
    if aux is None:  # the engines' default: nothing to configure
        assert "eagle_config" not in cfg and "eagle_aux_hidden_state_layer_ids" not in cfg
    card = (out / "README.md").read_text()
    assert "| eagle3 |" in card and "2.50" in card and "EAGLE3" in card and "tiny-llama" in card


def test_transformers_reads_the_config_as_a_one_layer_llama(tmp_path, target):
    from transformers import AutoConfig

    out = save_eagle3(tiny_draft(target), tmp_path / "e")
    cfg = AutoConfig.from_pretrained(out)
    assert cfg.model_type == "llama" and cfg.num_hidden_layers == 1 and cfg.draft_vocab_size == 40
    assert cfg.rope_parameters["rope_theta"] == target.config.rope_parameters["rope_theta"]
    assert cfg.head_dim == target.config.head_dim


def _vocab_of(draft):
    from drafttrain.kinds.vocab import DraftVocab

    return DraftVocab.from_d2t(draft.d2t, draft.config.vocab_size)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float32])
def test_round_trip_is_bit_identical(tmp_path, target, dtype):
    draft = tiny_draft(target).to(dtype)
    save_eagle3(draft, tmp_path / "e")
    loaded, info = load_eagle3(tmp_path / "e", target_config=target.config)
    assert loaded.config == draft.config and info.aux_layer_ids == draft.config.aux_layer_ids
    assert info.draft_vocab_size == 40 and info.target_num_layers == LAYERS
    assert list(loaded.state_dict()) == list(draft.state_dict())
    for key, value in draft.state_dict().items():
        assert loaded.state_dict()[key].dtype == value.dtype and torch.equal(loaded.state_dict()[key], value), key
    if dtype == torch.float64:
        loaded.attach_embeddings(target.get_input_embeddings())
        ids = torch.tensor([[3, 8, 21, 5, 9]])
        features = draft.target_features(target_hidden_states(target, ids))
        with torch.no_grad():
            assert torch.equal(loaded(features, ids, num_steps=2), draft(features, ids, num_steps=2))
            a = prefill(loaded, DraftKVCache(), features, ids, torch.arange(5)[None]).logits
            b = prefill(draft, DraftKVCache(), features, ids, torch.arange(5)[None]).logits
        assert torch.equal(a, b)
    assert next(load_eagle3(tmp_path / "e", dtype=torch.float32)[0].parameters()).dtype == torch.float32


def test_bad_checkpoints_are_one_line_user_errors(tmp_path, target):
    good = save_eagle3(tiny_draft(target), tmp_path / "good")

    def broken(name, edit):
        d = tmp_path / name
        d.mkdir()
        for f in good.iterdir():
            (d / f.name).write_bytes(f.read_bytes())
        edit(d)
        return d

    def expect(path, words, **kw):
        with pytest.raises(UserError) as e:
            load_eagle3(path, **kw)
        msg = str(e.value)
        assert "\n" not in msg and all(w in msg for w in words), msg

    expect(tmp_path / "nowhere", ["does not exist"])
    expect(broken("noconfig", lambda d: (d / "config.json").unlink()), ["no config.json"])
    expect(broken("badjson", lambda d: (d / "config.json").write_text("{oops")), ["not valid JSON"])
    expect(broken("arch", lambda d: _edit_config(d, architectures=["LlamaForCausalLM"])), ["architectures"])
    expect(broken("noweights", lambda d: (d / "model.safetensors").unlink()), ["no model.safetensors"])
    expect(broken("damaged", lambda d: _truncate(d / "model.safetensors")), ["damaged"])
    expect(broken("shape", lambda d: _edit_weight(d, "fc.weight", torch.zeros(32, 95))), ["fc.weight", "shape"])
    expect(broken("missing", lambda d: _drop_weight(d, "norm.weight")), ["missing", "norm.weight"])
    expect(broken("nan", lambda d: _edit_weight(d, "norm.weight", torch.full((32,), float("nan")))),
           ["non-finite"])
    expect(broken("maps", lambda d: _edit_weight(d, "d2t", torch.full((40,), 60, dtype=torch.long))), ["d2t"])
    other = tiny_target(hidden=48)
    expect(good, ["hidden size 32", "48"], target_config=other.config)
    from tiny import tiny_lm

    expect(good, ["number of layers"], target_config=tiny_lm(layers=9, vocab_size=VOCAB).config)


def _edit_config(d, **changes):
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))


def _truncate(file):
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])


def _edit_weight(d, key, value):
    state = load_file(str(d / "model.safetensors"))
    state[key] = value.to(state[key].dtype)
    save_file(state, str(d / "model.safetensors"))


def _drop_weight(d, key):
    state = load_file(str(d / "model.safetensors"))
    del state[key]
    save_file(state, str(d / "model.safetensors"))


def test_foreign_checkpoints_give_their_layers_in_either_engines_convention(tmp_path, target):
    """A checkpoint from another trainer (no `drafttrain` key) names its layers the vLLM way, the
    SGLang way (output of layer i = our index i + 1) or not at all (the engines' default)."""
    saved = save_eagle3(tiny_draft(target), tmp_path / "e")

    def variant(name, **keys):
        d = tmp_path / name
        d.mkdir()
        (d / "model.safetensors").write_bytes((saved / "model.safetensors").read_bytes())
        cfg = json.loads((saved / "config.json").read_text())
        del cfg["drafttrain"]
        cfg.update(keys)
        (d / "config.json").write_text(json.dumps(cfg))
        return d

    sglang = variant("sglang", eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 2, 5]})
    assert load_eagle3(sglang, target_config=target.config)[1].aux_layer_ids == (1, 3, 6)
    vllm = variant("vllm", eagle_aux_hidden_state_layer_ids=[1, 3, 6])
    assert load_eagle3(vllm, target_config=target.config)[1].aux_layer_ids == (1, 3, 6)
    plain = variant("plain")
    assert load_eagle3(plain, target_config=target.config)[1].aux_layer_ids == (2, 3, 4)
    with pytest.raises(UserError, match="how many layers"):
        load_eagle3(plain)


@pytest.mark.parametrize("changes, words", [
    ({"draft_vocab_size": -5}, ["draft_vocab_size", "positive integer", "-5"]),
    ({"draft_vocab_size": "40"}, ["draft_vocab_size", "'40'"]),
    ({"draft_vocab_size": 10**6}, ["draft_vocab_size", "exceeds vocab_size"]),
    ({"target_hidden_size": "32"}, ["target_hidden_size", "'32'"]),
    ({"hidden_act": "swishy"}, ["hidden_act", "'swishy'"]),
    ({"hidden_act": 3}, ["hidden_act"]),
    ({"rms_norm_eps": "1e-6"}, ["rms_norm_eps", "positive number"]),
    ({"rms_norm_eps": -1.0}, ["rms_norm_eps"]),
    ({"rope_parameters": {"rope_type": "spiral", "rope_theta": 10000.0}}, ["rope type", "'spiral'", "linear"]),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": "big"}}, ["rope_theta"]),
    ({"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0}}, ["rope_parameters", "cannot build"]),
    ({"rope_parameters": "default"}, ["rope_parameters", "JSON object"]),
    ({"head_dim": 2.5}, ["head_dim"]),
    ({"num_key_value_heads": "2"}, ["num_key_value_heads"]),
    ({"max_position_embeddings": -1}, ["max_position_embeddings"]),
])
def test_malformed_config_fields_are_one_line_naming_field_and_file(tmp_path, target, changes, words):
    """Each of these was a traceback deep in torch or transformers, or (a string target_hidden_size)
    "made for hidden size 32, but this target has 32"."""
    d = save_eagle3(tiny_draft(target), tmp_path / "draft")
    _edit_config(d, **changes)
    with pytest.raises(UserError) as e:
        load_eagle3(d, target_config=target.config)
    msg = str(e.value)
    assert "\n" not in msg and str(d / "config.json") in msg and all(w in msg for w in words), msg


def test_malformed_config_is_one_error_line_from_the_command(tmp_path, target, capsys):
    from tiny import save_pair, tiny_tokenizer

    from drafttrain.cli import main

    save_pair(tmp_path / "target", target, tiny_tokenizer())
    d = save_eagle3(tiny_draft(target), tmp_path / "draft")
    _edit_config(d, draft_vocab_size="40")
    (tmp_path / "p.jsonl").write_text('{"prompt": "w5 w6"}\n')
    capsys.readouterr()
    code = main(["eval", "--target", str(tmp_path / "target"), "--eagle3", str(d), "--prompts",
                 str(tmp_path / "p.jsonl"), "--out", str(tmp_path / "out"), "--quiet"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error:") and "draft_vocab_size" in err[0], err
