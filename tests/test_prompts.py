"""Prompt files (SPEC §1): ids, categories, the three prompt forms, and `FILE:LINE` errors.

The tiny word-level tokenizer maps `w{i}` to id i, the specials `<unk>`, `<|im_start|>`,
`<|im_end|>` to 0, 1, 2, and any other word to `<unk>`, so expected ids are written by hand.
"""

import json

import pytest
from tiny import tiny_tokenizer

from drafttrain.errors import UserError
from drafttrain.prompts import EncodedPrompt, encode_prompt, encode_prompts, read_prompt_file, read_prompts

START, END, UNK = 1, 2, 0


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def plain_tok():
    return tiny_tokenizer(chat_template=False)


def write(path, lines):
    path.write_text("".join((l if isinstance(l, str) else json.dumps(l)) + "\n" for l in lines))
    return path


@pytest.mark.parametrize("record, expected", [
    ({"id": "a", "question_id": 1, "task_id": "t", "prompt": "w5"}, "a"),
    ({"task_id": "t", "question_id": 1, "prompt": "w5"}, 1),
    ({"task_id": "HumanEval/3", "prompt": "w5"}, "HumanEval/3"),
    ({"prompt": "w5"}, 1),  # no id field: the 0-based line number (the file's second line)
])
def test_id_precedence(tmp_path, record, expected):
    path = write(tmp_path / "p.jsonl", [{"id": "first", "prompt": "w4"}, record])
    assert [r.id for r in read_prompt_file(path)] == ["first", expected]


def test_blank_lines_skipped_and_line_numbers_kept(tmp_path):
    path = write(tmp_path / "p.jsonl", ["", {"prompt": "w4"}, "   ", "\t", {"prompt": "w5", "category": "code"}, ""])
    records = read_prompt_file(path)
    assert [r.id for r in records] == [1, 4]
    assert [r.category for r in records] == ["default", "code"]
    assert [r.source for r in records] == [f"{path}:2", f"{path}:5"]


def test_line_separators_inside_strings_do_not_split_records(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "w5\u2028w6\x85w7"}, ensure_ascii=False) + "\r\n"
                    + json.dumps({"prompt": "w8"}) + "\r\n", encoding="utf-8")
    records = read_prompt_file(path)
    assert [r.text for r in records] == ["w5\u2028w6\x85w7", "w8"]
    assert [r.id for r in records] == [0, 1]


def test_prompt_is_tokenized_verbatim(tmp_path, tok):
    (r,) = read_prompt_file(write(tmp_path / "p.jsonl", [{"prompt": "w5 w9 hello w13"}]))
    assert encode_prompt(r, tok) == [5, 9, UNK, 13]


def test_turns_send_the_first_turn_through_the_chat_template(tmp_path, tok):
    (r,) = read_prompt_file(write(tmp_path / "p.jsonl", [{"turns": ["w6 w7", "w8 w9"]}]))
    # "<|im_start|>user w6 w7<|im_end|><|im_start|>assistant "
    assert encode_prompt(r, tok) == [START, UNK, 6, 7, END, START, UNK]


def test_messages_go_through_the_chat_template(tmp_path, tok):
    msgs = [{"role": "system", "content": "w5"}, {"role": "user", "content": "w6 w7"}]
    (r,) = read_prompt_file(write(tmp_path / "p.jsonl", [{"messages": msgs}]))
    assert encode_prompt(r, tok) == [START, UNK, 5, END, START, UNK, 6, 7, END, START, UNK]


def test_humaneval_and_specbench_lines(tmp_path, tok):
    humaneval = {"task_id": "HumanEval/0", "prompt": "w10 w11\n    w12\n", "entry_point": "f",
                 "canonical_solution": "w13", "test": "w14"}
    specbench = {"question_id": 81, "category": "writing", "turns": ["w20 w21", "w22"]}
    path = write(tmp_path / "mixed.jsonl", [humaneval, specbench])
    he, sb = read_prompt_file(path)
    assert (he.id, he.category, encode_prompt(he, tok)) == ("HumanEval/0", "default", [10, 11, 12])
    assert (sb.id, sb.category, encode_prompt(sb, tok)) == (81, "writing", [START, UNK, 20, 21, END, START, UNK])


