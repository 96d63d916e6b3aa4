from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from drafttrain.errors import UserError
from drafttrain.export import export_draft, render_acceptance_table

VOCAB = 96
EOS = 2


def tiny_llama(layers, seed, tie=False):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      bos_token_id=1, eos_token_id=EOS, pad_token_id=3, tie_word_embeddings=tie)
    return LlamaForCausalLM(cfg).to(torch.float64).eval()


def tiny_tokenizer():
    words = ["<unk>", "<s>", "</s>", "<pad>"] + [f"w{i}" for i in range(VOCAB - 4)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>", pad_token="<pad>")


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("target")
    tiny_llama(4, seed=0).save_pretrained(d)
    tiny_tokenizer().save_pretrained(d)
    return d


ROWS = [
    {"drafter": "this draft", "tau": 2.3456, "acceptance_rate": 0.6123, "speedup": 1.8},
    {"drafter": "n-gram", "tau": 1.2, "acceptance_rate": 0.1, "speedup": None, "note": "a|b"},
]


def test_render_acceptance_table():
    text = render_acceptance_table(ROWS)
    assert text.splitlines() == [
        "| drafter | τ (mean accepted length) | acceptance rate | speedup | note |",
        "| --- | ---: | ---: | ---: | --- |",
        "| this draft | 2.35 | 61.2% | 1.80× | – |",
        "| n-gram | 1.20 | 10.0% | – | a\\|b |",
    ]
    assert render_acceptance_table([]) == ""


@torch.no_grad()
def test_export_loads_and_assists_the_target(target_dir, tmp_path):
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float64).eval()
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    draft = tiny_llama(1, seed=1, tie=True)  # different weights: the target must reject some drafts
    out = tmp_path / "draft"
    out.mkdir()
    (out / "stale.txt").write_text("from an earlier export")
    export_draft(draft, tokenizer, out, eos_token_id=tokenizer.eos_token_id, acceptance_table=ROWS,
                 base_info={"target": "tiny/target", "init": "random", "steps": 3})

    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "README.md", "tokenizer.json",
            "tokenizer_config.json"} <= names
    assert "stale.txt" not in names and not any(p.name.startswith(".") for p in tmp_path.iterdir())
    assert (out / "tokenizer.json").read_bytes() == (target_dir / "tokenizer.json").read_bytes()
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == EOS
    assert set(load_file(out / "model.safetensors")) and load_file(out / "model.safetensors")[
        "model.embed_tokens.weight"].dtype == torch.float64

    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    assert loaded.dtype == torch.float64 and loaded.lm_head.weight is loaded.model.embed_tokens.weight
    for name, tensor in draft.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    assert AutoTokenizer.from_pretrained(out).get_vocab() == tokenizer.get_vocab()

    prompt = tokenizer("w1 w5 w9 w2 w7", return_tensors="pt")
    plain = target.generate(**prompt, do_sample=False, max_new_tokens=20)
    assisted = target.generate(**prompt, assistant_model=loaded, do_sample=False, max_new_tokens=20)
    assert plain.shape[1] > prompt["input_ids"].shape[1] + 5
    assert torch.equal(assisted, plain)

    card = (out / "README.md").read_text()
    assert render_acceptance_table(ROWS) in card
    assert "assistant_model=draft" in card and f"--draft {out}" in card
    assert "**init**: random" in card and "**steps**: 3" in card and "tiny/target" in card


def test_export_rejects_bad_inputs(tmp_path):
    tokenizer = tiny_tokenizer()
    with pytest.raises(UserError, match="eos_token_id"):
        export_draft(tiny_llama(1, 0), tokenizer, tmp_path / "a", eos_token_id=VOCAB)
    with pytest.raises(UserError, match="eos_token_id"):
        export_draft(tiny_llama(1, 0), tokenizer, tmp_path / "a", eos_token_id=None)
    small = LlamaForCausalLM(LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    with pytest.raises(UserError, match="96 tokens"):
        export_draft(small, tokenizer, tmp_path / "a", eos_token_id=EOS)
    assert not (tmp_path / "a").exists()


# ----------------------------------------------------------------------------- a full disk


def disk_full(*args, **kwargs):
    from safetensors import SafetensorError

    raise SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space '
                          'left on device" })')


@pytest.mark.parametrize("writer", ["medusa", "eagle3", "best"])
def test_a_full_disk_while_exporting_is_one_error_and_the_earlier_directory_stays(writer, tmp_path, monkeypatch):
    """safetensors reports a failed write as SafetensorError, not OSError: it must still be one line."""
    import safetensors.torch

    import drafttrain.training.checkpoints as checkpoints
    from drafttrain.training.checkpoints import save_best

    out = tmp_path / "final"
    out.mkdir()
    (out / "earlier.txt").write_text("kept")
    if writer == "medusa":
        from drafttrain.kinds.medusa.model import MedusaConfig, MedusaHeads
        from drafttrain.kinds.medusa.export import save_medusa

        heads = MedusaHeads(MedusaConfig(hidden_size=8, vocab_size=16, num_heads=2, num_layers=1))
        write = lambda: save_medusa(heads, out)  # noqa: E731
    elif writer == "eagle3":
        from drafttrain.kinds.eagle3.export import save_eagle3
        from drafttrain.kinds.eagle3.model import Eagle3Config, Eagle3Draft

        draft = Eagle3Draft(Eagle3Config(hidden_size=8, intermediate_size=16, num_attention_heads=2,
                                         num_key_value_heads=1, head_dim=4, rms_norm_eps=1e-6, vocab_size=32,
                                         draft_vocab_size=16, target_hidden_size=8, target_num_layers=4,
                                         aux_layer_ids=(1, 2, 3), max_position_embeddings=64))
        write = lambda: save_eagle3(draft, out)  # noqa: E731
    else:
        out = tmp_path / "best"
        out.mkdir()
        (out / "earlier.txt").write_text("kept")
        write = lambda: save_best(tmp_path, {"w": torch.zeros(2)}, 3, {"tau": 1.0})  # noqa: E731
    monkeypatch.setattr(safetensors.torch, "save_file", disk_full)
    monkeypatch.setattr(checkpoints, "save_file", disk_full)
    with pytest.raises(UserError) as e:
        write()
    assert str(e.value).startswith(f"writing {out} failed (Error while serializing") and "No space left" in str(e.value)
    assert "start the same command again" in str(e.value)
    assert os.listdir(out) == ["earlier.txt"] and (out / "earlier.txt").read_text() == "kept"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary left behind
