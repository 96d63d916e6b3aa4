"""The static cached LM: a preallocated KV cache and fixed-shape compiled steps.

The model's own submodules do most of the work (embedding, norms, o projections, Qwen3's q/k
norms, the MLPs' activations and down projections, the final norm and the LM head; rotary cos/sin
come from the model's rotary module, tabulated once for every slot). Fused weights: each layer's
q/k/v and gate/up weights (and biases) are concatenated once when the engine is built
(`FusedWeights`, a copy beside the cache; the model's own parameters are left as they are), so a
layer takes two matmuls where it took five, on a GPU fewer kernel launches per layer of a step
that costs its launches more than its arithmetic. Only the attention core is ours: SDPA
over the whole preallocated cache with a boolean mask computed from tensor inputs, so the same
compiled graph serves every cache length. The mask lets a query see

- every slot before the first new token (the cached prefix),
- inside the new block, what `block_mask` allows (causal for a chain, ancestors for a tree),
- itself (so a left-padding position never has an empty row),

and nothing at or after the block's end, which is what makes rollback free: forgetting tokens
moves `length`, and the stale entries past it are never read before they are overwritten.

Steps of a registered size (`warmup`) run compiled (`torch.compile(fullgraph=True,
dynamic=False)`, `mode="reduce-overhead"` on CUDA: one CUDA graph per size). A shorter input is
padded to the next registered size: the padding sits after the real tokens, causal masking
hides it from them, its logits are dropped and `length` advances by the real count only.
Positions, cache slots and masks are tensors, never Python ints inside the graph, or every new
length would recompile. Prefill, a chain longer than every bucket, runs as compiled chunks of
`PREFILL_CHUNK` tokens (the last padded as a bucket is; `warmup` compiles the chunk for each
hidden-layer set it warms), so a prompt costs ceil(n / 64) graph launches, not one uncompiled
step's ~1,300 kernel launches. Near the cache's end, where a padded chunk would run past its
capacity, the tail takes smaller registered buckets; only if none fits, or where nothing was
warmed up for those hidden layers, does it run uncompiled. Uncompiled (the CPU default), the same
chunks run the same function eagerly.

A decode step's verification is one graph with its verdict (`verify`, `verify_step`): the rule's
argmax, comparison and accepted path run after the logits inside it, the verified tokens padded
with -1 (equal to no argmax, so never accepted), positions and slots computed from a 0-d start.
Each (size, hidden layers, verdict, tree depth) that `warmup` registered runs compiled.

Grouped-query attention without copying the cache: the G query heads that share a KV head are
stacked along the query axis ([B, kv_heads, G * n, d]), so SDPA reads each cached K/V once.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from ...errors import UserError
from ...models import is_sharded_module
from ...trees import Tree
from .base import CachedLM, device_tensor
from .compiled import WARMUP_RUNS, CompiledStep, static_capacity, step_state, timed_warmup
from .matmul import use_skinny_matmuls

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text")
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")  # cos/sin depend on the position only
WINDOWED_ARCHITECTURES = ("gemma3_text",)  # sliding-window layers honoured by the mask at any length
# Prefill's compiled width. A prompt longer than every bucket runs as ceil(n / 64) compiled steps
# (one CUDA graph replay each) instead of one uncompiled step (~1,300 kernel launches from Python
# for a small model): 64 rows keep the matmuls wide enough to run at full speed and a long prompt
# to few launches (32 for 2k tokens), while padding the last chunk wastes at most 63 rows; and it
# is one more shape to compile per hidden-layer set, not one per prompt length.
PREFILL_CHUNK = 64


def static_support(model, max_length: int | None = None) -> str | None:
    """None when the static engine reproduces this model exactly; else why not (for an error)."""
    cfg = model.config
    kind = getattr(cfg, "model_type", None)
    arch = ", ".join(getattr(cfg, "architectures", None) or [type(model).__name__])
    if is_sharded_module(model):
        return "the model's weights are sharded across ranks (FSDP/ZeRO-3), gathered only inside its own forward"
    if kind not in SUPPORTED_ARCHITECTURES:
        return f"the static engine supports {', '.join(SUPPORTED_ARCHITECTURES)} models, not {arch} ({kind})"
    body = getattr(model, "model", None)
    if body is None or not all(hasattr(body, a) for a in ("embed_tokens", "layers", "norm", "rotary_emb")):
        return f"{arch} does not have the expected model.embed_tokens/layers/norm/rotary_emb modules"
    if not all(fusable(layer) for layer in body.layers):
        return f"{arch}'s q/k/v or gate/up projections are not plain linear layers (quantized or adapter-wrapped)"
    rope = getattr(body.rotary_emb, "rope_type", "default")
    ropes = rope.values() if isinstance(rope, dict) else [rope]  # Gemma-3: one per layer type
    bad = [r for r in ropes if not isinstance(r, str) or r not in STATIC_ROPE_TYPES]
    if bad:
        return f"{arch} uses {bad[0]!r} rotary embeddings, which change with the sequence length"
    if getattr(cfg, "use_bidirectional_attention", False):
        return f"{arch} attends bidirectionally, and the static engine's mask is causal"
    window = getattr(cfg, "sliding_window", None)
    sliding = window is not None and kind not in WINDOWED_ARCHITECTURES and (
        kind == "mistral" or "sliding_attention" in (getattr(cfg, "layer_types", None) or []))
    if sliding and (max_length is None or max_length > window):
        return (f"{arch} uses sliding-window attention (window {window}), which the static engine does not "
                f"implement beyond the window (max_length {max_length})")
    return None


def fused_linear(*parts: nn.Linear) -> nn.Linear:
    """One linear layer whose output is `parts`' outputs side by side: their weights (and biases,
    zeros for a part without one) concatenated into new tensors; the parts stay as they are. A
    plain frozen `nn.Linear`, so `use_skinny_matmuls` gives it the few-rows path as it does the
    model's own layers."""
    with torch.no_grad(), torch.inference_mode(False):  # read by compiled steps, which run outside it
        weight = torch.cat([p.weight for p in parts])
        fused = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
        fused.weight = nn.Parameter(weight, requires_grad=False)
        if any(p.bias is not None for p in parts):
            biases = [p.bias if p.bias is not None else weight.new_zeros(p.out_features) for p in parts]
            fused.bias = nn.Parameter(torch.cat(biases), requires_grad=False)
    return fused


