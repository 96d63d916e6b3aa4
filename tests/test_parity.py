"""drafttrain.parity (issue 41): drafttrain's rows in speculators' dataset layout, the speculators flags a
recipe config maps to, and speculators' exports rewritten in drafttrain's layout. speculators itself is not
installed here (it has its own environment, scripts/setup_speculators.sh): its layouts are written out as
speculators 0.9.0 reads and writes them (speculators/train/data.py, hs_connectors' FileTransfer,
Eagle3DraftModel / DFlashDraftModel checkpoints)."""

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny import save_pair, tiny_lm, tiny_tokenizer

from drafttrain.data.collate import pack_example
from drafttrain.errors import UserError
from drafttrain.kinds.dflash.export import load_dflash
from drafttrain.kinds.dflash.model import DFlashDraft
from drafttrain.kinds.eagle3.export import load_eagle3
from drafttrain.kinds.eagle3.model import Eagle3Draft
from drafttrain.kinds.vocab import build_draft_vocab
from drafttrain.parity import (convert_dflash_export, convert_eagle3_export, drafttrain_speed, main,
                               read_data_summary, recipe_config, report, speculators_argv, speculators_example,
                               target_hidden_states, validation_ratio, write_speculators_data)

VOCAB = 64


@pytest.mark.parametrize("prompt, response, max_len", [(5, 4, 32), (5, 40, 20), (30, 6, 20), (3, 1, 8)])
def test_rows_are_cut_as_drafttrain_cuts_them_and_train_the_same_drafts(prompt, response, max_len):
    p, r = list(range(10, 10 + prompt)), list(range(50, 50 + response))
    packed = pack_example(p, r, max_len)
    ids, mask = speculators_example(p, r, max_len, "eagle3")
    assert ids == packed["input_ids"]
    # EAGLE-3: speculators trains, where loss_mask[p], the draft made at p of token p + 1: drafttrain's mask.
    assert mask == [int(t) for t in packed["loss_mask"]]
    n_prompt = packed["loss_mask"].index(True) + 1
    assert all(ids[t + 1] >= 50 for t in range(len(ids) - 1) if mask[t])  # every trained draft is an answer token
    assert sum(mask) == len(ids) - n_prompt  # ... and every answer token is drafted
    # DFlash: anchors where the mask is 1 (from the prompt's last token), labels the answer's tokens.
    ids_d, mask_d = speculators_example(p, r, max_len, "dflash")
    assert ids_d == ids and mask_d == [0] * (n_prompt - 1) + [1] * (len(ids) - n_prompt + 1)


def test_a_row_without_an_answer_is_dropped():
    assert speculators_example([1, 2, 3], [], 8) is None


def test_the_validation_split_holds_out_the_copy_only():
    for n in range(1, 3000):
        assert int((n + 1) * validation_ratio(n)) == n


@pytest.fixture(scope="module")
def target():
    return tiny_lm(0, vocab_size=VOCAB, layers=4, hidden=32, dtype=torch.float32)


def test_hidden_states_are_the_layer_inputs_and_the_last_output_before_the_norm(target):
    ids = [3, 9, 4, 17, 22, 5]
    hs = target_hidden_states(target, ids, [1, 2, 3])
    assert hs.shape == (len(ids), 4, 32)
    with torch.no_grad():
        out = target(input_ids=torch.tensor([ids]), output_hidden_states=True)
    for j, i in enumerate([1, 2, 3]):
        torch.testing.assert_close(hs[:, j], out.hidden_states[i][0])
    # speculators' teacher: the target's norm and LM head on the last entry give the target's logits.
    torch.testing.assert_close(target.lm_head(target.model.norm(hs[:, 3])), out.logits[0], rtol=1e-4, atol=1e-4)


