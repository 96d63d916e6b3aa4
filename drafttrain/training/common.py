"""Recipe plumbing shared by every training recipe (draft distillation, Medusa heads).

What the recipes have in common lives here once: the config checks every recipe repeats, the
held-out prompts and the greedy acceptance measurement that picks the exported weights, the
rows of the exported acceptance table, and the thin `recipes/*.py` entry point.
"""

from __future__ import annotations

import os
import re
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..config import config_from_argv, config_to_dict, dump_config_yaml
from ..data.config import drafttrain_home
from ..errors import UserError
from ..fileio import atomic_write_text
from ..models import DTYPES, check_model_path, context_length
from ..prompts import encode_prompt

# ----------------------------------------------------------------------------- config


def expand_vars(value: str, key: str) -> str:
    """`${VAR}` / `$VAR` from the environment; DRAFTTRAIN_HOME defaults to the drafttrain cache."""
    env = {"DRAFTTRAIN_HOME": str(drafttrain_home()), **os.environ}

    def sub(m: re.Match) -> str:
        name = m.group(1) or m.group(2)
        if name not in env:
            raise UserError(f"config key {key!r} uses ${{{name}}}, which is not set; export it or write the path out")
        return env[name]

    return os.path.expanduser(re.sub(r"\$\{(\w+)\}|\$(\w+)", sub, str(value)))


def validate_common(cfg) -> None:
    """The checks every recipe config shares (output_dir, target, dtypes, data, train, optim).

    `cfg` has the fields every recipe config has: output_dir, target, target_dtype,
    export_dtype, data, train, optim. Paths are ${VAR}-expanded in place; raises a one-line
    UserError.
    """
    if not str(cfg.output_dir).strip():
        raise UserError("output_dir is empty; set output_dir=runs/NAME")
    cfg.output_dir = expand_vars(cfg.output_dir, "output_dir")
    cfg.target = expand_vars(cfg.target, "target")
    check_model_path(cfg.target, "target")
    if cfg.target_dtype != "auto" and cfg.target_dtype not in DTYPES:
        raise UserError(f"target_dtype {cfg.target_dtype!r} is unknown; use auto, {', '.join(DTYPES)}")
    if cfg.export_dtype not in ("float32", "bfloat16", "float16"):
        raise UserError(f"export_dtype {cfg.export_dtype!r} is unknown; use float32, bfloat16 or float16")

    for src in cfg.data.sources:
        if src.path:
            src.path = expand_vars(src.path, "data.sources[].path")
    cfg.data.cache_dir = expand_vars(cfg.data.cache_dir, "data.cache_dir")
    cfg.data.validate()
    if not cfg.data.sources:
        raise UserError("data.sources is empty; add at least one prompt source (jsonl, hf or self_instruct)")
    if cfg.data.heldout_size == 0 or (cfg.data.heldout_size is None and cfg.data.heldout_fraction == 0):
        raise UserError("evaluation needs held-out prompts; set data.heldout_size > 0 or data.heldout_fraction > 0")
    cfg.train.validate()
    cfg.optim.validate()


# ----------------------------------------------------------------------------- evaluation


@dataclass
class EvalPrompt:
    id: object
    category: str
    ids: list[int]


def eval_prompts(records, tokenizer, target, *, num_prompts: int, max_new_tokens: int) -> list[EvalPrompt]:
    """The first `num_prompts` held-out prompts that fit the target's context with the answer."""
    limit = context_length(target)
    out = []
    for r in records:
        ids = encode_prompt(r, tokenizer)
        if limit is None or len(ids) + max_new_tokens <= limit:
            out.append(EvalPrompt(r.id, r.category, ids))
        if len(out) == num_prompts:
            break
    if not out:
        raise UserError("no held-out prompt fits the target's context together with eval.max_new_tokens; "
                        "lower eval.max_new_tokens or hold out shorter prompts")
    return out