class FusedWeights(nn.Module):
    """Each layer's q/k/v projections as one linear layer (`qkv[i]`, outputs q | k | v) and its
    MLP's gate/up as another (`gate_up[i]`, gate | up), concatenated once when the engine is built.
    A step then launches two matmuls where it launched five (of about 12 kernels a layer): on a
    GPU, where a small step costs its launches more than its arithmetic, that is time per layer.

    A copy, not the model's parameters rearranged: the same model runs on the eager engine, trains
    and is saved by the recipes. So those weights are held twice, and a model changed after the
    engine is built needs a new engine."""

    def __init__(self, model):
        super().__init__()
        layers = model.model.layers
        self.qkv = nn.ModuleList(fused_linear(l.self_attn.q_proj, l.self_attn.k_proj, l.self_attn.v_proj)
                                 for l in layers)
        self.gate_up = nn.ModuleList(fused_linear(l.mlp.gate_proj, l.mlp.up_proj) for l in layers)
        self.qkv_sizes = [(l.self_attn.q_proj.out_features, l.self_attn.k_proj.out_features,
                           l.self_attn.v_proj.out_features) for l in layers]


FUSED_PROJECTIONS = (("self_attn", "q_proj"), ("self_attn", "k_proj"), ("self_attn", "v_proj"),
                     ("mlp", "gate_proj"), ("mlp", "up_proj"))


def fusable(layer) -> bool:
    """Whether `FusedWeights` reproduces this layer: its q/k/v and gate/up are plain `nn.Linear`
    (a quantized or adapter-wrapped layer's product is not its `weight` alone)."""
    return all(type(getattr(getattr(layer, block, None), name, None)) is nn.Linear
               for block, name in FUSED_PROJECTIONS)


