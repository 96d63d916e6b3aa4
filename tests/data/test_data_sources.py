from __future__ import annotations

import json

import pytest
import torch

from drafttrain.config import from_dict
from drafttrain.data.config import DataConfig, PromptSourceConfig
from drafttrain.data.sampling import RowSampling
from drafttrain.data.sources import (
    PLAIN_ANSWER,
    PLAIN_QUESTION,
    extract_prompt,
    load_prompts_from_source,
    prompt_key,
    self_instruct_prompts,
    split_heldout,
    user_turn_prefix,
    write_prompts_jsonl,
)
from drafttrain.errors import UserError
from drafttrain.prompts import PromptRecord, encode_prompt, read_prompt_file

CHATML_USER_PREFIX = "<|im_start|>system\nYou are helpful .<|im_end|>\n<|im_start|>user\n"


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# --- jsonl and hf sources -----------------------------------------------------------------------

def test_jsonl_source_reuses_prompt_file_parsing(tmp_path, tiny_tokenizer):
    f = write_jsonl(tmp_path / "p.jsonl", [
        {"question_id": 7, "category": "math", "turns": ["w1 w2", "w3"]},
        {"task_id": "t1", "prompt": "w4 w5"},
        {"prompt": "w6"},
    ])
    src = PromptSourceConfig(kind="jsonl", path=str(f), num_prompts=2)
    records = load_prompts_from_source(src, tiny_tokenizer)
    assert records == read_prompt_file(f)[:2]
    assert [r.id for r in records] == [7, "t1"]
    assert records[0].messages == [{"role": "user", "content": "w1 w2"}]


def test_hf_source_from_local_json(tmp_path, tiny_tokenizer):
    f = write_jsonl(tmp_path / "d.jsonl", [
        {"q": "w1 w2", "category": "a"},
        {"q": "   ", "category": "a"},  # unusable: skipped with a warning
        {"q": "w3", "category": None},
        {"q": "w4 w5 w6", "category": "b"},
    ])
    src = PromptSourceConfig(kind="hf", path="json", data_files=str(f), column="q")
    with pytest.warns(UserWarning, match="skipped 1 row"):
        records = load_prompts_from_source(src, tiny_tokenizer)
    assert [r.messages for r in records] == [[{"role": "user", "content": t}] for t in ("w1 w2", "w3", "w4 w5 w6")]
    assert [r.category for r in records] == ["a", "default", "b"]
    # Through the chat template, exactly as a `turns` record of a prompt file would be.
    expected = tiny_tokenizer(tiny_tokenizer.apply_chat_template(
        [{"role": "user", "content": "w1 w2"}], tokenize=False, add_generation_prompt=True),
        add_special_tokens=False)["input_ids"]
    assert encode_prompt(records[0], tiny_tokenizer) == expected

    verbatim = PromptSourceConfig(kind="hf", path="json", data_files=str(f), column="q", chat_template=False,
                                  num_prompts=1)
    (record,) = load_prompts_from_source(verbatim, tiny_tokenizer)
    assert record.text == "w1 w2" and encode_prompt(record, tiny_tokenizer) == tiny_tokenizer("w1 w2")["input_ids"]


def test_hf_messages_are_cut_after_the_first_user_turn(tmp_path, tiny_tokenizer):
    convo = [{"role": "system", "content": "w9"}, {"role": "user", "content": "w1"},
             {"role": "assistant", "content": "w2"}, {"role": "user", "content": "w3"}]
    f = write_jsonl(tmp_path / "m.jsonl", [{"messages": convo}])
    src = PromptSourceConfig(kind="hf", path="json", data_files=str(f), column="messages")
    (record,) = load_prompts_from_source(src, tiny_tokenizer)
    assert record.messages == convo[:2]


