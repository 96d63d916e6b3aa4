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

from dataclasses import dataclass, field
from pathlib import Path

import torch

from ...errors import UserError
from ...export import (building_draft, card_acceptance_section, card_info_lines, card_vllm_usage, check_vocab_maps,
                       check_weights, config_int, decoder_config_fields, draft_sizes, hidden_act, optional_config_int,
                       positive_number, read_export_config, read_weights, rope_parameters, save_tensor_dir,
                       t2d_from_d2t)
from .model import Eagle3Config, Eagle3Draft, check_aux_layer_ids, default_aux_layer_ids

ARCHITECTURE = "LlamaForCausalLMEagle3"
ACCEPTED_ARCHITECTURES = (ARCHITECTURE, "Eagle3LlamaForCausalLM")  # vLLM registers both names


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
    cfg = {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "num_hidden_layers": 1,
        **decoder_config_fields(config, dtype),
        "draft_vocab_size": config.draft_vocab_size,
        "mlp_bias": False,
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
        *card_info_lines(info),
        *card_acceptance_section(acceptance_table),
        "## Use it",
        "",
        "```bash",
        f"python -m sglang.launch_server --model {target} --speculative-algorithm EAGLE3 \\",
        "    --speculative-draft-model-path <this directory> --speculative-num-steps 4 \\",
        "    --speculative-eagle-topk 1 --speculative-num-draft-tokens 5",
        "```",
        "",
        *card_vllm_usage(target, "eagle3", "eagle3", 4),
    ]
    return "\n".join(lines)


def save_eagle3(draft: Eagle3Draft, out_dir, *, acceptance_table: list[dict] | None = None,
                base_info: dict | None = None, extra_config: dict | None = None, record: dict | None = None) -> Path:
    """Write config.json, model.safetensors and README.md to `out_dir`, replacing it atomically.
    `acceptance_table`: rows for the card (`drafttrain.export.render_acceptance_table`); `record`:
    drafttrain.json (held-out chain acceptance and plans)."""
    cfg = eagle3_config_dict(draft.config, draft.lm_head.weight.dtype, extra_config)
    return save_tensor_dir(out_dir, draft.state_dict(), cfg, model_card(cfg, acceptance_table, base_info), record)


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
    heads = config_int(cfg, "num_attention_heads", config_file)
    try:
        return Eagle3Config(
            hidden_size=hidden, intermediate_size=config_int(cfg, "intermediate_size", config_file),
            num_attention_heads=heads,
            num_key_value_heads=optional_config_int(cfg, "num_key_value_heads", heads, config_file),
            head_dim=optional_config_int(cfg, "head_dim", hidden // heads, config_file),
            rms_norm_eps=positive_number(cfg, "rms_norm_eps", 1e-6, config_file),
            vocab_size=vocab, draft_vocab_size=draft_vocab, target_hidden_size=target_hidden,
            target_num_layers=layers, aux_layer_ids=_aux_layer_ids(cfg, layers, config_file),
            max_position_embeddings=optional_config_int(cfg, "max_position_embeddings", 2048, config_file),
            rope_parameters=rope_parameters(cfg, config_file), hidden_act=hidden_act(cfg, config_file),
            initializer_range=positive_number(cfg, "initializer_range", 0.02, config_file))
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
    hidden, vocab, draft_vocab, target_hidden, layers = draft_sizes(cfg, config_file, path, target_config, "EAGLE-3 draft")
    config = _eagle3_config(cfg, config_file, hidden=hidden, vocab=vocab, draft_vocab=draft_vocab,
                            target_hidden=target_hidden, layers=layers)

    state = read_weights(path, "EAGLE-3 draft directory")
    state.pop("embed_tokens.weight", None)  # some trainers save the target's embedding too: we use the target's
    if "d2t" not in state and draft_vocab == vocab:  # a full-vocabulary draft may leave the maps out
        state["d2t"] = torch.zeros(vocab, dtype=torch.long)
        state["t2d"] = torch.ones(vocab, dtype=torch.bool)
    if "d2t" in state and "t2d" not in state:  # SGLang and vLLM ignore t2d; rebuild it
        state["t2d"] = t2d_from_d2t(state["d2t"], vocab)
    file_dtype = state["lm_head.weight"].dtype if "lm_head.weight" in state else torch.float32
    with building_draft(config_file):
        draft = Eagle3Draft(config).to(file_dtype)
    check_weights(path, state, draft.state_dict())
    check_vocab_maps(path, state["d2t"], state["t2d"], vocab)
    state["d2t"], state["t2d"] = state["d2t"].to(torch.long), state["t2d"].bool()
    draft.load_state_dict(state)
    draft.to(device=device, dtype=dtype or file_dtype)
    info = Eagle3Info(aux_layer_ids=config.aux_layer_ids, draft_vocab_size=draft_vocab, vocab_size=vocab,
                      target_hidden_size=target_hidden, target_num_layers=layers, config=cfg)
    return draft.eval(), info
