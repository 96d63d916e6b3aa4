"""Prompt files (SPEC §1): JSONL records -> token ids, with `error: FILE:LINE` for bad records."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from .errors import UserError

ID_KEYS = ("id", "question_id", "task_id")


@dataclass
class PromptRecord:
    id: str | int
    category: str
    source: str                      # "FILE:LINE", for error messages
    text: str | None = None          # `prompt`: tokenized verbatim
    messages: list[dict] | None = None  # `turns` / `messages`: through the chat template


def read_prompt_file(path: str | Path, flag: str = "--prompts") -> list[PromptRecord]:
    """The records of one prompt file; `flag` is the option that named it, so a missing file's
    error names the flag the user has to fix."""
    path = Path(path)
    if path.is_dir():  # "not found" would send the user looking for a path that is there
        raise UserError(f"{path}: is a directory, not a prompt file; pass a JSONL file to {flag}")
    if not path.is_file():
        raise UserError(f"{path}: prompt file not found; pass an existing JSONL file to {flag}")
    records = []
    try:
        lines = path.read_text(encoding="utf-8").split("\n")  # not splitlines(): JSON strings may hold U+2028
    except UnicodeDecodeError as e:
        raise UserError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start}); pass an uncompressed JSONL file") from e
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"{where}: not valid JSON ({e.msg}); write one JSON object per line") from e
        if not isinstance(obj, dict):
            raise UserError(f"{where}: expected a JSON object, got {type(obj).__name__}")
        records.append(_parse_record(obj, where, default_id=lineno - 1))
    if not records:
        raise UserError(f"{path}: the prompt file is empty; add JSONL lines with a \"prompt\", \"turns\" or \"messages\" field")
    return records


def _parse_record(obj: dict, where: str, default_id: int) -> PromptRecord:
    category = obj.get("category") or "default"
    record = PromptRecord(id=_record_id(obj, where, default_id), category=str(category), source=where)
    usable = _usable_fields(obj)
    if len(usable) > 1:
        raise UserError(f"{where}: both {' and '.join(repr(k) for k in usable)} give a prompt, and exactly one of "
                        "\"prompt\", \"turns\" or \"messages\" must; keep only the one to send")
    if not usable:
        raise UserError(
            f"{where}: no usable prompt; give a non-empty \"prompt\" string, a \"turns\" list of strings, "
            "or a \"messages\" list of {\"role\", \"content\"}"
        )
    prompt, turns, messages = obj.get("prompt"), obj.get("turns"), obj.get("messages")
    if usable == ["prompt"]:
        record.text = prompt
    elif usable == ["turns"]:
        record.messages = [{"role": "user", "content": turns[0]}]
    else:
        record.messages = [{"role": m["role"], "content": m["content"]} for m in messages]
    return record


def _usable_fields(obj: dict) -> list[str]:
    """Which of prompt / turns / messages hold a prompt: SPEC §1 wants exactly one, so a record
    never silently sends one while the user meant another."""
    prompt, turns, messages = obj.get("prompt"), obj.get("turns"), obj.get("messages")
    usable = {
        "prompt": isinstance(prompt, str) and bool(prompt),
        "turns": isinstance(turns, list) and bool(turns) and isinstance(turns[0], str) and bool(turns[0]),
        "messages": isinstance(messages, list) and bool(messages) and all(
            isinstance(m, dict) and "role" in m and "content" in m for m in messages),
    }
    return [k for k, ok in usable.items() if ok]


def _record_id(obj: dict, where: str, default_id: int) -> str | int | float:
    """The record's id (SPEC §1). Reports write it into JSON and replay matches outputs by it, so it
    must be a string or a finite number: NaN or infinity is not JSON, a list or object no key."""
    key = next((k for k in ID_KEYS if k in obj), None)
    if key is None:
        return default_id
    pid = obj[key]
    finite_number = isinstance(pid, (int, float)) and not isinstance(pid, bool) and math.isfinite(pid)
    if not (isinstance(pid, str) or finite_number):
        raise UserError(f"{where}: \"{key}\" is {json.dumps(pid)}, not a usable id; give a string or a finite "
                        "number")
    return pid


def read_prompts(paths: list[str | Path], limit: int | None = None, flag: str = "--prompts") -> list[PromptRecord]:
    """All records of all files in order; `limit` applies per file, so each file is sampled."""
    out: list[PromptRecord] = []
    for path in paths:
        records = read_prompt_file(path, flag)
        out.extend(records[:limit] if limit else records)
    return out


def require_unique_ids(records: list[PromptRecord]) -> None:
    """Reports key every output by its prompt's id and `replay` matches outputs back by it, so two
    prompts under one id would make a report whose outputs no later step can tell apart."""
    seen: dict[str, PromptRecord] = {}
    for r in records:
        first = seen.setdefault(str(r.id), r)
        if first is not r:
            raise UserError(f"{r.source}: prompt id {r.id!r} is already the id of {first.source} (a line without an "
                            "id takes its 0-based line number); give every prompt its own \"id\"")


def prompt_content(record: PromptRecord) -> str:
    """What a record sends, for telling two prompts apart by content rather than by file or id."""
    return record.text if record.text is not None else json.dumps(record.messages, sort_keys=True)


def encode_prompt(record: PromptRecord, tokenizer) -> list[int]:
    if record.text is not None:
        ids = tokenizer(record.text)["input_ids"]
    else:
        if not getattr(tokenizer, "chat_template", None):
            raise UserError(
                f"{record.source}: this record needs a chat template but the target tokenizer has none; "
                "use a \"prompt\" field instead"
            )
        text = tokenizer.apply_chat_template(record.messages, tokenize=False, add_generation_prompt=True)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if not ids:
        raise UserError(f"{record.source}: the prompt encodes to zero tokens; give a non-empty prompt")
    return list(ids)


@dataclass
class EncodedPrompt:
    """A prompt ready for decoding: its id and category (for reports) and its token ids."""

    id: str | int
    category: str
    ids: list[int]


def encode_prompts(records: list[PromptRecord], tokenizer, *, max_new_tokens: int, context_limit: int | None,
                   on_too_long: str = "error", max_prompts: int | None = None) -> list[EncodedPrompt]:
    """Encode records whose prompt plus `max_new_tokens` fits `context_limit` (None: no limit).

    A prompt that does not fit is an error (`on_too_long="error"`: evaluation must decode every
    prompt it was given) or is left out (`"skip"`: a recipe's held-out set just needs enough).
    `max_prompts` stops after that many prompts are kept. The list may be empty with `"skip"`.
    """
    if on_too_long not in ("error", "skip"):
        raise ValueError(f"on_too_long must be 'error' or 'skip', got {on_too_long!r}")
    out: list[EncodedPrompt] = []
    for r in records:
        if max_prompts is not None and len(out) >= max_prompts:
            break
        ids = encode_prompt(r, tokenizer)
        if context_limit is not None and len(ids) + max_new_tokens > context_limit:
            if on_too_long == "skip":
                continue
            raise UserError(
                f"{r.source}: prompt of {len(ids)} tokens plus --max-new-tokens {max_new_tokens} exceeds the "
                f"target's context of {context_limit} tokens; shorten the prompt or lower --max-new-tokens")
        out.append(EncodedPrompt(r.id, r.category, ids))
    return out
