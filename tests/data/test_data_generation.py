from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from drafttrain.data.config import DataConfig, PromptSourceConfig
from drafttrain.data.generation import generate_responses, target_fingerprint
from drafttrain.tokens import cut_at_eos
from drafttrain.data.pipeline import prepare_distillation_data
from drafttrain.errors import UserError
from drafttrain.prompts import PromptRecord, encode_prompt

EOS = 3
MAX_NEW = 12


def make_records():
    """Prompts of different lengths (so batches need padding), verbatim and through the chat template."""
    records = [PromptRecord(id=i, category="d", source=f"t:{i}", text=" ".join(f"w{(7 * i + j) % 80}" for j in range(1 + i % 5)))
               for i in range(7)]
    records.append(PromptRecord(id="chat", category="d", source="t:chat", messages=[{"role": "user", "content": "w5 w6"}]))
    return records


def reference_greedy(model, prompt):
    """Each prompt alone, through transformers' own generate: no padding involved."""
    ids = torch.tensor([prompt])
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                         max_new_tokens=MAX_NEW, eos_token_id=EOS, pad_token_id=0)
    return cut_at_eos(out[0, len(prompt):].tolist(), [EOS])


def forbid_generate(model, monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("the target generated again")

    monkeypatch.setattr(model, "generate", fail)


@pytest.fixture
def cfg(tmp_path):
    return DataConfig(max_response_tokens=MAX_NEW, generation_batch_size=3, cache_dir=str(tmp_path / "cache"))


def test_batched_greedy_equals_each_prompt_alone(tiny_model, tiny_tokenizer, cfg):
    records = make_records()
    ds = generate_responses(tiny_model, tiny_tokenizer, records, cfg, eos_token_id=EOS,
                            target_fingerprint="fp")
    assert ds.column_names == ["prompt_ids", "response_ids"]
    assert len(ds) == len(records)
    stopped = full = 0
    for record, row in zip(records, ds):
        assert row["prompt_ids"] == encode_prompt(record, tiny_tokenizer)
        assert row["response_ids"] == reference_greedy(tiny_model, row["prompt_ids"])
        stopped += row["response_ids"][-1] == EOS
        full += len(row["response_ids"]) == MAX_NEW and EOS not in row["response_ids"]
    # The check means something only if some rows stopped early (padding after EOS was cut) and some did not.
    assert stopped and full


def test_cache_is_reused_and_invalidated(tiny_model, tiny_tokenizer, cfg, monkeypatch, tmp_path):
    records = make_records()
    first = generate_responses(tiny_model, tiny_tokenizer, records, cfg, eos_token_id=EOS, target_fingerprint="fp")
    entries = [p for p in Path(cfg.cache_dir).iterdir() if not p.name.startswith(".")]
    assert len(entries) == 1
    assert json.loads((entries[0] / "drafttrain_meta.json").read_text())["prompts"] == len(records)

    real_generate = tiny_model.generate
    forbid_generate(tiny_model, monkeypatch)
    again = generate_responses(tiny_model, tiny_tokenizer, records, cfg, eos_token_id=EOS, target_fingerprint="fp")
    assert again[:] == first[:]
    # Greedy answers do not depend on the seed: still cached.
    cfg.seed = 123
    generate_responses(tiny_model, tiny_tokenizer, records, cfg, eos_token_id=EOS, target_fingerprint="fp")

    # Anything that changes the answers must miss the cache.
    changes = [
        dict(max_response_tokens=MAX_NEW - 1), dict(response_temperature=0.5), dict(store_topk=2),
    ]
    for change in changes:
        changed = DataConfig(**{**cfg.__dict__, **change})
        with pytest.raises(AssertionError, match="generated again"):
            generate_responses(tiny_model, tiny_tokenizer, records, changed, eos_token_id=EOS, target_fingerprint="fp")
    with pytest.raises(AssertionError, match="generated again"):
        generate_responses(tiny_model, tiny_tokenizer, records, cfg, eos_token_id=EOS, target_fingerprint="other")
    with pytest.raises(AssertionError, match="generated again"):
        generate_responses(tiny_model, tiny_tokenizer, records[:-1], cfg, eos_token_id=EOS, target_fingerprint="fp")
    monkeypatch.setattr(tiny_model, "generate", real_generate)


def test_a_half_written_cache_is_never_used(tiny_model, tiny_tokenizer, cfg, monkeypatch):
    import datasets

    records = make_records()[:3]
    real_save = datasets.Dataset.save_to_disk

    def crash(self, path, *args, **kwargs):
        real_save(self, path, *args, **kwargs)
        raise KeyboardInterrupt  # killed after writing, before the rename

    monkeypatch.setattr(datasets.Dataset, "save_to_disk", crash)
    with pytest.raises(KeyboardInterrupt):
        generate_responses(tiny_model, tiny_tokenizer, records, cfg, eos_token_id=EOS, target_fingerprint="fp")
    # No dataset and no temp dir: only the answers' chunks, kept for the next run.
    (parts,) = Path(cfg.cache_dir).iterdir()
    assert parts.name.endswith(".parts") and sorted(p.name for p in parts.iterdir()) == ["chunk-000000.pt", "plan.json"]
    monkeypatch.setattr(datasets.Dataset, "save_to_disk", real_save)

    forbid_generate(tiny_model, monkeypatch)  # every chunk was written: nothing is generated again
    ds = generate_responses(tiny_model, tiny_tokenizer, records, cfg, eos_token_id=EOS, target_fingerprint="fp")
    assert len(ds) == 3 and not parts.exists()


def test_topk_is_the_targets_log_softmax_at_each_response_position(tiny_model, tiny_tokenizer, cfg):
    # Sampled answers at temperature 0.7; the stored distribution is still the raw temperature-1 one.
    cfg.store_topk, cfg.response_temperature, cfg.seed = 4, 0.7, 5
    records = make_records()
    ds = generate_responses(tiny_model, tiny_tokenizer, records, cfg, eos_token_id=EOS, target_fingerprint="fp")
    assert ds.column_names == ["prompt_ids", "response_ids", "topk_ids", "topk_logprobs"]
    for row in ds:
        prompt, response = row["prompt_ids"], row["response_ids"]
        ids, logprobs = torch.tensor(row["topk_ids"]), torch.tensor(row["topk_logprobs"], dtype=torch.float64)
        assert ids.shape == logprobs.shape == (len(response), 4)
        with torch.no_grad():
            logits = tiny_model(torch.tensor([prompt + response])).logits[0]
        # Response token j is predicted at position len(prompt) - 1 + j.
        ref = logits[len(prompt) - 1: len(prompt) - 1 + len(response)].log_softmax(-1)
        ref_values, ref_ids = ref.topk(4, dim=-1)
        assert torch.equal(ids, ref_ids)
        torch.testing.assert_close(logprobs, ref_values, rtol=1e-6, atol=1e-6)


def test_sampling_is_seeded(tiny_model, tiny_tokenizer, tmp_path):
    records = make_records()

    def run(seed, where):
        cfg = DataConfig(max_response_tokens=MAX_NEW, generation_batch_size=4, response_temperature=1.0,
                         seed=seed, cache_dir=str(tmp_path / where))
        ds = generate_responses(tiny_model, tiny_tokenizer, records, cfg, eos_token_id=EOS, target_fingerprint="fp")
        return ds["response_ids"]

    assert run(0, "a") == run(0, "b")
    assert run(0, "a") != run(1, "c")


def test_target_fingerprint_tracks_weights_and_path(make_tiny_model, tmp_path):
    build_model = make_tiny_model
    model = build_model(seed=1)
    fp = target_fingerprint(str(tmp_path), model)
    assert fp == target_fingerprint(str(tmp_path), build_model(seed=1))
    assert fp != target_fingerprint(str(tmp_path / "elsewhere"), model)
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight.add_(1e-3)
    assert fp != target_fingerprint(str(tmp_path), model)


def test_pipeline_keeps_heldout_prompts_out_of_the_training_data(tiny_model, tiny_tokenizer, tmp_path):
    rows = [{"id": i, "prompt": f"w{i} w{i + 1}"} for i in range(30)] + [{"id": "long", "prompt": " ".join(["w1"] * 40)}]
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = DataConfig(sources=[PromptSourceConfig(kind="jsonl", path=str(path))], heldout_fraction=0.3,
                     max_response_tokens=4, max_seq_len=32, generation_batch_size=8, cache_dir=str(tmp_path / "c"))
    with pytest.warns(UserWarning, match="dropped 1 training prompt"):
        data = prepare_distillation_data(cfg, tiny_model, tiny_tokenizer, target_path=str(tmp_path))
    held_ids = {tuple(encode_prompt(r, tiny_tokenizer)) for r in data.heldout}
    train_ids = {tuple(p) for p in data.train["prompt_ids"]}
    assert data.heldout and not held_ids & train_ids
    assert len(train_ids) + len(held_ids) == 30  # the 40-token prompt cannot fit max_seq_len

    cfg.sources = []
    with pytest.raises(UserError, match="sources is empty"):
        prepare_distillation_data(cfg, tiny_model, tiny_tokenizer, target_path=str(tmp_path))


def test_prompt_topk_is_the_targets_log_softmax_at_each_prompt_position(tiny_model, tiny_tokenizer, cfg):
    cfg.store_topk, cfg.prompt_loss_weight = 3, 0.5
    records = make_records()
    ds = generate_responses(tiny_model, tiny_tokenizer, records, cfg, eos_token_id=EOS, target_fingerprint="fp")
    assert {"prompt_topk_ids", "prompt_topk_logprobs"} <= set(ds.column_names)
    for row in ds:
        prompt = row["prompt_ids"]
        ids, logprobs = torch.tensor(row["prompt_topk_ids"]), torch.tensor(row["prompt_topk_logprobs"], dtype=torch.float64)
        assert len(row["prompt_topk_ids"]) == len(prompt) - 1
        if len(prompt) == 1:
            continue
        with torch.no_grad():  # each prompt alone, unpadded: the batched, left-padded forward must agree
            ref = tiny_model(torch.tensor([prompt])).logits[0, :-1].log_softmax(-1)
        ref_values, ref_ids = ref.topk(3, dim=-1)
        assert torch.equal(ids, ref_ids)
        torch.testing.assert_close(logprobs, ref_values, rtol=1e-6, atol=1e-6)
    # The prompt columns are part of the cache key: without them, the same settings are another entry.
    plain = DataConfig(max_response_tokens=MAX_NEW, generation_batch_size=3, cache_dir=cfg.cache_dir, store_topk=3)
    ds2 = generate_responses(tiny_model, tiny_tokenizer, records, plain, eos_token_id=EOS, target_fingerprint="fp")
    assert "prompt_topk_ids" not in ds2.column_names
