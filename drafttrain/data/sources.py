"""Where training prompts come from (prompt files, `datasets` datasets, or the target itself), and
the held-out split that keeps evaluation prompts out of training."""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import warnings
from pathlib import Path

import torch

from ..errors import UserError
from ..fileio import atomic_write_json, atomic_write_jsonl
from ..models import first_line
from ..prompts import ID_KEYS, PromptRecord, read_prompt_file
from ..tokens import eos_token_ids, left_pad, pad_token_id
from .config import PromptSourceConfig
from .ranks import SINGLE, Ranks
from .sampling import sampling_kwargs, seed_of

SENTINEL = "XXSENTINELXX"
SELF_INSTRUCT_BATCH = 32  # rows per batch where data.generation_batch_size is not set


def load_prompts_from_source(
    src: PromptSourceConfig,
    tokenizer,
    target_model=None,
    *,
    seed: int = 0,
    batch_size: int | None = None,
    cache_dir: str | Path | None = None,
    target_fingerprint: str | None = None,
    ranks: Ranks = SINGLE,
) -> list[PromptRecord]:
    """The first `src.num_prompts` records of one source. Self-instruct prompts are cached under
    `cache_dir` when both it and `target_fingerprint` are given (writing them costs generation time),
    and written by every rank of `ranks` together (collective)."""
    src.validate()
    if src.kind == "jsonl":
        records = read_prompt_file(src.path)
    elif src.kind == "hf":
        with ranks.main_first():  # the main process fills `datasets`' cache, the others read it
            records = _load_hf(src, tokenizer)
    else:
        if target_model is None:
            raise UserError("a self_instruct prompt source needs the target model; load it before the prompts")
        texts = _cached_self_instruct(src, target_model, tokenizer, seed, batch_size or SELF_INSTRUCT_BATCH,
                                      cache_dir, target_fingerprint, ranks)
        records = [self_instruct_record(i, t, tokenizer) for i, t in enumerate(texts)]
    return records[: src.num_prompts] if src.num_prompts is not None else records


# --- `datasets` sources -------------------------------------------------------------------------

def _load_hf(src: PromptSourceConfig, tokenizer) -> list[PromptRecord]:
    import datasets

    if src.chat_template and not has_chat_template(tokenizer):
        raise UserError(f"{src.path}: the target tokenizer has no chat template; "
                        "set chat_template: false to tokenize the prompts verbatim")
    try:
        ds = _open_hf_dataset(src)
    except (OSError, ValueError, datasets.exceptions.DatasetsError) as e:
        raise UserError(f"cannot load the dataset {src.path!r} ({first_line(e)}); "
                        "check path, name, split and data_files") from e
    if src.column not in ds.column_names:
        raise UserError(f"{src.path}: no column {src.column!r}; available columns: "
                        f"{', '.join(ds.column_names)}; set `column` to one of them")
    if src.num_prompts is not None:
        ds = ds.select(range(min(src.num_prompts, len(ds))))  # rows are skipped rarely; not worth over-reading
    id_key = next((k for k in ID_KEYS if k in ds.column_names), None)
    has_category = "category" in ds.column_names
    records, skipped = [], 0
    for index, row in enumerate(ds):
        where = f"{src.path}[{src.split}]:{index}"
        record = PromptRecord(
            id=row[id_key] if id_key else index,
            category=str(row["category"] or "default") if has_category else "default",
            source=where,
        )
        if not _fill_from_value(record, row[src.column], src.chat_template):
            skipped += 1
            continue
        records.append(record)
    if skipped:
        warnings.warn(f"{src.path}: skipped {skipped} row(s) whose {src.column!r} holds no usable prompt")
    if not records:
        raise UserError(f"{src.path}: column {src.column!r} holds no usable prompt; "
                        "it needs strings, lists of strings, or messages lists")
    return records


def _open_hf_dataset(src: PromptSourceConfig):
    import datasets

    local = Path(src.path)
    if local.is_dir() and ((local / "state.json").exists() or (local / "dataset_dict.json").exists()):
        ds = datasets.load_from_disk(str(local))  # written by save_to_disk; load_dataset cannot read it
        if isinstance(ds, datasets.DatasetDict):
            if src.split not in ds:
                raise UserError(f"{src.path}: no split {src.split!r} (slices are not supported for save_to_disk "
                                f"directories; use num_prompts); available splits: {', '.join(ds)}")
            ds = ds[src.split]
        return ds
    return datasets.load_dataset(src.path, src.name, split=src.split, data_files=src.data_files)


def _fill_from_value(record: PromptRecord, value, chat_template: bool) -> bool:
    """A string, a list of turns (the first is asked), or messages cut after the first user message
    (the target writes the reply; any later turns were someone else's answers)."""
    if isinstance(value, str):
        if not value.strip():
            return False
        if chat_template:
            record.messages = [{"role": "user", "content": value}]
        else:
            record.text = value
        return True
    if isinstance(value, list) and value and isinstance(value[0], str):
        if not value[0].strip():
            return False
        record.messages = [{"role": "user", "content": value[0]}]
        return True
    if isinstance(value, list) and value and all(isinstance(m, dict) and "role" in m and "content" in m
                                                 for m in value):
        for n, m in enumerate(value):
            if m["role"] == "user" and isinstance(m["content"], str) and m["content"].strip():
                record.messages = [{"role": x["role"], "content": x["content"]} for x in value[: n + 1]]
                return True
    return False