def greedy_acceptance(decoder, prompts: list[EvalPrompt], max_new_tokens: int, extra: dict | None = None) -> dict:
    """Greedy decoding of `prompts` with one of drafttrain's decoders: tau and acceptance (+ `extra`)."""
    from ..metrics import PromptResult, compute_metrics

    results = []
    for p in prompts:
        start = time.perf_counter()
        gen = decoder.generate(p.ids, max_new_tokens)
        results.append(PromptResult(p.id, p.category, gen, time.perf_counter() - start))
    k = decoder.num_draft_tokens
    m = compute_metrics(results, k, greedy=True)
    keep = ("prompts", "new_tokens", "target_forwards", "draft_tokens", "accepted_tokens", "acceptance_rate",
            "mean_accepted_length", "per_position_acceptance", "per_position_acceptance_when_proposed")
    return {"tau": m["mean_accepted_length"], **{key: m[key] for key in keep}, "num_draft_tokens": k,
            **(extra or {})}


def response_window(loss_mask) -> int:
    """Where the batch's first trained position is: logits before it are never used, and on a 50k
    vocabulary the LM head over the prompt costs as much as the rest of the draft."""
    rows = loss_mask.any(dim=1)
    if not bool(rows.any()):
        return 0
    return int(loss_mask.int().argmax(dim=1)[rows].min())


def table_row(name: str, metrics: dict) -> dict:
    """One row of the exported acceptance table, from an evaluation's metrics."""
    return {"drafter": name, "num_draft_tokens": metrics["num_draft_tokens"], "tau": metrics["tau"],
            "acceptance_rate": metrics["acceptance_rate"], "per_position_acceptance": metrics["per_position_acceptance"]}


# ----------------------------------------------------------------------------- runs and entry points


def write_run_config(accelerator, cfg, out: Path) -> None:
    """Everything is checked: from here on the run writes its directory, starting with the resolved config."""
    resolved = dump_config_yaml(cfg)
    if accelerator.is_main_process:
        note_config_change(out / "config.yaml", cfg)
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out / "config.yaml", resolved)
        accelerator.print(f"resolved config (saved to {out / 'config.yaml'}):\n{resolved}")


def prepare_recipe_data(accelerator, cfg, tokenizer, target, out: Path):
    """(data, eval prompts): the target's answers to the training prompts, the held-out prompts
    (saved to heldout.jsonl) and the first of them that evaluation decodes."""
    from ..data import prepare_distillation_data, write_prompts_jsonl

    with accelerator.main_process_first():
        data = prepare_distillation_data(cfg.data, target, tokenizer, target_path=cfg.target)
    if accelerator.is_main_process:
        write_prompts_jsonl(out / "heldout.jsonl", data.heldout)
    prompts = eval_prompts(data.heldout, tokenizer, target, num_prompts=cfg.eval.num_prompts,
                           max_new_tokens=cfg.eval.max_new_tokens)
    return data, prompts


def note_config_change(path: Path, cfg) -> None:
    """Resuming with a changed config is allowed (e.g. more steps), but say what changed."""
    if not path.is_file():
        return
    import yaml

    try:
        old = _flatten(yaml.safe_load(path.read_text()) or {})
    except yaml.YAMLError:
        return
    new = _flatten(config_to_dict(cfg))
    changed = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
    if changed:
        warnings.warn(f"{path} differs from this run's config in: {', '.join(changed[:10])}")


def _flatten(d, prefix: str = "") -> dict:
    if not isinstance(d, dict):
        return {prefix[:-1]: d}
    out = {}
    for k, v in d.items():
        out |= _flatten(v, f"{prefix}{k}.")
    return out


def recipe_main(config_cls: type, run_fn: Callable, argv: list[str] | None, prog: str) -> int:
    """A recipe script's `main`: parse the config, run; a UserError prints one `error:` line (exit 2)."""
    try:
        run_fn(config_from_argv(config_cls, argv, prog=prog))
    except UserError as e:
        if int(os.environ.get("RANK", "0")) == 0:  # every rank fails alike; say it once
            print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    finally:
        _close_process_group()
    return 0


def _close_process_group() -> None:
    """Tear the process group down before the interpreter does: left to exit, gloo's threads can
    die un-joined ("terminate called without an active exception", SIGABRT) after a finished run."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


__all__ = ["EvalPrompt", "eval_prompts", "expand_vars", "greedy_acceptance", "note_config_change",
           "prepare_recipe_data", "recipe_main", "table_row", "validate_common", "write_run_config"]
