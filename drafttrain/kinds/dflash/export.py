"""Save and load DFlash block drafts in the layout vLLM serves (`speculative_config={"method": "dflash",
"model": DIR, "num_speculative_tokens": block_size - 1}`).

What vLLM 0.32 reads (`model_executor/models/qwen3_dflash.py`, `v1/spec_decode/dflash.py`, checked by
tests/kinds/dflash/test_dflash_export.py):
- config.json: `architectures: ["DFlashDraftModel"]` (registered as `DFlashQwen3ForCausalLM`),
  `model_type: "qwen3"` (the layers are built from a Qwen3Config: per-head q/k norms, rotary, gated
  MLP), the draft's sizes with `num_hidden_layers` = the draft's own layers, `vocab_size` = the target's
  and `draft_vocab_size` when the draft's is smaller, `target_hidden_size` (fc input = that times the
  number of target layers), the rotary settings (as `rope_parameters` and as `rope_theta` /
  `rope_scaling`), and `dflash_config`: `mask_token_id` (the id vLLM feeds the mask slots),
  `target_layer_ids` (DFlash's numbering, the output of layer i: vLLM adds 1 and captures the input of
  layer i + 1, the same hidden state) and `causal` (attention inside the block). `block_size` is
  DFlash's own record; vLLM takes the block from `num_speculative_tokens` (one bonus query + K masks).
- model.safetensors: `fc.weight`, `hidden_norm.weight`, `norm.weight` and per layer
  `layers.{i}.self_attn.{q,k,v,o}_proj.weight`, `layers.{i}.self_attn.{q,k}_norm.weight`,
  `layers.{i}.mlp.{gate,up,down}_proj.weight`, `layers.{i}.{input,post_attention}_layernorm.weight`
  (vLLM prefixes `model.` and stacks q/k/v and gate/up itself). `lm_head.weight` and `d2t` (int64,
  vLLM's `draft_id_to_target_id`; `t2d`, bool, which vLLM skips) only with a reduced draft vocabulary:
  with the full one vLLM has no `draft_id_to_target_id` to load a d2t into and shares the target's LM
  head when the file has none, which is exactly the draft's (the target's rows, frozen). No
  `embed_tokens`: vLLM shares the target's.
- mask_embedding.pt: `{"mask_token_id": id, "embedding": [hidden]}`, which vLLM's `_read_mask_embedding`
  reads from the draft directory (a local one too: `get_hf_file_bytes` looks there first) and
  substitutes for the embedding of `mask_token_id`: the mask slots' input is the draft's trained
  vector. vLLM substitutes it wherever that id is in the block, the last token included, where
  drafttrain's model reads the token's own embedding: a mask_token_id the target never emits keeps
  the two the same.
drafttrain's own record (the target's layer count) is kept under `drafttrain` in config.json.
"""

from __future__ import annotations

import io
import pickle
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ...errors import UserError
from ...export import (building_draft, card_acceptance_section, card_info_lines, card_vllm_usage, check_vocab_maps,
                       check_weights, config_int, decoder_config_fields, draft_sizes, hidden_act, optional_config_int,
                       positive_number, read_export_config, read_weights, rope_parameters, save_tensor_dir,
                       t2d_from_d2t)
from .model import DFlashConfig, DFlashDraft