class StaticCache(nn.Module):
    """Every layer's K and V in ONE buffer `kv` [2, layers, batch, kv_heads, capacity, head_dim]
    (so moving entries, `move_entries`, is one gather and one scatter for the whole model rather than
    four per layer), the rotary tables and the fused q/k/v and gate/up weights (`fused`): what a step
    reads besides the model's own modules. Steps take each layer's slice inside their graph, so the
    buffer is the graph's one mutated input."""

    def __init__(self, model, capacity: int, batch_size: int = 1):
        super().__init__()
        cfg = model.config
        body = model.model
        weight = body.embed_tokens.weight
        attn = body.layers[0].self_attn
        self.num_layers = len(body.layers)
        self.kv_heads = cfg.num_key_value_heads
        self.heads = cfg.num_attention_heads
        self.head_dim = attn.head_dim
        self.capacity = capacity
        shape = (2, self.num_layers, batch_size, self.kv_heads, capacity, self.head_dim)
        # a fixed address: CUDA graphs replay in place
        self.register_buffer("kv", step_state(shape, dtype=weight.dtype, device=weight.device), persistent=False)
        self.windows = layer_windows(model)
        self.rope_names = layer_rope_names(model)
        with torch.no_grad():
            probe = torch.zeros(1, 1, self.head_dim, dtype=weight.dtype, device=weight.device)
            tables = rotary_tables(body, self.rope_names, probe, capacity)
        for name, (cos, sin) in tables.items():
            self.register_buffer(f"cos{name}", cos[0].contiguous(), persistent=False)  # [capacity, head_dim]
            self.register_buffer(f"sin{name}", sin[0].contiguous(), persistent=False)
        self.fused = FusedWeights(model)

    @property
    def keys(self) -> list[torch.Tensor]:
        """Each layer's K [batch, kv_heads, capacity, head_dim]: views of `kv`."""
        return list(self.kv[0].unbind(0))

    @property
    def values(self) -> list[torch.Tensor]:
        return list(self.kv[1].unbind(0))


def layer_windows(model) -> list[int | None]:
    """Each layer's sliding window (None: global attention). Gemma-3 interleaves the two
    (`layer_types`); other models get none here, since `static_support` refuses their windows
    unless the whole cache fits inside one, where a window changes nothing."""
    cfg, n = model.config, len(model.model.layers)
    if cfg.model_type not in WINDOWED_ARCHITECTURES:
        return [None] * n
    return [cfg.sliding_window if t == "sliding_attention" else None for t in cfg.layer_types[:n]]


def layer_rope_names(model) -> list[str]:
    """Each layer's rotary-table suffix: Gemma-3's rotary module takes a layer type (its local
    layers rotate with a smaller base than its global ones); other models share one table ("")."""
    body, n = model.model, len(model.model.layers)
    if not isinstance(getattr(body.rotary_emb, "rope_type", None), dict):
        return [""] * n
    return [f"_{t}" for t in model.config.layer_types[:n]]


def rotary_tables(body, names: list[str], probe: torch.Tensor, capacity: int) -> dict[str, tuple]:
    """{suffix: (cos, sin)} for every slot position, from the model's own rotary module."""
    positions = torch.arange(capacity, device=probe.device)[None]
    return {name: body.rotary_emb(probe, positions, *([name[1:]] if name else []))
            for name in dict.fromkeys(names)}


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def attention_mask(slots: torch.Tensor, block_mask: torch.Tensor, capacity: int,
                   key_valid: torch.Tensor | None) -> torch.Tensor:
    """Bool [B or 1, 1, n, capacity]: who each new token may attend to (see the module doc)."""
    n = slots.shape[0]
    rel = torch.arange(capacity, device=slots.device) - slots[0]        # key slot relative to the block
    in_block = (rel >= 0) & (rel < n)
    allowed = (block_mask[:, rel.clamp(0, n - 1)] & in_block) | (rel < 0)  # [n, capacity]
    if key_valid is not None:  # left padding of a batch: padding keys are never read
        allowed = allowed[None] & key_valid[:, None, :]
    else:
        allowed = allowed[None]
    allowed = allowed | (rel[None, None, :] == torch.arange(n, device=slots.device)[None, :, None])
    return allowed[:, None]


