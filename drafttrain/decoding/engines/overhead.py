"""What a decode step costs outside its compiled steps, counted on any machine (a CPU included).

On a GPU a step's speed is set less by its kernels than by what keeps the GPU waiting: every read
of a device value on the host (`.tolist()`, `.item()`, `bool()`, ...) drains the queue, a
`torch.tensor(host values, device=...)` blocks the same way, and every op run eagerly outside a
compiled step (a CUDA graph) is one more kernel launch from Python. None of that needs a GPU to
be seen: `count_overhead()` counts host syncs (those calls, on device tensors or not, since on the
CPU every tensor is a "device" tensor) and aten ops other than views (which launch no kernel)
dispatched outside `CompiledStep` calls (which pause the count). Moving a tensor the host built to the device without `non_blocking`
counts as a sync too: `engines.device_tensor` stages through pinned memory instead.

The decode loop's budget (one sync per step, few eager ops) is tested with it
(tests/decoding/test_overhead.py), and `drafttrain bench` reports it per drafter kind.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

SYNC_METHODS = ("tolist", "item", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy")
# ops that read a device value on the host from inside torch (indexing with a 0-d tensor, a
# boolean mask, a data-dependent output size): syncs the Python-level methods above do not see
SYNC_OPS = ("aten._local_scalar_dense.default", "aten.nonzero.default", "aten.masked_select.default",
            "aten._unique2.default", "aten.is_nonzero.default")


@dataclass
class Overhead:
    """Counts over the counted region: host syncs, eager (uncompiled) aten ops and calls of
    compiled steps (each one graph launch: a CUDA graph replay on CUDA)."""

    syncs: int = 0
    eager_ops: int = 0
    compiled_calls: int = 0


class _OpCounter(TorchDispatchMode):
    def __init__(self, overhead: Overhead):
        super().__init__()
        self.overhead = overhead

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:  # a view launches no kernel
            self.overhead.eager_ops += 1
        if str(func) in SYNC_OPS and not _in_method:
            self.overhead.syncs += 1
        return func(*args, **(kwargs or {}))


_active: list[Overhead] = []  # the innermost counting region's totals
_originals: dict = {}
_in_method = False  # inside a counted method: its own internal read is the same sync


def _counting(name, original):
    def counted(*args, **kwargs):
        global _in_method
        if not _active or _in_method:
            return original(*args, **kwargs)
        _active[-1].syncs += 1
        _in_method = True
        try:
            return original(*args, **kwargs)
        finally:
            _in_method = False
    counted.__name__ = name
    return counted


def _blocking_tensor(original):
    def tensor(data, *args, **kwargs):
        if _active and kwargs.get("device") is not None:
            _active[-1].syncs += 1
        return original(data, *args, **kwargs)
    return tensor


def _blocking_to(original):
    def to(self, *args, **kwargs):
        moves = any(isinstance(a, (torch.device, str)) for a in args) or "device" in kwargs
        if _active and moves and self.device.type == "cpu" and not kwargs.get("non_blocking"):
            _active[-1].syncs += 1
        return original(self, *args, **kwargs)
    return to


def _patch() -> None:
    for name in SYNC_METHODS:
        _originals[name] = getattr(torch.Tensor, name)
        setattr(torch.Tensor, name, _counting(name, _originals[name]))
    _originals["to"] = torch.Tensor.to
    torch.Tensor.to = _blocking_to(_originals["to"])
    _originals["tensor"] = torch.tensor
    torch.tensor = _blocking_tensor(_originals["tensor"])


def _unpatch() -> None:
    for name in SYNC_METHODS + ("to",):
        setattr(torch.Tensor, name, _originals.pop(name))
    torch.tensor = _originals.pop("tensor")


@contextlib.contextmanager
def count_overhead():
    """Count host syncs and eager ops inside the block: yields the `Overhead` it fills."""
    overhead = Overhead()
    _patch()
    _active.append(overhead)
    try:
        with _OpCounter(overhead):
            yield overhead
    finally:
        _active.pop()
        _unpatch()


@contextlib.contextmanager
def paused():
    """No counting inside (a compiled step runs here: its ops are one graph, not eager launches,
    and dynamo must trace torch's own methods, not the counters); the graph's launch is counted."""
    if not _active:
        yield
        return
    overhead = _active.pop()
    overhead.compiled_calls += 1
    _unpatch()
    try:
        with _disable_current_modes():
            yield
    finally:
        _patch()
        _active.append(overhead)


@dataclass
class StepOverhead:
    """Per verification step, averaged over a generation: host syncs, eager ops, compiled calls."""

    syncs: float
    eager_ops: float
    compiled_calls: float
    steps: int


def step_overhead(decoder, prompt: list[int], max_new_tokens: int) -> StepOverhead:
    """What each step of `decoder` generating from `prompt` costs outside its graphs: prefill and
    the drafter's reset are not counted, every verification step is."""
    total, steps = Overhead(), 0
    step = decoder._step

    def counted_step(budget):
        nonlocal steps
        with count_overhead() as counts:
            result = step(budget)
        total.syncs += counts.syncs
        total.eager_ops += counts.eager_ops
        total.compiled_calls += counts.compiled_calls
        steps += 1
        return result

    decoder._step = counted_step
    try:
        decoder.generate(prompt, max_new_tokens)
    finally:
        del decoder._step
    n = max(steps, 1)
    return StepOverhead(total.syncs / n, total.eager_ops / n, total.compiled_calls / n, steps)