ARCHITECTURE = "DFlashDraftModel"
MASK_EMBEDDING_NAME = "mask_embedding.pt"
# Our flat layer modules -> vLLM's (Qwen3's) `self_attn.` / `mlp.` sub-modules.
_SERVED_MODULES = {**{m: f"self_attn.{m}" for m in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")},
                   **{m: f"mlp.{m}" for m in ("gate_proj", "up_proj", "down_proj")}}
_VOCAB_MAPS = ("lm_head.weight", "d2t", "t2d")  # written only with a reduced draft vocabulary


@dataclass
class DFlashInfo:
    """What a loaded checkpoint says about itself, beyond the weights."""

    target_layer_ids: tuple[int, ...]  # DFlash's numbering: the output of target layer i
    block_size: int
    mask_token_id: int
    draft_vocab_size: int
    vocab_size: int
    target_hidden_size: int
    target_num_layers: int
    head_from_target: bool  # the file has no lm_head (full vocabulary): the target's is attached, or must be
    config: dict = field(default_factory=dict)  # config.json as written


def reduced_vocab(config: DFlashConfig) -> bool:
    return config.draft_vocab_size < config.vocab_size


def served_name(name: str) -> str:
    """Our state_dict name -> vLLM's checkpoint name: `layers.0.q_proj.weight` ->
    `layers.0.self_attn.q_proj.weight`, `layers.0.gate_proj.weight` -> `layers.0.mlp.gate_proj.weight`."""
    match = re.fullmatch(r"(layers\.\d+\.)(\w+)(\.weight)", name)
    if match and match[2] in _SERVED_MODULES:
        return f"{match[1]}{_SERVED_MODULES[match[2]]}{match[3]}"
    return name


def served_state(state: dict[str, torch.Tensor], config: DFlashConfig) -> dict[str, torch.Tensor]:
    """The tensors of model.safetensors, by vLLM's names: all but the mask embedding (its own file) and,
    with the full vocabulary, the LM head and the maps (vLLM shares the target's head)."""
    left_out = {"mask_embedding", *(() if reduced_vocab(config) else _VOCAB_MAPS)}
    return {served_name(k): v for k, v in state.items() if k not in left_out}


def dflash_config_dict(config: DFlashConfig, dtype: torch.dtype) -> dict:
    """config.json for `config` (see the module docstring for what vLLM reads)."""
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "qwen3",
        "num_hidden_layers": config.num_hidden_layers,
        **decoder_config_fields(config, dtype),
        **({"draft_vocab_size": config.draft_vocab_size} if reduced_vocab(config) else {}),
        "block_size": config.block_size,
        "dflash_config": {"mask_token_id": config.mask_token_id, "target_layer_ids": list(config.target_layer_ids),
                          "causal": config.causal},
        "drafttrain": {"target_num_layers": config.target_num_layers,
                       "target_layer_ids_convention": "DFlash: i = the output of layer i (hidden_states[i + 1])",
                       "mask_embedding": MASK_EMBEDDING_NAME},
    }


def model_card(cfg: dict, acceptance_table: list[dict] | None, base_info: dict | None) -> str:
    info = dict(base_info or {})
    target = str(info.get("target") or info.get("target_model") or "TARGET")
    ours, dflash = cfg["drafttrain"], cfg["dflash_config"]
    drafts = cfg["block_size"] - 1
    vocabulary = (f"the {cfg['draft_vocab_size']} most frequent tokens of the target's answers, out of its "
                  f"{cfg['vocab_size']} (an LM head of their rows and `d2t` mapping them to the target's ids)"
                  if "draft_vocab_size" in cfg else
                  f"the target's whole vocabulary of {cfg['vocab_size']} tokens (its LM head is the target's, "
                  "shared, not stored)")
    lines = [
        "---",
        "library_name: vllm",
        "tags: [dflash, speculative-decoding, drafttrain]",
        "---",
        "",
        f"# DFlash draft for {target}",
        "",
        f"A DFlash block drafter (Chen et al. 2026): {cfg['num_hidden_layers']} Qwen3 decoder layer(s) whose keys "
        f"and values of the context are made from the target's hidden states (the outputs of layers "
        f"{', '.join(map(str, dflash['target_layer_ids']))} of {ours['target_num_layers']}), drafting a block of "
        f"{drafts} tokens in ONE forward: the last accepted token and {drafts} mask slots, attending to each "
        f"other {'causally' if dflash['causal'] else 'non-causally'}. The mask slots' input is a trained mask "
        f"embedding (`{MASK_EMBEDDING_NAME}`, which vLLM substitutes for token id {dflash['mask_token_id']}). "
        f"It proposes tokens from {vocabulary}. The target verifies every drafted "
        "token, so the output is exactly the target's (greedy) or has its distribution (sampling). Made with "
        "drafttrain; stored in the layout vLLM loads.",
        "",
        "## How it was made",
        "",
        f"- **sizes**: hidden {cfg['hidden_size']}, intermediate {cfg['intermediate_size']}, heads "
        f"{cfg['num_attention_heads']} / {cfg['num_key_value_heads']} KV, {cfg['num_hidden_layers']} layer(s), "
        f"block size {cfg['block_size']}; weights in {cfg['torch_dtype']}",
        *card_info_lines(info),
        *card_acceptance_section(acceptance_table),
        "## Use it",
        "",
        *card_vllm_usage(target, "dflash", "dflash", drafts),
    ]
    return "\n".join(lines)


