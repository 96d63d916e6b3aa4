"""The static engine's fused weights (q/k/v and gate/up concatenated once, `FusedWeights`) against
the unfused model: transformers' own forward, in float64, on Llama and Qwen2 (both with q/k/v
biases) and Gemma-3 (GELU-tanh MLP, q/k norms, sandwich norms). The model's own parameters are
left as they were; the engine really reads the fused copies (corrupting them changes its
logits); and float32 CPU models give the fused layers the few-rows matmul path too."""

from __future__ import annotations

import functools

import pytest
import torch
from test_static import VOCAB, build, hf

from drafttrain.decoding import StaticLM
from drafttrain.decoding.engines import static
from drafttrain.decoding.engines.matmul import use_skinny_matmuls

FUSED_ARCHS = ["llama", "qwen2", "gemma3"]


def static_outputs(lm: StaticLM, tokens: list[int], layers: tuple[int, ...]):
    lm.reset()
    with torch.no_grad():
        return lm.forward(torch.tensor(tokens), hidden_layers=layers)


def text(n: int, seed: int = 1) -> list[int]:
    return torch.randint(VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("arch", FUSED_ARCHS)
def test_fused_logits_and_hidden_states_equal_the_unfused_model(arch):
    model = build(arch)
    before = {name: (p.data_ptr(), p.clone()) for name, p in model.named_parameters()}
    L = model.config.num_hidden_layers
    layers = (0, 1, L)
    lm = StaticLM(model, max_length=40, compile=False)
    tokens = text(30)
    logits, hidden = static_outputs(lm, tokens[:20], layers)  # a prompt
    ref_logits, ref_hidden = hf(model, tokens[:20], layers)
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=1e-12)
    torch.testing.assert_close(hidden, ref_hidden, rtol=0, atol=1e-12)
    logits, _ = lm.forward(torch.tensor(tokens[20:23]))  # a verification chain on top of it
    torch.testing.assert_close(logits, hf(model, tokens[:23])[0][20:], rtol=0, atol=1e-12)
    for name, p in model.named_parameters():  # the model's own weights: untouched, not re-pointed
        ptr, value = before[name]
        assert p.data_ptr() == ptr and torch.equal(p, value), name


@pytest.mark.parametrize("arch", FUSED_ARCHS)
def test_fused_weights_are_q_k_v_and_gate_up_in_order(arch):
    model = build(arch)
    fused = StaticLM(model, max_length=16, compile=False).cache.fused
    for layer, qkv, gate_up in zip(model.model.layers, fused.qkv, fused.gate_up):
        attn, mlp = layer.self_attn, layer.mlp
        assert torch.equal(qkv.weight, torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]))
        assert torch.equal(gate_up.weight, torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))
        if attn.q_proj.bias is not None:  # Llama here and Qwen2: q/k/v biases
            assert torch.equal(qkv.bias, torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]))
        assert qkv.weight.data_ptr() != attn.q_proj.weight.data_ptr()  # a copy
        assert not qkv.weight.requires_grad and not gate_up.weight.requires_grad


@pytest.mark.parametrize("part", ["qkv", "gate_up"])
def test_the_engine_reads_the_fused_copies(part):
    """Swapping the halves of one fused weight (k with v, gate with up) changes the engine's
    logits and not the model's: the equality tests above would catch a wrong split."""
    model = build("gemma3")
    lm = StaticLM(model, max_length=16, compile=False)
    tokens = text(8)
    good, _ = static_outputs(lm, tokens, ())
    fused = getattr(lm.cache.fused, part)[0]
    with torch.no_grad():
        w = fused.weight
        if part == "qkv":
            q, k, v = w.split(lm.cache.fused.qkv_sizes[0])
            w.copy_(torch.cat([q, v, k]))
        else:
            w.copy_(torch.cat(w.chunk(2)[::-1]))
    bad, _ = static_outputs(lm, tokens, ())
    assert (bad - good).abs().max() > 1e-3
    torch.testing.assert_close(hf(model, tokens)[0], good, rtol=0, atol=1e-12)


def test_float32_fused_layers_take_the_few_rows_path(monkeypatch):
    """`use_skinny_matmuls` installs on the fused layers as on the model's own (here for every
    row count, whatever this machine measures), and the outputs still match transformers'."""
    every_row = functools.partial(use_skinny_matmuls, rows_for=lambda weight: frozenset(range(1, 17)))
    monkeypatch.setattr(static, "use_skinny_matmuls", every_row)
    model = build("qwen2", dtype=torch.float32)
    lm = StaticLM(model, max_length=16, compile=False)
    assert all(hasattr(m, "skinny_rows") for m in (*lm.cache.fused.qkv, *lm.cache.fused.gate_up))
    tokens = text(6)
    lm.reset()
    with torch.no_grad():
        lm.forward(torch.tensor(tokens[:3]))
        logits, _ = lm.forward(torch.tensor(tokens[3:]))  # 3 rows: the skinny path, padded to 4
    torch.testing.assert_close(logits, hf(model, tokens)[0][3:], rtol=1e-4, atol=1e-4)
