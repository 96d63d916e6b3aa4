"""MedusaHeads: vLLM's parameter layout, the residual-block formula, and identity at init."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from drafttrain.kinds.medusa.model import MedusaConfig, MedusaHeads
from tiny import vllm_medusa_shapes


def tiny_llama(tie: bool = False) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=tie)
    model = LlamaForCausalLM(cfg).to(torch.float64).eval()
    with torch.no_grad():  # full float64 mantissas, so a float32 detour in from_target would show
        model.get_output_embeddings().weight.add_(torch.randn(96, 32, dtype=torch.float64) * 1e-3)
    return model


def randomize(heads: MedusaHeads, seed: int = 0) -> MedusaHeads:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in heads.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) * 0.3)
    return heads


def test_parameter_names_and_shapes_match_vllm():
    H, V = 8, 11
    heads = MedusaHeads(MedusaConfig(hidden_size=H, vocab_size=V, num_heads=3, num_layers=2))
    expected = vllm_medusa_shapes(H, V, num_heads=3, num_layers=2)
    assert {k: tuple(v.shape) for k, v in heads.state_dict().items()} == expected


def test_forward_matches_formula():
    cfg = MedusaConfig(hidden_size=6, vocab_size=10, num_heads=3, num_layers=2)
    heads = randomize(MedusaHeads(cfg).double())
    h = torch.randn(2, 5, 6, dtype=torch.float64)
    sd = heads.state_dict()
    out = heads(h)
    assert out.shape == (3, 2, 5, 10)
    for i in range(3):
        x = h.clone()
        for j in range(2):
            z = x @ sd[f"blocks.{i}.layers.{j}.weight"].T + sd[f"blocks.{i}.layers.{j}.bias"]
            x = x + z * torch.sigmoid(z)  # SiLU
        ref = x @ sd[f"lm_heads.{i}.weight"].T
        torch.testing.assert_close(out[i], ref, rtol=0, atol=1e-12)
        torch.testing.assert_close(heads.forward_head(i, h), ref, rtol=0, atol=1e-12)
    # top-k of one position, per head
    topk = heads.topk(h[0, 0], 4)
    assert topk.shape == (3, 4)
    assert torch.equal(topk, out[:, 0, 0].topk(4, dim=-1).indices)


@pytest.mark.parametrize("tie", [False, True])
def test_fresh_heads_from_target_equal_target_lm_head(tie):
    target = tiny_llama(tie)
    heads = MedusaHeads.from_target(target, num_heads=4, num_layers=1)
    assert heads.config == MedusaConfig(hidden_size=32, vocab_size=96, num_heads=4, num_layers=1)
    assert next(heads.parameters()).dtype == torch.float64
    for block in heads.blocks:
        for layer in block.layers:
            assert not layer.weight.any() and not layer.bias.any()
    ids = torch.randint(96, (1, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = target(ids, output_hidden_states=True)
        logits = heads(out.hidden_states[-1])  # the post-norm hidden state the heads read
    for i in range(4):
        torch.testing.assert_close(logits[i], out.logits, rtol=0, atol=1e-12)
    # The heads own copies: training them must not touch the target.
    with torch.no_grad():
        heads.lm_heads[0].weight.add_(1.0)
    assert not torch.equal(heads.lm_heads[0].weight, target.lm_head.weight)
    assert torch.equal(heads.lm_heads[1].weight, target.lm_head.weight)


def test_zero_init_still_trains_blocks():
    """W = 0 is not a dead start: the gradient reaches every block weight."""
    target = tiny_llama()
    heads = MedusaHeads.from_target(target, num_heads=2, num_layers=2)
    h = torch.randn(3, 32, dtype=torch.float64)
    labels = torch.randint(96, (2, 3))
    logits = heads(h)
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 96), labels.reshape(-1))
    loss.backward()
    for name, p in heads.named_parameters():
        if name.startswith("blocks."):
            assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_config_validation_and_lm_head_shape():
    with pytest.raises(ValueError, match="num_heads"):
        MedusaConfig(hidden_size=4, vocab_size=5, num_heads=0)
    MedusaConfig(hidden_size=4, vocab_size=5, num_heads=1, num_layers=0)  # lm heads only: allowed
    with pytest.raises(ValueError, match="shape"):
        MedusaHeads(MedusaConfig(hidden_size=4, vocab_size=5), lm_head_weight=torch.zeros(4, 5))


def test_a_shared_lm_head_is_the_targets_behind_every_block():
    """One vocab x hidden head for all heads: each head is still its own block then that head, and
    the batched forward (one pass over the head's weight) equals head-by-head."""
    target = tiny_llama()
    heads = randomize(MedusaHeads.from_target(target, num_heads=3, num_layers=2, shared_lm_head=True))
    with torch.no_grad():
        heads.lm_heads[0].weight.copy_(target.lm_head.weight)
    assert len(heads.lm_heads) == 1 and "lm_heads.1.weight" not in heads.state_dict()
    assert sum(p.numel() for p in heads.parameters()) == 96 * 32 + 3 * 2 * (32 * 32 + 32)
    h = torch.randn(5, 32, dtype=torch.float64)
    with torch.no_grad():
        logits = heads(h)
        for i in range(3):
            torch.testing.assert_close(logits[i], heads.forward_head(i, h), rtol=0, atol=1e-12)
            torch.testing.assert_close(logits[i], target.lm_head(heads.blocks[i](h)), rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="shared_lm_head"):
        MedusaConfig(hidden_size=4, vocab_size=5, shared_lm_head=1)
