"""Decode-time linear layers on CPU: `W · xᵀ` instead of `x · Wᵀ` for a few rows, where this
machine computes it faster.

Speculative decoding lives on forwards of 2 .. K+1 tokens, so its speedup is set by how much
more such a forward costs than a 1-token one. On CPU, PyTorch's `F.linear(x, W)` for a few rows
calls a BLAS GEMM whose small-M kernels (MKL on the AMD EPYC of our 2-core machines) cost about
twice the 1-row GEMV: a 4-token SmolLM2-135M forward took 1.6× a 1-token one, and the draft's
49152-row LM head 2.5×. The same product taken as `mm(W, xᵀ)` (weights as the left operand, the
rows as a narrow right-hand side) streams the weights once, as the GEMV does, so a few rows cost
little more than one: the 4-token forward fell to 1.2× and the draft's to 1.1× (in-process,
interleaved medians; `drafttrain bench` measures the curve on any machine).

MKL's narrow kernel for exactly 3 columns is slower than its 4-column one (SmolLM2, 2 cores:
3 tokens 118 ms, 4 tokens 96 ms), so 3 rows are padded to 4 (`PADDED_ROWS`): a verification
of 2 drafts then costs what one of 3 does.

Which is faster depends on the BLAS and the CPU, so it is measured, not assumed: on the 2 Intel
Xeon cores of a later machine (MKL again) `F.linear` was the fast one, 2 to 8 rows costing about
what 1 does, and `W · xᵀ` 3-4× slower (SmolLM2's MLP, 2 rows: 29 against 114 µs). Installing the
path times both products on each weight shape for every row count (interleaved repeats, medians,
once per process and shape: `faster_rows`) and keeps `W · xᵀ` only for the row counts where it
wins clearly.

In a forward every weight arrives cold from memory, so every row count is timed against cold
copies of the weight (`COLD_BYTES` of copies in all, read in turn). One row was once left to
BLAS's GEMV and timed hot: on an AMD EPYC machine a 1-token SmolLM2 forward then took 57 ms and a
2-token one 48, since the GEMV streams a cold weight slowly. Later 2-8 rows, still timed hot,
misjudged Gemma-3's k/v and down projections the same way.

The rows reach `mm` as they were timed: the transpose of contiguous rows. A skinny layer returns
a transposed view, and passed on as it was, the next layer's rows arrived as a row-major right
operand, a layout MKL multiplies up to 3x slower: Gemma-3-270M's 2-token forward cost 49 ms
against 37 for one, SmolLM2's 36 against 24; made contiguous (a copy of a few rows), 39 and 27.

The result is the same product up to float rounding; baseline and speculative decoding run the
same model, so they share it (each report's `match baseline` checks equality). Only 1 to
`MAX_ROWS` rows take this path: prefill keeps the BLAS GEMM, which is right for many rows.
Installed by the engines on float32 CPU models only: GPUs are untouched, and float64, the dtype of the exactness tests, keeps transformers' own product bit for
bit (the rounding of `mm(W, xᵀ)` depends on the number of rows, and an architecture that rounds
through float32 inside, as Qwen3's q/k norms do, turns a 1e-17 difference into 1e-7).
"""

from __future__ import annotations

import itertools
import time
import types
from statistics import median

import torch

MAX_ROWS = 16
PADDED_ROWS = {1: 2, 3: 4}  # rows -> the width that computes them faster (zero rows added, dropped after)
COLD_BYTES = 64 << 20  # one row is timed on this many bytes of weight copies, read in turn: past any cache
CLEAR_WIN = 0.85  # W · xᵀ is kept where it takes less than this share of F.linear's time
REPEATS = 5
_FASTER: dict[tuple[int, int], frozenset[int]] = {}  # weight shape -> row counts where W · xᵀ wins


def _mm_product(weight: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
    rows = flat.shape[0]
    width = PADDED_ROWS.get(rows, rows)
    if width > rows:
        flat = torch.cat([flat, flat.new_zeros(width - rows, flat.shape[1])])
    return torch.mm(weight, flat.contiguous().t()).t()[:rows]


@torch.no_grad()
def product_seconds(weight: torch.Tensor, rows: int) -> tuple[float, float]:
    """Median seconds of (W · xᵀ, F.linear) for `rows` random rows against `weight`, interleaved,
    each call on another cold copy of the weight (`COLD_BYTES` in all), as a decoding forward meets it."""
    x = torch.randn(rows, weight.shape[1], dtype=weight.dtype)
    count = -(-COLD_BYTES // max(1, weight.numel() * weight.element_size()))
    copies = itertools.cycle([weight] + [weight.clone() for _ in range(count - 1)])
    products = (lambda: _mm_product(next(copies), x), lambda: torch.nn.functional.linear(x, next(copies)))
    times: tuple[list[float], list[float]] = ([], [])
    for product in products:
        product()  # warm
    for _ in range(REPEATS):
        for product, spent in zip(products, times):
            start = time.perf_counter()
            product()
            spent.append(time.perf_counter() - start)
    return median(times[0]), median(times[1])


def faster_rows(weight: torch.Tensor, measure=product_seconds) -> frozenset[int]:
    """The row counts (1 .. MAX_ROWS) for which `W · xᵀ` beats `F.linear` clearly on this machine,
    measured once per weight shape and process."""
    shape = tuple(weight.shape)
    if shape not in _FASTER:
        wins = []
        for rows in range(1, MAX_ROWS + 1):
            mm, linear = measure(weight, rows)
            if mm < CLEAR_WIN * linear:
                wins.append(rows)
        _FASTER[shape] = frozenset(wins)
    return _FASTER[shape]


def _skinny_linear(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if rows not in self.skinny_rows:  # where F.linear was measured as fast
        return torch.nn.functional.linear(x, self.weight, self.bias)
    y = _mm_product(self.weight, x.reshape(rows, x.shape[-1]))
    if self.bias is not None:
        y = y + self.bias
    return y.reshape(*x.shape[:-1], self.weight.shape[0])


def _whole_weight(weight: torch.Tensor) -> bool:
    """A weight this process holds whole: DeepSpeed ZeRO-3 leaves each rank an empty 1-D stand-in
    (tagged `ds_id`) that its hooks gather only around a forward, so it can neither be timed nor
    multiplied outside one."""
    return weight.dim() == 2 and weight.numel() > 0 and not hasattr(weight, "ds_id")


def use_skinny_matmuls(model: torch.nn.Module, rows_for=faster_rows) -> None:
    """Give every float32 `nn.Linear` of a CPU model the few-rows path, for the row counts where it
    is faster here (none: the layer is left as it is). Idempotent. Layers whose weight is sharded
    away (ZeRO-3) keep their own forward."""
    for module in model.modules():
        if (type(module) is torch.nn.Linear and module.weight.device.type == "cpu"
                and module.weight.dtype == torch.float32 and "forward" not in module.__dict__
                and _whole_weight(module.weight)):
            rows = rows_for(module.weight)
            if rows:
                module.skinny_rows = rows
                module.forward = types.MethodType(_skinny_linear, module)


__all__ = ["MAX_ROWS", "faster_rows", "use_skinny_matmuls"]