def test_hf_missing_column_names_the_available_ones(tmp_path, tiny_tokenizer):
    f = write_jsonl(tmp_path / "d.jsonl", [{"question": "w1", "answer": "w2"}])
    src = PromptSourceConfig(kind="hf", path="json", data_files=str(f), column="prompt")
    with pytest.raises(UserError, match="no column 'prompt'; available columns: question, answer"):
        load_prompts_from_source(src, tiny_tokenizer)


def test_hf_missing_dataset_is_a_user_error(tmp_path, tiny_tokenizer):
    src = PromptSourceConfig(kind="hf", path="json", data_files=str(tmp_path / "nope.jsonl"))
    with pytest.raises(UserError, match="cannot load the dataset"):
        load_prompts_from_source(src, tiny_tokenizer)


def test_config_validation_and_sources_from_yaml_data(tmp_path):
    # Plain data (YAML) becomes typed sources through the config loader, which checks every key.
    cfg = from_dict(DataConfig, {"sources": [{"kind": "jsonl", "path": "x.jsonl"}], "cache_dir": str(tmp_path)})
    assert cfg.sources == [PromptSourceConfig(kind="jsonl", path="x.jsonl")]
    cfg.validate()
    with pytest.raises(UserError, match="unknown config key 'sources\[0\].pth'"):
        from_dict(DataConfig, {"sources": [{"kind": "jsonl", "pth": "x.jsonl"}]})
    with pytest.raises(UserError, match="needs `num_prompts`"):
        DataConfig(sources=[PromptSourceConfig(kind="self_instruct")]).validate()
    with pytest.raises(UserError, match="unknown prompt source kind"):
        PromptSourceConfig(kind="csv", path="x").validate()
    with pytest.raises(UserError, match="heldout_fraction"):
        DataConfig(heldout_fraction=1.5).validate()


def test_default_cache_dir_follows_drafttrain_home(tmp_path, monkeypatch):
    monkeypatch.setenv("DRAFTTRAIN_HOME", str(tmp_path))
    assert DataConfig().cache_dir == str(tmp_path / "data")


def test_every_config_field_is_documented():
    from dataclasses import fields

    for cls in (DataConfig, PromptSourceConfig):
        for f in fields(cls):
            assert f.metadata.get("doc"), f"{cls.__name__}.{f.name} has no doc"


# --- self-instruct ------------------------------------------------------------------------------

def test_user_turn_prefix_on_chatml(tiny_tokenizer):
    assert user_turn_prefix(tiny_tokenizer) == CHATML_USER_PREFIX


def test_user_turn_prefix_needs_a_template(tiny_tokenizer):
    import copy

    plain = copy.deepcopy(tiny_tokenizer)
    plain.chat_template = None
    with pytest.raises(UserError, match="no chat template"):
        user_turn_prefix(plain)


def test_extract_prompt_drops_truncated_and_short(tiny_tokenizer):
    w = tiny_tokenizer.convert_tokens_to_ids
    eos = [w("<|im_end|>")]
    assert extract_prompt([w("w1"), w("w2"), eos[0], 0, 0], eos, tiny_tokenizer, 2) == "w1 w2"
    assert extract_prompt([w("w1"), w("w2")], eos, tiny_tokenizer, 2) is None          # never ended
    assert extract_prompt([eos[0], w("w1")], eos, tiny_tokenizer, 1) is None            # empty
    assert extract_prompt([w("w1"), eos[0]], eos, tiny_tokenizer, 5) is None            # too short
    assert extract_prompt([w("<|im_start|>"), w("w10"), eos[0]], eos, tiny_tokenizer, 1) == "w10"


