"""Compiled steps: the one place where drafttrain's compile choices are made.

Every compiled step (the target's static steps and cache compaction, the EAGLE-3 draft's
drafting steps, batched generation) is a function of fixed-shape tensors compiled once per shape
with `torch.compile(fullgraph=True, dynamic=False)`; on CUDA with `mode="reduce-overhead"`, so
each shape is captured as a CUDA graph. Lengths, positions and masks are tensor inputs, never
Python ints inside the graph, or every new length would recompile.

A CUDA graph writes its outputs into the same buffers at every replay, so a caller must mark each
step's beginning and copy what it keeps before the next replay: `CompiledStep.__call__` does both.
Warming up runs a shape three times: CUDA graph trees warm up, record, then replay.
"""

from __future__ import annotations

import torch

WARMUP_RUNS = 3


def raise_compile_limits() -> None:
    """One graph per (shape, hidden layers, batch): well past dynamo's default of 8 per function."""
    import torch._dynamo

    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    torch._dynamo.config.accumulated_cache_size_limit = max(torch._dynamo.config.accumulated_cache_size_limit, 1024)


def _clone(out):
    if isinstance(out, torch.Tensor):
        return out.clone()
    if isinstance(out, tuple):
        return type(out)(*(_clone(o) for o in out)) if hasattr(out, "_fields") else tuple(_clone(o) for o in out)
    return out


class CompiledStep:
    """`fn` compiled for fixed shapes on `device` (CUDA graphs on CUDA); calls return outputs
    that stay valid after the next call."""

    def __init__(self, fn, device: torch.device):
        raise_compile_limits()
        self.cudagraphs = torch.device(device).type == "cuda"
        self.fn = torch.compile(fn, fullgraph=True, dynamic=False,
                                mode="reduce-overhead" if self.cudagraphs else None)

    def __call__(self, *args):
        if self.cudagraphs:
            torch.compiler.cudagraph_mark_step_begin()
        return _clone(self.fn(*args))

    def warm(self, *args) -> None:
        """Compile and capture this shape, so no timed call compiles."""
        for _ in range(WARMUP_RUNS):
            self(*args)
