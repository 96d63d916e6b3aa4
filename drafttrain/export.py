"""Export a trained draft LM as a plain Hugging Face model directory (SPEC section 3).

The directory is all a user needs: `AutoModelForCausalLM.from_pretrained(dir)` loads it, the
tokenizer files are the target's own (speculative decoding needs token-for-token identical
vocabularies), `generation_config.json` stops at the target's EOS, and `README.md` says what the
draft is, how it was made and how much it speeds the target up.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import shlex
from pathlib import Path
from typing import Any

from .errors import UserError
from .fileio import atomic_dir

# Column headers for the usual acceptance-table keys; any other key is shown as it is.
COLUMN_LABELS = {
    "drafter": "drafter",
    "category": "category",
    "num_draft_tokens": "K",
    "temperature": "temperature",
    "tau": "τ (mean accepted length)",
    "mean_accepted_length": "τ (mean accepted length)",
    "acceptance_rate": "acceptance rate",
    "speedup": "speedup",
    "per_position_acceptance": "per-position acceptance",
}


@contextlib.contextmanager
def writing(what: Path):
    """A failed write of `what` (a full disk, a read-only file system) as one UserError line.
    safetensors reports such failures as its own SafetensorError, not as an OSError: both land
    here. Whatever was there before stays (the writers below replace directories atomically)."""
    from safetensors import SafetensorError

    try:
        yield
    except (OSError, SafetensorError) as e:
        reason = getattr(e, "strerror", None) or str(e).strip().splitlines()[0]
        raise UserError(f"writing {what} failed ({reason}); free disk space (or fix the file system) and start the "
                        "same command again: the run resumes from its newest checkpoint") from e


def save_tensor_dir(out_dir: str | os.PathLike, tensors: dict, config: dict, card: str,
                    record: dict | None = None) -> Path:
    """model.safetensors, config.json and README.md in `out_dir`, replacing it atomically: the
    layout of the Medusa and EAGLE-3 exports (serving engines' own formats); `record` becomes its
    `drafttrain.json`."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    tensors = {k: v.detach().to("cpu").contiguous().clone() for k, v in tensors.items()}
    with writing(out_dir), atomic_dir(out_dir, overwrite=True) as tmp:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        (tmp / "README.md").write_text(card)
        if record is not None:
            (tmp / RECORD).write_text(json.dumps(record, indent=2) + "\n")
    return out_dir


def read_export_config(path: Path, what: str, written_by: str, expected: str, redo: str) -> dict:
    """The config.json of an exported drafter directory, or one UserError line saying what is wrong
    (`what`: "Medusa heads directory"; `written_by`: the recipe; `expected`: what the directory
    holds; `redo`: how to fix a damaged file)."""
    if not path.is_dir():
        raise UserError(f"{what} {str(path)!r} does not exist; pass the directory written by {written_by} "
                        "(it holds config.json and model.safetensors)")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise UserError(f"{path} has no config.json; pass {expected}")
    try:
        cfg = json.loads(config_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{config_file} is not valid JSON ({e}); {redo}") from None
    if not isinstance(cfg, dict):
        raise UserError(f"{config_file} must hold a JSON object; {redo}")
    return cfg


RECORD = "drafttrain.json"  # beside an exported draft: what drafttrain measured of it (SPEC §7)


def held_out_record(metrics: dict, prompts: int) -> dict:
    """The draft's held-out acceptance as `drafttrain.json` keeps it: what `--num-draft-tokens auto`
    plans from when no calibration prompts are given (never the prompts being evaluated)."""
    return {"held_out": {"prompts": prompts, "num_draft_tokens": metrics["num_draft_tokens"], "tau": metrics["tau"],
                         "per_position_acceptance": list(metrics["per_position_acceptance"])}}


def export_draft(model, tokenizer, out_dir: str | os.PathLike, *, eos_token_id: int | list[int],
                 acceptance_table: list[dict] | None = None, base_info: dict | None = None,
                 record: dict | None = None) -> Path:
    """Write `model` + the *target's* `tokenizer` to `out_dir`, replacing it atomically; `record`
    (`held_out_record`) becomes its `drafttrain.json`."""
    eos = _check_eos(eos_token_id, model)
    rows = _embedding_rows(model)
    if rows is not None and len(tokenizer) > rows:
        raise UserError(f"the tokenizer has {len(tokenizer)} tokens but the draft's embedding has only {rows} "
                        "rows; export a draft built for this target's vocabulary")

    out_dir = Path(out_dir)
    with writing(out_dir), atomic_dir(out_dir, overwrite=True) as tmp:
        model.save_pretrained(tmp)
        _set_config_eos(tmp / "config.json", eos)

        generation_config = copy.deepcopy(model.generation_config)
        generation_config.eos_token_id = eos
        if getattr(tokenizer, "pad_token_id", None) is not None:
            generation_config.pad_token_id = tokenizer.pad_token_id
        generation_config.save_pretrained(tmp)

        tokenizer.save_pretrained(tmp)
        (tmp / "README.md").write_text(model_card(model, tokenizer, out_dir, acceptance_table, base_info))
        if record is not None:
            (tmp / RECORD).write_text(json.dumps(record, indent=2) + "\n")
    return out_dir


def render_acceptance_table(rows: list[dict] | None) -> str:
    """A markdown table with one row per dict; columns in order of first appearance ("" if no rows)."""
    if not rows:
        return ""
    columns: list[str] = []
    for row in rows:
        columns += [k for k in row if k not in columns]
    header = [_escape(COLUMN_LABELS.get(c, c)) for c in columns]
    lines = ["| " + " | ".join(header) + " |",
             "| " + " | ".join("---" if _is_text(c, rows) else "---:" for c in columns) + " |"]
    for row in rows:
        lines.append("| " + " | ".join(_format_cell(c, row.get(c)) for c in columns) + " |")
    return "\n".join(lines) + "\n"


def model_card(model, tokenizer, out_dir: Path, acceptance_table: list[dict] | None,
               base_info: dict | None) -> str:
    info = dict(base_info or {})
    target = str(info.get("target") or info.get("target_model") or "TARGET")
    cfg = model.config
    params = sum(p.numel() for p in model.parameters())
    layers = getattr(cfg, "num_hidden_layers", None)
    front = ["---", "library_name: transformers", "pipeline_tag: text-generation",
             "tags:", "- speculative-decoding", "- draft-model", "- drafttrain"]
    if target != "TARGET" and not Path(target).is_absolute():
        front.append(f"base_model: {json.dumps(target)}")
    front.append("---")

    size = f"{params / 1e6:.1f}M" if params >= 1e6 else f"{params:,}"
    made = [f"- **architecture**: {cfg.model_type}; decoder layers: {layers}; hidden size: "
            f"{getattr(cfg, 'hidden_size', '?')}; parameters: {size}; dtype: {str(model.dtype).removeprefix('torch.')}",
            f"- **tokenizer**: the target's own ({len(tokenizer)} tokens), copied unchanged"]
    made += [f"- **{_escape(str(k))}**: {_info_value(v)}" for k, v in info.items()]

    table = render_acceptance_table(acceptance_table)
    if table:
        acceptance = [table.rstrip("\n"), "",
                      "τ (mean accepted length) is the number of tokens emitted per target forward pass "
                      "(plain decoding: 1.0); acceptance rate is the fraction of proposed draft tokens the "
                      "target accepted; speedup is tokens/s against the target alone, measured in the same run."]
    else:
        acceptance = ["Not measured yet: run `drafttrain eval` (below) to measure it."]

    body = [
        f"# Draft model for {target}",
        "",
        f"A small language model that drafts tokens for speculative decoding with `{target}`. The "
        "target verifies every drafted token, so the text is exactly what the target alone would "
        "produce (greedy) or has the same distribution (sampling); the draft only changes how fast "
        "it comes. Made with drafttrain.",
        "",
        "## How it was made",
        "",
        *made,
        "",
        "## Acceptance",
        "",
        *acceptance,
        "",
        "## Use it",
        "",
        "With `transformers` (assisted generation):",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "",
        f"tokenizer = AutoTokenizer.from_pretrained({target!r})",
        f"target = AutoModelForCausalLM.from_pretrained({target!r})",
        f"draft = AutoModelForCausalLM.from_pretrained({str(out_dir)!r})",
        'inputs = tokenizer("def fibonacci(n):", return_tensors="pt")',
        "out = target.generate(**inputs, assistant_model=draft, max_new_tokens=128)",
        "print(tokenizer.decode(out[0], skip_special_tokens=True))",
        "```",
        "",
        "With drafttrain, to measure acceptance and speedup on your own prompts:",
        "",
        "```bash",
        f"drafttrain eval --target {shlex.quote(target)} --draft {shlex.quote(str(out_dir))} "
        "--prompts prompts.jsonl --out results/",
        "```",
        "",
    ]
    return "\n".join(front + [""] + body)


def _is_text(column: str, rows: list[dict]) -> bool:
    """Left-align columns of names, right-align columns of numbers."""
    return any(isinstance(row.get(column), str) for row in rows)


def _format_cell(column: str, value: Any) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return ", ".join(_format_cell(column, v) for v in value)
    if isinstance(value, float):
        if column == "speedup":
            return f"{value:.2f}×"
        if column in ("acceptance_rate", "per_position_acceptance"):
            return f"{value:.1%}"
        if column in ("tau", "mean_accepted_length"):
            return f"{value:.2f}"
        return f"{value:.3g}"
    return _escape(str(value))


def _escape(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _info_value(value: Any) -> str:
    return _escape(value if isinstance(value, str) else json.dumps(value, default=str))


def _embedding_rows(model) -> int | None:
    try:
        return model.get_input_embeddings().weight.shape[0]
    except (AttributeError, NotImplementedError):
        return None


def _check_eos(eos_token_id, model) -> int | list[int]:
    ids = eos_token_id if isinstance(eos_token_id, (list, tuple)) else [eos_token_id]
    vocab = _embedding_rows(model)
    if not ids or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise UserError(f"eos_token_id {eos_token_id!r} must be a token id or a list of them; "
                        "pass the target tokenizer's eos_token_id")
    if vocab is not None and max(ids) >= vocab:
        raise UserError(f"eos_token_id {eos_token_id!r} is outside the draft's vocabulary of {vocab}; "
                        "pass the target tokenizer's eos_token_id")
    return list(ids) if isinstance(eos_token_id, (list, tuple)) else ids[0]


def _set_config_eos(path: Path, eos) -> None:
    """config.json carries token ids too; keep them in step with generation_config.json."""
    data = json.loads(path.read_text())
    if "eos_token_id" in data:
        data["eos_token_id"] = eos
        path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