def test_the_dataset_is_speculators_layout(tmp_path, target):
    import datasets

    rows = [([1, 5, 6, 7], [8, 9, 10, 2]), ([1, 11, 12], [13, 2]), ([1, 4], [])]
    vocab = build_draft_vocab([r for _, r in rows], VOCAB, 16, always_include=(2,))
    summary = write_speculators_data(tmp_path / "d", rows, target, layer_ids=[1, 2, 3], max_seq_len=16,
                                     vocab=vocab, extra={"note": 1})
    assert (summary.rows, summary.dropped, summary.draft_vocab_size) == (2, 1, 16)
    data = datasets.load_from_disk(str(tmp_path / "d"))
    assert len(data) == 3 and int(len(data) * summary.train_data_ratio) == 2  # the last row: validation only
    assert isinstance(data[0]["input_ids"], torch.Tensor)  # speculators compares them as tensors
    assert data[0]["input_ids"].tolist() == [1, 5, 6, 7, 8, 9, 10, 2] and data[0]["seq_len"] == 8
    assert data[2]["input_ids"].tolist() == data[0]["input_ids"].tolist()
    for i in range(3):
        hs = load_file(str(tmp_path / "d" / "hidden_states" / f"hs_{i}.safetensors"))
        assert hs["token_ids"].tolist() == data[i]["input_ids"].tolist()
        assert hs["hidden_states"].shape == (data[i]["seq_len"], 4, 32)
    np.testing.assert_array_equal(np.load(tmp_path / "d" / "d2t-16.npy"), vocab.d2t.numpy())
    np.testing.assert_array_equal(np.load(tmp_path / "d" / "t2d-16.npy"), vocab.t2d.numpy())
    assert read_data_summary(tmp_path / "d") == summary
    with pytest.raises(UserError, match="not empty"):
        write_speculators_data(tmp_path / "d", rows, target, layer_ids=[1], max_seq_len=16)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, target):
    root = tmp_path_factory.mktemp("parity")
    save_pair(root / "target", target, tiny_tokenizer(VOCAB))
    (root / "p.jsonl").write_text("".join(json.dumps({"id": i, "prompt": f"w{i}"}) + "\n" for i in range(20)))
    return root


def config_file(root, kind):
    draft = "  vocab_size: 16\n" if kind == "eagle3" else "  block_size: 4\n  target_layer_ids: [0, 1, 2]\n"
    evaluation = "" if kind == "eagle3" else "eval:\n  num_draft_tokens: 3\n"
    loss = "  ttt_steps: 2\n  decay: 0.5\n" if kind == "eagle3" else "  anchors: 3\n"
    path = root / f"{kind}.yaml"
    path.write_text(f"output_dir: {root}/run\ntarget: {root}/target\ndraft:\n{draft}"
                    f"data:\n  sources:\n    - kind: jsonl\n      path: {root}/p.jsonl\n  heldout_size: 2\n"
                    f"  max_seq_len: 40\nloss:\n{loss}optim:\n  lr: 2.0e-3\n  warmup_steps: 3\n"
                    "train:\n  max_steps: 12\n  micro_batch_size: 4\n  seed: 7\n" + evaluation)
    return str(path)


def flag(argv, name, count=1):
    i = argv.index(name)
    return argv[i + 1: i + 1 + count]


def test_eagle3_flags_match_the_recipe(model_dir, tmp_path, target):
    cfg = recipe_config("eagle3", config_file(model_dir, "eagle3"), ["optim.min_lr_ratio=0"])
    summary = write_speculators_data(tmp_path / "d", [([1, 2, 3], [4, 5, 2])] * 3, target,
                                     layer_ids=[2, 2, 1], max_seq_len=40,
                                     vocab=build_draft_vocab([[4, 5]], VOCAB, 16, always_include=(2,)))
    run = speculators_argv("eagle3", cfg, summary, tmp_path / "d", tmp_path / "s")
    a = run.argv
    assert flag(a, "--speculator-type") == ["eagle3"] and flag(a, "--target-layer-ids", 3) == ["2", "2", "1"]
    assert flag(a, "--max-steps") == ["12"] and flag(a, "--samples-per-step") == ["4"]
    assert flag(a, "--draft-vocab-size") == ["16"] and flag(a, "--seed") == ["7"]
    assert flag(a, "--optimizer") == ["adamw"] and float(flag(a, "--lr")[0]) == 2e-3
    assert flag(a, "--scheduler-type") == ["cosine"] and flag(a, "--scheduler-warmup-steps") == ["3"]
    assert flag(a, "--ttt-steps") == ["2"] and float(flag(a, "--ttt-step-loss-decay")[0]) == 0.5
    assert {"--no-norm-before-residual", "--no-norm-before-fc", "--no-norm-output"} <= set(a)
    assert flag(a, "--draft-attn-impl") == ["sdpa"] and flag(a, "--loss-implementation") == ["eager"]
    assert "--draft-attn-impl" not in speculators_argv("eagle3", cfg, summary, "d", "s", cpu=False).argv
    assert float(flag(a, "--train-data-ratio")[0]) == summary.train_data_ratio
    assert any("batch" in item for item in run.unmatched) and "steps" in run.matched