def save_dflash(draft: DFlashDraft, out_dir, *, acceptance_table: list[dict] | None = None,
                base_info: dict | None = None, record: dict | None = None) -> Path:
    """Write config.json, model.safetensors, mask_embedding.pt and README.md to `out_dir`, replacing it
    atomically. `acceptance_table`: rows for the card (`drafttrain.export.render_acceptance_table`);
    `record`: drafttrain.json (held-out acceptance and plans)."""
    config = draft.config
    if not reduced_vocab(config) and bool(draft.d2t.any()):
        raise ValueError("a full-vocabulary draft's ids must be the target's (d2t all 0): vLLM serves it with the "
                         "target's own LM head")
    cfg = dflash_config_dict(config, draft.fc.weight.dtype)
    mask = io.BytesIO()
    torch.save({"mask_token_id": config.mask_token_id, "embedding": draft.mask_embedding.detach().cpu().clone()},
               mask)
    return save_tensor_dir(out_dir, served_state(draft.state_dict(), config), cfg,
                           model_card(cfg, acceptance_table, base_info), record,
                           extra_files={MASK_EMBEDDING_NAME: mask.getvalue()})


@torch.no_grad()
def attach_target_head(draft: DFlashDraft, head_weight: torch.Tensor) -> DFlashDraft:
    """Fill the draft's (frozen) LM head with the target's rows of the draft vocabulary: a
    full-vocabulary export stores no head (vLLM shares the target's), so its loader takes it from
    the target (`target.get_output_embeddings().weight`)."""
    c = draft.config
    if tuple(head_weight.shape) != (c.vocab_size, c.hidden_size):
        raise UserError(f"the target's LM head is {tuple(head_weight.shape)} but this DFlash draft needs "
                        f"({c.vocab_size}, {c.hidden_size}); use the draft with its own target")
    rows = head_weight.detach().index_select(0, draft.draft_target_ids.to(head_weight.device))
    draft.lm_head.weight.copy_(rows.to(draft.lm_head.weight))
    draft.lm_head.requires_grad_(False)
    return draft


def _dflash_section(cfg: dict, where: Path, vocab: int) -> tuple[int, list, bool]:
    """dflash_config's (mask_token_id, target_layer_ids, causal), each checked."""
    section = cfg.get("dflash_config")
    if not isinstance(section, dict):
        raise UserError(f"{where}: dflash_config must be a JSON object with mask_token_id and target_layer_ids, "
                        f"got {section!r}; re-export the draft")
    mask, layers, causal = section.get("mask_token_id"), section.get("target_layer_ids"), section.get("causal", False)
    if not isinstance(mask, int) or isinstance(mask, bool) or not 0 <= mask < vocab:
        raise UserError(f"{where}: dflash_config.mask_token_id must be a token id in [0, {vocab}), got {mask!r}; "
                        "re-export the draft")
    if not isinstance(layers, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in layers):
        raise UserError(f"{where}: dflash_config.target_layer_ids must be a list of layer numbers, got {layers!r}; "
                        "re-export the draft")
    if not isinstance(causal, bool):
        raise UserError(f"{where}: dflash_config.causal must be true or false, got {causal!r}; re-export the draft")
    return mask, layers, causal


