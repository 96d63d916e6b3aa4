"""Compiled steps: the one place where drafttrain's compile choices are made.

Every compiled step (the target's static steps and cache compaction, the EAGLE-3 draft's feed
and tree drafting, batched generation) is a function of fixed-shape tensors compiled once per
shape with `torch.compile(fullgraph=True, dynamic=False)`; on CUDA with `mode="reduce-overhead"`,
so each shape is captured as a CUDA graph. Lengths, positions and masks are tensor inputs, never
Python ints inside the graph, or every new length would recompile.

Inputs are copied into the step's own buffers (one set per input signature): the graph always
sees the same addresses, strides and inference-ness, so no guard fails on a caller's layout and
a CUDA graph reads them in place; the step runs under `no_grad` and outside inference mode,
whatever the caller's mode (a graph compiled in one mode fails its guards in the other). CUDA graph trees share one memory pool across graphs, so an
output is only safe to keep past the next compiled call once copied: on CUDA the outputs are
cloned (small: tokens, a tree, one step's logits); on the CPU they are returned as they are.
Warming up runs a shape three times: CUDA graph trees warm up, record, then replay
(`timed_warmup`, which every engine's `warmup` calls, times it as compile time).

Compiled artifacts are kept on disk under `$DRAFTTRAIN_HOME/compile/<torch>/<device>` (inductor's
FX graph and autotuning caches), so a second identical run on this machine skips code
generation; `compile_cache_state` says whether a run's compiles were served from it (a home that
cannot hold them is one warning, and the cache "off": `writable_cache_dir`). A graph's
shapes include its KV cache's capacity, so every static cache's capacity is rounded up to
`CAPACITY_MULTIPLE` (`static_capacity`): other prompts of about the same length need the same
graphs, and a second run with another prompt set reads them from the cache too.
`capture_counts` says what CUDA graph trees did (graphs recorded, compiles that skipped capture).
torch's counters are process-wide: `compile_counts` at a run's start, passed as `since`, counts
that run's alone.
`DRAFTTRAIN_COMPILE_BACKEND=eager` traces with dynamo (guards, recompiles, fullgraph checks)
without generating code: what the CPU tests use to prove shapes are stable.
"""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
import time
from typing import Callable, Iterable

import torch

from .base import synchronize
from .overhead import paused

WARMUP_RUNS = 3
BACKEND_VARIABLE = "DRAFTTRAIN_COMPILE_BACKEND"
CAPACITY_MULTIPLE = 256
# torch's process-wide counters (torch._dynamo.utils.counters[group][name]) that a run's compile
# and capture figures come from; ("drafttrain", "cuda_graphs") is ours (`count_cuda_graphs`).
CACHE_COUNTERS = {"hit": [("inductor", "fxgraph_cache_hit"), ("aot_autograd", "autograd_cache_hit")],
                  "miss": [("inductor", "fxgraph_cache_miss"), ("aot_autograd", "autograd_cache_miss")],
                  "bypass": [("inductor", "fxgraph_cache_bypass"), ("aot_autograd", "autograd_cache_bypass")]}
CAPTURE_COUNTERS = {"cudagraph_skips": ("inductor", "cudagraph_skips"), "cuda_graphs": ("drafttrain", "cuda_graphs")}


def static_capacity(entries: int) -> int:
    """The slots a static KV cache preallocates to hold `entries`: rounded up to a multiple of
    `CAPACITY_MULTIPLE`, for the target's cache, draft LMs' and the EAGLE-3 draft's alike. The
    capacity is part of every compiled graph's shapes (the cache, the masks, the rotary tables),
    and the entries a run needs follow its longest prompt: rounded to 16, nearly every new prompt
    set had a new capacity, so its graphs missed inductor's FX graph cache and were generated
    again; rounded to 256, prompt sets of about the same length share them. (Multiples of 16 also
    suit the fused attention kernels.) The price: attention reads up to 255 more slots, masked.
    Room checks stay on the asked-for length (`CachedLM.max_length`), never the capacity."""
    return -(-int(entries) // CAPACITY_MULTIPLE) * CAPACITY_MULTIPLE


def raise_compile_limits() -> None:
    """Room for every graph a process compiles, well past dynamo's default of 8 per code object.
    Each compiled step is a `functools.partial`, which dynamo enters through torch's one wrapper
    frame: every step of the process (each engine's verification, prefill and step sizes, every
    draft's feed and next-draft graphs) is a cache entry of that ONE code object, so a process that
    builds many decoders (a compare with plans, a test session) holds hundreds. Recompiles after
    warm-up are caught otherwise (`tests/decoding/test_overhead.py` makes them an error)."""
    import torch._dynamo

    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 4096)
    torch._dynamo.config.accumulated_cache_size_limit = max(torch._dynamo.config.accumulated_cache_size_limit, 8192)