def test_dflash_flags_match_the_recipe(model_dir, tmp_path, target):
    cfg = recipe_config("dflash", config_file(model_dir, "dflash"), [])
    summary = write_speculators_data(tmp_path / "d", [([1, 2, 3], [4, 5, 2])] * 3, target,
                                     layer_ids=[1, 2, 3], max_seq_len=40, kind="dflash",
                                     extra={"mask_token_id": 60})
    a = speculators_argv("dflash", cfg, summary, tmp_path / "d", tmp_path / "s").argv
    assert flag(a, "--block-size") == ["4"] and flag(a, "--mask-token-id") == ["60"]
    assert flag(a, "--max-anchors") == ["12"]  # 3 per answer x 4 answers a step
    assert float(flag(a, "--dflash-decay-gamma")[0]) == 2.0  # block_size / 2, drafttrain's default
    assert "--sliding-window-non-causal" in a and flag(a, "--loss-fn") == ["ce"]
    assert "--draft-vocab-size" not in a
    summary.extra = {}
    with pytest.raises(UserError, match="mask_token_id"):
        speculators_argv("dflash", cfg, summary, "d", "s")


def test_the_layer_ids_follow_each_kinds_numbering(model_dir):
    from drafttrain.parity import speculators_layer_ids

    eagle3 = recipe_config("eagle3", config_file(model_dir, "eagle3"), ["draft.aux_layer_ids=[1,2,3]"])
    assert speculators_layer_ids("eagle3", eagle3, 4) == [1, 2, 3]  # transformers' hidden_states index, as is
    dflash = recipe_config("dflash", config_file(model_dir, "dflash"))
    assert speculators_layer_ids("dflash", dflash, 4) == [1, 2, 3]  # DFlash's layer-output numbering + 1


def speculators_checkpoint(path, config: dict, state: dict):
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in state.items()}, str(path / "model.safetensors"))


def test_an_eagle3_checkpoint_becomes_drafttrains_layout(tmp_path, target):
    vocab = build_draft_vocab([[4, 5, 6, 7]], VOCAB, 16, always_include=(2,))
    draft = Eagle3Draft.from_target(target, vocab, aux_layer_ids=[1, 2, 3], dtype=torch.bfloat16, seed=1)
    state = {("layers.0." + k[len("midlayer."):] if k.startswith("midlayer.") else k): v
             for k, v in draft.state_dict().items()}
    state["embed_tokens.weight"] = target.model.embed_tokens.weight.to(torch.bfloat16)
    config = {"speculators_model_type": "eagle3", "speculators_version": "0.9.0", "draft_vocab_size": 16,
              "eagle_aux_hidden_state_layer_ids": [1, 2, 3], "norm_before_residual": False, "norm_before_fc": False,
              "norm_output": False, "fc_norm": False, "transformer_layer_config": {"num_hidden_layers": 1}}
    speculators_checkpoint(tmp_path / "ckpt", config, state)
    convert_eagle3_export(tmp_path / "ckpt", tmp_path / "out", target)
    loaded, info = load_eagle3(tmp_path / "out", target_config=target.config)
    assert info.aux_layer_ids == (1, 2, 3) and loaded.fc.weight.dtype == torch.bfloat16
    for key, value in draft.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[key], value, rtol=0, atol=0)
    speculators_checkpoint(tmp_path / "v31", {**config, "norm_before_fc": True, "norm_output": True}, state)
    with pytest.raises(UserError, match="norm_before_fc, norm_output"):
        convert_eagle3_export(tmp_path / "v31", tmp_path / "out2", target)
    with pytest.raises(UserError, match="not 'dflash'"):
        convert_dflash_export(tmp_path / "ckpt", tmp_path / "out3", target)


