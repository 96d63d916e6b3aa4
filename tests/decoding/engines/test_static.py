"""The static engine against transformers' own forward, per supported architecture, in float64:
prefill, chain steps, rollback, bucket-padded steps, kept tree paths and hidden states; the
engine choice (`resolve_engine`, `cached_lm`); and one compiled run. Gemma-3 (a 4-token sliding
window, so every test runs past it) adds tree passes, batches and the real model's first layers;
its decoding with every drafter kind is in tests/decoding and tests/eagle3."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from tiny import greedy_reference, tiny_gemma3, tiny_lm

from drafttrain.decoding import EagerLM, ChainDecoder, StaticLM, cached_lm, resolve_engine, static_support
from drafttrain.kinds.ngram.decode import NgramProposer
from drafttrain.errors import UserError

VOCAB = 64
SHAPE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False)


def build(arch: str, dtype=torch.float64, **extra):
    import transformers

    if arch == "gemma3":  # sharpened, with random (1 + w) norm weights
        return tiny_gemma3(vocab_size=VOCAB, dtype=dtype, **extra)
    torch.manual_seed(0)
    if arch == "llama":
        cfg = transformers.LlamaConfig(**SHAPE, attention_bias=True, **extra)  # biases, as in some fine-tunes
        cls = transformers.LlamaForCausalLM
    elif arch == "qwen2":
        cfg = transformers.Qwen2Config(**SHAPE, **extra)  # q/k/v biases
        cls = transformers.Qwen2ForCausalLM
    elif arch == "qwen3":
        cfg = transformers.Qwen3Config(**SHAPE, head_dim=16, **extra)  # q/k norms, explicit head_dim
        cls = transformers.Qwen3ForCausalLM
    elif arch == "mistral":
        cfg = transformers.MistralConfig(**{**SHAPE, "sliding_window": None, **extra})
        cls = transformers.MistralForCausalLM
    elif arch == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=128)
        cls = transformers.GPT2LMHeadModel
    model = cls(cfg).to(dtype).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)  # clear greedy choices
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)  # zero-initialised biases would test nothing
    return model


ARCHS = ["llama", "qwen2", "qwen3", "mistral", "gemma3"]


def hf(model, tokens, layers=()):
    with torch.no_grad():
        out = model(torch.tensor([tokens]), output_hidden_states=True)
    hidden = torch.cat([out.hidden_states[i][0] for i in layers], -1) if layers else None
    return out.logits[0], hidden


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_and_hidden_states_equal_transformers(arch):
    model = build(arch)
    L = model.config.num_hidden_layers
    layers = (0, 1, L)
    lm = StaticLM(model, max_length=40, compile=False)
    g = torch.Generator().manual_seed(1)
    text = torch.randint(VOCAB, (30,), generator=g).tolist()
    lm.reset()
    seen: list[int] = []

    def step(tokens, buckets=None):
        if buckets:
            lm.sizes = {layers: buckets}  # padded to the next bucket, as a compiled step would be
        logits, hidden = lm.forward(torch.tensor(tokens), hidden_layers=layers)
        lm.sizes = {}
        seen.extend(tokens)
        ref_logits, ref_hidden = hf(model, seen, layers)
        torch.testing.assert_close(logits, ref_logits[-len(tokens):], rtol=0, atol=1e-10)
        torch.testing.assert_close(hidden, ref_hidden[-len(tokens):], rtol=0, atol=1e-10)
        assert lm.length == len(seen)

    step(text[:7])                   # prefill
    step(text[7:11])                 # a verification chain
    step(text[11:12])                # one token
    lm.rollback(9)                   # forget 3: moving the length is all it takes
    del seen[9:]
    step(text[20:23])                # new tokens overwrite the forgotten slots
    step(text[23:25], buckets=[5])   # 2 real tokens padded to 5
    step(text[25:26], buckets=[4, 8])
    with pytest.raises(ValueError, match="roll back"):
        lm.rollback(lm.length + 1)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_decoding_equals_generate(arch):
    model = build(arch)
    decoder = ChainDecoder(StaticLM(model, max_length=64, compile=False), NgramProposer("cpu"),
                                 num_draft_tokens=3)
    decoder.warmup()  # buckets 1, 2, 4: three-token steps are padded
    for prompt in ([5, 9, 13, 7, 5, 9], [40], [3, 4, 5, 6, 3, 4, 5]):
        assert decoder.generate(prompt, 24).tokens == greedy_reference(model, prompt, 24)


def test_rollback_copies_nothing_and_keep_gathers_in_order():
    model = build("llama")
    lm = StaticLM(model, max_length=32, compile=False)
    lm.reset()
    lm.forward(torch.arange(9))
    before = [k.clone() for k in lm.cache.keys]
    lm.rollback(4)
    assert lm.length == 4 and all(torch.equal(a, b) for a, b in zip(before, lm.cache.keys))
    lm.forward(torch.arange(9, 14))  # slots 4..8 rewritten
    before = [(k.clone(), v.clone()) for k, v in zip(lm.cache.keys, lm.cache.values)]
    lm.compact(4, [0, 3, 1])
    assert lm.length == 7
    for (k0, v0), k, v in zip(before, lm.cache.keys, lm.cache.values):
        idx = torch.tensor([0, 1, 2, 3, 4, 7, 5])
        torch.testing.assert_close(k[:, :, :7], k0[:, :, idx], rtol=0, atol=0)
        torch.testing.assert_close(v[:, :, :7], v0[:, :, idx], rtol=0, atol=0)


def test_supported_and_unsupported_models():
    llama = build("llama")
    gpt2 = build("gpt2")
    assert static_support(llama) is None
    assert "gpt2" in static_support(gpt2)
    with pytest.raises(UserError, match="gpt2.*--engine eager"):
        resolve_engine("static", gpt2)
    with pytest.raises(UserError, match="gpt2.*--engine eager"):
        StaticLM(gpt2, max_length=16)
    assert resolve_engine("auto", gpt2) == "eager"
    assert resolve_engine("auto", llama) == "eager"  # CPU: auto is eager
    assert resolve_engine("static", llama) == "static"
    assert resolve_engine("eager", llama) == "eager"
    with pytest.raises(UserError, match="unknown --engine 'fast'"):
        resolve_engine("fast", llama)
    # Mistral's sliding window: exact only while the cache fits inside the window.
    windowed = build("mistral", sliding_window=16)
    assert static_support(windowed, max_length=16) is None
    assert "sliding-window" in static_support(windowed, max_length=17)
    with pytest.raises(UserError, match="sliding-window.*--engine eager"):
        resolve_engine("static", windowed, max_length=64)
    assert resolve_engine("auto", windowed, max_length=64) == "eager"
    lm = StaticLM(windowed, max_length=16, compile=False)
    assert ChainDecoder(lm, NgramProposer("cpu"), num_draft_tokens=2).generate([3, 4, 5], 12).tokens == \
        greedy_reference(windowed, [3, 4, 5], 12)


def test_cached_lm_api():
    model = build("llama")
    eager = cached_lm(model, "eager")
    assert isinstance(eager, EagerLM) and eager.compile_seconds == 0.0 and eager.engine == "eager"
    assert isinstance(cached_lm(model, "auto", max_length=32), EagerLM)  # CPU
    static = cached_lm(model, "static", max_length=32)
    assert isinstance(static, StaticLM) and static.engine == "static"
    assert static.compile is False and static.compile_seconds == 0.0  # compile None: off on CPU
    assert static.max_length == 32 and static.capacity == 256  # a multiple of 256: graphs shared across prompt sets
    assert cached_lm(model, "static", max_length=257).capacity == 512
    with pytest.raises(ValueError, match="max_length"):
        cached_lm(model, "static")
    for lm in (cached_lm(model, "eager", max_length=10), static):
        lm.reset()
        with pytest.raises(UserError, match="holds at most"):
            lm.forward(torch.arange(40))


def _inductor_available() -> bool:
    return shutil.which("g++") is not None or shutil.which("c++") is not None


@pytest.mark.slow
@pytest.mark.skipif(not _inductor_available(), reason="inductor needs a C++ compiler to build CPU kernels")
def test_compiled_steps_equal_generate_without_recompiling():
    """The compiled path (inductor on CPU; CUDA graphs on CUDA): warm-up compiles each bucket once,
    and decoding prompts of other lengths, with padded and rolled-back steps, never recompiles."""
    import torch._dynamo

    from tiny import tiny_lm

    model = tiny_lm(0, layers=1, dtype=torch.float32)
    lm = cached_lm(model, "static", max_length=48, compile=True)
    decoder = ChainDecoder(lm, NgramProposer("cpu"), num_draft_tokens=2)
    seconds = lm.warmup([1, 3])  # two buckets: a two-token step is padded to three
    assert seconds > 0 and lm.compile_seconds == seconds and lm.sizes == {(): [1, 3]}
    proposed = []
    with torch._dynamo.config.patch(error_on_recompile=True):
        for prompt in ([5, 9, 13, 7, 5, 9], [40], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 3, 4, 5]):
            gen = decoder.generate(prompt, 19)
            assert gen.tokens == greedy_reference(model, prompt, 19)
            proposed += gen.proposed_lengths
    assert {0, 1, 2} <= set(proposed)  # one-, padded two- and three-token steps all ran
    assert any(a < p for a, p in zip(gen.accepted_lengths, gen.proposed_lengths))  # and a rollback


# --- Gemma-3: sliding and global layers past the window ---------------------------------------


def gemma3_lm(engine: str, model=None, max_length: int = 64):
    model = model if model is not None else build("gemma3")
    lm = cached_lm(model, "eager" if engine == "eager" else "static", max_length=max_length)
    if engine == "static-bucket":
        lm.warmup([16])  # every step below is padded to 16 rows
    return lm


def plain_logits(model, tokens):
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0]


def test_gemma3_is_supported_at_any_length_but_not_bidirectional():
    model = build("gemma3")
    assert model.config.sliding_window == 4 and static_support(model, max_length=4096) is None
    assert resolve_engine("static", model, max_length=4096) == "static"
    bidirectional = build("gemma3", use_bidirectional_attention=True)
    assert "bidirectionally" in static_support(bidirectional, max_length=16)
    capped = build("gemma3", attn_logit_softcapping=1.0)  # transformers' Gemma-3 never applies it: nor do we
    lm = StaticLM(capped, max_length=16, compile=False)
    lm.reset()
    logits, _ = lm.forward(torch.arange(3, 15))
    torch.testing.assert_close(logits, plain_logits(capped, list(range(3, 15))), rtol=0, atol=1e-10)


@pytest.mark.parametrize("engine", ["eager", "static", "static-bucket"])
def test_gemma3_tree_pass_and_compact_equal_transformers(engine):
    """Every node of a tree drafted 9 tokens past a 4-token window sees its own path's window;
    keeping a path (out of slot order) and decoding on equals the plain sequence."""
    from drafttrain.trees import tree_from_parents

    lm = gemma3_lm(engine)
    model = lm.model
    tree = tree_from_parents([-1, 0, 0, 1, 2, 1, 3, 5, 6, 8])
    g = torch.Generator().manual_seed(3)
    prefix = torch.randint(VOCAB, (9,), generator=g).tolist()
    tokens = torch.randint(VOCAB, (tree.num_nodes,), generator=g)
    lm.reset()
    with torch.no_grad():
        lm.forward(torch.tensor(prefix))
        logits, _ = lm.forward(tokens, tree=tree)
        for n in range(tree.num_nodes):
            want = plain_logits(model, prefix + tokens[tree.path_to(n)].tolist())[-1]
            torch.testing.assert_close(logits[n], want, rtol=0, atol=1e-10)
        path = tree.path_to(9)  # [0, 2, 4, 8, 9]: slots 9, 11, 13, 17, 18 move to 9..13
        lm.compact(len(prefix), path)
        more = [11, 12, 13, 14, 15, 16]
        cont, _ = lm.forward(torch.tensor(more))
        want = plain_logits(model, prefix + tokens[path].tolist() + more)[-len(more):]
        torch.testing.assert_close(cont, want, rtol=0, atol=1e-10)
        lm.rollback(len(prefix) + 2)  # forget past the window, then decode over it again
        cont, _ = lm.forward(torch.tensor(more))
        want = plain_logits(model, prefix + tokens[path[:2]].tolist() + more)[-len(more):]
        torch.testing.assert_close(cont, want, rtol=0, atol=1e-10)


def test_gemma3_batch_rows_equal_each_prompt_alone():
    """Left-padded rows: the window counts each row's own positions, not the padded slots."""
    from drafttrain.tokens import left_pad
    from drafttrain.decoding.batch import BatchGenerator

    model = build("gemma3")
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [12, 13], [14], [15, 16, 17, 18, 19, 20]]
    ids, mask = left_pad(prompts, 0, "cpu")
    rows, _, _ = BatchGenerator(model, batch_size=4, max_length=ids.shape[1] + 12).generate(
        ids, mask, max_new_tokens=12, eos_token_ids=[2])
    assert rows == [greedy_reference(model, p, 12, eos=2) for p in prompts]