def test_self_instruct_prompts_are_unique_and_start_from_the_user_turn(chatty_model, tiny_tokenizer, monkeypatch):
    seen_inputs = []
    real_generate = chatty_model.generate

    def spy(*args, **kwargs):
        seen_inputs.append(kwargs["input_ids"])
        out = real_generate(*args, **kwargs)
        # The model only ever sees the start of a user turn; each row samples from its own seed, untruncated.
        (sampler,) = kwargs["logits_processor"]
        assert isinstance(sampler, RowSampling) and sampler.top_p == 1.0 and len(set(sampler.seeds.tolist())) == 8
        return out

    monkeypatch.setattr(chatty_model, "generate", spy)
    prompts = self_instruct_prompts(chatty_model, tiny_tokenizer, 5, max_prompt_tokens=24, seed=1,
                                    batch_size=8, min_chars=2)
    assert len(prompts) == 5
    assert all(p and p == p.strip() for p in prompts)
    assert len({" ".join(p.split()) for p in prompts}) == 5
    assert all("<|im_start|>" not in p and "<|im_end|>" not in p for p in prompts)
    prefix_ids = tiny_tokenizer(CHATML_USER_PREFIX, add_special_tokens=False)["input_ids"]
    assert all(x.tolist() == [prefix_ids] * 8 for x in seen_inputs)
    # Same seed, same prompts; the global RNG is left alone.
    state = torch.random.get_rng_state()
    again = self_instruct_prompts(chatty_model, tiny_tokenizer, 5, max_prompt_tokens=24, seed=1,
                                  batch_size=8, min_chars=2)
    assert again == prompts
    assert torch.equal(torch.random.get_rng_state(), state)


def test_self_instruct_warns_when_it_runs_out_of_attempts(chatty_model, tiny_tokenizer):
    with pytest.warns(UserWarning, match="only"):
        prompts = self_instruct_prompts(chatty_model, tiny_tokenizer, 50, max_prompt_tokens=4, seed=0,
                                        batch_size=4, min_chars=2, max_batches=2)
    assert len(prompts) < 50


def test_self_instruct_source_is_cached(chatty_model, tiny_tokenizer, tmp_path, monkeypatch):
    src = PromptSourceConfig(kind="self_instruct", num_prompts=3, max_prompt_tokens=24, min_prompt_chars=2)
    kwargs = dict(seed=2, batch_size=8, cache_dir=tmp_path, target_fingerprint="fp")
    records = load_prompts_from_source(src, tiny_tokenizer, chatty_model, **kwargs)
    assert len(records) == 3 and all(r.messages[0]["role"] == "user" for r in records)

    def fail(*a, **k):
        raise AssertionError("generated again despite the cache")

    monkeypatch.setattr(chatty_model, "generate", fail)
    assert load_prompts_from_source(src, tiny_tokenizer, chatty_model, **kwargs) == records
    with pytest.raises(UserError, match="needs the target model"):
        load_prompts_from_source(src, tiny_tokenizer, None)


@pytest.fixture
def base_tokenizer(tiny_tokenizer):
    """The tiny tokenizer as a base model's: no chat template."""
    import copy

    plain = copy.deepcopy(tiny_tokenizer)
    plain.chat_template = None
    return plain


class LineTokenizer:
    """Token i decodes to WORDS[i]: enough to write a newline, which the word-level tokenizer cannot."""
    WORDS = ["<eos>", "how", "do", "I", "sort", "?", "\n", "Answer"]

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(self.WORDS[i] for i in ids if not (skip_special_tokens and i == 0))


def test_a_base_models_prompt_ends_at_its_first_newline():
    tok, eos = LineTokenizer(), [0]
    assert extract_prompt([1, 2, 3, 4, 5, 6, 7, 1], eos, tok, 2, stop="\n") == "how do I sort ?"
    assert extract_prompt([1, 2, 3, 0, 6, 4], eos, tok, 2, stop="\n") == "how do I"   # EOS ends it too
    assert extract_prompt([1, 2, 3, 4], eos, tok, 2, stop="\n") is None                 # never ended
    assert extract_prompt([6, 1, 2, 6, 4], eos, tok, 1, stop="\n") == "how do"         # blank lines first: skipped
    assert extract_prompt([6, 1, 2], eos, tok, 1, stop="\n") is None                    # then never ended
    assert extract_prompt([6, 6, 0], eos, tok, 1, stop="\n") is None                    # empty