def test_a_dflash_checkpoint_becomes_drafttrains_layout(tmp_path, target):
    vocab = build_draft_vocab([list(range(VOCAB))], VOCAB, VOCAB)
    draft = DFlashDraft.from_target(target, vocab, layers=2, block_size=4, target_layer_ids=(0, 1, 2),
                                    mask_token_id=60, dtype=torch.float32, seed=1)
    state = {}
    for key, value in draft.state_dict().items():
        if key in ("mask_embedding", "d2t", "t2d", "lm_head.weight"):
            continue  # speculators' full-vocabulary DFlash checkpoint has none of them
        parts = key.split(".")
        if parts[0] == "layers" and parts[2] in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"):
            key = ".".join(parts[:2] + ["self_attn"] + parts[2:])
        elif parts[0] == "layers" and parts[2] in ("gate_proj", "up_proj", "down_proj"):
            key = ".".join(parts[:2] + ["mlp"] + parts[2:])
        state[key] = value
    config = {"speculators_model_type": "dflash", "speculators_version": "0.9.0", "draft_vocab_size": VOCAB,
              "aux_hidden_state_layer_ids": [1, 2, 3], "block_size": 4, "mask_token_id": 60,
              "sample_from_anchor": False, "sliding_window_non_causal": True,
              "transformer_layer_config": {"num_hidden_layers": 2}}
    speculators_checkpoint(tmp_path / "ckpt", config, state)
    convert_dflash_export(tmp_path / "ckpt", tmp_path / "out", target)
    loaded, _ = load_dflash(tmp_path / "out", target_config=target.config,
                            target_lm_head=target.get_output_embeddings().weight)
    c = loaded.config
    assert (c.target_layer_ids, c.block_size, c.mask_token_id, c.causal) == ((0, 1, 2), 4, 60, False)
    # speculators feeds the mask slots the target's embedding of the mask token
    torch.testing.assert_close(loaded.mask_embedding.detach(), target.model.embed_tokens.weight[60].detach())
    for key, value in state.items():
        mine = key.replace("self_attn.", "").replace("mlp.", "")
        torch.testing.assert_close(loaded.state_dict()[mine], value, rtol=0, atol=0)


def test_the_report_reads_a_run_directory(tmp_path):
    run = tmp_path / "drafttrain-eagle3"
    run.mkdir()
    (run / "config.yaml").write_text("train:\n  micro_batch_size: 4\n")
    (run / "train_log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [
        {"type": "train", "step": 10, "steps_per_s": 2.0}, {"type": "eval", "step": 10, "tau": 1.5},
        {"type": "train", "step": 20, "steps_per_s": 1.0}]))
    speed = drafttrain_speed(run)
    assert (speed["steps"], speed["samples"], speed["seconds"]) == (20, 80, 15.0)
    (tmp_path / "speculators-eagle3").mkdir()
    (tmp_path / "speculators-eagle3" / "speed.json").write_text(json.dumps(
        {"steps": 20, "samples": 78, "samples_per_step": 3.9, "samples_per_s": 9.5}))
    (tmp_path / "judge-eagle3").mkdir()
    (tmp_path / "judge-eagle3" / "comparison.json").write_text(json.dumps({"drafters": [
        {"drafter": "drafttrain", "backend": "drafttrain", "num_draft_tokens": 4, "tau": 1.8,
         "per_position_acceptance": [0.5, 0.2, 0.1, 0.0], "outputs_match_baseline": 1.0},
        {"drafter": "speculators-served", "backend": "vllm", "num_draft_tokens": 4, "tau": 1.7,
         "per_position_acceptance": [0.45, 0.2, 0.05, 0.0]}]}))
    (tmp_path / "settings-eagle3.json").write_text(json.dumps({"argv": [], "matched": {"steps": "20"},
                                                               "unmatched": ["batch: packed"]}))
    md = report(tmp_path, ["eagle3"])
    assert "| eagle3 | drafttrain | drafttrain | 4 | 1.800 | 0.50 / 0.20 / 0.10 / 0.00 | 1.00 |" in md
    assert "| eagle3 | speculators | vllm | 4 | 1.700 | 0.45 / 0.20 / 0.05 / 0.00 | - |" in md
    assert "| eagle3 | drafttrain | 20 | 4 | 5.33 |" in md and "| eagle3 | speculators | 20 | 3.90 | 9.50 |" in md
    assert "- steps: 20" in md and "- batch: packed" in md


def test_command_line_errors_are_one_line(tmp_path, capsys):
    assert main(["argv", "--kind", "eagle3", "--config", str(tmp_path / "missing.yaml"), "--data", "d",
                 "--save", "s"]) == 2
    assert capsys.readouterr().err.startswith("error: ")
