from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from drafttrain.kinds.draft_lm.model import draft_from_target, parse_layer_spec
from drafttrain.errors import UserError


def tiny_llama(layers=6, tie=False, seed=0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=tie, bos_token_id=None, eos_token_id=None, pad_token_id=None,
                      attn_implementation="eager")
    return LlamaForCausalLM(cfg).to(torch.float64).eval()


def manual_logits(target, ids, layers):
    """Brute force: embed -> the chosen target layers, one by one with an explicit causal mask -> norm -> head."""
    T = ids.shape[1]
    x = target.model.embed_tokens(ids)
    pos = torch.arange(T)[None]
    cos_sin = target.model.rotary_emb(x, pos)
    mask = torch.full((T, T), float("-inf"), dtype=x.dtype).triu(1)[None, None]
    for i in layers:
        out = target.model.layers[i](x, attention_mask=mask, position_ids=pos, position_embeddings=cos_sin)
        x = out[0] if isinstance(out, tuple) else out
    return target.lm_head(target.model.norm(x))


def greedy_no_cache(model, ids, n):
    for _ in range(n):
        nxt = model(ids, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
        ids = torch.cat([ids, nxt], dim=1)
    return ids


def test_parse_layer_spec():
    assert parse_layer_spec("every:5", 12) == [0, 5, 10]
    assert parse_layer_spec("every:1", 3) == [0, 1, 2]
    assert parse_layer_spec("first:2", 6) == [0, 1]
    assert parse_layer_spec("0, 4,8", 12) == [0, 4, 8]
    assert parse_layer_spec("0,-1", 12) == [0, 11]
    assert parse_layer_spec([1, 3], 6) == [1, 3]
    for spec, words in [("0,6", "out of range"), ([-7], "out of range"), ("first:7", "7 layers"),
                        ("every:0", "at least 1"), ("2,1", "increasing"), ("0,0", "increasing"),
                        ("half", "not understood"), ([], "no layers"), ([True], "not understood")]:
        with pytest.raises(UserError, match=words):
            parse_layer_spec(spec, 6)


@torch.no_grad()
def test_all_layers_is_the_target():
    target = tiny_llama()
    draft = draft_from_target(target, list(range(6)))
    assert type(draft) is LlamaForCausalLM and draft.config.num_hidden_layers == 6
    ids = torch.randint(0, 96, (2, 11))
    assert torch.equal(draft(ids).logits, target(ids).logits)
    # the manual reference is itself faithful to the target
    torch.testing.assert_close(manual_logits(target, ids, range(6)), target(ids).logits, rtol=0, atol=1e-12)


@pytest.mark.parametrize("tie", [False, True])
@torch.no_grad()
def test_layer_subset_matches_brute_force(tie):
    target = tiny_llama(tie=tie)
    draft = draft_from_target(target, "every:2")
    assert draft.config.num_hidden_layers == 3 and len(draft.model.layers) == 3
    assert [layer.self_attn.layer_idx for layer in draft.model.layers] == [0, 1, 2]
    assert draft.dtype == torch.float64 and not draft.training
    ids = torch.randint(0, 96, (2, 13))
    torch.testing.assert_close(draft(ids).logits, manual_logits(target, ids, [0, 2, 4]), rtol=0, atol=1e-12)
    assert not torch.allclose(draft(ids).logits, target(ids).logits)  # the reference can tell them apart
    # weights are copies (training the draft must not touch the target); tying follows the target
    assert draft.model.embed_tokens.weight.data_ptr() != target.model.embed_tokens.weight.data_ptr()
    assert (draft.lm_head.weight is draft.model.embed_tokens.weight) == tie
    assert (target.lm_head.weight is target.model.embed_tokens.weight) == tie


@torch.no_grad()
def test_cached_generation_matches_no_cache_argmax():
    target = tiny_llama()
    draft = draft_from_target(target, [1, 3, 5])
    ids = torch.randint(0, 96, (1, 7))
    out = draft.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=10)
    assert out.shape[1] == 17
    assert torch.equal(out, greedy_no_cache(draft, ids, 10))


@torch.no_grad()
def test_per_layer_config_lists_are_subset():
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4, head_dim=8,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      layer_types=["full_attention", "sliding_attention", "full_attention", "sliding_attention"],
                      use_sliding_window=True, sliding_window=3, bos_token_id=None, eos_token_id=None)
    target = Qwen3ForCausalLM(cfg).to(torch.float64).eval()
    draft = draft_from_target(target, "1,2")
    assert draft.config.layer_types == ["sliding_attention", "full_attention"]
    assert target.config.layer_types == cfg.layer_types  # the target's config is untouched
    ids = torch.randint(0, 64, (1, 9))
    out = draft.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=10)
    assert torch.equal(out, greedy_no_cache(draft, ids, 10))
    full = draft_from_target(target, "every:1")
    assert torch.equal(full(ids).logits, target(ids).logits)


