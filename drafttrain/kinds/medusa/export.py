"""Save and load Medusa heads in vLLM's Medusa format.

vLLM (`vllm/model_executor/models/medusa.py`, `vllm/transformers_utils/configs/medusa.py`)
builds `blocks.{i}.layers.{j}` as Linear(H, H, bias=config.medusa_fc_bias) and `lm_heads.{i}`
as a bias-free [V, H] projection, and silently skips checkpoint keys it has no parameter for.
So `medusa_fc_bias: true` must be in config.json or vLLM would drop our biases. vLLM's config
loader also renames every key containing "num" and "heads" to `num_heads` (and "num" +
"layers" to `num_hidden_layers`), so no other such key may appear in config.json.

Heads that share one LM head (`MedusaConfig.shared_lm_head`) are saved with `original_lm_head:
true` and the one `lm_heads.0.weight`, which vLLM loads as the `lm_head` behind every block.

`load_medusa` also reads the original Medusa repository's layout (`{i}.{j}.linear.weight|bias`,
`{i}.{num_layers}.weight`, config `medusa_num_heads` / `medusa_num_layers`).

`export_final` writes a training run's `final/` (recipes/train_heads.py): the heads, their model
card and, for Medusa-2, the merged adapted target they verify with.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path

import torch

from ...errors import UserError
from ...export import read_export_config, render_acceptance_table, save_tensor_dir
from ...fileio import atomic_dir
from ...models import DTYPES
from .model import MedusaConfig, MedusaHeads

WEIGHTS_NAME = "model.safetensors"
_ORIGINAL_WEIGHTS = ("medusa_lm_head.safetensors", "medusa_lm_head.pt")
_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16",
                torch.float64: "float64"}


def _is_renamed_by_vllm(key: str) -> bool:
    return "num" in key and ("heads" in key or "layers" in key)


def medusa_config_dict(config: MedusaConfig, dtype: torch.dtype, extra: dict | None = None) -> dict:
    cfg = {
        "architectures": ["MedusaModel"],
        "model_type": "medusa",
        "hidden_size": config.hidden_size,
        "vocab_size": config.vocab_size,
        "num_heads": config.num_heads,
        "num_hidden_layers": config.num_layers,
        "truncated_vocab_size": config.vocab_size,
        "medusa_fc_bias": True,
        "original_lm_head": config.shared_lm_head,  # vLLM: one `lm_head` for all heads, read from lm_heads.0
        "torch_dtype": _DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch.")),
    }
    for key, value in (extra or {}).items():
        if key in cfg:
            raise ValueError(f"extra config key {key!r} would overwrite a Medusa config field")
        if _is_renamed_by_vllm(key):
            raise ValueError(f"extra config key {key!r} contains 'num' and 'heads'/'layers'; vLLM's "
                             "MedusaConfig would read it as num_heads/num_hidden_layers, so rename it")
        cfg[key] = value
    return cfg


def _model_card(cfg: dict, notes: str | None) -> str:
    base = cfg.get("base_model") or cfg.get("base_model_name_or_path") or "TARGET"
    lines = [
        "---",
        "library_name: vllm",
        "tags: [medusa, speculative-decoding, drafttrain]",
        "---",
        "",
        "# Medusa heads",
        "",
        f"{cfg['num_heads']} Medusa heads (Cai et al. 2024) with {cfg['num_hidden_layers']} residual "
        f"block(s) each, for a target with hidden size {cfg['hidden_size']} and vocabulary "
        f"{cfg['vocab_size']}" + (", all behind one shared LM head" if cfg["original_lm_head"] else "")
        + ". Head i predicts the token i + 2 steps past the target's last hidden "
        "state. Trained with drafttrain; stored in vLLM's Medusa format.",
        "",
        "```python",
        "from vllm import LLM",
        f'llm = LLM(model="{base}", speculative_config={{"method": "medusa", '
        f'"model": "<this directory>", "num_speculative_tokens": {cfg["num_heads"]}}})',
        "```",
        "",
        "Also: `drafttrain eval --target TARGET --heads <this directory> ...`",
    ]
    if notes:
        lines += ["", notes.strip()]
    return "\n".join(lines) + "\n"


def save_medusa(heads: MedusaHeads, out_dir, extra: dict | None = None, card_notes: str | None = None,
                record: dict | None = None) -> Path:
    """Write config.json, model.safetensors (vLLM key names) and README.md, atomically; `record`:
    drafttrain.json (held-out chain acceptance and plans)."""
    cfg = medusa_config_dict(heads.config, next(heads.parameters()).dtype, extra)
    return save_tensor_dir(out_dir, heads.state_dict(), cfg, _model_card(cfg, card_notes), record)


def export_final(module, cfg, tokenizer, final_dir, steps: int, best_step: int, rows: list[dict], num_prompts: int,
                 *, calibrated: dict | None = None, plans: dict | None = None, record: dict | None = None) -> None:
    """final/ of a heads run (`cfg`: its HeadsConfig; `module`: the trained objective, `.heads` and,
    for Medusa-2, `.target` with its LoRA adapters): the heads in vLLM's format (with the
    calibrated tree, if any); Medusa-2 also target/, the merged adapted target (the verifier).
    `rows`: the model card's acceptance table; `plans`: its lines on the planned K. Written into
    one temporary directory and renamed, so heads never point at a half-written verifier."""
    final_dir = Path(final_dir)
    heads = copy.deepcopy(module.heads).to(device="cpu", dtype=DTYPES[cfg.export_dtype])
    verifier = str((final_dir / "target").resolve()) if cfg.lora.enabled else None
    info = {"kind": cfg.kind, "target": cfg.target, **({"verifier": verifier} if verifier else {})}
    if calibrated:
        info |= {"tree": calibrated["tree"], "topk_accuracy": calibrated["topk_accuracy"]}
    with atomic_dir(final_dir, overwrite=True) as tmp:
        save_medusa(heads, tmp, extra={"drafttrain": info, "base_model": verifier or cfg.target},
                    card_notes=card_notes(cfg, steps, best_step, num_prompts, render_acceptance_table(rows), plans),
                    record=record)
        if cfg.lora.enabled:
            merged = copy.deepcopy(module.target).merge_and_unload().to("cpu")
            merged.save_pretrained(tmp / "target")
            tokenizer.save_pretrained(tmp / "target")
            (tmp / "target" / "README.md").write_text(
                f"# Adapted target (Medusa-2)\n\n`{cfg.target}` with the LoRA adapters (r={cfg.lora.r}, "
                f"modules {', '.join(cfg.lora.target_modules)}) trained jointly with the Medusa heads in `..`, "
                "merged into its weights. It is the verifier those heads were trained for: pass this directory "
                "as --target.\n")


def card_notes(cfg, steps: int, best_step: int, num_prompts: int, table: str, plans: dict | None = None) -> str:
    """The model card's account of a heads run (`cfg`: its HeadsConfig): method, loss, steps, LoRA,
    and the acceptance `table`."""
    lines = ["## Training", "",
             f"- **method**: {cfg.kind} (" + ("LoRA adapters on the target trained jointly with the heads"
                                              if cfg.lora.enabled else "target frozen, only the heads trained") + ")",
             f"- **target**: `{cfg.target}`",
             f"- **heads loss**: {cfg.loss.kind}" + (" (self-distillation from the target's own distribution)"
                                                      if cfg.loss.kind == "kl" else " (on the target's tokens)")
             + f", head i weighted {cfg.loss.decay}^i",
             f"- **LM heads trained**: {'yes' if cfg.heads.train_lm_heads else 'no (residual blocks only)'}"
             + ("; one LM head shared by all heads" if cfg.heads.share_lm_head else ""),
             f"- **training steps**: {steps}; exported weights: step {best_step} "
             + ("(best held-out tau)" if cfg.train.keep_best else "(last)")]
    lines += [f"- **{key}**: {value}" for key, value in (plans or {}).items()]
    if cfg.lora.enabled:
        lines.append(f"- **LoRA**: r={cfg.lora.r}, alpha={cfg.lora.alpha}, modules "
                     f"{', '.join(cfg.lora.target_modules)}; language-model loss {cfg.lora.lm_loss} x "
                     f"{cfg.lora.lm_loss_weight}")
        lines += ["", "**The verifier is the adapted target** in `target/` next to these heads (the LoRA adapters "
                      "merged), not the original target: use it as the target, e.g. `drafttrain eval --target "
                      "<this directory>/target --heads <this directory> ...`, or as the model in vLLM."]
    lines += ["", f"## Acceptance (greedy tree decoding, {num_prompts} held-out prompts)", "", table.rstrip("\n")]
    return "\n".join(lines)


def _config_int(cfg: dict, key: str, path: Path) -> int:
    value = cfg[key]
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise UserError(f"{path}/config.json: {key} must be a non-negative integer, got {value!r}")
    return value


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    for name in (WEIGHTS_NAME, *_ORIGINAL_WEIGHTS):
        file = path / name
        if not file.is_file():
            continue
        if name.endswith(".safetensors"):
            from safetensors.torch import load_file

            return load_file(str(file))
        return torch.load(file, map_location="cpu", weights_only=True)
    raise UserError(f"Medusa heads directory {path} has no {WEIGHTS_NAME}; "
                    "pass a directory written by drafttrain (vLLM Medusa format)")


def _to_vllm_names(state: dict[str, torch.Tensor], num_layers: int) -> dict[str, torch.Tensor]:
    """Strip `medusa_heads.`/`medusa_head.` prefixes; map the original Medusa layout to vLLM's."""
    out = {}
    for key, value in state.items():
        key = re.sub(r"^medusa_heads?\.", "", key)
        if m := re.fullmatch(r"(\d+)\.(\d+)\.linear\.(weight|bias)", key):
            key = f"blocks.{m[1]}.layers.{m[2]}.{m[3]}"
        elif (m := re.fullmatch(r"(\d+)\.(\d+)\.weight", key)) and int(m[2]) == num_layers:
            key = f"lm_heads.{m[1]}.weight"
        out[key] = value
    return out


