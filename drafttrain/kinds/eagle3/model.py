"""The EAGLE-3 draft (Li et al. 2025): one decoder layer that reads the target's own features.

Layout (module names = the checkpoint names SGLang and vLLM load, see `export.py`):
`fc` (3·H_target -> H, no bias) fuses the target's hidden states from a low, a middle and a high
layer; `midlayer` is a Llama decoder layer whose attention reads [input_layernorm(embedding of
the token), hidden_norm(hidden)] (2·H wide) and whose residual stream starts from `hidden`;
`norm` + `lm_head` give logits over the reduced draft vocabulary; `d2t` / `t2d` map it to the
target's (`vocab.py`). The token embedding is the TARGET's matrix, frozen and not exported
(both engines share the target's): attach it with `attach_embeddings`.

Conventions
- Target features: transformers' `output_hidden_states` indexing. hidden_states[0] is the
  embeddings, hidden_states[i] the output of decoder layer i-1, i.e. the residual stream
  entering layer i, which is what vLLM and SGLang capture (`hidden_states + residual` before
  layer i). Allowed ids: 1 .. L-1 (the last entry is after the final norm, which no engine
  captures), strictly ascending (the engines concatenate in layer order). Default
  (2, L // 2, L - 3): the default of both engines, so an exported draft needs no layer setting.
- Index p of a sequence x (target positions pos_p): step 0 reads fc(features at p) and the
  embedding of x[p+1], sits at rotary position pos_p, and predicts x[p+2]. Step j >= 1 reads the
  draft's own output hidden state of step j-1 at p and the embedding of x[p+1+j], sits at
  position pos_p + j, and predicts x[p+2+j]. Its query sees the step-0 keys of indices <= p and
  the keys of steps 1..j at p: what a decoder that drafts j tokens past p sees in its cache.
- The hidden state a step hands on is the layer's output BEFORE `norm` (SGLang's
  `hidden_states_to_aux`, vLLM's `hidden_prenorm`); logits are lm_head(norm(hidden)).

Decoding is the run time's (`decode.py`: the draft's KV cache, its feed of the target's features and
its drafting steps, as functions of this model); the model holds what training and decoding share.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn

from ...errors import UserError
from ..layers import DraftShape, RMSNorm, norm_scale, rotate, softmax


def default_aux_layer_ids(num_layers: int) -> tuple[int, int, int]:
    """vLLM's and SGLang's default EAGLE-3 layers, as `output_hidden_states` indices."""
    return (2, num_layers // 2, num_layers - 3)


def valid_aux_layer_ids(ids: Sequence[int], num_layers: int) -> bool:
    return len(ids) == 3 and all(1 <= i <= num_layers - 1 for i in ids) and ids[0] < ids[1] < ids[2]


def suggested_aux_layer_ids(num_layers: int) -> tuple[int, int, int] | None:
    """The default where it is valid, else a low, a middle and a high layer; None below 4 layers,
    where no three distinct hidden states of layers 1 .. L-1 exist."""
    if num_layers < 4:
        return None
    default = default_aux_layer_ids(num_layers)
    return default if valid_aux_layer_ids(default, num_layers) else (1, num_layers // 2, num_layers - 1)


def check_aux_layer_ids(ids: Sequence[int] | None, num_layers: int) -> tuple[int, int, int]:
    """`ids` (None: the default), checked against a target of `num_layers` layers."""
    given = ids is not None
    ids = tuple(int(i) for i in ids) if given else default_aux_layer_ids(num_layers)
    if valid_aux_layer_ids(ids, num_layers):
        return ids
    what = f"aux_layer_ids {list(ids)}" if given else f"the default aux_layer_ids {list(ids)} (2, L//2, L-3)"
    suggestion = suggested_aux_layer_ids(num_layers)
    fix = (f"set draft.aux_layer_ids to e.g. {list(suggestion)}" if suggestion else
           f"no valid ids exist for {num_layers} layers: an EAGLE-3 draft needs a target of at least 4 layers")
    raise UserError(f"{what} must be 3 strictly ascending hidden-state indices in [1, {num_layers - 1}] for a "
                    f"target of {num_layers} layers (index i = output of layer i-1); {fix}")


@dataclass
class Eagle3Config(DraftShape):
    aux_layer_ids: tuple[int, int, int]

    def __post_init__(self):
        super().__post_init__()
        self.aux_layer_ids = check_aux_layer_ids(self.aux_layer_ids, self.target_num_layers)

    @classmethod
    def from_target(cls, target_config, draft_vocab_size: int,
                    aux_layer_ids: Sequence[int] | None = None) -> "Eagle3Config":
        """Sizes and rotary settings as the target's (EAGLE-3's choice: the draft layer is shaped
        like one of the target's layers), and its activation."""
        layers = target_config.num_hidden_layers
        return cls(**DraftShape.of_target(target_config, draft_vocab_size),
                   aux_layer_ids=tuple(aux_layer_ids) if aux_layer_ids is not None else default_aux_layer_ids(layers),
                   hidden_act=getattr(target_config, "hidden_act", "silu"))

    def llama_config(self):
        """A one-layer LlamaConfig with these sizes (rotary embedding; export)."""
        from transformers import LlamaConfig

        return LlamaConfig(
            hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_attention_heads=self.num_attention_heads, num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim, rms_norm_eps=self.rms_norm_eps, vocab_size=self.vocab_size,
            max_position_embeddings=self.max_position_embeddings, rope_parameters=dict(self.rope_parameters),
            hidden_act=self.hidden_act, num_hidden_layers=1, tie_word_embeddings=False,
            attention_bias=False, mlp_bias=False, initializer_range=self.initializer_range)