@torch.no_grad()
def test_gpt2_layout():
    torch.manual_seed(0)
    target = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=4, n_head=4, n_positions=64,
                                        bos_token_id=None, eos_token_id=None)).to(torch.float64).eval()
    draft = draft_from_target(target, "first:2")
    assert draft.config.n_layer == 2 and len(draft.transformer.h) == 2
    ids = torch.randint(0, 64, (1, 6))
    out = draft.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=10)
    assert torch.equal(out, greedy_no_cache(draft, ids, 10))
    assert torch.equal(draft_from_target(target, "every:1")(ids).logits, target(ids).logits)


def test_unsupported_model_names_its_type():
    class Odd(torch.nn.Module):
        class config:
            model_type = "oddformer"

    with pytest.raises(UserError, match="'oddformer'"):
        draft_from_target(Odd(), "every:2")


# ----------------------------------------------------------------------------- copy:N


def test_head_scores_of_uniform_attention_are_hand_computable():
    """With zero query weights every head attends uniformly over the causal prefix: at position t
    each key gets 1 / (t + 1), so both probes have closed-form means."""
    from drafttrain.kinds.draft_lm.model import head_scores

    model = tiny_llama(layers=3)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.zero_()
    model.set_attn_implementation("sdpa")
    L = 10
    prev, induction = head_scores(model, seq_len=L, batch=2)
    assert prev.shape == induction.shape == (3, 4)
    expected_prev = sum(1 / (t + 1) for t in range(1, 2 * L)) / (2 * L - 1)
    expected_induction = sum(1 / (t + 1) for t in range(L, 2 * L - 1)) / (L - 1)
    torch.testing.assert_close(prev, torch.full((3, 4), expected_prev, dtype=torch.float32), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(induction, torch.full((3, 4), expected_induction, dtype=torch.float32),
                               rtol=1e-5, atol=1e-6)
    assert model.config._attn_implementation == "sdpa"  # the probe switches to eager and back


def test_head_scores_equal_a_loop_over_the_attention_weights():
    """A random model (heads differ): each score, per layer and head, from the attention weights
    read one query at a time: previous token t - 1; in the repeat, the key just after the query
    token's earlier copy (checked to hold the same token)."""
    from drafttrain.kinds.draft_lm.model import head_scores

    model = tiny_llama(layers=2, seed=3)
    L, B = 8, 2
    prev, induction = head_scores(model, seq_len=L, batch=B, seed=5)
    g = torch.Generator().manual_seed(5)  # the probe's own tokens, drawn the same way
    half = torch.randint(96 // 10, 96, (B, L), generator=g)
    ids = torch.cat([half, half], dim=1)
    with torch.no_grad():
        attentions = model(ids, output_attentions=True).attentions
    for layer, a in enumerate(attentions):
        for h in range(a.shape[1]):
            p = [float(a[b, h, t, t - 1]) for b in range(B) for t in range(1, 2 * L)]
            i = []
            for b in range(B):
                for q in range(L, 2 * L - 1):
                    first = q - L  # the same position in the first copy holds the same token
                    assert ids[b, first] == ids[b, q]
                    i.append(float(a[b, h, q, first + 1]))
            assert prev[layer, h].item() == pytest.approx(sum(p) / len(p), rel=1e-5)
            assert induction[layer, h].item() == pytest.approx(sum(i) / len(i), rel=1e-5)
    assert len(set(prev.flatten().tolist())) > 1  # heads really differ: the check is per head


def fake_scores(prev_by_layer, induction_by_layer):
    prev = torch.tensor(prev_by_layer)[:, None].repeat(1, 4)
    induction = torch.tensor(induction_by_layer)[:, None].repeat(1, 4)
    prev[:, 1] = 0.0  # per-layer scores are the best head's
    return lambda model: (prev, induction)


def test_copy_circuit_keeps_the_circuit_whole_and_fills_from_the_bottom(monkeypatch):
    import drafttrain.kinds.draft_lm.model as draft_init

    #        layer:  0    1    2    3    4    5    6    7    8    9
    prev =        [0.1, 0.2, 0.7, 0.1, 0.9, 0.1, 0.3, 0.1, 0.6, 0.95]
    induction =   [0.0, 0.0, 0.0, 0.1, 0.0, 0.2, 0.8, 0.4, 0.0, 0.0]
    monkeypatch.setattr(draft_init, "head_scores", fake_scores(prev, induction))
    model = tiny_llama(layers=10)
    # Induction peaks at 6; the best previous-token layer below it is 4 (9 is stronger but above).
    assert draft_init.copy_circuit_layers(model, 3) == [4, 5, 6]
    assert draft_init.copy_circuit_layers(model, 5) == [0, 1, 4, 5, 6]
    assert draft_init.copy_circuit_layers(model, 8) == [0, 1, 2, 3, 4, 5, 6, 7]
    with pytest.raises(UserError, match="copy:3 or more"):
        draft_init.copy_circuit_layers(model, 2)
    draft = draft_from_target(model, "copy:5")
    assert draft.config.num_hidden_layers == 5 and draft.source_layers == [0, 1, 4, 5, 6]
    torch.testing.assert_close(draft.model.layers[4].mlp.up_proj.weight, model.model.layers[6].mlp.up_proj.weight)
    with pytest.raises(UserError, match="has 10"):
        draft_init.copy_circuit_layers(model, 11)