def window_mask(slots: torch.Tensor, positions: torch.Tensor, capacity: int, window: int) -> torch.Tensor:
    """Bool [B, 1, n, capacity]: keys within `window` of each query (q_pos - k_pos < window, as
    transformers' sliding masks have it). Positions count from the block's first token: a prefix
    slot s sits at s - slots[0], a block key at its own depth, which is right for chains, tree
    branches (depth, not slot order) and left-padded batch rows alike."""
    n = slots.shape[0]
    depth = positions - positions[:, :1]                                  # [B, n]
    rel = torch.arange(capacity, device=slots.device) - slots[0]
    key_pos = torch.where(rel >= 0, depth[:, rel.clamp(0, n - 1)], rel)  # [B, capacity]
    return ((depth[:, :, None] - key_pos[:, None, :]) < window)[:, None]


def layer_masks(cache: StaticCache, full: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
                groups: int) -> list[torch.Tensor]:
    """Each layer's mask repeated for the `groups` query heads per KV head: `full` itself, or
    for a sliding layer `full` cut to its window (built once per window size)."""
    masks = {w: full if w is None else full & window_mask(slots, positions, cache.capacity, w)
             for w in dict.fromkeys(cache.windows)}
    masks = {w: m.repeat(1, 1, groups, 1) for w, m in masks.items()}
    return [masks[w] for w in cache.windows]


