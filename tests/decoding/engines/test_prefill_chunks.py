"""Prefill as compiled fixed-size chunks (`PREFILL_CHUNK`), traced with dynamo's eager backend
(`DRAFTTRAIN_COMPILE_BACKEND=eager`: the same graphs, guards and recompiles as inductor, without
generating code): a prompt of any length runs ceil(n / C) compiled steps and, outside them, only
a few staging ops per chunk whatever the model's depth; its logits and hidden states equal
transformers' and the decoding after it the greedy reference; near the cache's end the tail takes
smaller buckets; and once warmed up, nothing compiles."""

from __future__ import annotations

import math

import pytest
import torch
from tiny import greedy_reference, tiny_gemma3, tiny_lm

from drafttrain.decoding import ChainDecoder, StaticLM
from drafttrain.kinds.ngram.decode import NgramProposer
from drafttrain.decoding.engines.overhead import count_overhead
from drafttrain.decoding.engines.static import PREFILL_CHUNK

C = PREFILL_CHUNK
LENGTHS = (1, C - 1, C, C + 1, 2 * C + 5)
BUCKETS = [1, 2, 4]


@pytest.fixture
def compiled_backend(monkeypatch):
    monkeypatch.setenv("DRAFTTRAIN_COMPILE_BACKEND", "eager")


def reference(model, tokens: torch.Tensor, layers: tuple[int, ...]):
    with torch.no_grad():
        out = model(tokens[None], output_hidden_states=True)
    return out.logits[0], torch.cat([out.hidden_states[i][0] for i in layers], -1)


def prompt(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 64, (n,), generator=torch.Generator().manual_seed(seed))


def warmed(model, max_length: int = 256, buckets=BUCKETS, layers: tuple[int, ...] = ()) -> StaticLM:
    lm = StaticLM(model, max_length=max_length, compile=True)
    lm.warmup(buckets, hidden_layers=layers)
    return lm


def counted_prefill(lm: StaticLM, tokens: torch.Tensor, layers: tuple[int, ...]):
    lm.reset()
    with count_overhead() as counts:
        logits, hidden = lm.forward(tokens, hidden_layers=layers)
    return counts, logits, hidden


def test_prefill_runs_compiled_chunks_only(compiled_backend):
    """compiled calls == ceil(n / C); eager ops a few per chunk (input staging, the last chunk's
    padding, the concatenation), the same for a 2- and a 4-layer model; outputs equal transformers'."""
    eager_ops = {}
    for depth in (2, 4):
        model = tiny_lm(0, layers=depth)
        layers = (0, depth)
        lm = warmed(model, layers=layers)
        assert lm.sizes == {layers: BUCKETS} and lm.prefill_chunks == {layers}  # the chunk is no bucket
        for n in LENGTHS:
            tokens = prompt(n)
            counts, logits, hidden = counted_prefill(lm, tokens, layers)
            chunks = math.ceil(n / C)
            assert counts.compiled_calls == chunks, (depth, n)
            assert counts.eager_ops <= 6 * chunks + 2 and counts.syncs == 0, (depth, n, counts)
            eager_ops[depth, n] = counts.eager_ops
            ref_logits, ref_hidden = reference(model, tokens, layers)
            torch.testing.assert_close(logits, ref_logits, rtol=0, atol=1e-12)
            torch.testing.assert_close(hidden, ref_hidden, rtol=0, atol=1e-12)
            assert lm.length == n
    assert all(eager_ops[2, n] == eager_ops[4, n] for n in LENGTHS)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_decoding_after_a_chunked_prefill_equals_greedy(compiled_backend, family):
    model = tiny_lm(0, layers=2) if family == "llama" else tiny_gemma3(0, layers=3)
    decoder = ChainDecoder(StaticLM(model, max_length=256, compile=True), NgramProposer("cpu"), num_draft_tokens=3)
    decoder.warmup()
    for n in (C + 1, 2 * C + 6):  # prefill feeds all but the last token: C and 2C + 5 tokens
        ids = prompt(n, seed=n).tolist()
        assert decoder.generate(ids, 20).tokens == greedy_reference(model, ids, 20)


def test_near_the_cache_end_the_tail_takes_smaller_buckets(compiled_backend):
    """A chain that starts off a chunk boundary and would push a padded chunk past the capacity:
    whole chunks while they fit, then the widest bucket that fits, still compiled, still exact."""
    model = tiny_lm(0, layers=2)
    lm = warmed(model, buckets=[1, 2, 4, 16])
    lm.reset()
    tokens = prompt(lm.capacity - 6)
    lm.forward(tokens[:10])                                      # a 16-token bucket step
    rest = tokens[10:]
    with count_overhead() as counts:
        logits, _ = lm.forward(rest)
    room = lm.capacity - 10
    chunks = (room - C) // C + 1                                 # chunks that end inside the cache
    tail = len(rest) - chunks * C                                # then 16-token buckets
    assert tail > 0  # the corner: a padded chunk at the tail's start would run past the capacity
    assert counts.compiled_calls == chunks + math.ceil(tail / 16)
    torch.testing.assert_close(logits, reference(model, tokens, (0,))[0][10:], rtol=0, atol=1e-12)
    assert lm.length == len(tokens)


def test_unwarmed_hidden_layers_and_trees_run_as_before(compiled_backend):
    """No chunk for hidden layers nobody warmed (one uncompiled step, as before: warm-up decides
    what compiles), and a tree wider than every bucket is no prefill."""
    from drafttrain.trees import tree_from_parents

    model = tiny_lm(0, layers=2)
    lm = warmed(model)
    lm.reset()
    with count_overhead() as counts:
        lm.forward(prompt(C + 3), hidden_layers=(1,))
    assert counts.compiled_calls == 0
    tree = tree_from_parents([-1, 0, 0, 1, 2, 1])
    with count_overhead() as counts:
        logits, _ = lm.forward(prompt(6, seed=1), tree=tree)
    assert counts.compiled_calls == 0 and logits.shape[0] == 6


def test_nothing_compiles_after_warm_up_for_long_prompts(compiled_backend):
    """Prompts of every kind of length, with and without hidden layers, across the cache's end,
    after warm-up: no recompile (an error) and no new graph."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    model = tiny_lm(0, layers=2)
    lm = warmed(model, buckets=[1, 2, 4, 16])
    lm.warmup([1, 2, 4, 16], hidden_layers=(0, 2))
    before = dict(counters["frames"])
    with torch._dynamo.config.patch(error_on_recompile=True):  # (monkeypatch's undo would delete the key)
        for layers in ((), (0, 2)):
            for n in (*LENGTHS, 3 * C, 200):
                lm.reset()
                lm.forward(prompt(n), hidden_layers=layers)
            lm.reset()
            lm.forward(prompt(10), hidden_layers=layers)
            lm.forward(prompt(lm.capacity - 16), hidden_layers=layers)  # past the last whole chunk
    assert dict(counters["frames"]) == before