def real_gemma3() -> Path | None:
    """The directory `drafttrain assets gemma3` builds, where it has been built."""
    home = Path(os.environ.get("DRAFTTRAIN_HOME") or Path.home() / ".cache" / "drafttrain")
    path = home / "models" / "gemma-3-270m"
    return path if (path / ".complete").is_file() else None


@pytest.mark.slow
@pytest.mark.skipif(real_gemma3() is None, reason="run `drafttrain assets gemma3` first")
def test_real_gemma3_first_layers_equal_transformers():
    """Gemma-3-270M's first two layers with the real weights, window 512 and 262k vocabulary, in
    float64 (the second switched to global attention, as every sixth layer is, so both rotary bases
    and both masks meet real weights): a prompt past the window, chain steps, a rollback across it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = real_gemma3()
    cfg = AutoConfig.from_pretrained(path)
    cfg.num_hidden_layers, cfg.layer_types = 2, ["sliding_attention", "full_attention"]
    model = AutoModelForCausalLM.from_pretrained(path, config=cfg, dtype=torch.float64).eval()
    assert model.config.vocab_size == 262144 and model.config.sliding_window == 512
    lm = StaticLM(model, max_length=560, compile=False)
    text = torch.randint(3, 262144, (540,), generator=torch.Generator().manual_seed(0)).tolist()
    lm.reset()
    with torch.no_grad():
        for start, end in ((0, 505), (505, 514), (514, 515)):
            logits, _ = lm.forward(torch.tensor(text[start:end]))
            want = model(torch.tensor([text[:end]]), logits_to_keep=end - start).logits[0]
            torch.testing.assert_close(logits, want, rtol=0, atol=1e-9)
        lm.rollback(508)
        logits, _ = lm.forward(torch.tensor(text[520:540]))
        want = model(torch.tensor([text[:508] + text[520:540]]), logits_to_keep=20).logits[0]
        torch.testing.assert_close(logits, want, rtol=0, atol=1e-9)


def test_the_cache_is_one_tensor_and_moving_entries_is_two_ops_whatever_the_depth():
    """Compaction moves every layer's entries with one gather and one scatter (issue 36: not four
    kernels per layer), and equals moving each layer's entries one by one."""
    from drafttrain.decoding.engines.overhead import count_overhead
    from drafttrain.decoding.engines.static import move_entries

    for layers in (2, 4):
        lm = StaticLM(tiny_lm(0, vocab_size=64, layers=layers), max_length=16)
        lm.forward(torch.tensor([3, 5, 7, 9, 11, 13]))
        reference = [k[:, :, [0, 4, 5]].clone() for k in lm.cache.keys]
        src, dst = torch.tensor([0, 4, 5]), torch.tensor([1, 2, 3])
        with count_overhead() as counts:
            move_entries(lm.cache, src, dst)
        assert counts.eager_ops == 2
        assert all(torch.equal(k[:, :, 1:4], r) for k, r in zip(lm.cache.keys, reference))
