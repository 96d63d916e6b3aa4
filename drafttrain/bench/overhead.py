"""Each drafter kind's step overhead, with tiny random models: what no kernel can hide. The rows
are the registry's: each kind declares its own (`DrafterKind.bench_rows`: a random drafter for the
tiny target and its settings; none for the oracle).

With a model this small a step's time is almost all overhead: Python, launches of ops run outside
compiled steps, and waits for the host to read the device. So the figures show, on any machine,
what a drafter kind adds to every step before its models' work: host syncs per step (one is the
floor: the host must learn what was accepted), eager ops and compiled calls (graph launches) per
step (`engines.overhead`) and the median step time. Every kind runs on the static engine with compiled steps; on a CPU they are
traced by dynamo's eager backend (the same graphs, no generated code: inductor would spend
minutes compiling tiny graphs), on CUDA compiled and captured as CUDA graphs as in any run.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from statistics import median

import torch

from ..decoding import DecodeSettings, StaticLM
from ..kinds.factory import build_decoder
from ..kinds.registry import REGISTRY
from ..kinds.base import BENCH_TREE_NODES
from ..decoding.engines.compiled import BACKEND_VARIABLE
from ..decoding.engines.overhead import step_overhead

VOCAB, LAYERS, HIDDEN, PROMPT, NEW_TOKENS = 256, 4, 64, 24, 32


@contextmanager
def traced_on_cpu(device: torch.device):
    """Dynamo's eager backend for the CPU (see the module docstring); CUDA keeps inductor."""
    saved = os.environ.get(BACKEND_VARIABLE)
    if device.type != "cuda":
        os.environ[BACKEND_VARIABLE] = "eager"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(BACKEND_VARIABLE, None)
        else:
            os.environ[BACKEND_VARIABLE] = saved


def tiny_target(device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """A 4-layer random Llama: every kind's rows draft for it (`DrafterKind.bench_rows`)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=LAYERS,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    return LlamaForCausalLM(config).to(device=device, dtype=dtype).eval().requires_grad_(False)


def step_overheads(device: torch.device, dtype: torch.dtype, k: int, seed: int = 0) -> list[dict]:
    """Per drafter kind's row (`DrafterKind.bench_rows`, the registry's order, rows with a lookup's
    branch last): host syncs, eager ops and compiled calls per step (counted), median step
    milliseconds."""
    with traced_on_cpu(device):
        target = tiny_target(device, dtype)
        length = PROMPT + NEW_TOKENS + 2 * (BENCH_TREE_NODES + k)
        lm = StaticLM(target, max_length=length, compile=True)
        prompt = torch.randint(VOCAB - 1, (PROMPT,), generator=torch.Generator().manual_seed(seed)).tolist()
        kinds = [row for kind in REGISTRY for row in kind.bench_rows(target, k, length)]
        rows = []
        for name, drafter, extra in sorted(kinds, key=lambda row: bool(row[2].get("hybrid"))):
            decoder = build_decoder(lm, drafter, DecodeSettings(num_draft_tokens=k, **extra))
            decoder.warmup()
            counted = step_overhead(decoder, prompt, NEW_TOKENS)
            seconds = decoder.generate(prompt, NEW_TOKENS).step_seconds
            rows.append({"drafter": name, "syncs_per_step": counted.syncs, "eager_ops_per_step": counted.eager_ops,
                         "compiled_calls_per_step": counted.compiled_calls, "steps": counted.steps,
                         "step_ms": 1e3 * median(seconds)})
    return rows
