"""The eager cached LM: the model's own forward on transformers' DynamicCache.

The reference every other engine is tested against, and the fallback for any architecture and
device. Rollback crops the cache; a tree pass hands the model a 4-D additive mask and explicit
positions; `compact` gathers the accepted path's entries (`compact_cache`).
"""

from __future__ import annotations

import contextlib
import copy

import torch

from ...errors import UserError
from ...trees import Tree
from .base import CachedLM, select_hidden
from .matmul import use_skinny_matmuls

MASKABLE_ATTENTION = ("sdpa", "eager")  # kernels that honour a custom 4-D mask
# Prefills kept while `keeping_prefills`, the oldest dropped first: a plan's probes (one, or three
# where its prompts differ in length), each with and without the hidden layers its drafter reads.
KEPT_PREFILLS = 8


def forward_parameters(model):
    """The keywords the model's forward takes (transformers renames and adds some between releases)."""
    import inspect

    return inspect.signature(model.forward).parameters


def cache_argument(model) -> str:
    """The name the model's forward takes its KV cache under: `cache` from transformers 5.24,
    `past_key_values` before (5.24 still takes the old name, with a warning on stderr that would
    break the one-line error contract of every command)."""
    return "cache" if "cache" in forward_parameters(model) else "past_key_values"


def head_argument(model) -> str | None:
    """The keyword that limits a forward's LM head to the last positions (`logits_to_keep` in
    transformers 5's causal LMs), None for a model without one (its prefill computes every row)."""
    return "logits_to_keep" if "logits_to_keep" in forward_parameters(model) else None


def returned_cache(out):
    """The KV cache a forward returned, under either transformers' name (see `cache_argument`)."""
    return out["cache"] if "cache" in out.keys() else out["past_key_values"]


class EagerLM(CachedLM):
    engine = "eager"

    def __init__(self, model, *, max_length: int | None = None):
        self.model = model
        self.device = next(model.parameters()).device
        use_skinny_matmuls(model)
        self.cache_argument = cache_argument(model)
        self.head_argument = head_argument(model)
        self.max_length = max_length
        self.cache = None
        self.length = 0  # tokens held in the cache
        self.kept: dict | None = None  # (tokens, hidden layers) -> (cache, hidden) while `keeping_prefills`

    @property
    def supports_trees(self) -> bool:
        attn = getattr(self.model.config, "_attn_implementation", None) or "eager"
        return attn in MASKABLE_ATTENTION

    def reset(self) -> None:
        self.cache = new_cache(self.model.config)
        self.length = 0

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, *, tree: Tree | None = None, hidden_layers: tuple[int, ...] = ()):
        n = tokens.numel()
        self._check_room(n)
        mask = positions = None
        if tree is not None and not _is_chain(tree):  # a chain is causal: the model's own mask is right
            if not self.supports_trees:
                attn = getattr(self.model.config, "_attn_implementation", None)
                raise UserError(f"tree decoding needs an attention kernel that accepts custom masks, but the target "
                                f"uses {attn!r}; load it with attn_implementation='sdpa' or use a chain tree")
            mask, positions = tree_attention_inputs(tree, self.length, self.device, self.model.dtype)
            mask = sliding_tree_masks(self.model.config, mask, positions, self.length)
        return self._run(tokens, mask, positions, hidden_layers)

    @contextlib.contextmanager
    def keeping_prefills(self):
        """`CachedLM.keeping_prefills`: Gemma-3-270M's prefill of a 167-token probe is 0.35-0.44 s on 2
        cores, and a plan's whole steps, loop overheads and forward curves each prefilled it again.
        A kept prefill is restored as a copy (the decode after it appends to its own cache), so
        what follows is what follows a prefill computed afresh. Nested: the outer context's kept."""
        outer = self.kept
        self.kept = {} if outer is None else outer
        try:
            yield
        finally:
            self.kept = outer

    @torch.inference_mode()
    def prefill(self, tokens: torch.Tensor, *, hidden_layers: tuple[int, ...] = ()):
        """`forward` with the LM head over the last token only (transformers' `logits_to_keep`);
        a copy of a kept one where `keeping_prefills` holds it."""
        self._check_room(tokens.numel())
        key = (tuple(tokens.tolist()), tuple(hidden_layers)) if self.kept is not None and self.length == 0 else None
        if key is not None and key in self.kept:
            cache, hidden = self.kept[key]
            self.cache, self.length = copy.deepcopy(cache), tokens.numel()
            return None if hidden is None else hidden.clone()
        head = {self.head_argument: 1} if self.head_argument else {}
        hidden = self._run(tokens, None, None, hidden_layers, **head)[1]
        if key is not None:
            if len(self.kept) >= KEPT_PREFILLS:
                del self.kept[next(iter(self.kept))]
            self.kept[key] = (copy.deepcopy(self.cache), None if hidden is None else hidden.clone())
        return hidden

    def _run(self, tokens: torch.Tensor, mask, positions, hidden_layers: tuple[int, ...], **head):
        out = self.model(input_ids=tokens.view(1, -1), use_cache=True, attention_mask=mask, position_ids=positions,
                         output_hidden_states=bool(hidden_layers), **{self.cache_argument: self.cache}, **head)
        self.cache = returned_cache(out)
        self.length += tokens.numel()
        hidden = select_hidden([h[0] for h in out.hidden_states], hidden_layers) if hidden_layers else None
        return out.logits[0], hidden

    def rollback(self, length: int) -> None:
        self._check_rollback(length)
        drop = self.length - length
        if drop:
            self.cache.crop(-drop)  # a negative count works on every transformers 5.x
            self.length = length

    def compact(self, past_len: int, nodes, path=None) -> None:
        nodes = [int(n) for n in nodes]
        self._check_compact(past_len, nodes)
        if nodes != list(range(len(nodes))):  # an accepted chain prefix is already in place
            compact_cache(self.cache, past_len, nodes)
            self.length = past_len + len(nodes)
        else:
            self.rollback(past_len + len(nodes))