def test_read_prompts_keeps_file_order_and_limits_each_file(tmp_path):
    a = write(tmp_path / "a.jsonl", [{"id": f"a{i}", "prompt": "w5"} for i in range(3)])
    b = write(tmp_path / "b.jsonl", [{"id": f"b{i}", "prompt": "w5"} for i in range(2)])
    assert [r.id for r in read_prompts([a, b])] == ["a0", "a1", "a2", "b0", "b1"]
    assert [r.id for r in read_prompts([a, b], limit=2)] == ["a0", "a1", "b0", "b1"]
    assert [r.id for r in read_prompts([b, a], limit=1)] == ["b0", "a0"]


def error(fn, *args) -> str:
    with pytest.raises(UserError) as e:
        fn(*args)
    message = str(e.value)
    assert "\n" not in message
    return message


def test_missing_file(tmp_path):
    assert "not found" in error(read_prompt_file, tmp_path / "nope.jsonl")


def test_a_directory_says_it_is_one(tmp_path):
    """Issue 40 (G): "not found" sent the user looking for a path that is there."""
    message = error(read_prompt_file, tmp_path, "--prompts")
    assert message == f"{tmp_path}: is a directory, not a prompt file; pass a JSONL file to --prompts"


@pytest.mark.parametrize("lines", [[], [""], ["", "  ", ""]])
def test_empty_file(tmp_path, lines):
    path = write(tmp_path / "p.jsonl", lines)
    assert "empty" in error(read_prompt_file, path)


def test_binary_file(tmp_path):
    path = tmp_path / "p.jsonl.gz"
    path.write_bytes(b"\x1f\x8b\x08\x00\xff\xfe binary")
    message = error(read_prompt_file, path)
    assert str(path) in message and "UTF-8" in message


def test_invalid_json_names_file_and_line(tmp_path):
    path = write(tmp_path / "p.jsonl", [{"prompt": "w5"}, "", '{"prompt": "w5"'])
    message = error(read_prompt_file, path)
    assert f"{path}:3" in message and "JSON" in message


def test_non_object_line(tmp_path):
    path = write(tmp_path / "p.jsonl", ['["w5"]'])
    assert f"{path}:1" in error(read_prompt_file, path)


@pytest.mark.parametrize("record", [
    {"id": 3, "text": "w5"},
    {"prompt": ""},
    {"prompt": ["w5"]},
    {"turns": []},
    {"turns": [7]},
    {"messages": []},
    {"messages": [{"role": "user"}]},
])
def test_record_without_a_usable_prompt(tmp_path, record):
    path = write(tmp_path / "p.jsonl", [{"prompt": "w5"}, record])
    message = error(read_prompt_file, path)
    assert f"{path}:2" in message
    assert all(word in message for word in ("prompt", "turns", "messages"))


def test_chat_record_without_chat_template(tmp_path, plain_tok):
    path = write(tmp_path / "p.jsonl", [{"prompt": "w5"}, {"turns": ["w5"]}])
    plain, chat = read_prompt_file(path)
    assert encode_prompt(plain, plain_tok) == [5]
    message = error(encode_prompt, chat, plain_tok)
    assert f"{path}:2" in message and "chat template" in message


def test_prompt_that_encodes_to_nothing(tmp_path, tok):
    (r,) = read_prompt_file(write(tmp_path / "p.jsonl", [{"prompt": "   "}]))
    assert f"{r.source}" in error(encode_prompt, r, tok)


def test_shipped_smoke_prompt_set_loads():
    from pathlib import Path

    from drafttrain.prompts import read_prompt_file

    records = read_prompt_file(Path(__file__).resolve().parents[1] / "eval" / "prompts" / "smoke.jsonl")
    assert [r.id for r in records] == ["code-1", "code-2", 1, "chat-2"]
    assert [r.category for r in records] == ["code", "code", "chat", "chat"]
    assert records[0].text.startswith("def fibonacci") and records[2].messages[0]["role"] == "user"
    assert records[3].messages[0] == {"role": "system", "content": "You are concise."}


