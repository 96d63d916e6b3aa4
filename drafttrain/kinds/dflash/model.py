"""A DFlash block draft (Chen et al. 2026): a block of drafts from ONE forward on the target's features.

The target's hidden states at a few of its layers (`target_layer_ids`, DFlash's numbering: the
output of layer i, transformers' `hidden_states[i + 1]`) are concatenated and projected (`fc`),
normalised (`hidden_norm`) and become, in every draft layer, the keys and values of the context:
one entry per position the target has verified. The queries are a block at positions p .. p+B-1:
the last accepted token (the target's bonus token, at p, which has no features yet) and B-1 mask
slots. Within the block attention is non-causal (every slot sees the whole block and the context);
the output at mask slot j is the draft for position p + j, so B-1 drafts come from one forward
whatever B, where an EAGLE-3 draft runs one forward per draft.

The layers are Qwen3's (per-head `q_norm`/`k_norm`, rotary, gated MLP), the shape vLLM's
`DFlashDraftModel` loads (`export.py`). The target's embedding is shared and frozen (read raw, without
a model's embedding scale, as vLLM shares it); the mask slots' embedding is a vector of the draft's
own (`mask_embedding`, exported as `mask_embedding.pt`, which vLLM substitutes for `mask_token_id`),
so no spare token of the tokenizer is needed. The LM head is the target's rows of the draft
vocabulary, frozen (the whole vocabulary, or the most used tokens where it is large: Gemma-3's 262k).

Training (`forward`) draws several anchors per sequence and runs all their blocks in one pass: block
i's queries see the context before its anchor and their own block (`block_mask`). Decoding reuses the
same pieces (`context`, `DFlashLayer.context_kv`, `DFlashLayer.forward`, `embed_block`, `logits`) over
a cache (the run time, `decode.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn

from ...errors import UserError
from ..layers import DraftShape, RMSNorm, norm_scale, rotate, softmax

MIN_BLOCK, MAX_BLOCK = 2, 32  # a block holds the last token and at least one mask; past 32 the tail drafts go unused


def default_target_layer_ids(num_layers: int, count: int = 3) -> tuple[int, ...]:
    """`count` layers evenly spaced from layer 1 to layer L-3 (DFlash's choice: the last layers
    specialise in the target's own next token), as DFlash numbers them (the output of layer i)."""
    if count == 1:
        return (num_layers // 2,)
    low, high = 1, max(1, num_layers - 3)
    return tuple(sorted({round(low + i * (high - low) / (count - 1)) for i in range(count)}))


def check_target_layer_ids(ids: Sequence[int], num_layers: int) -> tuple[int, ...]:
    """`ids` checked against a target of `num_layers` layers: ascending, in [0, L-2] (vLLM captures the
    input of layer i + 1, which the last layer has none of)."""
    ids = tuple(int(i) for i in ids)
    if not ids or list(ids) != sorted(set(ids)) or ids[0] < 0 or ids[-1] > num_layers - 2:
        raise UserError(f"draft.target_layer_ids {list(ids)} must be distinct ascending layers in [0, "
                        f"{num_layers - 2}] for a target of {num_layers} layers (layer i's output; the last layer's "
                        f"is not served); e.g. {list(default_target_layer_ids(num_layers))}")
    return ids


@dataclass
class DFlashConfig(DraftShape):
    num_hidden_layers: int           # the draft's own layers
    target_layer_ids: tuple[int, ...]
    block_size: int
    mask_token_id: int
    causal: bool = False             # attention inside the block: DFlash's is non-causal

    def __post_init__(self):
        super().__post_init__()
        self.target_layer_ids = check_target_layer_ids(self.target_layer_ids, self.target_num_layers)
        if not MIN_BLOCK <= self.block_size <= MAX_BLOCK:
            raise UserError(f"draft.block_size {self.block_size} must be in [{MIN_BLOCK}, {MAX_BLOCK}]: the last "
                            f"token and 1 to {MAX_BLOCK - 1} mask slots")

    @classmethod
    def from_target(cls, target_config, draft_vocab_size: int, *, layers: int = 1, block_size: int = 8,
                    target_layer_ids: Sequence[int] | None = None, mask_token_id: int = 0) -> DFlashConfig:
        """Layers shaped like the target's (its heads, head size and MLP width), as DFlash's drafts are;
        their activation Qwen3's (SiLU), which vLLM's DFlash layers are."""
        ids = target_layer_ids if target_layer_ids is not None else default_target_layer_ids(
            target_config.num_hidden_layers)
        return cls(**DraftShape.of_target(target_config, draft_vocab_size), num_hidden_layers=layers,
                   target_layer_ids=tuple(ids), block_size=block_size, mask_token_id=mask_token_id)

    @property
    def hidden_layers(self) -> tuple[int, ...]:
        """The target's `output_hidden_states` indices the draft reads."""
        return tuple(i + 1 for i in self.target_layer_ids)

    def llama_config(self):
        """A LlamaConfig of these sizes: the rotary embedding's settings."""
        from transformers import LlamaConfig

        return LlamaConfig(hidden_size=self.hidden_size, num_attention_heads=self.num_attention_heads,
                           num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim,
                           max_position_embeddings=self.max_position_embeddings,
                           rope_parameters=dict(self.rope_parameters), num_hidden_layers=self.num_hidden_layers)


class DFlashLayer(nn.Module):
    """Qwen3's decoder layer with its keys and values split in two: the context's, made from the
    target's features (`context_kv`), and the block's own, made from the block's hidden states."""

    def __init__(self, c: DFlashConfig):
        super().__init__()
        from transformers.activations import ACT2FN

        self.heads, self.kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.q_proj = nn.Linear(c.hidden_size, c.num_attention_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)
        self.act_fn = ACT2FN[c.hidden_act]

    def _heads(self, proj: nn.Linear, x: torch.Tensor, count: int) -> torch.Tensor:
        B, n, _ = x.shape
        return proj(x).view(B, n, count, self.head_dim).transpose(1, 2)

    def kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (normed per head, rotated) and values [B, kv_heads, n, d] of normed states `x` [B, n, H]."""
        return rotate(self.k_norm(self._heads(self.k_proj, x, self.kv_heads)), cos, sin), \
            self._heads(self.v_proj, x, self.kv_heads)

    def context_kv(self, context: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """The context's keys and values from `context` (the features after `fc` and `hidden_norm`):
        no input norm of their own (vLLM's `precompute_and_store_context_kv`)."""
        return self.kv(context, cos, sin)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, keys: torch.Tensor,
                values: torch.Tensor, visible: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The block's hidden states `x` [B, n, H] attending to `keys`/`values` [B, kv, S, d] (the context's
        entries, then the block's own, appended here) where `visible` [B, n, S + n] allows. Returns the new
        hidden states and the block's keys and values."""
        h = self.input_layernorm(x)
        B, n, _ = h.shape
        q = rotate(self.q_norm(self._heads(self.q_proj, h, self.heads)), cos, sin)
        k, v = self.kv(h, cos, sin)
        out = attend(q, torch.cat([keys, k], dim=2), torch.cat([values, v], dim=2), visible)
        x = x + self.o_proj(out.transpose(1, 2).reshape(B, n, -1))
        h = self.post_attention_layernorm(x)
        return x + self.down_proj(self.act_fn(self.gate_proj(h)) * self.up_proj(h)), k, v


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """Softmax attention of queries [B, heads, n, d] over grouped keys/values [B, kv_heads, S, d];
    visible: bool [B, n, S]. Every query sees at least its own block."""
    B, heads, n, d = q.shape
    groups = heads // k.shape[1]
    q = q.view(B, k.shape[1], groups, n, d)
    scores = q @ k.unsqueeze(2).transpose(-1, -2) / d ** 0.5
    scores = scores.masked_fill(~visible[:, None, None], torch.finfo(scores.dtype).min)
    return (softmax(scores) @ v.unsqueeze(2)).view(B, heads, n, d)


def block_visible(context_visible: torch.Tensor, blocks: int, block_size: int, causal: bool) -> torch.Tensor:
    """What each of `blocks` blocks' queries see: `context_visible` [B, blocks, S] of the context
    (each block its own row), then its own block's slots (all, or up to itself when `causal`), never
    another block's. Returns bool [B, blocks·block_size, S + blocks·block_size]."""
    B, _, S = context_visible.shape
    device = context_visible.device
    n = blocks * block_size
    block_of = torch.arange(n, device=device) // block_size
    own = block_of[:, None] == block_of[None, :]
    if causal:
        own = own & torch.ones(n, n, dtype=torch.bool, device=device).tril()
    context = context_visible.repeat_interleave(block_size, dim=1)
    return torch.cat([context, own.expand(B, n, n)], dim=-1)


class DFlashDraft(nn.Module):
    def __init__(self, config: DFlashConfig):
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        c = self.config = config
        self.fc = nn.Linear(len(c.target_layer_ids) * c.target_hidden_size, c.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(c) for _ in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mask_embedding = nn.Parameter(torch.zeros(c.hidden_size))
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)  # the target's rows, frozen
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(c.vocab_size, dtype=torch.bool))
        self.rotary_emb = LlamaRotaryEmbedding(config=c.llama_config())  # non-persistent buffers only
        self.__dict__["_embedding"] = None  # the target's weight, deliberately not a parameter of the draft

    # --- construction -------------------------------------------------------------------------

    @classmethod
    def from_target(cls, target, vocab, *, layers: int = 1, block_size: int = 8,
                    target_layer_ids: Sequence[int] | None = None, mask_token_id: int = 0,
                    dtype: torch.dtype | None = None, seed: int | None = None,
                    device: torch.device | None = None) -> DFlashDraft:
        """A draft for `target` over the draft vocabulary `vocab` (`eagle3.vocab.DraftVocab`),
        initialised as `init_from_target` says, the target's embedding attached."""
        if vocab.vocab_size != target.config.vocab_size:
            raise UserError(f"the draft vocabulary was built for {vocab.vocab_size} target tokens but the target "
                            f"has {target.config.vocab_size}; rebuild it from this target's answers")
        config = DFlashConfig.from_target(target.config, vocab.size, layers=layers, block_size=block_size,
                                          target_layer_ids=target_layer_ids, mask_token_id=mask_token_id)
        if seed is not None:
            torch.manual_seed(seed)
        draft = cls(config)
        draft.init_from_target(target, vocab)
        draft.to(device=device or next(target.parameters()).device, dtype=dtype or next(target.parameters()).dtype)
        return draft.attach_embeddings(target.get_input_embeddings())

    @torch.no_grad()
    def init_from_target(self, target, vocab) -> None:
        """Linear layers N(0, 0.02); norms 1 but `norm`, which takes the profile of the target's final
        norm (divided by its RMS, as EAGLE-3's does: the draft's output stands for the target's last
        hidden state, read by the target's LM head rows); the mask embedding the mean of the target's
        embedding rows, a token-like vector of the right scale."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                module.weight.normal_(0.0, self.config.initializer_range)
            elif isinstance(module, RMSNorm):
                module.weight.fill_(1.0)
        head = target.get_output_embeddings().weight
        self.lm_head.weight.copy_(head.detach().index_select(0, vocab.target_ids.to(head.device)).to(self.lm_head.weight))
        self.lm_head.requires_grad_(False)
        scale = norm_scale(getattr(getattr(target, "model", None), "norm", None))
        if scale is not None and scale.shape == self.norm.weight.shape:
            self.norm.weight.copy_(scale / scale.float().square().mean().sqrt().clamp_min(1e-6))
        embedding = target.get_input_embeddings().weight.detach()
        self.mask_embedding.copy_(embedding.float().mean(0).to(self.mask_embedding))
        self.d2t.copy_(vocab.d2t)
        self.t2d.copy_(vocab.t2d)

    def attach_embeddings(self, embedding: nn.Module) -> DFlashDraft:
        """Read tokens through the target's (frozen) embedding weight: neither trained, saved nor moved."""
        weight = embedding.weight
        if tuple(weight.shape) != (self.config.vocab_size, self.config.hidden_size):
            raise UserError(f"the target's embedding is {tuple(weight.shape)} but this draft needs "
                            f"({self.config.vocab_size}, {self.config.hidden_size}); use the draft with its own target")
        self.__dict__["_embedding"] = embedding
        return self

    # --- the pieces training and decoding share ------------------------------------------------

    def target_features(self, hidden_states: Sequence[torch.Tensor]) -> torch.Tensor:
        """The fc input [B, T, N·H] from a target's `output_hidden_states`."""
        return torch.cat([hidden_states[i] for i in self.config.hidden_layers], dim=-1).to(self.fc.weight.dtype)

    def context(self, features: torch.Tensor) -> torch.Tensor:
        """The normed context states [B, T, H] every layer's context keys and values are made from."""
        return self.hidden_norm(self.fc(features.to(self.fc.weight.dtype)))

    def rope(self, like: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rotary_emb(like, positions)

    def embed_block(self, last: torch.Tensor, size: int | None = None) -> torch.Tensor:
        """Blocks' inputs [B, blocks·size, H] from their last tokens `last` [B, blocks]: each token's raw
        embedding (the target's weight, no embedding scale), then size - 1 mask embeddings (`size`:
        the block size trained, or K + 1 when decoding K drafts, as vLLM queries K + 1 slots)."""
        size = size or self.config.block_size
        weight = self.__dict__["_embedding"].weight
        with torch.no_grad():
            first = torch.nn.functional.embedding(last, weight).to(self.fc.weight.dtype)
        B, blocks = last.shape
        masks = self.mask_embedding.to(first.dtype).expand(B, blocks, size - 1, -1)
        return torch.cat([first.unsqueeze(2), masks], dim=2).view(B, blocks * size, -1)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits of the final hidden states."""
        return self.lm_head(self.norm(hidden))

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    @property
    def draft_target_ids(self) -> torch.Tensor:
        """The target id of every draft id."""
        return torch.arange(self.config.draft_vocab_size, device=self.d2t.device) + self.d2t

    def to_target_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits -> the target's vocabulary, -inf (q = 0) outside the draft's."""
        out = logits.new_full((*logits.shape[:-1], self.config.vocab_size), float("-inf"))
        return out.index_copy_(-1, self.draft_target_ids, logits)

    def blocks(self, x: torch.Tensor, positions: torch.Tensor, context_keys, context_values,
               visible: torch.Tensor) -> torch.Tensor:
        """The draft layers over block inputs `x` [B, n, H] at `positions` [B, n], each layer attending to
        its context entries (`context_keys[i]`, `context_values[i]`: a list per layer, or a cache's
        [layers, ...] tensor) and the blocks as `visible` allows."""
        cos, sin = self.rope(x, positions)
        for layer, keys, values in zip(self.layers, context_keys, context_values):
            x, _, _ = layer(x, cos, sin, keys, values, visible)
        return x

    # --- training: every anchor's block in one forward -----------------------------------------

    def forward(self, features: torch.Tensor, input_ids: torch.Tensor, anchors: torch.Tensor, *,
                position_ids: torch.Tensor, attention_mask: torch.Tensor, size: int | None = None) -> torch.Tensor:
        """Logits [B, A, size - 1, draft vocab] of every mask slot of the blocks that start at `anchors`
        [B, A] (indices into the sequence; each block's last token is the anchor's): block a's queries
        see the context at real positions before a, and their own block. `size`: the block size
        (default the trained one; `replay` uses K + 1, as decoding does)."""
        B, T = input_ids.shape
        A, size = anchors.shape[1], size or self.config.block_size
        context = self.context(features)
        cos, sin = self.rope(context, position_ids)
        keys, values = zip(*(layer.context_kv(context, cos, sin) for layer in self.layers))
        before = torch.arange(T, device=input_ids.device)[None, None, :] < anchors[:, :, None]
        visible = block_visible(before & attention_mask.bool()[:, None, :], A, size, self.config.causal)
        x = self.embed_block(input_ids.gather(1, anchors), size)
        offsets = torch.arange(size, device=input_ids.device)
        positions = (position_ids.gather(1, anchors)[:, :, None] + offsets).view(B, A * size)
        hidden = self.blocks(x, positions, keys, values, visible).view(B, A, size, -1)
        return self.logits(hidden[:, :, 1:])