def layer_rotary(cache: StaticCache, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's (cos, sin) [B, 1, n, d] at `positions`, gathered once per table."""
    tables = {name: (getattr(cache, f"cos{name}")[positions].unsqueeze(1),
                     getattr(cache, f"sin{name}")[positions].unsqueeze(1))
              for name in dict.fromkeys(cache.rope_names)}
    return [tables[name] for name in cache.rope_names]


def fused_mlp(mlp: nn.Module, gate_up: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """The model's MLP, down(act(gate(x)) * up(x)), with gate and up one matmul; `act_fn` is the
    MLP's own (SiLU for Llama/Qwen, tanh-approximated GELU for Gemma-3)."""
    gate, up = gate_up(x).chunk(2, dim=-1)
    return mlp.down_proj(mlp.act_fn(gate) * up)


def residual_blocks(layer, gate_up: nn.Linear, x: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
    """The attention and MLP residual adds. Llama's `post_attention_layernorm` is the MLP's input
    norm; Gemma's sandwich norms the attention output and both sides of the MLP instead."""
    mlp = functools.partial(fused_mlp, layer.mlp, gate_up)
    if hasattr(layer, "pre_feedforward_layernorm"):  # Gemma
        x = x + layer.post_attention_layernorm(attn_out)
        return x + layer.post_feedforward_layernorm(mlp(layer.pre_feedforward_layernorm(x)))
    x = x + attn_out
    return x + mlp(layer.post_attention_layernorm(x))


def softcap_logits(config, logits: torch.Tensor) -> torch.Tensor:
    """Gemma's final_logit_softcapping, as its forward applies it (its attn_logit_softcapping
    never reaches transformers' attention functions, so it is not applied here either)."""
    cap = getattr(config, "final_logit_softcapping", None)
    if cap is None:
        return logits
    return torch.tanh(logits / cap) * cap


def lm_logits(model, x: torch.Tensor) -> torch.Tensor:
    """The LM head over final (normed) hidden states: logits, soft-capped where the model does."""
    return softcap_logits(model.config, model.lm_head(x))


def static_step(model, cache: StaticCache, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                block_mask: torch.Tensor, key_valid: torch.Tensor | None, hidden_layers: tuple[int, ...] = (),
                last_only: bool = False, rows: slice = slice(None)):
    """tokens/positions [B, n], slots [n], block_mask [n, n] -> (logits [B, n, V], hidden [B, n, D] or None).
    `last_only`: the last token's final (normed) hidden state [B, 1, D] in place of the logits, for
    the caller's one head over many (a batch's prefill reads no other token: `lm_logits`). `rows`:
    the cache rows the B rows are (a batch's prefill, a row at a time: `BatchGenerator`).

    Writes the n tokens' K/V at `slots` of every layer. The one function both compiled and
    uncompiled steps run. Each layer's q/k/v and gate/up take one matmul each (`cache.fused`).
    """
    body, fused = model.model, cache.fused
    B, n = tokens.shape
    G = cache.heads // cache.kv_heads
    d = cache.head_dim
    x = body.embed_tokens(tokens)
    picked = {0: x} if 0 in hidden_layers else {}
    rotary = layer_rotary(cache, positions)  # per layer: [B, 1, n, d]
    masks = layer_masks(cache, attention_mask(slots, block_mask, cache.capacity, key_valid), slots, positions, G)
    for i, layer in enumerate(body.layers):  # masks[i]: [B, 1, G*n, cap]
        cos, sin = rotary[i]
        attn = layer.self_attn
        h = layer.input_layernorm(x)
        q, k, v = fused.qkv[i](h).split(fused.qkv_sizes[i], dim=-1)  # one matmul for the three
        q, k = q.view(B, n, -1, d), k.view(B, n, -1, d)
        v = v.view(B, n, -1, d).transpose(1, 2)
        if getattr(attn, "q_norm", None) is not None:  # Qwen3, Gemma-3
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        keys, values = cache.kv[0, i, rows], cache.kv[1, i, rows]  # views taken in the graph: `kv` is its input
        keys.index_copy_(2, slots, k)
        values.index_copy_(2, slots, v)
        q = q.reshape(B, cache.kv_heads, G * n, d)  # query head j*G + g reads KV head j
        o = F.scaled_dot_product_attention(q, keys, values, attn_mask=masks[i], scale=attn.scaling)
        o = o.view(B, cache.heads, n, d).transpose(1, 2).reshape(B, n, cache.heads * d)
        x = residual_blocks(layer, fused.gate_up[i], x, attn.o_proj(o))
        if i + 1 in hidden_layers and i + 1 < cache.num_layers:
            picked[i + 1] = x
    x = body.norm(x)
    if cache.num_layers in hidden_layers:
        picked[cache.num_layers] = x
    logits = x[:, -1:] if last_only else lm_logits(model, x)
    if not hidden_layers:
        return logits, None
    hidden = [picked[i] for i in hidden_layers]
    return logits, (hidden[0] if len(hidden) == 1 else torch.cat(hidden, dim=-1))


def move_entries(cache: StaticCache, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Every layer's entries at slots `src` copied to slots `dst` (gathered first: overlap is fine):
    two kernels for the whole model, the cache being one tensor."""
    cache.kv.index_copy_(4, dst, cache.kv.index_select(4, src))


def verify_step(model, cache: StaticCache, tokens: torch.Tensor, start: torch.Tensor, parent: torch.Tensor | None = None,
                depths: torch.Tensor | None = None, mask: torch.Tensor | None = None, *, verdict, max_depth: int = 0,
                hidden_layers: tuple[int, ...] = ()):
    """One verification as one graph: `static_step` over `tokens` [W] (padding -1) at slots
    `start` .. start + W - 1 (`start` 0-d, on the device), then `verdict` on its logits.
    A chain (no `mask`) sits at positions start + 0 .. W - 1, causal; a tree's node i at
    start + depths[i], seeing what `mask` allows. Returns (verdict, hidden [W, D] or None)."""
    width = tokens.shape[0]
    slots = start + torch.arange(width, device=tokens.device)
    tree = None
    if mask is None:
        positions, block = slots, torch.ones(width, width, dtype=torch.bool, device=tokens.device).tril()
    else:
        positions, block = start + depths, mask
        tree = Tree(parent=parent, depths=depths, attention_mask=mask, max_depth=max_depth)
    logits, hidden = static_step(model, cache, tokens.clamp(min=0)[None], positions[None], slots, block, None,
                                 hidden_layers)
    return verdict(logits[0], tokens, tree), (hidden[0] if hidden is not None else None)


def padded_tree(tree: Tree, width: int) -> Tree:
    """`tree` padded to `width` nodes: each padding node a child of the root that sees only itself
    (its token, -1, is never accepted)."""
    pad = width - tree.num_nodes
    eye = torch.eye(width, dtype=torch.bool, device=tree.parent.device)
    return Tree(parent=F.pad(tree.parent, (0, pad)), depths=F.pad(tree.depths, (0, pad)),
                attention_mask=F.pad(tree.attention_mask, (0, pad, 0, pad)) | eye, max_depth=tree.max_depth)


class StaticLM(CachedLM):
    engine = "static"

    def __init__(self, model, *, max_length: int, compile: bool | None = None, batch_size: int = 1):
        """`compile` None: on for CUDA, off elsewhere (CPU steps run the same code uncompiled)."""
        if not isinstance(max_length, int) or max_length < 1:
            raise ValueError(f"max_length must be a positive int, got {max_length!r}")
        reason = static_support(model, max_length)
        if reason:
            raise UserError(f"--engine static: {reason}; use --engine eager")
        self.model = model
        self.device = next(model.parameters()).device
        use_skinny_matmuls(model)
        self.max_length = max_length
        self.batch_size = batch_size
        capacity = static_capacity(max_length)  # a multiple of 256: the same graphs for other prompt sets
        self.cache = StaticCache(model, capacity, batch_size)
        use_skinny_matmuls(self.cache.fused)
        self.compile = self.device.type == "cuda" if compile is None else bool(compile)
        self.cudagraphs = self.compile and self.device.type == "cuda"
        self.sizes: dict[tuple, list[int]] = {}  # registered step sizes (buckets) per hidden layers, ascending
        self.keep_width = 0          # registered width of compiled compaction (0: eager)
        self.compile_seconds = 0.0
        self.length = 0
        self._steps: dict = {}
        self.prefill_chunks: set[tuple[int, ...]] = set()  # hidden layers whose prefill chunk is warmed up
        self._verifies: dict = {}      # (hidden layers, verdict, tree depth) -> its compiled verification
        self._verify_keys: set = set()  # (width, hidden layers, verdict, tree depth) warmed up
        self._move = None
        self._causal: dict[int, torch.Tensor] = {}
        self._slots = torch.arange(self.cache.capacity, device=self.device)

    @property
    def capacity(self) -> int:
        return self.cache.capacity

    def at(self, index: int) -> torch.Tensor:
        """`index` as a 0-d tensor on the device: a view of a preallocated range, so a step's start
        slot reaches a graph with neither a host copy nor a sync."""
        return self._slots[index]

    def reset(self) -> None:
        self.length = 0  # stale entries are masked until overwritten

    # -- the compiled steps ---------------------------------------------------------------------

    def _step_fn(self, hidden_layers: tuple[int, ...], compiled: bool):
        step = functools.partial(static_step, self.model, self.cache, hidden_layers=hidden_layers)
        if not compiled:
            return step
        if hidden_layers not in self._steps:
            self._steps[hidden_layers] = CompiledStep(step, self.device)
        return self._steps[hidden_layers]

    def causal(self, n: int) -> torch.Tensor:
        if n not in self._causal:
            self._causal[n] = torch.ones(n, n, dtype=torch.bool, device=self.device).tril()
        return self._causal[n]

    @torch.no_grad()
    def run(self, tokens: torch.Tensor, positions: torch.Tensor, block_mask: torch.Tensor, *,
            key_valid: torch.Tensor | None = None, hidden_layers: tuple[int, ...] = (), compiled: bool = False,
            last_only: bool = False, rows: slice = slice(None)):
        """One step at slots length .. length + n - 1 ([B, n] inputs). Does not move `length`.
        `last_only` (uncompiled): the last token's final hidden state, not its logits (`lm_logits`
        heads it), and the inputs may be some `rows` of the cache's (`static_step`)."""
        n = tokens.shape[1]
        slots = torch.arange(self.length, self.length + n, device=self.device)
        if last_only:
            return static_step(self.model, self.cache, tokens, positions, slots, block_mask, key_valid,
                               tuple(hidden_layers), last_only=True, rows=rows)
        fn = self._step_fn(tuple(hidden_layers), compiled and self.compile)
        return fn(tokens, positions, slots, block_mask, key_valid)

    def _bucket(self, n: int, hidden_layers: tuple[int, ...]) -> int | None:
        """The smallest size registered with these hidden layers that holds n tokens: a graph is
        compiled per (size, hidden layers), so a size another decoder registered with other layers
        would compile inside a timed step."""
        for size in self.sizes.get(tuple(hidden_layers), ()):
            if size >= n and self.length + size <= self.capacity:
                return size
        return None

    @property
    def prefill_chunk(self) -> int:
        """The width of a prefill chunk: `PREFILL_CHUNK`, or the whole cache where it is smaller."""
        return min(PREFILL_CHUNK, self.capacity)

    def _prefill_width(self, rest: int, hidden_layers: tuple[int, ...]) -> int | None:
        """The compiled width of prefill's next piece, `rest` tokens still to feed: the smallest
        bucket that holds them all, else the widest compiled width that fits the cache (a chunk,
        or near the cache's end, where a padded chunk would run past it, a smaller bucket). None:
        none fits, and the rest runs uncompiled at its own width."""
        size = self._bucket(rest, hidden_layers)
        if size is not None:
            return size
        widths = (*self.sizes.get(hidden_layers, ()), self.prefill_chunk)
        return max((w for w in widths if self.length + w <= self.capacity), default=None)

    def _prefill(self, tokens: torch.Tensor, hidden_layers: tuple[int, ...]):
        """A chain longer than every bucket (a prompt) as compiled fixed-width pieces
        (`_prefill_width`): ceil(n / chunk) graph launches, not one uncompiled step. Outputs
        concatenated, as one step would return them."""
        pieces, done, n = [], 0, tokens.numel()
        while done < n:
            width = self._prefill_width(n - done, hidden_layers)
            real = min(n - done, width or n)
            pieces.append(self._padded_chain(tokens[done:done + real], width or real, hidden_layers,
                                             compiled=width is not None))
            done += real
        if len(pieces) == 1:
            return pieces[0]
        logits, hidden = zip(*pieces)
        return torch.cat(logits), (torch.cat(hidden) if hidden[0] is not None else None)

    def _padded_chain(self, tokens: torch.Tensor, width: int, hidden_layers: tuple[int, ...], *, compiled: bool):
        """One causal step of `tokens` padded to `width` as a bucket step is (padding after the real
        tokens, its outputs dropped, `length` advanced by the real count only)."""
        n = tokens.numel()
        if width > n:
            tokens = F.pad(tokens, (0, width - n))
        span = self._slots[self.length:self.length + width]  # positions of a chain: its slots
        logits, hidden = self.run(tokens.view(1, -1), span.view(1, -1), self.causal(width),
                                  hidden_layers=hidden_layers, compiled=compiled)
        self.length += n
        return logits[0, :n], (hidden[0, :n] if hidden is not None else None)

    def forward(self, tokens: torch.Tensor, *, tree: Tree | None = None, hidden_layers: tuple[int, ...] = ()):
        n = tokens.numel()
        self._check_room(n)
        hidden_layers = tuple(hidden_layers)
        size = self._bucket(n, hidden_layers)
        if tree is None:
            if size is None and hidden_layers in self.prefill_chunks:
                return self._prefill(tokens, hidden_layers)
            return self._padded_chain(tokens, size or n, hidden_layers, compiled=size is not None)
        if size is not None and size > n:  # padding after the real nodes, each seeing only itself
            tokens, tree = F.pad(tokens, (0, size - n)), padded_tree(tree, size)
        logits, hidden = self.run(tokens.view(1, -1), (tree.depths + self.length).view(1, -1), tree.attention_mask,
                                  hidden_layers=hidden_layers, compiled=size is not None)
        self.length += n
        return logits[0, :n], (hidden[0, :n] if hidden is not None else None)

    @torch.no_grad()
    def verify(self, tokens: torch.Tensor, verdict, *, tree: Tree | None = None, hidden_layers: tuple[int, ...] = ()):
        """`forward` and `verdict` as one graph (`verify_step`), compiled where `warmup` registered
        this size, hidden layers, verdict and tree depth; else the same function uncompiled (the
        steps a token budget cuts shallower, near the end of a generation)."""
        n = tokens.numel()
        self._check_room(n)
        kind = (tuple(hidden_layers), verdict, tree.max_depth if tree is not None else -1)
        width = min((key[0] for key in self._verify_keys if key[1:] == kind and n <= key[0]
                     and self.length + key[0] <= self.capacity), default=n)
        if width > n:
            tokens = F.pad(tokens, (0, width - n), value=-1)
            tree = padded_tree(tree, width) if tree is not None else None
        key = (width, *kind)
        args = [tokens, self.at(self.length)]
        if tree is not None:
            args += [tree.parent, tree.depths, tree.attention_mask]
        out = self._verify_fn(key, compiled=key in self._verify_keys)(*args)
        self.length += n
        return out

    def _verify_fn(self, key: tuple, compiled: bool):
        _, hidden_layers, verdict, max_depth = key
        step = functools.partial(verify_step, self.model, self.cache, verdict=verdict, max_depth=max(max_depth, 0),
                                 hidden_layers=hidden_layers)
        if not (compiled and self.compile):
            return step
        if key[1:] not in self._verifies:
            self._verifies[key[1:]] = CompiledStep(step, self.device)
        return self._verifies[key[1:]]

    def rollback(self, length: int) -> None:
        self._check_rollback(length)
        self.length = length

    @torch.no_grad()
    def compact(self, past_len: int, nodes, path: torch.Tensor | None = None) -> None:
        nodes = [int(n) for n in nodes]
        self._check_compact(past_len, nodes)
        m = len(nodes)
        if nodes != list(range(m)):  # an accepted chain prefix is already in place
            width = self.keep_width
            if self._move is not None and path is not None and path.numel() == width and past_len + width <= self.capacity:
                # fixed width, indices already on the device: the padding repeats the last pair
                self._move(path + past_len, self._slots[:width].clamp(max=m - 1) + past_len)
            else:
                src = device_tensor([past_len + i for i in nodes], self.device)
                move_entries(self.cache, src, self._slots[past_len:past_len + m])
        self.length = past_len + m

    # -- warm-up ----------------------------------------------------------------------------------

    @torch.no_grad()
    def warmup(self, sizes, *, hidden_layers: tuple[int, ...] = (), keep_width: int = 0, verdict=None,
               tree_depth: int = -1) -> float:
        """Register `sizes` as step buckets and compile/capture each (`timed_warmup`: three runs,
        CUDA graph trees warm up, record, then replay), and prefill's chunk for these hidden
        layers (`PREFILL_CHUNK`, not a bucket: decode steps never pad to it); with a `verdict`, also each size's
        verification graph (`verify`) for trees `tree_depth` deep (-1: chains). Returns the
        seconds spent, also added to `compile_seconds`. Runs dummy steps through the cache, so it
        ends with `reset()`: call it between generations."""
        sizes = sorted({int(s) for s in sizes if 0 < int(s) <= self.capacity})
        hidden_layers = tuple(hidden_layers)

        def step(size: int):
            tokens = torch.zeros(1, size, dtype=torch.long, device=self.device)
            positions = torch.arange(size, device=self.device)[None]
            return functools.partial(self.run, tokens, positions, self.causal(size), hidden_layers=hidden_layers,
                                     compiled=True)

        steps = [step(size) for size in sizes]
        if hidden_layers not in self.prefill_chunks and self.prefill_chunk not in sizes:
            steps.append(step(self.prefill_chunk))  # prefill's chunk (`_prefill`): no prompt compiles
        verify_keys = {(size, hidden_layers, verdict, tree_depth) for size in sizes} if verdict is not None else set()
        steps += [functools.partial(self._dummy_verify, key) for key in sorted(verify_keys - self._verify_keys,
                                                                                key=lambda k: k[0])]
        move = bool(keep_width) and self.compile and keep_width <= self.capacity
        if move:
            if self._move is None or keep_width != self.keep_width:
                self._move = CompiledStep(functools.partial(move_entries, self.cache), self.device)
            src = torch.arange(keep_width, device=self.device)
            # two tensors, as compact() passes: the same one twice compiles an aliasing guard
            steps.append(functools.partial(self._move, src, src.clone()))
        self.length = 0
        seconds = timed_warmup(self, steps, runs=WARMUP_RUNS if self.compile else 1)
        if move:
            self.keep_width = keep_width
        self.sizes[hidden_layers] = sorted(set(self.sizes.get(hidden_layers, ())) | set(sizes))
        self.prefill_chunks.add(hidden_layers)
        self._verify_keys |= verify_keys
        return seconds

    def _dummy_verify(self, key: tuple) -> None:
        """One verification of `key`'s shape on zeros (a star-shaped tree for a tree's), compiled."""
        width, _, _, depth = key
        tokens = torch.zeros(width, dtype=torch.long, device=self.device)
        args = [tokens, self.at(0)]
        if depth >= 0:
            parent = torch.zeros(width, dtype=torch.long, device=self.device)
            parent[0] = -1
            mask = torch.eye(width, dtype=torch.bool, device=self.device)
            mask[:, 0] = True
            args += [parent, (parent + 1).clamp(max=1), mask]
        self._verify_fn(key, compiled=True)(*args)