# --- self-instruct (Magpie) ---------------------------------------------------------------------

# A base model (a tokenizer without a chat template) is asked in plain text: fed PLAIN_QUESTION it
# writes a question, ended by a newline (base models rarely emit EOS that early), and a training
# prompt frames that question the same way and opens the answer, so the target answers it.
PLAIN_QUESTION, PLAIN_ANSWER = "Question:", "\nAnswer:"


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def self_instruct_record(i: int, text: str, tokenizer) -> PromptRecord:
    """A user message for an instruct model; for a base model the plain question-and-answer frame
    its question was written in (a record with messages would need the template it lacks)."""
    record = PromptRecord(id=f"self_instruct:{i}", category="self_instruct", source=f"self_instruct:{i}")
    if has_chat_template(tokenizer):
        record.messages = [{"role": "user", "content": text}]
    else:
        record.text = f"{PLAIN_QUESTION} {text}{PLAIN_ANSWER}"
    return record


def self_instruct_prefix(tokenizer) -> list[int]:
    """What the target is fed to write a prompt: the start of a user turn (chat template), else
    PLAIN_QUESTION with the tokenizer's own special tokens (Gemma's BOS), as any plain prompt gets."""
    if has_chat_template(tokenizer):
        return tokenizer(user_turn_prefix(tokenizer), add_special_tokens=False)["input_ids"]
    return tokenizer(PLAIN_QUESTION)["input_ids"]


def user_turn_prefix(tokenizer) -> str:
    """Everything the chat template renders before a user's words (system prompt, BOS, role header):
    an instruct model fed only this continues with a plausible user request (Magpie, Xu et al. 2024)."""
    if not has_chat_template(tokenizer):
        raise UserError("this target tokenizer has no chat template, so it has no user turn to start")
    text = tokenizer.apply_chat_template([{"role": "user", "content": SENTINEL}], tokenize=False,
                                         add_generation_prompt=False)
    cut = text.find(SENTINEL)
    if cut < 0:
        raise UserError("the chat template does not render the user's message verbatim, so the start of a "
                        "user turn cannot be found; use a jsonl or hf source")
    return text[:cut]


def self_instruct_prompts(
    model,
    tokenizer,
    n: int,
    *,
    temperature: float = 1.0,
    top_p: float = 1.0,
    max_prompt_tokens: int = 64,
    seed: int = 0,
    batch_size: int = 16,
    min_chars: int = 8,
    max_batches: int | None = None,
    ranks: Ranks = SINGLE,
) -> list[str]:
    """Up to `n` distinct prompts sampled from the model's own idea of a user turn (a base model's:
    of a question, see PLAIN_QUESTION): the first n distinct ones in row order, row r sampled from its own seed, so neither the batch size
    nor the number of ranks changes them (ranks write one batch each per round, collectively).
    Stops after `max_batches` batches (default: 4x what n needs, at least 10) and warns if short."""
    from tqdm.auto import tqdm

    if temperature <= 0:
        raise UserError(f"self_instruct needs temperature > 0 (got {temperature}); greedy gives one prompt")
    prefix = self_instruct_prefix(tokenizer)
    batch = _SelfInstructBatch(model, tokenizer, prefix, batch_size, temperature, top_p, max_prompt_tokens, seed,
                               min_chars)
    max_batches = max_batches or max(10, 4 * math.ceil(n / batch_size))
    prompts: list[str] = []
    seen: set[str] = set()
    with tqdm(total=n, desc="self-instruct prompts", unit="prompt", disable=not ranks.main) as bar:
        for first in range(0, max_batches, ranks.workers):
            j = first + ranks.share
            texts = batch(j) if j < max_batches else []
            gathered = ranks.all_gather(texts) if ranks.workers > 1 else [texts]  # batch order: rank order
            for text in itertools.chain.from_iterable(gathered):
                key = " ".join(text.split()) if text else ""
                if key and key not in seen and len(prompts) < n:
                    seen.add(key)
                    prompts.append(text)
                    bar.update(1)
            if len(prompts) >= n:
                break
    if len(prompts) < n:
        warnings.warn(f"self_instruct: only {len(prompts)} of {n} distinct prompts after {max_batches} batches; "
                      "raise temperature or max_prompt_tokens for more")
    return prompts