def compile_cache_dir(device) -> str:
    """Where this machine keeps compiled steps: keyed by torch version and device name, since
    neither kernels nor autotuning carry over between them."""
    from ...home import drafttrain_home

    device = torch.device(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    key = "".join(c if c.isalnum() or c in "._-" else "_" for c in f"torch-{torch.__version__}/{name}")
    return str(drafttrain_home() / "compile" / key)


def use_compile_cache(device) -> None:
    """Inductor's caches under `$DRAFTTRAIN_HOME`, unless the user chose TORCHINDUCTOR_CACHE_DIR
    (inductor writes its own default, a temporary directory, into the variable once it has used it)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    chosen = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    ours = {os.path.abspath(default_cache_dir()), *_UNCACHED.values()}
    if chosen is None or os.path.abspath(chosen) in ours:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = writable_cache_dir(compile_cache_dir(device))


_UNCACHED: dict[str, str] = {}  # a cache directory that cannot be written -> the throwaway one used instead


def writable_cache_dir(path: str) -> str:
    """`path`, created, where it can be written. Where it cannot (DRAFTTRAIN_HOME a file, or read-only),
    one warning naming it, and a temporary directory that no later run reads: inductor needs a place
    to write the code it generates (on that path it failed outright), and the run's report says
    the cache is off (`compile_cache_off`) rather than "cold" as if a next run would find it."""
    from ...errors import UserError
    from ...home import writable_home

    try:
        return str(writable_home(path))
    except UserError as e:
        if path not in _UNCACHED:
            print(f"warning: compiled steps are not kept for the next run: {e}", file=sys.stderr, flush=True)
            _UNCACHED[path] = tempfile.mkdtemp(prefix="drafttrain-compile-")
            atexit.register(shutil.rmtree, _UNCACHED[path], ignore_errors=True)
        return _UNCACHED[path]


def compile_cache_off() -> bool:
    """Whether compiled steps go to a throwaway directory (`writable_cache_dir`), not a cache."""
    return os.environ.get("TORCHINDUCTOR_CACHE_DIR") in _UNCACHED.values()


def _counter(group: str, name: str) -> int:
    from torch._dynamo.utils import counters

    return int(counters[group].get(name, 0)) if group in counters else 0


def compile_counts() -> dict[str, int]:
    """This process's compile and capture counters so far ("hit", "miss", "bypass": inductor's FX
    graph cache and AOTAutograd's cache together; "cudagraph_skips", "cuda_graphs"). torch's
    counters are process-wide: take this at a run's start and pass it as `since` to
    `compile_cache_state` and `capture_counts` to count that run's compiles alone."""
    counts = {kind: sum(_counter(*key) for key in keys) for kind, keys in CACHE_COUNTERS.items()}
    return {**counts, **{name: _counter(*key) for name, key in CAPTURE_COUNTERS.items()}}


def _since(since: dict[str, int] | None) -> dict[str, int]:
    now = compile_counts()
    return {k: max(v - (since or {}).get(k, 0), 0) for k, v in now.items()}


def compile_cache_state(compile_seconds: float, since: dict[str, int] | None = None) -> str:
    """"off" (nothing compiled, or nowhere to keep it: `compile_cache_off`), "warm" (every graph
    compiled since `since`, a `compile_counts` snapshot, or in this process where None, came from
    the disk cache: hits, and no miss and no bypass, in inductor's FX graph cache or AOTAutograd's)
    or "cold"."""
    if compile_seconds <= 0 or os.environ.get(BACKEND_VARIABLE, "inductor") != "inductor" or compile_cache_off():
        return "off"
    counts = _since(since)
    return "warm" if counts["hit"] and not counts["miss"] and not counts["bypass"] else "cold"


def _count_recording(args) -> None:
    from torch._dynamo.callback import CallbackTrigger
    from torch._dynamo.utils import counters

    if args.callback_trigger == CallbackTrigger.CUDAGRAPH_RECORDING:
        counters["drafttrain"]["cuda_graphs"] += 1


def count_cuda_graphs() -> None:
    """Count each CUDA graph that CUDA graph trees record (`counters["drafttrain"]["cuda_graphs"]`):
    torch has no counter for it, but runs its compile callbacks around every recording. Idempotent;
    every `CompiledStep` calls it (again after `torch._dynamo.reset()`, which drops callbacks)."""
    from torch._dynamo.callback import callback_handler

    if _count_recording not in callback_handler.start_callbacks:
        callback_handler.register_start_callback(_count_recording)


def capture_counts(device, since: dict[str, int] | None = None) -> dict[str, int | None]:
    """What CUDA graph capture did since `since` (a `compile_counts` snapshot; None: in this
    process): "cudagraph_skips", inductor's count of compiled graphs that fell back to running
    without a CUDA graph (0 when every step is captured), and "cuda_graphs", the CUDA graphs
    recorded. Both None off CUDA, where nothing is captured. The one reading of these counters,
    for `drafttrain bench` and the eval report's engine block alike."""
    if torch.device(device).type != "cuda":
        return {name: None for name in CAPTURE_COUNTERS}
    counts = _since(since)
    return {name: counts[name] for name in CAPTURE_COUNTERS}


def step_state(shape, *, dtype: torch.dtype | None = None, device=None) -> torch.Tensor:
    """Zeros that a compiled step reads or writes in place (a cache, an input buffer), at a fixed
    address. Allocated outside inference mode whatever the caller's mode: the step runs outside it,
    and on CUDA inductor's autotuner restores a mutated argument between its trials with an
    in-place copy, which an inference tensor refuses (every answer-writing run failed so on an H100
    while its caches were allocated under the writer's `inference_mode`)."""
    with torch.inference_mode(False):
        t = torch.zeros(shape, dtype=dtype, device=device)
    torch._dynamo.mark_static_address(t)
    return t


def _clone(out):
    if isinstance(out, torch.Tensor):
        return out.clone()
    if isinstance(out, tuple):
        return type(out)(*(_clone(o) for o in out)) if hasattr(out, "_fields") else tuple(_clone(o) for o in out)
    return out


def _signature(args) -> tuple:
    return tuple((tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else None for a in args)


class CompiledStep:
    """`fn` compiled for fixed shapes on `device` (CUDA graphs on CUDA); calls return outputs
    that stay valid after the next call."""

    def __init__(self, fn, device: torch.device):
        use_compile_cache(device)
        raise_compile_limits()
        count_cuda_graphs()
        self.device = torch.device(device)
        self.cudagraphs = self.device.type == "cuda"
        self.fn = torch.compile(fn, fullgraph=True, dynamic=False, backend=os.environ.get(BACKEND_VARIABLE, "inductor"),
                                mode="reduce-overhead" if self.cudagraphs else None)
        self._buffers: dict[tuple, list] = {}

    def _staged(self, args) -> list:
        """`args` copied into this step's own buffers for their signature (allocated once)."""
        key = _signature(args)
        if key not in self._buffers:
            self._buffers[key] = [step_state(a.shape, dtype=a.dtype, device=a.device)
                                  if isinstance(a, torch.Tensor) else None for a in args]
        staged = self._buffers[key]
        with torch.no_grad():
            for buffer, arg in zip(staged, args):
                if buffer is not None:
                    buffer.copy_(arg)
        return [arg if buffer is None else buffer for buffer, arg in zip(staged, args)]

    def __call__(self, *args):
        staged = self._staged(args)
        with paused(), torch.inference_mode(False), torch.no_grad():  # one mode for every caller: guards hold
            if self.cudagraphs:
                torch.compiler.cudagraph_mark_step_begin()
            out = self.fn(*staged)
        return _clone(out) if self.cudagraphs else out


def timed_warmup(engine, steps: Iterable[Callable[[], object]], *, runs: int = WARMUP_RUNS) -> float:
    """Compile and capture the shapes `steps` run, so no timed step compiles: each step (a call of
    one or more compiled steps on dummy inputs) runs `runs` times in a row (CUDA graph trees warm
    up, record, then replay), then `engine.reset()` (the dummy steps went through its cache) and
    the device is waited for. Returns the seconds spent, also added to `engine.compile_seconds`
    (reported apart from decoding time)."""
    start = time.perf_counter()
    for step in steps:
        for _ in range(runs):
            step()
    engine.reset()
    synchronize(engine.device)
    seconds = time.perf_counter() - start
    engine.compile_seconds += seconds
    return seconds
