"""Save and load EAGLE-3 drafts in the layout SGLang and vLLM serve (SPEC section 3).

What the engines read (`llama_eagle3.py` in both, checked by tests/eagle3/test_eagle3_export.py):
- config.json: `architectures: ["LlamaForCausalLMEagle3"]`, a Llama config of ONE layer with the
  target's sizes, `draft_vocab_size`, `target_hidden_size` (fc input = 3x that), the rotary
  settings, and `tie_word_embeddings: false` (SGLang would otherwise reuse the embedding as the
  LM head). Rotary settings are written both as transformers 5's `rope_parameters` and as the
  older `rope_theta` / `rope_scaling`, which transformers 4 (and engines on it) read.
- model.safetensors: `midlayer.*` (SGLang's `model.midlayer`; vLLM renames it to
  `model.layers.0` and stacks q/k/v and gate/up itself), `fc.weight`, `norm.weight`,
  `lm_head.weight`, `d2t` (int64: target = draft + d2t; vLLM's `draft_id_to_target_id`, SGLang's
  `hot_token_id`) and `t2d` (bool; both skip it, SpecForge reads it). No `embed_tokens`: both
  engines then use the target's.
- Target layers. Both engines default to capturing the residual stream entering layers
  (2, L//2, L-3), which is exactly drafttrain's default `aux_layer_ids` (transformers'
  hidden_states indices). For that default nothing is written. Other layers are written in both
  engines' conventions, which differ: vLLM reads a top-level `eagle_aux_hidden_state_layer_ids`
  as the index of the layer whose INPUT is captured (= our index); SGLang reads
  `eagle_config.eagle_aux_hidden_state_layer_ids` as the layer whose OUTPUT is captured and adds 1.
  drafttrain's own reading is kept under `drafttrain` in config.json.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ...errors import UserError
from ...export import read_export_config, render_acceptance_table, save_tensor_dir
from .model import Eagle3Config, Eagle3Draft, check_aux_layer_ids, default_aux_layer_ids

WEIGHTS_NAME = "model.safetensors"
ARCHITECTURE = "LlamaForCausalLMEagle3"
ACCEPTED_ARCHITECTURES = (ARCHITECTURE, "Eagle3LlamaForCausalLM")  # vLLM registers both names
_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16",
                torch.float64: "float64"}


@dataclass
class Eagle3Info:
    """What a loaded checkpoint says about itself, beyond the weights."""

    aux_layer_ids: tuple[int, int, int]  # transformers hidden_states indices of the target
    draft_vocab_size: int
    vocab_size: int
    target_hidden_size: int
    target_num_layers: int
    config: dict = field(default_factory=dict)  # config.json as written


def eagle3_config_dict(config: Eagle3Config, dtype: torch.dtype, extra: dict | None = None) -> dict:
    """config.json for `config` (see the module docstring for which engine reads what)."""
    rope = dict(config.rope_parameters)
    legacy_scaling = None if rope.get("rope_type", "default") == "default" else \
        {k: v for k, v in rope.items() if k != "rope_theta"}
    dtype_name = _DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))
    cfg = {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "num_hidden_layers": 1,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "hidden_act": config.hidden_act,
        "rms_norm_eps": config.rms_norm_eps,
        "vocab_size": config.vocab_size,
        "draft_vocab_size": config.draft_vocab_size,
        "target_hidden_size": config.target_hidden_size,
        "max_position_embeddings": config.max_position_embeddings,
        "rope_parameters": rope,
        "rope_theta": rope.get("rope_theta", 10000.0),
        "rope_scaling": legacy_scaling,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "initializer_range": config.initializer_range,
        "torch_dtype": dtype_name,
        "dtype": dtype_name,
        "drafttrain": {"aux_layer_ids": list(config.aux_layer_ids), "target_num_layers": config.target_num_layers,
                       "aux_layer_ids_convention": "transformers hidden_states index: i = output of layer i-1"},
    }
    if tuple(config.aux_layer_ids) != default_aux_layer_ids(config.target_num_layers):
        cfg["eagle_aux_hidden_state_layer_ids"] = list(config.aux_layer_ids)                 # vLLM
        cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in config.aux_layer_ids],
                               "use_aux_hidden_state": True}                               # SGLang
    for key, value in (extra or {}).items():
        if key in cfg:
            raise ValueError(f"extra config key {key!r} would overwrite an EAGLE-3 config field")
        cfg[key] = value
    return cfg


def model_card(cfg: dict, acceptance_table: list[dict] | None, base_info: dict | None) -> str:
    info = dict(base_info or {})
    target = str(info.get("target") or info.get("target_model") or "TARGET")
    layers = cfg["drafttrain"]["aux_layer_ids"]
    table = render_acceptance_table(acceptance_table)
    lines = [
        "---",
        "library_name: sglang",
        "tags: [eagle3, speculative-decoding, drafttrain]",
        "---",
        "",
        f"# EAGLE-3 draft for {target}",
        "",
        "An EAGLE-3 drafter (Li et al. 2025): one decoder layer that reads the target's hidden states "
        f"(entering layers {', '.join(map(str, layers))} of {cfg['drafttrain']['target_num_layers']}) and "
        f"proposes tokens from a vocabulary of the {cfg['draft_vocab_size']} most frequent tokens of the "
        "target's answers. The target verifies every drafted token, so the output is exactly the target's "
        "(greedy) or has its distribution (sampling). Made with drafttrain; stored in the layout SGLang and "
        "vLLM load.",
        "",
        "## How it was made",
        "",
        f"- **sizes**: hidden {cfg['hidden_size']}, intermediate {cfg['intermediate_size']}, heads "
        f"{cfg['num_attention_heads']} / {cfg['num_key_value_heads']} KV, target vocabulary {cfg['vocab_size']}, "
        f"draft vocabulary {cfg['draft_vocab_size']}; weights in {cfg['torch_dtype']}",
        *[f"- **{str(k).replace('|', '/')}**: {v if isinstance(v, str) else json.dumps(v, default=str)}"
          for k, v in info.items()],
        "",
        "## Acceptance",
        "",
        *([table.rstrip("\n"), "",
           "τ (mean accepted length) is the number of tokens emitted per target forward pass (plain decoding: "
           "1.0); speedup is tokens/s against the target alone, measured in the same run."]
          if table else ["Not measured yet: run `drafttrain eval` (below) to measure it."]),
        "",
        "## Use it",
        "",
        "```bash",
        f"python -m sglang.launch_server --model {target} --speculative-algorithm EAGLE3 \\",
        "    --speculative-draft-model-path <this directory> --speculative-num-steps 4 \\",
        "    --speculative-eagle-topk 1 --speculative-num-draft-tokens 5",
        "```",
        "",
        "```python",
        "from vllm import LLM",
        f'llm = LLM(model="{target}", speculative_config={{"method": "eagle3", '
        '"model": "<this directory>", "num_speculative_tokens": 4})',
        "```",
        "",
        f"Also: `drafttrain eval --target {target} --eagle3 <this directory> --prompts prompts.jsonl --out results/`",
        "",
    ]
    return "\n".join(lines)


def save_eagle3(draft: Eagle3Draft, out_dir, *, acceptance_table: list[dict] | None = None,
                base_info: dict | None = None, extra_config: dict | None = None, record: dict | None = None) -> Path:
    """Write config.json, model.safetensors and README.md to `out_dir`, replacing it atomically.
    `acceptance_table`: rows for the card (`drafttrain.export.render_acceptance_table`); `record`:
    drafttrain.json (held-out chain acceptance and plans)."""
    cfg = eagle3_config_dict(draft.config, draft.lm_head.weight.dtype, extra_config)
    return save_tensor_dir(out_dir, draft.state_dict(), cfg, model_card(cfg, acceptance_table, base_info), record)


def _int(cfg: dict, key: str, where: Path) -> int:
    value = cfg.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise UserError(f"{where}: {key} must be a positive integer, got {value!r}; re-export the draft")
    return value


def _optional_int(cfg: dict, key: str, default, where: Path) -> int:
    """A positive integer field that may be left out (or null): `default` then."""
    return default if cfg.get(key) is None else _int(cfg, key, where)


def _positive_number(cfg: dict, key: str, default: float, where: Path) -> float:
    value = cfg.get(key, default)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value < math.inf:
        raise UserError(f"{where}: {key} must be a positive number, got {value!r}; re-export the draft")
    return value


def _hidden_act(cfg: dict, where: Path) -> str:
    from transformers.activations import ACT2FN

    value = cfg.get("hidden_act", "silu")
    if not isinstance(value, str) or value not in ACT2FN:
        raise UserError(f"{where}: hidden_act {value!r} is not an activation transformers knows (e.g. silu, gelu); "
                        "re-export the draft")
    return value


def _rope(cfg: dict, where: Path) -> dict:
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
    _positive_number(rope, "rope_theta", 10000.0, where)
    return rope


def _aux_layer_ids(cfg: dict, num_layers: int, where: Path) -> tuple[int, int, int]:
    """drafttrain's own record, else vLLM's key (same convention), else SGLang's (+1), else the
    engines' common default."""
    ours = (cfg.get("drafttrain") or {}).get("aux_layer_ids")
    vllm = cfg.get("eagle_aux_hidden_state_layer_ids")
    sglang = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    try:
        if ours:
            return check_aux_layer_ids(ours, num_layers)
        if vllm:
            return check_aux_layer_ids(vllm, num_layers)
        if sglang:
            return check_aux_layer_ids([int(i) + 1 for i in sglang], num_layers)
        return check_aux_layer_ids(default_aux_layer_ids(num_layers), num_layers)
    except UserError as e:
        raise UserError(f"{where}: {e}") from None