class _SelfInstructBatch:
    """Batch j of self-instruct rows: the prefix (`self_instruct_prefix`) continued, row r of the whole run (j *
    batch size + r) from its own seed; the extracted prompt of each row, or None."""

    def __init__(self, model, tokenizer, prefix, batch_size, temperature, top_p, max_prompt_tokens, seed, min_chars):
        self.model, self.tokenizer, self.prefix, self.rows = model, tokenizer, prefix, batch_size
        self.temperature, self.top_p, self.max_new, self.seed, self.min_chars = (
            temperature, top_p, max_prompt_tokens, seed, min_chars)
        self.eos_ids = eos_token_ids(tokenizer, model, required=True)
        self.stop = None if has_chat_template(tokenizer) else "\n"  # a base model's question ends its line
        self.pad_id = pad_token_id(tokenizer, model)
        device = next(model.parameters()).device
        self.input_ids, self.attention_mask = left_pad([prefix] * batch_size, self.pad_id, device)  # no padding

    @torch.inference_mode()
    def __call__(self, j: int) -> list[str | None]:
        seeds = [seed_of(self.seed, "self_instruct", j * self.rows + r) for r in range(self.rows)]
        out = self.model.generate(
            input_ids=self.input_ids, attention_mask=self.attention_mask, max_new_tokens=self.max_new,
            eos_token_id=self.eos_ids, pad_token_id=self.pad_id,
            **sampling_kwargs(seeds, len(self.prefix), self.temperature, self.top_p))
        return [extract_prompt(row, self.eos_ids, self.tokenizer, self.min_chars, self.stop)
                for row in out[:, len(self.prefix):].tolist()]


def extract_prompt(tokens: list[int], eos_ids: list[int], tokenizer, min_chars: int,
                   stop: str | None = None) -> str | None:
    """The user text before the end of turn (EOS, or the first `stop` string after any leading
    whitespace: Gemma-3 continues "Question:" with a blank line more often than not, and cut there
    7 rows in 8 were lost); None if the model never ended it (truncated) or it is too short."""
    eos = set(eos_ids)
    end = next((t for t, tok in enumerate(tokens) if tok in eos), None)
    text = tokenizer.decode(tokens[:end], skip_special_tokens=True).lstrip()  # a base model often opens with blank lines
    cut = text.find(stop) if stop else -1
    if cut >= 0:
        text = text[:cut]
    elif end is None:
        return None
    text = text.strip()
    return text if len(text) >= max(min_chars, 1) else None


def _cached_self_instruct(src, model, tokenizer, seed, batch_size, cache_dir, fingerprint, ranks: Ranks) -> list[str]:
    # "sampler": rows sampled from seeds of their own (data.sampling); before, one stream per run.
    settings = {"target": fingerprint, "n": src.num_prompts, "temperature": src.temperature, "top_p": src.top_p,
                "max_prompt_tokens": src.max_prompt_tokens, "min_chars": src.min_prompt_chars, "seed": seed,
                "sampler": "per-row"}
    if not has_chat_template(tokenizer):  # only here: the keys of prompts cached from chat templates stay as they were
        settings["frame"] = PLAIN_QUESTION
    path = None
    if cache_dir is not None and fingerprint is not None:
        key = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()
        path = Path(cache_dir) / f"self_instruct-{key}.json"
        cached = ranks.broadcast(json.loads(path.read_text())["prompts"] if ranks.main and path.is_file() else None)
        if cached is not None:
            return cached
    prompts = self_instruct_prompts(
        model, tokenizer, src.num_prompts, temperature=src.temperature, top_p=src.top_p,
        max_prompt_tokens=src.max_prompt_tokens, seed=seed, batch_size=batch_size, min_chars=src.min_prompt_chars,
        ranks=ranks,
    )
    if path is not None and ranks.main:
        atomic_write_json(path, {"settings": settings, "prompts": prompts})
    return prompts


# --- held-out split -----------------------------------------------------------------------------

def prompt_key(record: PromptRecord) -> str:
    if record.text is not None:
        return "prompt\0" + record.text
    return "messages\0" + json.dumps(record.messages, sort_keys=True, ensure_ascii=False)


def _unit_hash(key: str, seed: int) -> float:
    digest = hashlib.sha256(f"{seed}\0{key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def split_heldout(
    records: list[PromptRecord], *, fraction: float = 0.1, size: int | None = None, seed: int = 0
) -> tuple[list[PromptRecord], list[PromptRecord]]:
    """(train, heldout). Each distinct prompt is placed by a hash of its content, so adding a source
    does not move other prompts (exactly so with `fraction`; with `size`, only at the boundary), and
    every copy of a held-out prompt stays out of training. Held-out keeps one copy of each prompt."""
    keys = [prompt_key(r) for r in records]
    score = {k: _unit_hash(k, seed) for k in set(keys)}
    if size is not None:
        held = set(sorted(score, key=lambda k: (score[k], k))[:size])
    else:
        held = {k for k, s in score.items() if s < fraction}
    train, heldout, taken = [], [], set()
    for record, key in zip(records, keys):
        if key not in held:
            train.append(record)
        elif key not in taken:
            taken.add(key)
            heldout.append(record)
    return train, heldout


def write_prompts_jsonl(path: str | Path, records: list[PromptRecord]) -> None:
    """Records as a SPEC section 1 prompt file, e.g. the held-out set for `drafttrain eval --prompts`."""
    rows = []
    for r in records:
        row = {"id": r.id, "category": r.category}
        row |= {"prompt": r.text} if r.text is not None else {"messages": r.messages}
        rows.append(row)
    atomic_write_jsonl(path, rows)
