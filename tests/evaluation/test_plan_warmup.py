"""Issue 36: the planner times only steps that were warmed up, compiled, with the hidden layers
its decoders verify with; after a decoder's own `warmup()` nothing it runs compiles. An EAGLE-3 draft reads the target's aux layers, so the target's step
for it is another compiled graph than the plain one (`StaticLM` compiles one per (size, hidden
layers)); timed before it was registered, it would run uncompiled (or compile inside the timing)
beside a compiled plain step. Steps are compiled by dynamo's eager backend
(`DRAFTTRAIN_COMPILE_BACKEND=eager`: real compiles, guards and recompiles, no code generated), on
a static target as a GPU run has it."""

from __future__ import annotations

import contextlib
import inspect
import sys
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters

from drafttrain.kinds.base import Drafter
from drafttrain.decoding import StaticLM
from drafttrain.kinds import features
from drafttrain.kinds.registry import BY_NAME
from drafttrain.decoding.engines import compiled as compiled_steps
from drafttrain.decoding.engines import static
from drafttrain.evaluation import plan as planner
from drafttrain.evaluation.config import EvalConfig
from drafttrain.evaluation.loading import LoadedModels

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kinds" / "eagle3"))  # the EAGLE-3 tests' trained draft
from eagle3_helpers import EOS, trained_pair  # noqa: E402

PROBE = [5, 9, 13, 7, 5, 9, 13, 7, 5, 11, 12, 13]
MAX_LENGTH = 96


@pytest.fixture(scope="module")
def compiled_backend():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DRAFTTRAIN_COMPILE_BACKEND", "eager")
        yield


def planned(**flags) -> tuple[EvalConfig, LoadedModels, tuple[int, ...]]:
    """An EAGLE-3 eval's config and its models bound as `bind_engine` binds them: a fresh static,
    compiled target (nothing registered yet, as when a plan runs) and the draft beside it."""
    target, draft = trained_pair()
    cfg = EvalConfig(target="t", prompts=["p"], out="o", eagle3="d", max_new_tokens=16, dtype="float64", **flags)
    lm = StaticLM(target, max_length=MAX_LENGTH, compile=True)
    settings = cfg.decode_settings(k=cfg.max_draft_tokens, nodes=cfg.max_tree_nodes)
    drafter = BY_NAME["eagle3"].bind(Drafter("eagle3", draft), lm, "static", MAX_LENGTH, settings)
    models = LoadedModels(target=target, tokenizer=None, device=lm.device, eos={EOS}, drafter=drafter, target_lm=lm)
    return cfg, models, tuple(draft.config.aux_layer_ids)


@contextlib.contextmanager
def watched(monkeypatch):
    """(eager, verified, compiles), outside warm-ups (`timed_warmup`, which every engine's `warmup`
    calls) and prefills (a step at slot 0): the target steps that ran uncompiled ((tokens, hidden
    layers): `static_step` itself runs only uncompiled, or while dynamo traces it), the target's
    forwards and verifications ((tokens, hidden layers)), and the compiled steps that compiled a
    graph while they ran."""

    def graphs() -> int:  # dynamo's count of graphs made (torch 2.13: stats; older: frames)
        return counters["stats"]["unique_graphs"] + sum(counters["frames"].values())

    eager, verified, compiles, warming = [], [], [], [0]
    step, call = static.static_step, compiled_steps.CompiledStep.__call__

    def watched_step(model, cache, tokens, positions, slots, *args, **kwargs):
        if not torch.compiler.is_compiling() and not warming[0] and int(slots[0]) > 0:
            eager.append((tokens.shape[1], tuple(kwargs.get("hidden_layers", args[2] if len(args) > 2 else ()))))
        return step(model, cache, tokens, positions, slots, *args, **kwargs)

    def watched_call(self, *args):
        before = graphs()
        out = call(self, *args)
        if not warming[0] and graphs() != before:
            fn = inspect.unwrap(self.fn)  # the step torch.compile wraps (a partial)
            compiles.append(getattr(getattr(fn, "func", fn), "__name__", repr(fn)))
        return out

    def entry(name):  # StaticLM.forward, and .verify where the engine has one
        real = getattr(StaticLM, name)

        def watched_entry(self, tokens, *args, hidden_layers=(), **kwargs):
            if self.length and not warming[0]:
                verified.append((tokens.numel(), tuple(hidden_layers)))
            return real(self, tokens, *args, hidden_layers=hidden_layers, **kwargs)

        monkeypatch.setattr(StaticLM, name, watched_entry)

    def warm(module):
        real = module.timed_warmup

        def timed_warmup(*args, **kwargs):
            warming[0] += 1
            try:
                return real(*args, **kwargs)
            finally:
                warming[0] -= 1

        monkeypatch.setattr(module, "timed_warmup", timed_warmup)

    for module in (static, features):
        warm(module)
    for name in ("forward", "verify"):
        if hasattr(StaticLM, name):
            entry(name)
    monkeypatch.setattr(static, "static_step", watched_step)
    monkeypatch.setattr(compiled_steps.CompiledStep, "__call__", watched_call)
    yield eager, verified, compiles


def check(watch, aux):
    eager, verified, compiles = watch
    layers = sorted({layers for n, layers in verified if n > 1})
    problems = []
    if eager:
        problems.append(f"timed target steps ran uncompiled (tokens, hidden layers): {sorted(set(eager))}")
    if compiles:
        problems.append(f"steps compiled after their decoder's warm-up, in the planner's decodes: {compiles}")
    if layers != [aux]:
        problems.append(f"verifications were timed with hidden layers {layers}, the decoder verifies with {aux}")
    assert not problems, "; ".join(problems)


@pytest.mark.slow
def test_tree_timings_warm_up_the_decoders_and_verify_with_their_hidden_layers(compiled_backend, monkeypatch):
    """A whole tree step, a plain step, and the tree verification curve with the layers the
    planner finds its decoder verifying with."""
    cfg, models, aux = planned(tree="dynamic", num_draft_tokens=2, tree_nodes=4, tree_topk=2)
    layers = planner.verified_layers(cfg, models, cfg.decode_settings(k=2, nodes=4, topk=2))
    with watched(monkeypatch) as watch:
        nodes, seconds = planner.tree_step_seconds(cfg, models, PROBE, 2, 4, 2)
        plain = planner.tree_step_seconds(cfg, models, PROBE, 0, 1, 1)[1]
        verify = planner.tree_verification(cfg, models, PROBE, layers, [1, 2, 4, 6])
    assert seconds > 0 and plain > 0 and all(v > 0 for timings in verify for v in timings)
    check(watch, aux)


@pytest.mark.slow
def test_chain_costs_warm_up_and_verify_with_the_drafters_hidden_layers(compiled_backend, monkeypatch):
    """A chain round: the target's verification curve and the loop's overhead, and the draft's step."""
    cfg, models, aux = planned(tree="chain", num_draft_tokens=2)
    acceptance = planner.Acceptance([0.8, 0.5], None, "test")
    layers = planner.verified_layers(cfg, models, cfg.decode_settings(k=2, nodes=cfg.max_tree_nodes))
    with watched(monkeypatch) as watch:
        verify, overhead = planner.target_round(cfg, models, PROBE, layers, 3)
        draft, _ = planner.drafter_seconds(cfg, models, PROBE, acceptance, 2)
    assert len(verify) == 3 and len(draft) == 3 and overhead >= 0
    check(watch, aux)