def _eagle3_config(cfg: dict, config_file: Path, *, hidden: int, vocab: int, draft_vocab: int, target_hidden: int,
                   layers: int) -> Eagle3Config:
    """The draft's config with every field checked: a malformed one names itself and the file."""
    heads = _int(cfg, "num_attention_heads", config_file)
    try:
        return Eagle3Config(
            hidden_size=hidden, intermediate_size=_int(cfg, "intermediate_size", config_file),
            num_attention_heads=heads, num_key_value_heads=_optional_int(cfg, "num_key_value_heads", heads, config_file),
            head_dim=_optional_int(cfg, "head_dim", hidden // heads, config_file),
            rms_norm_eps=_positive_number(cfg, "rms_norm_eps", 1e-6, config_file),
            vocab_size=vocab, draft_vocab_size=draft_vocab, target_hidden_size=target_hidden,
            target_num_layers=layers, aux_layer_ids=_aux_layer_ids(cfg, layers, config_file),
            max_position_embeddings=_optional_int(cfg, "max_position_embeddings", 2048, config_file),
            rope_parameters=_rope(cfg, config_file), hidden_act=_hidden_act(cfg, config_file),
            initializer_range=_positive_number(cfg, "initializer_range", 0.02, config_file))
    except ValueError as e:
        raise UserError(f"{config_file}: {e}; re-export the draft") from None


def load_eagle3(path, device=None, dtype: torch.dtype | None = None,
                target_config=None) -> tuple[Eagle3Draft, Eagle3Info]:
    """Read a draft saved by `save_eagle3` (or by SpecForge, in the same layout). `dtype` defaults
    to the file's. With `target_config`, the draft is checked against that target. Attach the
    target's embedding before use: `draft.attach_embeddings(target.get_input_embeddings())`."""
    path = Path(path)
    config_file = path / "config.json"
    cfg = read_export_config(path, "EAGLE-3 draft directory", "train_eagle3", "an EAGLE-3 draft directory",
                             "re-export the draft")
    archs = cfg.get("architectures") or []
    if not any(a in ACCEPTED_ARCHITECTURES for a in archs):
        raise UserError(f"{config_file}: architectures is {archs}, not [{ARCHITECTURE!r}]; pass an EAGLE-3 draft "
                        "directory (for a draft LM use --draft, for Medusa heads --heads)")
    if cfg.get("num_hidden_layers", 1) != 1:
        raise UserError(f"{config_file}: num_hidden_layers is {cfg.get('num_hidden_layers')}; only one-layer "
                        "EAGLE-3 drafts are supported")
    hidden = _int(cfg, "hidden_size", config_file)
    vocab = _int(cfg, "vocab_size", config_file)
    draft_vocab = _optional_int(cfg, "draft_vocab_size", vocab, config_file)
    if draft_vocab > vocab:
        raise UserError(f"{config_file}: draft_vocab_size {draft_vocab} exceeds vocab_size {vocab} (the target's); "
                        "re-export the draft")
    target_hidden = _optional_int(cfg, "target_hidden_size", hidden, config_file)
    ours = cfg.get("drafttrain")
    if ours is not None and not isinstance(ours, dict):
        raise UserError(f"{config_file}: drafttrain must be a JSON object, got {ours!r}; re-export the draft")
    layers = _optional_int(ours or {}, "target_num_layers", getattr(target_config, "num_hidden_layers", None),
                           config_file)
    if not layers:
        raise UserError(f"{config_file} does not say how many layers the target has; pass the target "
                        "(its config) to load this draft")
    if target_config is not None:
        for key, ours, theirs in (("hidden size", target_hidden, target_config.hidden_size),
                                  ("vocabulary size", vocab, target_config.vocab_size),
                                  ("number of layers", layers, target_config.num_hidden_layers)):
            if ours != theirs:
                raise UserError(f"the EAGLE-3 draft in {path} was made for a target with {key} {ours}, but this "
                                f"target has {theirs}; use the draft with its own target")
    config = _eagle3_config(cfg, config_file, hidden=hidden, vocab=vocab, draft_vocab=draft_vocab,
                            target_hidden=target_hidden, layers=layers)

    state = _read_weights(path)
    state.pop("embed_tokens.weight", None)  # some trainers save the target's embedding too: we use the target's
    if "d2t" not in state and draft_vocab == vocab:  # a full-vocabulary draft may leave the maps out
        state["d2t"] = torch.zeros(vocab, dtype=torch.long)
        state["t2d"] = torch.ones(vocab, dtype=torch.bool)
    if "d2t" in state and "t2d" not in state:  # SGLang and vLLM ignore t2d; rebuild it
        state["t2d"] = _t2d_from_d2t(state["d2t"], vocab)
    file_dtype = state["lm_head.weight"].dtype if "lm_head.weight" in state else torch.float32
    try:  # transformers builds the rotary embedding: a rope type's missing or bad parameters fail there
        draft = Eagle3Draft(config).to(file_dtype)
    except (KeyError, TypeError, ValueError) as e:
        raise UserError(f"{config_file}: cannot build the draft from it ({type(e).__name__}: {e}); check "
                        "rope_parameters, or re-export the draft") from None
    expected = draft.state_dict()
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
    ids = state["d2t"].to(torch.long) + torch.arange(draft_vocab)
    if int(ids.min()) < 0 or int(ids.max()) >= vocab or not torch.equal(_t2d_from_d2t(state["d2t"], vocab),
                                                                         state["t2d"].bool()):
        raise UserError(f"{path}/{WEIGHTS_NAME}: d2t and t2d do not describe the same draft vocabulary inside "
                        f"the target's {vocab} tokens; re-export the draft")
    state["d2t"], state["t2d"] = state["d2t"].to(torch.long), state["t2d"].bool()
    draft.load_state_dict(state)
    draft.to(device=device, dtype=dtype or file_dtype)
    info = Eagle3Info(aux_layer_ids=config.aux_layer_ids, draft_vocab_size=draft_vocab, vocab_size=vocab,
                      target_hidden_size=target_hidden, target_num_layers=layers, config=cfg)
    return draft.eval(), info


def _t2d_from_d2t(d2t, vocab: int) -> torch.Tensor | None:
    if d2t is None:
        return None
    mask = torch.zeros(vocab, dtype=torch.bool)
    ids = d2t.to(torch.long) + torch.arange(d2t.numel())
    mask[ids.clamp(0, vocab - 1)] = True
    return mask


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    file = path / WEIGHTS_NAME
    if not file.is_file():
        raise UserError(f"EAGLE-3 draft directory {path} has no {WEIGHTS_NAME}; re-export the draft")
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(file))
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise UserError(f"{file} is damaged ({first}); re-export the draft") from None