def _one_lm_head(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`original_lm_head`, as vLLM reads it: the one head is `lm_head.weight`, else `lm_heads.0.weight`;
    any other `lm_heads.{i}` is ignored (vLLM has no parameter for it)."""
    head = state.get("lm_head.weight", state.get("lm_heads.0.weight"))
    out = {k: v for k, v in state.items() if not k.startswith(("lm_head.", "lm_heads."))}
    return out | ({"lm_heads.0.weight": head} if head is not None else {})


def load_medusa(path, device=None, dtype: torch.dtype | None = None) -> MedusaHeads:
    """Read heads saved by `save_medusa` (or the original Medusa layout); dtype defaults to the file's."""
    path = Path(path)
    config_file = path / "config.json"
    cfg = read_export_config(path, "Medusa heads directory", "train_heads", "a Medusa heads directory (vLLM format: "
                             "config.json with model_type 'medusa' + model.safetensors)", "re-export the heads")

    # Same key folding as vLLM's MedusaConfig.from_pretrained (covers medusa_num_heads etc.).
    for key in list(cfg):
        if "num" in key and "heads" in key:
            cfg["num_heads"] = cfg.pop(key)
        elif "num" in key and "layers" in key:
            cfg["num_hidden_layers"] = cfg.pop(key)
    is_medusa = cfg.get("model_type") == "medusa" or "MedusaModel" in (cfg.get("architectures") or [])
    if not is_medusa and "num_heads" not in cfg:
        raise UserError(f"{config_file} is not a Medusa config: it lacks model_type 'medusa' and "
                        f"num_heads (model_type is {cfg.get('model_type')!r}); pass a Medusa heads directory")
    if "num_heads" not in cfg:
        raise UserError(f"{config_file} lacks num_heads; re-export the heads with drafttrain")
    num_heads = _config_int(cfg, "num_heads", path)
    num_layers = _config_int(cfg, "num_hidden_layers", path) if "num_hidden_layers" in cfg else 1
    vocab = cfg.get("vocab_size")
    if cfg.get("truncated_vocab_size") not in (None, vocab):
        raise UserError(f"{config_file}: truncated_vocab_size (token_map) heads are not supported; "
                        "export heads over the full vocabulary")

    state = _to_vllm_names(_read_weights(path), num_layers)
    state.pop("token_map", None)
    shared = bool(cfg.get("original_lm_head"))
    if shared:
        state = _one_lm_head(state)
    if "lm_heads.0.weight" not in state:
        raise UserError(f"{path} weights lack lm_heads.0.weight; pass a Medusa heads directory")
    V, H = state["lm_heads.0.weight"].shape
    for key, value in (("hidden_size", H), ("vocab_size", V)):
        if key in cfg and cfg[key] != value:
            raise UserError(f"{config_file}: {key} is {cfg[key]} but the weights have {value}; re-export the heads")

    file_dtype = state["lm_heads.0.weight"].dtype
    config = MedusaConfig(hidden_size=H, vocab_size=V, num_heads=num_heads, num_layers=num_layers,
                          shared_lm_head=shared)
    heads = MedusaHeads(config, dtype=file_dtype)  # the file's dtype: no lossy round trip
    expected = heads.state_dict()
    for key, value in expected.items():  # vLLM's medusa_fc_bias=false: no biases, i.e. zero biases
        if key.endswith(".bias") and key not in state:
            state[key] = torch.zeros_like(value)
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise UserError(f"{path} weights do not match the config (missing: {missing[:3]}, "
                        f"unexpected: {unexpected[:3]}); re-export the heads")
    for key, value in state.items():
        if value.shape != expected[key].shape:
            raise UserError(f"{path}: {key} has shape {tuple(value.shape)}, expected "
                            f"{tuple(expected[key].shape)}; re-export the heads")
    heads.load_state_dict(state)
    if dtype is not None:
        heads = heads.to(dtype=dtype)
    return heads.to(device) if device is not None else heads


def read_heads_info(path) -> dict:
    """What drafttrain recorded about how the heads were trained (config.json's `drafttrain` key).

    For Medusa-2 heads this names the adapted target they were trained with, which is then the
    verifier: reports and model cards must say so.
    """
    import json

    try:
        cfg = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    info = cfg.get("drafttrain")
    return info if isinstance(info, dict) else {}
