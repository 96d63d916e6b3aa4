"""Export a trained draft LM as a plain Hugging Face model directory (SPEC section 3).

The directory is all a user needs: `AutoModelForCausalLM.from_pretrained(dir)` loads it, the
tokenizer files are the target's own (speculative decoding needs token-for-token identical
vocabularies), `generation_config.json` stops at the target's EOS, and `README.md` says what the
draft is, how it was made and how much it speeds the target up.

Below it, what the exports in serving engines' own formats share (Medusa heads, the feature drafts
in `kinds/<name>/export.py`): the atomic tensor-directory write, reading config.json, the fields a
feature draft's decoder layers write and their strict reading (every malformed field or weight one
`UserError` line naming the file and the fix), and the model card's acceptance section.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import shlex
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import UserError
from .fileio import atomic_dir

if TYPE_CHECKING:
    import torch

WEIGHTS_NAME = "model.safetensors"  # the tensors of a Medusa, EAGLE-3 or DFlash export

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
                    record: dict | None = None, extra_files: dict[str, bytes] | None = None) -> Path:
    """model.safetensors, config.json and README.md in `out_dir`, replacing it atomically: the
    layout of the Medusa, EAGLE-3 and DFlash exports (serving engines' own formats); `record`
    becomes its `drafttrain.json`; `extra_files` (name -> bytes) are written beside them, inside the
    same atomic write (DFlash's `mask_embedding.pt`)."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    tensors = {k: v.detach().to("cpu").contiguous().clone() for k, v in tensors.items()}
    with writing(out_dir), atomic_dir(out_dir, overwrite=True) as tmp:
        save_file(tensors, str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        (tmp / "README.md").write_text(card)
        if record is not None:
            (tmp / RECORD).write_text(json.dumps(record, indent=2) + "\n")
        for name, data in (extra_files or {}).items():
            (tmp / name).write_bytes(data)
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


# --- writing and reading a feature draft's config.json and tensors (EAGLE-3, DFlash) -------------
# Each malformed field or weight is one UserError line naming the file, the field and the fix: a
# bad value otherwise failed deep inside torch or transformers, or loaded a draft that drafts nothing.

DTYPE_NAMES = {"torch.float32": "float32", "torch.float16": "float16", "torch.bfloat16": "bfloat16",
               "torch.float64": "float64"}


def dtype_name(dtype) -> str:
    """config.json's `torch_dtype` of a torch dtype ("bfloat16")."""
    return DTYPE_NAMES.get(str(dtype), str(dtype).removeprefix("torch."))


def rope_config(rope_parameters: dict) -> dict:
    """The rotary settings as transformers 5's `rope_parameters` and as the older `rope_theta` /
    `rope_scaling`, which transformers 4 (and engines on it) read."""
    rope = dict(rope_parameters)
    legacy_scaling = None if rope.get("rope_type", "default") == "default" else \
        {k: v for k, v in rope.items() if k != "rope_theta"}
    return {"rope_parameters": rope, "rope_theta": rope.get("rope_theta", 10000.0), "rope_scaling": legacy_scaling}


def decoder_config_fields(config, dtype) -> dict:
    """The config.json fields a feature draft's decoder layers share with a Llama's or Qwen3's (`config`:
    the draft's config): sizes, rotary settings, no biases, no tied head (an engine would otherwise
    reuse the embedding as the LM head), the weights' dtype."""
    weights_dtype = dtype_name(dtype)
    return {
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "hidden_act": config.hidden_act,
        "rms_norm_eps": config.rms_norm_eps,
        "vocab_size": config.vocab_size,
        "target_hidden_size": config.target_hidden_size,
        "max_position_embeddings": config.max_position_embeddings,
        **rope_config(config.rope_parameters),
        "tie_word_embeddings": False,
        "attention_bias": False,
        "initializer_range": config.initializer_range,
        "torch_dtype": weights_dtype,
        "dtype": weights_dtype,
    }


def config_int(cfg: dict, key: str, where: Path) -> int:
    value = cfg.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise UserError(f"{where}: {key} must be a positive integer, got {value!r}; re-export the draft")
    return value


def optional_config_int(cfg: dict, key: str, default, where: Path) -> int:
    """A positive integer field that may be left out (or null): `default` then."""
    return default if cfg.get(key) is None else config_int(cfg, key, where)


def positive_number(cfg: dict, key: str, default: float, where: Path) -> float:
    value = cfg.get(key, default)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value < math.inf:
        raise UserError(f"{where}: {key} must be a positive number, got {value!r}; re-export the draft")
    return value


def hidden_act(cfg: dict, where: Path) -> str:
    from transformers.activations import ACT2FN

    value = cfg.get("hidden_act", "silu")
    if not isinstance(value, str) or value not in ACT2FN:
        raise UserError(f"{where}: hidden_act {value!r} is not an activation transformers knows (e.g. silu, gelu); "
                        "re-export the draft")
    return value


def rope_parameters(cfg: dict, where: Path) -> dict:
    """transformers 5's rope_parameters, else the older rope_theta + rope_scaling, checked: the
    rotary embedding is built from them, and a bad one failed deep inside transformers."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = cfg.get("rope_scaling") or {}
    rope = cfg.get("rope_parameters") or {"rope_type": "default", "rope_theta": cfg.get("rope_theta", 10000.0),
                                          **(scaling if isinstance(scaling, dict) else {"rope_scaling": scaling})}
    if not isinstance(rope, dict):
        raise UserError(f"{where}: rope_parameters must be a JSON object, got {rope!r}; re-export the draft")
    if "rope_scaling" in rope:
        raise UserError(f"{where}: rope_scaling must be a JSON object, got {rope['rope_scaling']!r}; re-export the "
                        "draft")
    rope = dict(rope)
    if "type" in rope and "rope_type" not in rope:  # transformers 4's key
        rope["rope_type"] = rope.pop("type")
    known = ("default", *ROPE_INIT_FUNCTIONS)
    if rope.get("rope_type", "default") not in known:
        raise UserError(f"{where}: rope type {rope.get('rope_type')!r} is unknown; use one of {', '.join(known)}, "
                        "or re-export the draft")
    positive_number(rope, "rope_theta", 10000.0, where)
    return rope


def vocab_sizes(cfg: dict, where: Path) -> tuple[int, int]:
    """(the target's vocabulary size, the draft's): a draft vocabulary is part of the target's."""
    vocab = config_int(cfg, "vocab_size", where)
    draft_vocab = optional_config_int(cfg, "draft_vocab_size", vocab, where)
    if draft_vocab > vocab:
        raise UserError(f"{where}: draft_vocab_size {draft_vocab} exceeds vocab_size {vocab} (the target's); "
                        "re-export the draft")
    return vocab, draft_vocab


def target_num_layers(cfg: dict, where: Path, target_config) -> int:
    """The target's layer count, from drafttrain's own record in config.json, else from the target."""
    ours = cfg.get("drafttrain")
    if ours is not None and not isinstance(ours, dict):
        raise UserError(f"{where}: drafttrain must be a JSON object, got {ours!r}; re-export the draft")
    layers = optional_config_int(ours or {}, "target_num_layers", getattr(target_config, "num_hidden_layers", None),
                                 where)
    if not layers:
        raise UserError(f"{where} does not say how many layers the target has; pass the target "
                        "(its config) to load this draft")
    return layers


def check_target(what: str, path: Path, target_config, *, hidden: int, vocab: int, layers: int) -> None:
    """A draft reads its own target's features and tokens: another target's sizes are an error."""
    if target_config is None:
        return
    for key, ours, theirs in (("hidden size", hidden, target_config.hidden_size),
                              ("vocabulary size", vocab, target_config.vocab_size),
                              ("number of layers", layers, target_config.num_hidden_layers)):
        if ours != theirs:
            raise UserError(f"the {what} in {path} was made for a target with {key} {ours}, but this "
                            f"target has {theirs}; use the draft with its own target")


@contextlib.contextmanager
def building_draft(config_file: Path):
    """transformers builds the rotary embedding: a rope type's missing or bad parameters fail there."""
    try:
        yield
    except (KeyError, TypeError, ValueError) as e:
        raise UserError(f"{config_file}: cannot build the draft from it ({type(e).__name__}: {e}); check "
                        "rope_parameters, or re-export the draft") from None


def read_weights(path: Path, what: str) -> dict[str, torch.Tensor]:
    """The tensors of `path`/model.safetensors (`what`: "EAGLE-3 draft directory")."""
    file = path / WEIGHTS_NAME
    if not file.is_file():
        raise UserError(f"{what} {path} has no {WEIGHTS_NAME}; re-export the draft")
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(file))
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise UserError(f"{file} is damaged ({first}); re-export the draft") from None


def check_weights(path: Path, state: dict, expected: dict) -> None:
    """`state` (the file's tensors) holds exactly the `expected` names (a module's state_dict), in
    their shapes, every float finite."""
    import torch

    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or unexpected:
        raise UserError(f"{path}/{WEIGHTS_NAME} does not match its config (missing: {missing[:3]}, unexpected: "
                        f"{unexpected[:3]}); re-export the draft")
    for key, value in state.items():
        if tuple(value.shape) != tuple(expected[key].shape):
            raise UserError(f"{path}/{WEIGHTS_NAME}: {key} has shape {tuple(value.shape)} but the config needs "
                            f"{tuple(expected[key].shape)}; re-export the draft")
        if value.is_floating_point() and not torch.isfinite(value).all():
            raise UserError(f"{path}/{WEIGHTS_NAME}: {key} holds non-finite values; the checkpoint is damaged, "
                            "re-export the draft")


def t2d_from_d2t(d2t: torch.Tensor | None, vocab: int) -> torch.Tensor | None:
    """The bool mask over the target's vocabulary of the draft's tokens (target = draft + d2t)."""
    import torch

    if d2t is None:
        return None
    mask = torch.zeros(vocab, dtype=torch.bool)
    ids = d2t.to(torch.long) + torch.arange(d2t.numel())
    mask[ids.clamp(0, vocab - 1)] = True
    return mask


def check_vocab_maps(path: Path, d2t: torch.Tensor, t2d: torch.Tensor, vocab: int) -> None:
    """`d2t` maps every draft id into the target's `vocab` and `t2d` marks exactly those ids."""
    import torch

    ids = d2t.to(torch.long) + torch.arange(d2t.numel())
    if int(ids.min()) < 0 or int(ids.max()) >= vocab or not torch.equal(t2d_from_d2t(d2t, vocab), t2d.bool()):
        raise UserError(f"{path}/{WEIGHTS_NAME}: d2t and t2d do not describe the same draft vocabulary inside "
                        f"the target's {vocab} tokens; re-export the draft")


def card_info_lines(info: dict) -> list[str]:
    """A model card's "How it was made" entries of `base_info` (one `- **key**: value` each)."""
    return [f"- **{str(k).replace('|', '/')}**: {v if isinstance(v, str) else json.dumps(v, default=str)}"
            for k, v in info.items()]


def card_acceptance_section(acceptance_table: list[dict] | None) -> list[str]:
    """A model card's "Acceptance" section (blank lines around it): the table and what τ means, or how
    to measure it."""
    table = render_acceptance_table(acceptance_table)
    if not table:
        return ["", "## Acceptance", "", "Not measured yet: run `drafttrain eval` (below) to measure it.", ""]
    return ["", "## Acceptance", "", table.rstrip("\n"), "",
            "τ (mean accepted length) is the number of tokens emitted per target forward pass (plain decoding: "
            "1.0); speedup is tokens/s against the target alone, measured in the same run.", ""]

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


def card_vllm_usage(target: str, method: str, flag: str, drafts: int) -> list[str]:
    """A card's lines on serving the export with vLLM (`method`) and decoding it with drafttrain (`--flag`)."""
    return ["```python", "from vllm import LLM",
            f'llm = LLM(model="{target}", speculative_config={{"method": "{method}", '
            f'"model": "<this directory>", "num_speculative_tokens": {drafts}}})', "```", "",
            f"Also: `drafttrain eval --target {target} --{flag} <this directory> --prompts prompts.jsonl --out results/`",
            ""]


def draft_sizes(cfg: dict, config_file: Path, path: Path, target_config, what: str) -> tuple[int, int, int, int, int]:
    """A feature-reading draft's export sizes, checked, and checked against the target when given:
    (hidden, target vocabulary, draft vocabulary, target hidden, target layers)."""
    hidden = config_int(cfg, "hidden_size", config_file)
    vocab, draft_vocab = vocab_sizes(cfg, config_file)
    target_hidden = optional_config_int(cfg, "target_hidden_size", hidden, config_file)
    layers = target_num_layers(cfg, config_file, target_config)
    check_target(what, path, target_config, hidden=target_hidden, vocab=vocab, layers=layers)
    return hidden, vocab, draft_vocab, target_hidden, layers
