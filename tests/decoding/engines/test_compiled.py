"""Compiled steps: inputs staged in the step's own buffers, and compiled code kept on disk under
`$DRAFTTRAIN_HOME` so that a second identical run on this machine does not generate it again."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from drafttrain.decoding.engines import compiled
from drafttrain.decoding.engines.compiled import CompiledStep, compile_cache_dir, compile_cache_state


def test_the_cache_is_keyed_by_torch_and_device_under_the_home(tmp_path, monkeypatch):
    monkeypatch.setenv("DRAFTTRAIN_HOME", str(tmp_path))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    path = compile_cache_dir("cpu")
    assert path.startswith(str(tmp_path / "compile")) and torch.__version__.replace("+", "_") in path
    compiled.use_compile_cache("cpu")
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == path
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/elsewhere")  # the user's own choice is kept
    compiled.use_compile_cache("cpu")
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == "/elsewhere"


def test_the_cache_state_says_off_cold_or_warm(monkeypatch):
    """"warm" only where graphs hit the cache and none missed or bypassed it, in inductor's FX graph
    cache or AOTAutograd's (a bypassed graph is generated anew as surely as a missed one)."""
    from collections import Counter

    from torch._dynamo.utils import counters

    def set_counts(inductor=(0, 0, 0), aot=(0, 0, 0)):
        names = ("hit", "miss", "bypass")
        monkeypatch.setitem(counters, "inductor", Counter({f"fxgraph_cache_{n}": v for n, v in zip(names, inductor)}))
        monkeypatch.setitem(counters, "aot_autograd", Counter({f"autograd_cache_{n}": v for n, v in zip(names, aot)}))

    monkeypatch.delenv(compiled.BACKEND_VARIABLE, raising=False)
    set_counts(inductor=(3, 0, 0), aot=(3, 0, 0))
    assert compile_cache_state(0.0) == "off" and compile_cache_state(2.0) == "warm"
    set_counts(inductor=(3, 0, 0))
    assert compile_cache_state(2.0) == "warm"
    set_counts()  # compiled, but no graph came from the cache
    assert compile_cache_state(2.0) == "cold"
    set_counts(inductor=(3, 1, 0))
    assert compile_cache_state(2.0) == "cold"
    set_counts(inductor=(3, 0, 1))
    assert compile_cache_state(2.0) == "cold"
    set_counts(inductor=(3, 0, 0), aot=(2, 0, 1))
    assert compile_cache_state(2.0) == "cold"
    set_counts(inductor=(3, 0, 0), aot=(2, 1, 0))
    assert compile_cache_state(2.0) == "cold"
    # Process-wide counters: a run counts from its own start (an earlier run's miss is not its own).
    set_counts(inductor=(3, 1, 1))
    since = compiled.compile_counts()
    assert compile_cache_state(2.0, since=since) == "cold"  # nothing since: no hit
    counters["inductor"]["fxgraph_cache_hit"] += 2
    assert compile_cache_state(2.0, since=since) == "warm" and compile_cache_state(2.0) == "cold"
    counters["inductor"]["fxgraph_cache_bypass"] += 1
    assert compile_cache_state(2.0, since=since) == "cold"
    monkeypatch.setenv(compiled.BACKEND_VARIABLE, "eager")  # nothing generated, nothing cached
    assert compile_cache_state(2.0) == "off"


def test_capture_counts_read_the_counters_on_cuda_and_are_none_elsewhere(monkeypatch):
    """cudagraph_skips is inductor's counter; cuda_graphs counts CUDA graph trees' recordings, each
    announced to dynamo's compile callbacks (torch has no counter for it); both since a snapshot."""
    from collections import Counter

    from torch._dynamo.callback import CallbackTrigger, callback_handler
    from torch._dynamo.utils import counters

    monkeypatch.setitem(counters, "inductor", Counter(cudagraph_skips=2))
    monkeypatch.setitem(counters, "drafttrain", Counter())
    assert compiled.capture_counts("cpu") == {"cudagraph_skips": None, "cuda_graphs": None}
    assert compiled.capture_counts("cuda") == {"cudagraph_skips": 2, "cuda_graphs": 0}
    since = compiled.compile_counts()
    compiled.count_cuda_graphs()
    compiled.count_cuda_graphs()  # idempotent: one callback
    try:
        for _ in range(3):  # what CUDAGraphTreeManager.record_function does around each recording
            with callback_handler.install_callbacks(CallbackTrigger.CUDAGRAPH_RECORDING, "0/0"):
                pass
        with callback_handler.install_callbacks(CallbackTrigger.DYNAMO, "0/1"):  # a compile is no recording
            pass
    finally:
        callback_handler.remove_start_callback(compiled._count_recording)
    counters["inductor"]["cudagraph_skips"] += 1
    assert compiled.capture_counts("cuda") == {"cudagraph_skips": 3, "cuda_graphs": 3}
    assert compiled.capture_counts(torch.device("cuda", 0), since=since) == {"cudagraph_skips": 1, "cuda_graphs": 3}


