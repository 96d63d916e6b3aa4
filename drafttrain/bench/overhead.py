"""Each drafter kind's step overhead, with tiny random models: what no kernel can hide.

With a model this small a step's time is almost all overhead: Python, launches of ops run outside
compiled steps, and waits for the host to read the device. So the figures show, on any machine,
what a drafter kind adds to every step before its models' work: host syncs per step (one is the
floor: the host must learn what was accepted), eager ops and compiled calls (graph launches) per
step (`engines.overhead`) and the median step time. Every kind runs on the static engine with compiled steps; on a CPU they are
traced by dynamo's eager backend (the same graphs, no generated code: inductor would spend
minutes compiling tiny graphs), on CUDA compiled and captured as CUDA graphs as in any run.
"""

from __future__ import annotations

import copy
import os
from contextlib import contextmanager
from statistics import median

import torch

from ..decoding import DecodeSettings, Drafter, StaticLM, build_decoder
from ..decoding.engines.compiled import BACKEND_VARIABLE
from ..decoding.engines.overhead import step_overhead

VOCAB, LAYERS, HIDDEN, PROMPT, NEW_TOKENS = 256, 4, 64, 24, 32
MASK = VOCAB - 1  # the parallel draft's mask token
DYNAMIC = dict(tree="dynamic", tree_nodes=16, tree_topk=4)
KINDS = {
    "plain": ("none", {}),
    "n-gram": ("ngram", {}),
    "draft LM": ("draft", {}),
    "parallel draft": ("parallel_draft", {}),
    "Medusa tree": ("medusa", dict(tree="default")),
    "EAGLE-3 chain": ("eagle3", dict(tree="chain")),
    "EAGLE-3 dynamic tree": ("eagle3", DYNAMIC),
    "draft LM + n-gram": ("draft", dict(ngram_hybrid=True)),
    "EAGLE-3 tree + n-gram": ("eagle3", dict(DYNAMIC, ngram_hybrid=True)),
}


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


def tiny_models(device: torch.device, dtype: torch.dtype, k: int) -> tuple[torch.nn.Module, dict]:
    """A 4-layer random Llama and a random drafter of every kind for it (kind -> (model, info))."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from ..eagle3.model import Eagle3Draft
    from ..eagle3.vocab import build_draft_vocab
    from ..medusa.model import MedusaHeads

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=LAYERS,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    target = LlamaForCausalLM(config).to(device=device, dtype=dtype).eval().requires_grad_(False)
    draft = copy.deepcopy(target)
    vocab = build_draft_vocab([list(range(VOCAB))], VOCAB, VOCAB // 2)
    drafters = {"none": (None, {}), "ngram": (None, {}), "draft": (draft, {}),
                "parallel_draft": (draft, {"pard_token": MASK, "parallel_tokens": k}),
                "medusa": (MedusaHeads.from_target(target, 3).to(device=device, dtype=dtype), {}),
                "eagle3": (Eagle3Draft.from_target(target, vocab, (1, 2, 3), dtype=dtype, seed=0), {})}
    return target, drafters


def step_overheads(device: torch.device, dtype: torch.dtype, k: int, seed: int = 0) -> list[dict]:
    """Per drafter kind: host syncs, eager ops and compiled calls per step (counted), median step
    milliseconds."""
    with traced_on_cpu(device):
        target, drafters = tiny_models(device, dtype, k)
        length = PROMPT + NEW_TOKENS + 2 * (DYNAMIC["tree_nodes"] + k)
        lm = StaticLM(target, max_length=length, compile=True)
        draft_lms = {}
        prompt = torch.randint(VOCAB - 1, (PROMPT,), generator=torch.Generator().manual_seed(seed)).tolist()
        rows = []
        for name, (kind, extra) in KINDS.items():
            model, info = drafters[kind]
            if kind in ("draft", "parallel_draft"):
                model = draft_lms.setdefault(kind, StaticLM(model, max_length=length, compile=True))
            decoder = build_decoder(lm, Drafter(kind, model, info), DecodeSettings(num_draft_tokens=k, **extra))
            decoder.warmup()
            counted = step_overhead(decoder, prompt, NEW_TOKENS)
            seconds = decoder.generate(prompt, NEW_TOKENS).step_seconds
            rows.append({"drafter": name, "syncs_per_step": counted.syncs, "eager_ops_per_step": counted.eager_ops,
                         "compiled_calls_per_step": counted.compiled_calls, "steps": counted.steps,
                         "step_ms": 1e3 * median(seconds)})
    return rows