def test_encode_prompts_keeps_ids_and_categories(tmp_path, tok):
    path = write(tmp_path / "p.jsonl", [{"id": "a", "prompt": "w5 w6", "category": "code"}, {"turns": ["w7"]}])
    prompts = encode_prompts(read_prompt_file(path), tok, max_new_tokens=4, context_limit=None)
    assert prompts == [EncodedPrompt("a", "code", [5, 6]), EncodedPrompt(1, "default", [START, UNK, 7, END, START, UNK])]


def test_encode_prompts_too_long_is_an_error_or_skipped(tmp_path, tok):
    path = write(tmp_path / "p.jsonl", [{"id": "short", "prompt": "w5 w6"}, {"id": "long", "prompt": "w5 w6 w7 w8"},
                                        {"id": "s2", "prompt": "w9"}])
    records = read_prompt_file(path)
    # 2 + 6 = 8 fits a context of 8; 4 + 6 does not
    message = error(lambda: encode_prompts(records, tok, max_new_tokens=6, context_limit=8))
    assert message.startswith(f"{path}:2: prompt of 4 tokens plus --max-new-tokens 6 exceeds the target's context of 8")
    kept = encode_prompts(records, tok, max_new_tokens=6, context_limit=8, on_too_long="skip")
    assert [p.id for p in kept] == ["short", "s2"]
    assert [p.id for p in encode_prompts(records, tok, max_new_tokens=6, context_limit=8, on_too_long="skip",
                                         max_prompts=1)] == ["short"]
    assert encode_prompts(records, tok, max_new_tokens=60, context_limit=8, on_too_long="skip") == []
    with pytest.raises(ValueError):
        encode_prompts(records, tok, max_new_tokens=6, context_limit=8, on_too_long="truncate")


@pytest.mark.parametrize("record, fields", [
    ({"prompt": "w5", "turns": ["w6"]}, ("prompt", "turns")),
    ({"prompt": "w5", "messages": [{"role": "user", "content": "w6"}]}, ("prompt", "messages")),
    ({"turns": ["w5"], "messages": [{"role": "user", "content": "w6"}]}, ("turns", "messages")),
])
def test_record_with_two_usable_prompts_is_an_error(tmp_path, record, fields):
    """SPEC §1: exactly one of prompt / turns / messages must be usable; two is ambiguous."""
    path = write(tmp_path / "p.jsonl", [{"prompt": "w5"}, record])
    message = error(read_prompt_file, path)
    assert f"{path}:2" in message and all(f in message for f in fields)


def test_an_unusable_second_field_does_not_count(tmp_path):
    path = write(tmp_path / "p.jsonl", [{"prompt": "w5", "turns": []}, {"prompt": "", "turns": ["w6"]}])
    first, second = read_prompt_file(path)
    assert first.text == "w5" and second.messages == [{"role": "user", "content": "w6"}]


@pytest.mark.parametrize("line", ['{"id": NaN, "prompt": "w5"}', '{"id": Infinity, "prompt": "w5"}',
                                  '{"question_id": -Infinity, "prompt": "w5"}', '{"id": [1], "prompt": "w5"}',
                                  '{"id": {"a": 1}, "prompt": "w5"}', '{"id": true, "prompt": "w5"}',
                                  '{"task_id": null, "prompt": "w5"}'])
def test_an_id_that_is_not_a_finite_scalar_is_an_error(tmp_path, line):
    """An id goes into outputs.jsonl: NaN there is not JSON, and replay matches prompts by id."""
    path = write(tmp_path / "p.jsonl", [{"prompt": "w5"}, line])
    message = error(read_prompt_file, path)
    assert f"{path}:2" in message and "id" in message


def test_finite_numeric_ids_are_kept(tmp_path):
    path = write(tmp_path / "p.jsonl", [{"id": 1.5, "prompt": "w5"}, {"id": -3, "prompt": "w5"}])
    assert [r.id for r in read_prompt_file(path)] == [1.5, -3]