def test_self_instruct_on_a_base_model_writes_plain_questions(chatty_model, base_tokenizer, tmp_path, monkeypatch):
    """No chat template: the target continues PLAIN_QUESTION (after its special tokens), and each
    prompt becomes a plain question-and-answer text that encodes without a template."""
    seen_inputs = []
    real_generate = chatty_model.generate

    def spy(*args, **kwargs):
        seen_inputs.append(kwargs["input_ids"])
        return real_generate(*args, **kwargs)

    monkeypatch.setattr(chatty_model, "generate", spy)
    src = PromptSourceConfig(kind="self_instruct", num_prompts=3, max_prompt_tokens=24, min_prompt_chars=2)
    records = load_prompts_from_source(src, base_tokenizer, chatty_model, seed=1, batch_size=8,
                                       cache_dir=tmp_path, target_fingerprint="fp")
    assert len(records) == 3 and all(r.messages is None for r in records)
    assert all(r.text.startswith(PLAIN_QUESTION + " ") and r.text.endswith(PLAIN_ANSWER) for r in records)
    prefix = base_tokenizer(PLAIN_QUESTION)["input_ids"]
    assert seen_inputs and all(x.tolist() == [prefix] * 8 for x in seen_inputs)
    assert all(encode_prompt(r, base_tokenizer) for r in records)
    cached = json.loads(next(tmp_path.glob("self_instruct-*.json")).read_text())
    assert cached["settings"]["frame"] == PLAIN_QUESTION  # never mistaken for a chat model's prompts


# --- held-out split -----------------------------------------------------------------------------

def make_records(texts, source="s"):
    return [PromptRecord(id=i, category="default", source=f"{source}:{i}", text=t) for i, t in enumerate(texts)]


def test_heldout_prompts_never_reach_training():
    texts = [f"prompt {i % 150}" for i in range(300)]  # every prompt appears twice
    train, heldout = split_heldout(make_records(texts), fraction=0.2, seed=3)
    train_texts = {r.text for r in train}
    held_texts = [r.text for r in heldout]
    assert held_texts and not train_texts & set(held_texts)
    assert len(held_texts) == len(set(held_texts))  # one copy each
    assert train_texts | set(held_texts) == set(texts)
    assert 0.1 < len(held_texts) / 150 < 0.3


def test_heldout_split_is_stable_when_sources_are_added():
    first = make_records([f"a{i}" for i in range(200)])
    more = first + make_records([f"b{i}" for i in range(200)], source="t")
    _, held1 = split_heldout(first, fraction=0.1, seed=0)
    train2, held2 = split_heldout(more, fraction=0.1, seed=0)
    assert {r.text for r in held1} == {r.text for r in held2 if r.text.startswith("a")}
    # Same inputs, same split; another seed, another split.
    assert split_heldout(more, fraction=0.1, seed=0) == (train2, held2)
    assert split_heldout(more, fraction=0.1, seed=1)[1] != held2


def test_heldout_size_counts_distinct_prompts():
    records = make_records([f"p{i % 40}" for i in range(80)])
    train, heldout = split_heldout(records, size=7, seed=0)
    assert len(heldout) == 7
    assert len(train) == 80 - 14
    assert not {r.text for r in train} & {r.text for r in heldout}


def test_prompt_key_separates_verbatim_and_chat_prompts():
    a = PromptRecord(id=0, category="d", source="x", text="hi")
    b = PromptRecord(id=0, category="d", source="x", messages=[{"role": "user", "content": "hi"}])
    assert prompt_key(a) != prompt_key(b)


def test_write_prompts_jsonl_round_trips(tmp_path):
    records = make_records(["w1", "w2"]) + [
        PromptRecord(id="m", category="c", source="x", messages=[{"role": "user", "content": "w3"}])]
    write_prompts_jsonl(tmp_path / "held.jsonl", records)
    back = read_prompt_file(tmp_path / "held.jsonl")
    assert [(r.id, r.category, r.text, r.messages) for r in back] == \
        [(r.id, r.category, r.text, r.messages) for r in records]