class Eagle3Attention(nn.Module):
    def __init__(self, c: Eagle3Config):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(2 * c.hidden_size, c.num_attention_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)

    def queries(self, x, cos, sin) -> torch.Tensor:
        """[B, n, 2H] -> grouped queries [B, kv_heads, heads per kv head, n, d] (GQA without copies;
        head kv·r + i is query head i of key head kv, as transformers' repeat_kv orders them)."""
        B, n, _ = x.shape
        q = rotate(self.q_proj(x).view(B, n, self.num_heads, self.head_dim).transpose(1, 2), cos, sin)
        return q.view(B, self.num_kv_heads, self.num_heads // self.num_kv_heads, n, self.head_dim)

    def keys_values(self, x, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, n, 2H] -> keys (rotated) and values, [B, kv_heads, n, d]."""
        B, n, _ = x.shape
        k = self.k_proj(x).view(B, n, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, n, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return rotate(k, cos, sin), v

    def merge(self, out: torch.Tensor) -> torch.Tensor:
        """Grouped attention output [B, kv, r, n, d] -> o_proj of [B, n, heads·d]."""
        B, _, _, n, _ = out.shape
        return self.o_proj(out.reshape(B, self.num_heads, n, self.head_dim).transpose(1, 2).reshape(B, n, -1))


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """Softmax attention of grouped queries [B, kv, r, n, d] over keys/values [B, kv, S, d];
    visible: bool [B, n, S]. Every query must see at least one key."""
    scores = q @ k.unsqueeze(2).transpose(-1, -2) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~visible[:, None, None], torch.finfo(scores.dtype).min)
    return softmax(scores) @ v.unsqueeze(2)


def attend_unrolled(q, k0, v0, visible0, diag_k: list, diag_v: list) -> torch.Tensor:
    """Training-time-test attention of step j = len(diag_k): each query (index p) sees the step-0
    keys where `visible0` [B, n, S] allows, plus the keys of steps 1..j at its own index p
    (diag_k[i]: [B, kv, n, d], row p), SpecForge's "cached keys per unroll step"."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    s0 = (q @ k0.unsqueeze(2).transpose(-1, -2)) * scale
    s0 = s0.masked_fill(~visible0[:, None, None], torch.finfo(s0.dtype).min)
    sd = torch.stack([(q * kd.unsqueeze(2)).sum(-1) for kd in diag_k], dim=-1) * scale  # [B, kv, r, n, j]
    p = softmax(torch.cat([s0, sd], dim=-1))
    S = k0.shape[2]
    vd = torch.stack(diag_v, dim=-2).unsqueeze(2)  # [B, kv, 1, n, j, d]
    return p[..., :S] @ v0.unsqueeze(2) + (p[..., S:].unsqueeze(-1) * vd).sum(-2)


class Eagle3MLP(nn.Module):
    def __init__(self, c: Eagle3Config):
        super().__init__()
        from transformers.activations import ACT2FN

        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)
        self.act_fn = ACT2FN[c.hidden_act]

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class Eagle3DecoderLayer(nn.Module):
    """`midlayer`: SGLang's / vLLM's first EAGLE-3 layer, residual taken before `hidden_norm`."""

    def __init__(self, c: Eagle3Config):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Eagle3Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = Eagle3MLP(c)

    def attention_input(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)

    def finish(self, hidden: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """Residual adds and MLP after the attention: the layer's output, before the final norm."""
        h = hidden + self.self_attn.merge(attn_out)
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Draft(nn.Module):
    def __init__(self, config: Eagle3Config):
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        c = self.config = config
        self.midlayer = Eagle3DecoderLayer(c)
        self.fc = nn.Linear(3 * c.target_hidden_size, c.hidden_size, bias=False)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(c.vocab_size, dtype=torch.bool))
        self.rotary_emb = LlamaRotaryEmbedding(config=c.llama_config())  # non-persistent buffers only
        self.__dict__["_embed_tokens"] = None  # the target's, deliberately not a submodule

    # --- construction -------------------------------------------------------------------------

    @classmethod
    def from_target(cls, target, vocab, aux_layer_ids: Sequence[int] | None = None,
                    dtype: torch.dtype | None = None, seed: int | None = None,
                    device: torch.device | None = None) -> "Eagle3Draft":
        """A draft for `target` (a transformers causal LM) over the draft vocabulary `vocab`
        (`vocab.DraftVocab`), initialised as `init_from_target` says, the target's embedding attached;
        on `device` (default: the target's)."""
        if vocab.vocab_size != target.config.vocab_size:
            raise UserError(f"the draft vocabulary was built for {vocab.vocab_size} target tokens but the target "
                            f"has {target.config.vocab_size}; rebuild it from this target's answers")
        config = Eagle3Config.from_target(target.config, vocab.size, aux_layer_ids)
        if seed is not None:
            torch.manual_seed(seed)
        draft = cls(config)
        draft.init_from_target(target, vocab)
        device = device or next(target.parameters()).device
        draft.to(device=device, dtype=dtype or next(target.parameters()).dtype)
        return draft.attach_embeddings(target.get_input_embeddings())

    @torch.no_grad()
    def init_from_target(self, target, vocab) -> None:
        """Why this start: linear layers get the usual N(0, 0.02) (HF's initializer_range). The LM
        head starts as the target's LM head rows of the draft vocabulary and `norm` as the
        target's final norm: the draft's output plays the role of the target's last hidden state,
        so the target's readout of it is the best guess there is. That norm's profile, not its
        size: it is divided by its root mean square. A fresh draft's output is not yet that hidden
        state, and Gemma-3-270M's final norm (RMS 54, up to 301) turns a random one into logits so
        large that the first loss was 187 where uniform logits give ln(32768) = 10.4, and the
        scale-free norm leaves the draft no quick way down. The other norms start at 1.
        Not the target's first-layer input norm for `input_layernorm`: in SmolLM2 it is ~0.001,
        which would all but shut the token embedding out of the draft's attention."""
        std = self.config.initializer_range
        for module in self.modules():
            if isinstance(module, nn.Linear):
                module.weight.normal_(0.0, std)
            elif isinstance(module, RMSNorm):
                module.weight.fill_(1.0)
        ids = vocab.target_ids.to(self.lm_head.weight.device)
        head = target.get_output_embeddings().weight
        self.lm_head.weight.copy_(head.detach().index_select(0, ids.to(head.device)).to(self.lm_head.weight))
        base = getattr(target, "model", None)
        scale = norm_scale(getattr(base, "norm", None))
        if scale is not None and scale.shape == self.norm.weight.shape:
            self.norm.weight.copy_(scale / scale.float().square().mean().sqrt().clamp_min(1e-6))
        self.set_vocab(vocab)

    @torch.no_grad()
    def set_vocab(self, vocab) -> None:
        if vocab.size != self.config.draft_vocab_size or vocab.vocab_size != self.config.vocab_size:
            raise ValueError("the vocabulary does not match the draft's sizes")
        self.d2t.copy_(vocab.d2t)
        self.t2d.copy_(vocab.t2d)

    def attach_embeddings(self, embedding: nn.Module) -> "Eagle3Draft":
        """Use the target's (frozen) token embedding. Kept outside the module tree on purpose: it
        is neither trained, saved, exported nor moved by `.to()`."""
        weight = getattr(embedding, "weight", None)
        if weight is not None and tuple(weight.shape) != (self.config.vocab_size, self.config.hidden_size):
            raise UserError(f"the target's embedding is {tuple(weight.shape)} but this draft needs "
                            f"({self.config.vocab_size}, {self.config.hidden_size}); use the draft with its own target")
        self.__dict__["_embed_tokens"] = embedding
        return self

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        embedding = self.__dict__["_embed_tokens"]
        if embedding is None:
            raise RuntimeError("attach the target's embedding first: draft.attach_embeddings(target.get_input_embeddings())")
        with torch.no_grad():
            return embedding(ids).to(self.fc.weight.dtype)

    # --- shared pieces ------------------------------------------------------------------------

    def target_features(self, hidden_states: Sequence[torch.Tensor]) -> torch.Tensor:
        """The fc input [B, T, 3·H] from a target's `output_hidden_states`."""
        return torch.cat([hidden_states[i] for i in self.config.aux_layer_ids], dim=-1).to(self.fc.weight.dtype)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden))

    @property
    def draft_target_ids(self) -> torch.Tensor:
        """The target id of every draft id (SGLang's `hot_token_id`)."""
        return torch.arange(self.config.draft_vocab_size, device=self.d2t.device) + self.d2t

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def to_target_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits -> the target's vocabulary, -inf (q = 0) outside the draft's."""
        out = logits.new_full((*logits.shape[:-1], self.config.vocab_size), float("-inf"))
        return out.index_copy_(-1, self.draft_target_ids, logits)

    def rope(self, like: torch.Tensor, positions: torch.Tensor):
        """The rotary tables (cos, sin) of `positions` [B, n], in `like`'s dtype."""
        return self.rotary_emb(like, positions)

    # --- training: the training-time-test unroll ----------------------------------------------

    def forward_hidden(self, features: torch.Tensor, input_ids: torch.Tensor, *,
                       attention_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                       num_steps: int = 1, logits_from: int = 0) -> list[torch.Tensor]:
        """The unroll's output hidden states, one [B, T - logits_from, H] per step, for indices
        logits_from.. (see the module docstring). Indices before `logits_from` still give their
        step-0 keys; nothing else is computed for them, so pass the first index any loss uses
        (`loss.first_trained_index`). Steps feed the ground-truth tokens: at an index whose
        earlier drafts were all accepted, that is exactly what decoding feeds."""
        B, T = input_ids.shape
        if not 0 <= logits_from < T:
            raise ValueError(f"logits_from must be in [0, {T}), got {logits_from}")
        device = input_ids.device
        valid = (attention_mask.bool() if attention_mask is not None
                 else torch.ones(B, T, dtype=torch.bool, device=device))
        positions = (position_ids if position_ids is not None
                     else torch.arange(T, device=device).expand(B, T))
        s, layer, attn = logits_from, self.midlayer, self.midlayer.self_attn

        def shifted(j: int) -> torch.Tensor:  # x[p + 1 + j] at index p; the tail is padding (masked)
            ids = input_ids[:, 1 + j:]
            return torch.cat([ids, input_ids[:, -1:].expand(B, T - ids.shape[1])], dim=1)

        h_in = self.fc(features.to(self.fc.weight.dtype))
        x = layer.attention_input(self.embed(shifted(0)), h_in)
        cos, sin = self.rope(x, positions)
        k0, v0 = attn.keys_values(x, cos, sin)
        key = torch.arange(T, device=device)
        query = key[s:, None]
        visible0 = ((key[None, :] <= query) & valid[:, None, :]) | (key[None, :] == query)  # [B, T-s, T]
        h = layer.finish(h_in[:, s:], attend(attn.queries(x[:, s:], cos[:, s:], sin[:, s:]), k0, v0, visible0))
        outputs, diag_k, diag_v = [h], [], []
        for j in range(1, num_steps):
            x = layer.attention_input(self.embed(shifted(j)[:, s:]), h)
            cos, sin = self.rope(x, positions[:, s:] + j)
            kd, vd = attn.keys_values(x, cos, sin)
            diag_k.append(kd)
            diag_v.append(vd)
            h = layer.finish(h, attend_unrolled(attn.queries(x, cos, sin), k0, v0, visible0, diag_k, diag_v))
            outputs.append(h)
        return outputs

    def forward(self, features, input_ids, *, attention_mask=None, position_ids=None, num_steps: int = 1,
                logits_from: int = 0) -> torch.Tensor:
        """Draft-vocabulary logits of the unroll: [num_steps, B, T - logits_from, draft_vocab_size];
        step j at local index i (index logits_from + i) predicts x[logits_from + i + 2 + j]."""
        hidden = self.forward_hidden(features, input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                     num_steps=num_steps, logits_from=logits_from)
        return torch.stack([self.compute_logits(h) for h in hidden])