def test_every_static_cache_capacity_is_a_multiple_of_256():
    """The capacity is in every graph's shapes: rounded coarsely, another prompt set of about the
    same length compiles the same graphs and finds them in the disk cache."""
    assert compiled.CAPACITY_MULTIPLE == 256
    assert [compiled.static_capacity(n) for n in (1, 37, 256, 257, 700)] == [256, 256, 256, 512, 768]


def test_inputs_are_staged_in_the_steps_own_buffers(monkeypatch):
    """Each call copies its inputs into one buffer set per signature: the graph's guards and a CUDA
    graph always see the same tensors, whatever the caller hands in."""
    monkeypatch.setenv(compiled.BACKEND_VARIABLE, "eager")
    seen = []

    def record(a, b):  # stands in for the compiled function: which tensors does it get?
        seen.append((a.data_ptr(), b.data_ptr()))
        return a + b

    step = CompiledStep(record, torch.device("cpu"))
    step.fn = record
    for _ in range(2):
        x, y = torch.arange(3.0), torch.ones(3)
        assert torch.equal(step(x, y), x + 1)
    assert seen[0] == seen[1] and x.data_ptr() not in seen[1] and y.data_ptr() not in seen[1]
    step(torch.arange(4.0), torch.ones(4))  # another signature, another buffer set
    assert seen[2][0] != seen[0][0]


@pytest.mark.slow
def test_a_second_identical_run_reads_its_compiled_code_from_the_cache(tmp_path):
    """Two processes compile the same step with inductor under one DRAFTTRAIN_HOME: the first
    generates (cold), the second is served from the disk cache (warm)."""
    script = textwrap.dedent("""
        import time, torch
        from drafttrain.decoding.engines.compiled import CompiledStep, compile_cache_state
        step = CompiledStep(lambda a: (a.sin() * 2 + a.cos()).sum(-1), torch.device("cpu"))
        start = time.perf_counter()
        step(torch.randn(4, 8))
        print(compile_cache_state(time.perf_counter() - start))
    """)
    env = {**os.environ, "DRAFTTRAIN_HOME": str(tmp_path)}
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    env.pop(compiled.BACKEND_VARIABLE, None)
    states = [subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True
                             ).stdout.split()[-1] for _ in range(2)]
    assert states == ["cold", "warm"]


def test_state_a_step_writes_in_place_is_never_an_inference_tensor():
    """The answer writer builds its generator under `inference_mode`; the compiled step runs
    outside it, and on CUDA inductor's autotuner restores each mutated argument between trials
    with an in-place copy, which an inference tensor refuses (every GPU answer-writing run failed
    so). That copy, done here on every cache a compiled step writes, must pass."""
    from tiny import tiny_lm

    from drafttrain.decoding.batch import BatchGenerator
    from drafttrain.kinds.features import DraftKVCache

    model = tiny_lm(0, vocab_size=64)
    with torch.inference_mode():
        generator = BatchGenerator(model, batch_size=2, max_length=16, compile=False)
        draft_cache = DraftKVCache(capacity=8, kv_heads=1, head_dim=8)
        staged = CompiledStep(lambda x: x, torch.device("cpu"))._staged([torch.ones(3)])
    state = [*generator.lm.cache.keys, *generator.lm.cache.values, draft_cache.keys, draft_cache.values,
             draft_cache.valid, staged[0]]
    with torch.no_grad():
        for t in state:
            t.copy_(torch.ones_like(t))  # the autotuner's restore, outside inference mode
    assert all(bool(t.all()) for t in state)


def test_a_process_compiles_hundreds_of_steps(monkeypatch):
    """Every compiled step is a partial that dynamo enters through one wrapper frame, so all steps
    of a process share that code object's cache: the full test session hit dynamo's limit of 64
    entries there (a `fullgraph` step then raises). 200 steps of distinct functions and shapes
    each compile once and run."""
    import functools

    monkeypatch.setenv("DRAFTTRAIN_COMPILE_BACKEND", "eager")

    def scaled(factor, x):
        return x * factor + 1

    for i in range(200):
        step = CompiledStep(functools.partial(scaled, i), torch.device("cpu"))
        assert torch.equal(step(torch.ones(1 + i % 7)), torch.full((1 + i % 7,), float(i + 1)))
