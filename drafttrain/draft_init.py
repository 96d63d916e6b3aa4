"""Build a draft from the target itself (a subset of its decoder layers) when no small sibling exists.

Keeping every few layers, plus the embeddings, final norm and LM head, gives a model that already
speaks the target's vocabulary and roughly tracks its residual stream, so distillation starts far
closer to the target than a random init (the "layer-skip" initialization used by e.g. DistillSpec
baselines). The draft is a fresh model of the same class, so it saves, loads and works as
`assistant_model=` like any other Hugging Face model.
"""

from __future__ import annotations

import copy
import re

import torch

from .errors import UserError

# Where causal-LM classes keep their stack of decoder blocks.
LAYER_PATHS = ("model.layers", "transformer.h", "gpt_neox.layers", "model.decoder.layers")

# Config lists with one entry per layer: the draft keeps the entries of the layers it keeps.
PER_LAYER_LISTS = ("layer_types", "no_rope_layers", "kv_sharing_modes")

# Config lists of layer indices (e.g. Qwen-MoE's dense layers): remapped to the draft's numbering.
LAYER_INDEX_LISTS = ("mlp_only_layers",)


def parse_layer_spec(spec: str | list[int] | tuple[int, ...], num_layers: int) -> list[int]:
    """Turn "every:N", "first:N", "0,4,8" (negative = from the end) or a list into layer indices."""
    if isinstance(spec, str):
        text = spec.strip().replace(" ", "")
        mode = re.fullmatch(r"(every|first):(\d+)", text)
        if mode:
            n = int(mode.group(2))
            if n < 1:
                raise UserError(f"layer spec {spec!r}: N must be at least 1")
            if mode.group(1) == "first" and n > num_layers:
                raise UserError(f"layer spec {spec!r} asks for {n} layers but the target has {num_layers}")
            layers = list(range(0, num_layers, n)) if mode.group(1) == "every" else list(range(n))
        elif re.fullmatch(r"-?\d+(,-?\d+)*", text):
            layers = [int(x) for x in text.split(",")]
        else:
            raise UserError(f"layer spec {spec!r} is not understood; write every:N, first:N or "
                            "a comma-separated list like 0,4,8")
    elif isinstance(spec, (list, tuple)) and all(isinstance(x, int) and not isinstance(x, bool) for x in spec):
        layers = list(spec)
    else:
        raise UserError(f"layer spec {spec!r} is not understood; give every:N, first:N or a list of ints")

    if not layers:
        raise UserError(f"layer spec {spec!r} selects no layers; keep at least one")
    bad = [i for i in layers if not -num_layers <= i < num_layers]
    if bad:
        raise UserError(f"layer spec {spec!r}: {bad} out of range for a target with {num_layers} layers "
                        f"(valid: 0..{num_layers - 1}, or negative from the end)")
    layers = [i % num_layers for i in layers]
    if any(b <= a for a, b in zip(layers, layers[1:])):
        raise UserError(f"layer spec {spec!r} gives {layers}; list each layer once, in increasing order")
    return layers


def decoder_layers(model) -> tuple[str, torch.nn.ModuleList]:
    """(dotted path, module list) of the model's decoder blocks, or a UserError naming the model type."""
    for path in LAYER_PATHS:
        node = model
        for part in path.split("."):
            node = getattr(node, part, None)
        if isinstance(node, torch.nn.ModuleList) and len(node) > 0:
            return path, node
    model_type = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
    raise UserError(f"cannot build a layer-subset draft for model type {model_type!r}: no decoder layer "
                    f"list at {', '.join(LAYER_PATHS)}; pick a small model of the same family as --draft instead")


def draft_from_target(target_model, layers: list[int] | str):
    """A fresh model of the target's class holding a copy of the chosen decoder layers.

    Embeddings, final norm and LM head are copied (and tied if the target ties them); the
    config gets `num_hidden_layers=len(layers)` and its per-layer lists are subset. Building a
    fresh model (rather than deleting layers from a copy) numbers the attention modules'
    `layer_idx` 0..n-1, which is what the KV cache indexes by.
    """
    path, blocks = decoder_layers(target_model)
    config = target_model.config
    if getattr(config, "is_heterogeneous", False):
        raise UserError(f"model type {config.model_type!r} has per-layer configs, which layer-subset "
                        "drafts do not support; pick a small model of the same family as --draft instead")
    keep = parse_layer_spec(layers, len(blocks))

    new_config = copy.deepcopy(config)
    new_config.num_hidden_layers = len(keep)
    for name in PER_LAYER_LISTS:
        values = getattr(config, name, None)
        if isinstance(values, (list, tuple)) and len(values) == len(blocks):
            setattr(new_config, name, [values[i] for i in keep])
    for name in LAYER_INDEX_LISTS:
        values = getattr(config, name, None)
        if isinstance(values, (list, tuple)):
            setattr(new_config, name, [keep.index(i) for i in values if i in keep])

    draft = type(target_model)._from_config(new_config, dtype=target_model.dtype)
    draft.load_state_dict(_remap_state_dict(target_model.state_dict(), path, keep), strict=True)
    draft.generation_config = copy.deepcopy(target_model.generation_config)
    draft.to(target_model.device)
    draft.train(target_model.training)
    return draft


def _remap_state_dict(state: dict, path: str, keep: list[int]) -> dict:
    """Rename `path.{old}.` to `path.{new}.` for kept layers and drop the others."""
    new_index = {old: new for new, old in enumerate(keep)}
    pattern = re.compile(rf"^{re.escape(path)}\.(\d+)\.(.*)$")
    out = {}
    for key, tensor in state.items():
        m = pattern.match(key)
        if m is None:
            out[key] = tensor
        elif int(m.group(1)) in new_index:
            out[f"{path}.{new_index[int(m.group(1))]}.{m.group(2)}"] = tensor
    return out
