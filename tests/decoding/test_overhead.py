"""The step budget that keeps drafters at GPU speed, counted on the CPU (`engines.overhead`).

Every drafter kind decodes on the static engine with its steps compiled by dynamo's eager backend
(`DRAFTTRAIN_COMPILE_BACKEND=eager`: the same graphs, guards and recompiles as inductor, without
generating code), so what runs outside a compiled step is exactly what would run as separate
kernel launches on a GPU, and every host sync is one the GPU would wait for. Each kind must make
one host sync per step, and the EAGLE-3 kinds few eager ops (the device-built EAGLE-2 tree); the
output stays the target's own greedy output. A `compare`-style target shared by every kind
compiles nothing once warmed up.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from tiny import greedy_reference, noisy_copy

from drafttrain.decoding import DecodeSettings, StaticLM
from drafttrain.kinds.base import Drafter
from drafttrain.kinds.factory import build_decoder
from drafttrain.decoding.engines.overhead import count_overhead, step_overhead

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kinds" / "eagle3"))  # the EAGLE-3 tests' trained draft
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kinds" / "medusa"))  # the Medusa tests' heads
from eagle3_helpers import EOS, trained_pair  # noqa: E402
from test_medusa_decoding import noisy_heads  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kinds" / "dflash"))  # the DFlash tests' draft
from dflash_helpers import tiny_draft as tiny_dflash  # noqa: E402

MASK = 9
PROMPTS = [[5, 9, 13, 7, 5, 9, 13, 7, 5], [3, 4, 5, 6, 7, 8, 3, 4, 5, 6]]
MAX_NEW = 24
K = 4
DYNAMIC = dict(tree="dynamic", tree_nodes=12, tree_topk=3)
# Per step, the most each kind may cost outside its graphs: issue 36's launch floor, 1 host sync,
# at most 2 compiled calls (graph launches) and 16 eager ops (views excluded) for every drafter kind
# (before it: draft LM 4.5 calls and 56 ops, EAGLE-3 tree 3 and 39, Medusa 1.1 and 46). A `+ngram`
# hybrid merges its lookup's branch into the model's tree on the host-built side of the step (~30
# small ops and the draft's own call): it has a budget of its own.
FLOOR = (2, 16)
KINDS = {
    "plain": ("none", {}, FLOOR),
    "draft": ("draft", {}, FLOOR),
    "parallel": ("parallel_draft", {}, FLOOR),
    "ngram": ("ngram", {}, FLOOR),
    "suffix": ("suffix", {}, FLOOR),
    "medusa": ("medusa", dict(tree="default"), FLOOR),
    "eagle3-chain": ("eagle3", dict(tree="chain"), FLOOR),
    "eagle3-tree": ("eagle3", DYNAMIC, FLOOR),
    "dflash": ("dflash", {}, FLOOR),
    "draft+ngram": ("draft", dict(hybrid="ngram"), (3, 60)),
    "eagle3-tree+ngram": ("eagle3", dict(DYNAMIC, hybrid="ngram"), (3.5, 60)),
    "dflash+ngram": ("dflash", dict(hybrid="ngram"), (3.5, 60)),  # its feed and block are two calls beside the tree
}


@pytest.fixture(scope="module")
def compiled_backend():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DRAFTTRAIN_COMPILE_BACKEND", "eager")
        yield


@pytest.fixture(scope="module")
def shared(compiled_backend):
    """One static, compiled target (as `compare` shares it) and every kind's drafter for it."""
    target, draft = trained_pair()
    lm = StaticLM(target, max_length=96, compile=True)
    drafts = {"draft": StaticLM(noisy_copy(target, scale=0.6), max_length=96, compile=True),
              "parallel_draft": StaticLM(noisy_copy(target, scale=0.6, seed=8), max_length=96, compile=True)}
    models = {"none": None, "ngram": None, "suffix": None, "eagle3": draft, "medusa": noisy_heads(target, 3),
              "dflash": tiny_dflash(target, scale=0.5, block_size=K + 1), **drafts}
    decoders = {}
    for name, (kind, extra, _) in KINDS.items():
        info = {"pard_token": MASK, "parallel_tokens": K} if kind == "parallel_draft" else {}
        settings = DecodeSettings(num_draft_tokens=K, eos_token_ids=frozenset({EOS}), **extra)
        decoders[name] = build_decoder(lm, Drafter(kind, models[kind], info), settings)
    for decoder in decoders.values():
        decoder.warmup()
    return target, decoders


@pytest.mark.slow
@pytest.mark.parametrize("name", list(KINDS))
def test_one_host_sync_two_graphs_and_few_eager_ops_per_step(shared, name):
    target, decoders = shared
    decoder = decoders[name]
    calls, ops = KINDS[name][2]
    for prompt in PROMPTS:
        counted = step_overhead(decoder, prompt, MAX_NEW)
        assert counted.steps > 1 and counted.syncs == 1, f"{name}: {counted.syncs} host syncs per step"
        assert counted.compiled_calls <= calls, f"{name}: {counted.compiled_calls:.2f} compiled calls per step"
        assert counted.eager_ops <= ops, f"{name}: {counted.eager_ops:.1f} eager ops per step"
        assert decoder.generate(prompt, MAX_NEW).tokens == greedy_reference(target, prompt, MAX_NEW, eos=EOS)


@pytest.mark.slow
def test_nothing_compiles_after_warm_up(shared):
    """Every kind decodes on the shared target after all were warmed up: no recompile (an error)
    and no new graph. Each shape a run can meet was compiled for its own hidden layers."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    _, decoders = shared
    before = counters["stats"]["unique_graphs"]
    with torch._dynamo.config.patch(error_on_recompile=True):  # (monkeypatch's undo would delete the key)
        for decoder in decoders.values():
            for prompt in PROMPTS + [[7, 3]]:
                for budget in (MAX_NEW, 1, 2):  # the steps a token budget cuts short too
                    decoder.generate(prompt, budget)
    assert counters["stats"]["unique_graphs"] == before


def test_the_counter_sees_syncs_and_eager_ops_but_not_compiled_ones(compiled_backend):
    """The counter itself: reads and blocking copies are syncs, a pinned/non-blocking copy is not,
    and a compiled step's ops are not eager ops."""
    from drafttrain.decoding.engines import device_tensor
    from drafttrain.decoding.engines.compiled import CompiledStep

    x = torch.arange(4)
    step = CompiledStep(lambda a: (a * 2 + 1).sum(), torch.device("cpu"))
    step(x)  # compiled before counting
    with count_overhead() as counts:
        x.tolist()
        int(x[0])
        torch.tensor([1, 2], device="cpu")
        device_tensor([1, 2], torch.device("cpu"))
        step(x)
    assert counts.syncs == 3
    with count_overhead() as counts:
        step(x)
    assert counts.eager_ops == 1  # the input's copy into the step's own buffer
    assert counts.compiled_calls == 1