def new_cache(config):
    """An empty DynamicCache. Built from a config with a sliding window (Gemma-3's local layers),
    transformers keeps only the window's last tokens on those layers and cannot roll back past
    it; without the config every layer keeps every token, and the model's masks still apply the
    window."""
    from transformers import DynamicCache

    if getattr(config, "sliding_window", None) is not None:
        return DynamicCache()
    try:
        return DynamicCache(config=config)
    except TypeError:  # older signature
        return DynamicCache()


def sliding_tree_masks(config, mask: torch.Tensor, positions: torch.Tensor, past_len: int):
    """`mask` as the per-layer-type dict a model with sliding layers (Gemma-3) takes: one 4-D mask
    would reach its sliding layers unwindowed. A key is visible there only while
    q_pos - k_pos < window, with tree nodes at their own positions."""
    if "sliding_attention" not in (getattr(config, "layer_types", None) or []):
        return mask
    key_pos = torch.cat([torch.arange(past_len, device=positions.device), positions[0]])
    far = positions[0][:, None] - key_pos[None, :] >= config.sliding_window
    return {"full_attention": mask, "sliding_attention": mask.masked_fill(far, torch.finfo(mask.dtype).min)}


def _is_chain(tree: Tree) -> bool:
    return tree.parents is not None and tree.parents == [-1] + list(range(tree.num_nodes - 1))


def tree_attention_inputs(tree: Tree, past_len: int, device=None,
                          dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Additive mask [1, 1, N, past_len + N] and position ids [1, N] for an eager tree pass.

    Node n sees every cached position and its tree ancestors, and sits at position
    past_len + depth(n) (siblings share a position, exactly as if each path were decoded alone).
    """
    N = tree.num_nodes
    allowed = torch.cat([torch.ones(N, past_len, dtype=torch.bool), tree.attention_mask.cpu()], dim=1)
    mask = torch.zeros(N, past_len + N, dtype=dtype)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    position_ids = (tree.depths.cpu() + past_len).unsqueeze(0)
    return mask[None, None].to(device), position_ids.to(device)


def compact_cache(cache, past_len: int, keep_node_indices) -> None:
    """DynamicCache version of `CachedLM.compact`: keep the prefix and the kept nodes' entries, in
    place, in the given order (`EagerLM.compact` calls this; nothing else touches a cache)."""
    keep = torch.as_tensor(list(keep_node_indices), dtype=torch.long)
    for layer in cache.layers:
        if getattr(layer, "is_sliding", False) or hasattr(layer, "cumulative_length"):
            raise NotImplementedError("compact_cache supports full-attention DynamicCache layers only")
        if layer.keys is None or layer.keys.numel() == 0:
            continue  # uninitialised layer (e.g. KV sharing)
        if keep.numel() and (int(keep.min()) < 0 or past_len + int(keep.max()) >= layer.keys.shape[-2]):
            raise ValueError(f"node indices {keep.tolist()} out of range for a cache of "
                             f"{layer.keys.shape[-2]} entries with past_len={past_len}")
        index = torch.cat([torch.arange(past_len), past_len + keep]).to(layer.keys.device)
        layer.keys = layer.keys.index_select(-2, index)
        layer.values = layer.values.index_select(-2, index)