def _check_architecture(cfg: dict, where: Path) -> None:
    archs = cfg.get("architectures") or []
    if ARCHITECTURE not in archs:
        raise UserError(f"{where}: architectures is {archs}, not [{ARCHITECTURE!r}]; pass a DFlash draft directory "
                        "(for an EAGLE-3 draft use --eagle3, for a draft LM --draft)")
    if cfg.get("model_type") != "qwen3":
        raise UserError(f"{where}: model_type is {cfg.get('model_type')!r}, not 'qwen3' (vLLM builds a DFlash "
                        "draft's layers from a Qwen3 config); re-export the draft")
    if cfg.get("attention_bias"):
        raise UserError(f"{where}: attention_bias is {cfg['attention_bias']!r}; drafttrain's DFlash layers have no "
                        "biases, re-export the draft")


def _dflash_config(cfg: dict, where: Path, *, hidden: int, vocab: int, draft_vocab: int, target_hidden: int,
                   layers: int) -> DFlashConfig:
    """The draft's config with every field checked: a malformed one names itself and the file."""
    heads = config_int(cfg, "num_attention_heads", where)
    mask, layer_ids, causal = _dflash_section(cfg, where, vocab)
    try:
        return DFlashConfig(
            hidden_size=hidden, intermediate_size=config_int(cfg, "intermediate_size", where),
            num_hidden_layers=config_int(cfg, "num_hidden_layers", where), num_attention_heads=heads,
            num_key_value_heads=optional_config_int(cfg, "num_key_value_heads", heads, where),
            head_dim=optional_config_int(cfg, "head_dim", hidden // heads, where),
            rms_norm_eps=positive_number(cfg, "rms_norm_eps", 1e-6, where), vocab_size=vocab,
            draft_vocab_size=draft_vocab, target_hidden_size=target_hidden, target_num_layers=layers,
            target_layer_ids=tuple(layer_ids), block_size=config_int(cfg, "block_size", where), mask_token_id=mask,
            max_position_embeddings=config_int(cfg, "max_position_embeddings", where), causal=causal,
            rope_parameters=rope_parameters(cfg, where), hidden_act=hidden_act(cfg, where),
            initializer_range=positive_number(cfg, "initializer_range", 0.02, where))
    except UserError as e:  # DFlashConfig's own checks (block size, target layers) name the field
        raise UserError(f"{where}: {e}") from None
    except ValueError as e:
        raise UserError(f"{where}: {e}; re-export the draft") from None


def _read_mask_embedding(path: Path, config: DFlashConfig) -> torch.Tensor:
    """mask_embedding.pt as vLLM reads it (a dict of mask_token_id and embedding, or the bare vector),
    checked against config.json's mask_token_id and the hidden size."""
    file = path / MASK_EMBEDDING_NAME
    if not file.is_file():
        raise UserError(f"DFlash draft directory {path} has no {MASK_EMBEDDING_NAME} (the mask slots' embedding); "
                        "re-export the draft")
    try:
        state = torch.load(file, map_location="cpu", weights_only=True)
    except (RuntimeError, EOFError, OSError, ValueError, pickle.UnpicklingError) as e:  # damaged, or not a tensor file
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise UserError(f"{file} is damaged ({first}); re-export the draft") from None
    if isinstance(state, dict):
        if state.get("mask_token_id", config.mask_token_id) != config.mask_token_id:
            raise UserError(f"{file}: mask_token_id {state.get('mask_token_id')!r} is not config.json's "
                            f"dflash_config.mask_token_id {config.mask_token_id}; re-export the draft")
        state = state.get("embedding")
    if not isinstance(state, torch.Tensor) or not state.is_floating_point() or state.numel() != config.hidden_size:
        raise UserError(f"{file} must hold the mask embedding, {config.hidden_size} floats, got "
                        f"{tuple(state.shape) if isinstance(state, torch.Tensor) else type(state).__name__}; "
                        "re-export the draft")
    if not torch.isfinite(state).all():
        raise UserError(f"{file}: the mask embedding holds non-finite values; the checkpoint is damaged, re-export "
                        "the draft")
    return state.reshape(-1)


def _our_state(path: Path, served: dict[str, torch.Tensor], draft: DFlashDraft) -> dict[str, torch.Tensor]:
    """The file's tensors (vLLM's names), checked and renamed to the draft's state_dict; with the full
    vocabulary the maps are the identity and the head is left out (NaN until the target's is attached)."""
    config, expected = draft.config, draft.state_dict()
    by_served = {served_name(k): k for k in expected if k != "mask_embedding"}
    names = set(by_served)
    if not reduced_vocab(config):  # no maps, and a head only where the file has one
        names -= {"d2t", "t2d"} | ({"lm_head.weight"} - set(served))
    elif "d2t" in served and "t2d" not in served:  # vLLM skips t2d; rebuild it
        served["t2d"] = t2d_from_d2t(served["d2t"], config.vocab_size)
    check_weights(path, served, {k: expected[by_served[k]] for k in names})
    state = {by_served[k]: v for k, v in served.items()}
    if reduced_vocab(config):
        check_vocab_maps(path, state["d2t"], state["t2d"], config.vocab_size)
    else:
        state["d2t"] = torch.zeros(config.vocab_size, dtype=torch.long)
        state["t2d"] = torch.ones(config.vocab_size, dtype=torch.bool)
        state.setdefault("lm_head.weight", torch.full_like(expected["lm_head.weight"], float("nan")))
    state["d2t"], state["t2d"] = state["d2t"].to(torch.long), state["t2d"].bool()
    return state


def load_dflash(path, device=None, dtype: torch.dtype | None = None, target_config=None,
                target_lm_head: torch.Tensor | None = None) -> tuple[DFlashDraft, DFlashInfo]:
    """Read a draft saved by `save_dflash`. `dtype` defaults to the file's. With `target_config`, the
    draft is checked against that target. A full-vocabulary draft's file has no LM head (vLLM shares
    the target's): pass `target_lm_head` (`target.get_output_embeddings().weight`), or call
    `attach_target_head` before use (until then the head is NaN; `info.head_from_target` says so).
    Attach the target's embedding before use too: `draft.attach_embeddings(target.get_input_embeddings())`."""
    path = Path(path)
    config_file = path / "config.json"
    cfg = read_export_config(path, "DFlash draft directory", "drafttrain's DFlash export", "a DFlash draft directory",
                             "re-export the draft")
    _check_architecture(cfg, config_file)
    hidden, vocab, draft_vocab, target_hidden, layers = draft_sizes(cfg, config_file, path, target_config, "DFlash draft")
    config = _dflash_config(cfg, config_file, hidden=hidden, vocab=vocab, draft_vocab=draft_vocab,
                            target_hidden=target_hidden, layers=layers)

    served = read_weights(path, "DFlash draft directory")
    file_dtype = served["fc.weight"].dtype if "fc.weight" in served else torch.float32
    with building_draft(config_file):
        draft = DFlashDraft(config).to(file_dtype)
    state = _our_state(path, served, draft)
    head_from_target = not reduced_vocab(config) and "lm_head.weight" not in served
    state["mask_embedding"] = _read_mask_embedding(path, config).to(file_dtype)
    draft.load_state_dict(state)
    draft.lm_head.requires_grad_(False)  # the target's rows, frozen
    draft.to(device=device, dtype=dtype or file_dtype)
    if head_from_target and target_lm_head is not None:
        attach_target_head(draft, target_lm_head)
    info = DFlashInfo(target_layer_ids=config.target_layer_ids, block_size=config.block_size,
                      mask_token_id=config.mask_token_id, draft_vocab_size=draft_vocab, vocab_size=vocab,
                      target_hidden_size=target_hidden, target_num_layers=layers,
                      head_from_target=head_from_target, config=cfg)
    return draft.eval(), info
