"""The EAGLE-3 draft: the training-time-test unroll against brute-force cached decoding (float64)."""

from __future__ import annotations

import re

import pytest
import torch

from drafttrain.data.collate import TrainingCollator
from drafttrain.kinds.eagle3.decode import draft_step, prefill, step_in_place
from drafttrain.kinds.eagle3.model import Eagle3Config, Eagle3Draft, check_aux_layer_ids, default_aux_layer_ids
from drafttrain.errors import UserError
from drafttrain.kinds.features import DraftKVCache
from eagle3_helpers import VOCAB, target_hidden_states, tiny_draft, tiny_target

STEPS = 4


@pytest.fixture(scope="module")
def pair():
    target = tiny_target()
    return target, tiny_draft(target)


def collated_batch():
    """Two rows as drafttrain's collator makes them: left-padded prompts, per-row positions."""
    rows = [{"prompt_ids": [5, 9, 13, 21, 30], "response_ids": [40, 41, 7, 12, 33, 8, 2]},
            {"prompt_ids": [11, 3], "response_ids": [17, 25, 6, 44, 50, 2]}]
    return TrainingCollator(max_seq_len=64, pad_id=2, align_prompts=True)(rows)


def decode_reference(draft, target, tokens: list[int], p: int, steps: int) -> list[torch.Tensor]:
    """Brute force: features of tokens[:p+1] from a fresh target forward, prefill them into an
    empty cache, then draft step by step feeding the ground-truth tokens."""
    ids = torch.tensor([tokens])
    features = draft.target_features(target_hidden_states(target, ids))
    cache = DraftKVCache()
    out = prefill(draft, cache, features[:, :p + 1], ids[:, 1:p + 2], torch.arange(p + 1)[None])
    logits, hidden = [out.logits[0, -1]], out.hidden[:, -1:]
    for j in range(1, steps):
        out = draft_step(draft, cache, hidden, ids[:, p + 1 + j:p + 2 + j], torch.tensor([[p + j]]))
        logits.append(out.logits[0, -1])
        hidden = out.hidden
    return logits


def test_unroll_equals_cached_decoding_at_every_index_and_step(pair):
    target, draft = pair
    batch = collated_batch()
    hs = target_hidden_states(target, batch["input_ids"], batch["attention_mask"], batch["position_ids"])
    start = 2
    with torch.no_grad():
        logits = draft(draft.target_features(hs), batch["input_ids"], attention_mask=batch["attention_mask"],
                       position_ids=batch["position_ids"], num_steps=STEPS, logits_from=start)
    assert logits.shape == (STEPS, 2, batch["input_ids"].shape[1] - start, draft.config.draft_vocab_size)
    checked = 0
    for b in range(2):
        real = batch["attention_mask"][b].bool()
        offset = int((~real).cumsum(0)[real.nonzero()[0, 0]])  # left padding of this row
        tokens = batch["input_ids"][b][real].tolist()
        for p in range(max(start - offset, 0), len(tokens) - 1):
            steps = min(STEPS, len(tokens) - 1 - p)  # step j needs token p + 1 + j
            reference = decode_reference(draft, target, tokens, p, steps)
            for j in range(steps):
                torch.testing.assert_close(logits[j, b, p + offset - start], reference[j], rtol=1e-9, atol=1e-9)
                checked += 1
    assert checked > 30


def test_step_zero_equals_transformers_causal_attention(pair):
    """Step 0 against transformers' own LlamaAttention (SDPA, causal) fed the same 2H input."""
    from transformers.models.llama.modeling_llama import LlamaAttention

    target, draft = pair
    c = draft.config
    cfg = c.llama_config()
    cfg.hidden_size = 2 * c.hidden_size  # the q/k/v input width
    cfg._attn_implementation = "sdpa"
    reference = LlamaAttention(cfg, layer_idx=0).to(torch.float64)
    mine = draft.midlayer.self_attn
    with torch.no_grad():
        for name in ("q_proj", "k_proj", "v_proj"):
            getattr(reference, name).weight.copy_(getattr(mine, name).weight)
        reference.o_proj = mine.o_proj
    ids = torch.tensor([[4, 9, 33, 12, 50, 7, 21, 8, 3]])
    features = draft.target_features(target_hidden_states(target, ids))
    with torch.no_grad():
        logits = draft(features, ids, num_steps=1)[0, 0]
        layer = draft.midlayer
        h = draft.fc(features)
        x = layer.attention_input(draft.embed(torch.cat([ids[:, 1:], ids[:, -1:]], 1)), h)
        cos_sin = draft.rotary_emb(x, torch.arange(ids.shape[1])[None])
        attn, _ = reference(x, position_embeddings=cos_sin, attention_mask=None)
        h = h + attn
        h = h + layer.mlp(layer.post_attention_layernorm(h))
        expected = draft.lm_head(draft.norm(h))[0]
    torch.testing.assert_close(logits, expected, rtol=1e-10, atol=1e-10)


def test_batched_prefill_with_left_padding_equals_each_row_alone(pair):
    target, draft = pair
    rows = [[7, 8, 9, 10, 11, 12], [30, 31, 32]]
    width = max(map(len, rows))
    ids = torch.tensor([[2] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    hs = target_hidden_states(target, ids, mask, positions)
    cache = DraftKVCache()
    n = width - 1
    with torch.no_grad():
        batched = prefill(draft, cache, draft.target_features(hs)[:, :n], ids[:, 1:], positions[:, :n], mask[:, :n])
        step = draft_step(draft, cache, batched.hidden[:, -1:], torch.tensor([[40], [41]]), positions[:, n - 1:n] + 1)
    for b, row in enumerate(rows):
        alone = DraftKVCache()
        r = torch.tensor([row])
        with torch.no_grad():
            out = prefill(draft, alone, draft.target_features(target_hidden_states(target, r))[:, :-1], r[:, 1:],
                          torch.arange(len(row) - 1)[None])
            nxt = draft_step(draft, alone, out.hidden[:, -1:], torch.tensor([[40 + b]]), torch.tensor([[len(row) - 1]]))
        torch.testing.assert_close(batched.logits[b, width - len(row):], out.logits[0], rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(step.logits[b, 0], nxt.logits[0, 0], rtol=1e-10, atol=1e-10)


def chain(draft, target, prompt: list[int], path: list[int]):
    """Fresh cache: prefill the prompt, then draft `path` one token at a time; logits of each step."""
    ids = torch.tensor([prompt])
    cache = DraftKVCache()
    out = prefill(draft, cache, draft.target_features(target_hidden_states(target, ids))[:, :-1], ids[:, 1:],
                  torch.arange(len(prompt) - 1)[None])
    hidden, logits = out.hidden[:, -1:], []
    for i, token in enumerate(path):
        out = draft_step(draft, cache, hidden, torch.tensor([[token]]), torch.tensor([[len(prompt) - 2 + 1 + i]]))
        hidden = out.hidden
        logits.append(out.logits[0, 0])
    return logits


def test_tree_levels_equal_chains_along_each_branch_and_keep_compacts(pair):
    target, draft = pair
    prompt = [3, 14, 15, 9, 26, 5]
    ids = torch.tensor([prompt])
    root = len(prompt) - 2  # the last prefilled index
    # Tree: depth 1 = (a, b), depth 2 = (a->c, a->d, b->e); node order a, b, c, d, e.
    a, b, c, d, e = 40, 41, 42, 43, 44
    parents = [-1, -1, 0, 0, 1]
    tokens = [a, b, c, d, e]
    ancestors = torch.zeros(5, 5, dtype=torch.bool)
    for i in range(5):
        n = i
        while n >= 0:
            ancestors[i, n] = True
            n = parents[n]
    with torch.no_grad():
        cache = DraftKVCache()
        pre = prefill(draft, cache, draft.target_features(target_hidden_states(target, ids))[:, :-1], ids[:, 1:],
                      torch.arange(len(prompt) - 1)[None])
        past = cache.length
        level1 = draft_step(draft, cache, pre.hidden[:, -1:].expand(1, 2, -1), torch.tensor([[a, b]]),
                            torch.full((1, 2), root + 1), tree_mask=ancestors[:2, :2])
        hidden2 = level1.hidden[:, [0, 0, 1]]
        level2 = draft_step(draft, cache, hidden2, torch.tensor([[c, d, e]]), torch.full((1, 3), root + 2),
                            tree_mask=ancestors[2:, :5])
        node_logits = [*level1.logits[0], *level2.logits[0]]
        for node in range(5):
            path, n = [], node
            while n >= 0:
                path.insert(0, tokens[n])
                n = parents[n]
            torch.testing.assert_close(node_logits[node], chain(draft, target, prompt, path)[-1],
                                       rtol=1e-10, atol=1e-10)
        assert cache.length == past + 5


def test_rollback_then_prefill_equals_a_fresh_cache(pair):
    target, draft = pair
    tokens = [3, 14, 15, 9, 26, 5, 35, 8, 9, 7]
    ids = torch.tensor([tokens])
    features = draft.target_features(target_hidden_states(target, ids))
    with torch.no_grad():
        cache = DraftKVCache()
        out = prefill(draft, cache, features[:, :5], ids[:, 1:6], torch.arange(5)[None])
        draft_step(draft, cache, out.hidden[:, -1:], torch.tensor([[60]]), torch.tensor([[5]]))  # a rejected draft
        draft_step(draft, cache, out.hidden[:, -1:], torch.tensor([[61]]), torch.tensor([[6]]))
        cache.rollback(5)
        after = prefill(draft, cache, features[:, 5:8], ids[:, 6:9], torch.arange(5, 8)[None])
        fresh = prefill(draft, DraftKVCache(), features[:, :8], ids[:, 1:9], torch.arange(8)[None])
    torch.testing.assert_close(after.logits, fresh.logits[:, 5:], rtol=1e-10, atol=1e-10)
    with pytest.raises(ValueError):
        cache.rollback(cache.length + 1)
    cache.reset()
    assert cache.length == 0


def test_state_dict_names_shapes_and_vocab_maps(pair):
    target, draft = pair
    c = draft.config
    H, I, hd = c.hidden_size, c.intermediate_size, c.head_dim
    expected = {
        "fc.weight": (H, 3 * H), "norm.weight": (H,), "lm_head.weight": (c.draft_vocab_size, H),
        "d2t": (c.draft_vocab_size,), "t2d": (VOCAB,),
        "midlayer.input_layernorm.weight": (H,), "midlayer.hidden_norm.weight": (H,),
        "midlayer.post_attention_layernorm.weight": (H,),
        "midlayer.self_attn.q_proj.weight": (c.num_attention_heads * hd, 2 * H),
        "midlayer.self_attn.k_proj.weight": (c.num_key_value_heads * hd, 2 * H),
        "midlayer.self_attn.v_proj.weight": (c.num_key_value_heads * hd, 2 * H),
        "midlayer.self_attn.o_proj.weight": (H, c.num_attention_heads * hd),
        "midlayer.mlp.gate_proj.weight": (I, H), "midlayer.mlp.up_proj.weight": (I, H),
        "midlayer.mlp.down_proj.weight": (H, I),
    }
    assert {k: tuple(v.shape) for k, v in draft.state_dict().items()} == expected
    # d2t / t2d agree: every draft id maps to a kept target id, and logits land there.
    target_ids = draft.to_target_ids(torch.arange(c.draft_vocab_size))
    assert draft.t2d[target_ids].all() and int(draft.t2d.sum()) == c.draft_vocab_size
    assert torch.equal(target_ids, draft.t2d.nonzero().flatten())
    logits = torch.randn(3, c.draft_vocab_size, dtype=torch.float64)
    full = draft.to_target_logits(logits)
    assert torch.equal(full[:, target_ids], logits)
    assert torch.isneginf(full[:, ~draft.t2d]).all()
    assert torch.equal(full.argmax(-1), draft.to_target_ids(logits.argmax(-1)))


def test_initialisation_reads_the_target():
    target = tiny_target()
    from drafttrain.kinds.vocab import build_draft_vocab

    vocab = build_draft_vocab([[1, 5, 5, 9]], VOCAB, 10)
    with torch.no_grad():
        target.model.norm.weight.copy_(torch.linspace(1.0, 7.0, target.config.hidden_size))
    draft = Eagle3Draft.from_target(target, vocab, dtype=torch.float64)
    torch.testing.assert_close(draft.lm_head.weight, target.lm_head.weight[vocab.target_ids])
    # The final norm's profile at unit root mean square: a weight proportional to the target's.
    w = target.model.norm.weight.double()
    torch.testing.assert_close(draft.norm.weight, w / w.square().mean().sqrt())
    assert abs(draft.norm.weight.square().mean().item() - 1.0) < 1e-6
    assert torch.equal(draft.midlayer.input_layernorm.weight, torch.ones_like(draft.norm.weight))
    assert draft.config.aux_layer_ids == (2, 3, 4) and draft.config.rope_parameters["rope_type"] == "default"
    # The embedding is the target's and is not part of the draft's parameters or state.
    assert not any(p is target.model.embed_tokens.weight for p in draft.parameters())
    assert all("embed" not in k for k in draft.state_dict())


def test_a_gemma3_target_is_read_right():
    """Gemma-3-270M's config (18 layers, head_dim 256 != 640 / 4 heads, rotary per layer type)
    gives the default aux layers and the global layers' rotary; a tiny Gemma-3's final norm,
    which stores 1 + w as w, starts the draft's Llama-style norm at 1 + w (at unit RMS)."""
    from transformers import Gemma3TextConfig

    from drafttrain.kinds.vocab import build_draft_vocab

    real = Gemma3TextConfig(vocab_size=262144, hidden_size=640, intermediate_size=2048, num_hidden_layers=18,
                            num_attention_heads=4, num_key_value_heads=1, head_dim=256, sliding_window=512,
                            rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                             "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
    config = Eagle3Config.from_target(real, 32768)
    assert config.aux_layer_ids == (2, 9, 15) and config.head_dim == 256 and config.num_key_value_heads == 1
    assert config.rope_parameters == {"rope_type": "default", "rope_theta": 1e6}
    target = tiny_target(arch="gemma3")
    with torch.no_grad():
        target.model.norm.weight.copy_(torch.linspace(20.0, 30.0, target.config.hidden_size))  # Gemma's size
    draft = Eagle3Draft.from_target(target, build_draft_vocab([[1, 5, 5, 9]], VOCAB, 10), dtype=torch.float64)
    scale = 1 + target.model.norm.weight.double()
    torch.testing.assert_close(draft.norm.weight, scale / scale.square().mean().sqrt())
    assert draft.config.rope_parameters == target.config.rope_parameters["full_attention"]


def test_aux_layer_ids_are_checked():
    assert default_aux_layer_ids(30) == (2, 15, 27)  # vLLM's / SGLang's default for SmolLM2's 30 layers
    assert check_aux_layer_ids([1, 3, 5], 7) == (1, 3, 5)
    for bad in ([0, 3, 5], [1, 3, 7], [3, 3, 5], [5, 3, 1], [1, 2]):
        with pytest.raises(UserError):
            check_aux_layer_ids(bad, 7)
    with pytest.raises(UserError):  # too few layers for the default: (2, 2, 1)
        Eagle3Config.from_target(_four_layer_config(), 10)


@pytest.mark.parametrize("layers, suggestion", [(4, "[1, 2, 3]"), (6, "[1, 3, 5]"), (30, "[2, 15, 27]")])
def test_a_bad_choice_suggests_ids_that_are_valid(layers, suggestion):
    """The old message suggested the default even where it is invalid ((2, 2, 1) for 4 layers)."""
    assert check_aux_layer_ids(None, 30) == (2, 15, 27)
    with pytest.raises(UserError, match=rf"set draft.aux_layer_ids to e.g. {re.escape(suggestion)}$"):
        check_aux_layer_ids([0, 1, 2], layers)
    fixed = [int(x) for x in suggestion.strip("[]").split(", ")]
    assert check_aux_layer_ids(fixed, layers) == tuple(fixed)


@pytest.mark.parametrize("layers", [2, 3])
def test_a_target_too_small_for_any_ids_says_so(layers):
    with pytest.raises(UserError, match=rf"the default aux_layer_ids .* no valid ids exist for {layers} layers"):
        check_aux_layer_ids(None, layers)


def _four_layer_config():
    from tiny import tiny_lm

    return tiny_lm(layers=4).config


def test_the_static_cache_writes_what_the_growing_one_does(pair):
    """Both caches own their writes (`update`): the static one appended to (the prompt's feed), then
    written in place at tensor slots with its length unmoved (a compiled chain step), gives the
    growing cache's logits, holds the same entries, and a rollback then a feed equals a fresh one."""
    target, draft = pair
    tokens = [3, 14, 15, 9, 26, 5, 35, 8, 9, 7]
    ids = torch.tensor([tokens])
    features = draft.target_features(target_hidden_states(target, ids))
    grown, static = DraftKVCache(), DraftKVCache(capacity=12, kv_heads=draft.config.num_key_value_heads,
                                                   head_dim=draft.config.head_dim, dtype=features.dtype)
    with torch.no_grad():
        out = [prefill(draft, c, features[:, :5], ids[:, 1:6], torch.arange(5)[None]) for c in (grown, static)]
        torch.testing.assert_close(out[1].logits, out[0].logits, rtol=1e-12, atol=1e-12)
        assert grown.length == static.length == 5
        hidden, token, position = out[0].hidden[:, -1:], torch.tensor([[60]]), torch.tensor([[5]])
        want = draft_step(draft, grown, hidden, token, position)
        one = torch.ones(1, 1, dtype=torch.bool)
        logits, _ = step_in_place(draft, static, hidden, token, position, torch.tensor(5), one)
        torch.testing.assert_close(logits, want.logits, rtol=1e-12, atol=1e-12)
        assert static.length == 5 and bool(static.valid[0, :6].all()) and not bool(static.valid[0, 6:].any())
        torch.testing.assert_close(static.keys[0][:, :, :6], grown.keys[0], rtol=0, atol=0)
        torch.testing.assert_close(static.values[0][:, :, :6], grown.values[0], rtol=0, atol=0)
        static.rollback(5)  # the drafted entry is stale past the length: the next feed overwrites it
        after = prefill(draft, static, features[:, 5:8], ids[:, 6:9], torch.arange(5, 8)[None])
        fresh = prefill(draft, DraftKVCache(), features[:, :8], ids[:, 1:9], torch.arange(8)[None])
    torch.testing.assert_close(after.logits, fresh.logits[:, 5:], rtol=1e-10, atol=1e-10)
    with pytest.raises(ValueError, match="holds 12 entries"):
        prefill(draft, static, features[:, :5], ids[:, 1:6], torch.arange(8, 13)[None])
