"""A draft LM's K sequential drafts as one compiled call (`draft_lm.draft_chain`). On the static
engine with compiled steps (dynamo's eager backend on the CPU: the graphs, guards and recompiles
inductor would have, as tests/decoding/test_overhead.py counts them), a greedy step is two graph
launches (the draft's K forwards; the target's verification with its verdict), one host sync and
a few eager ops; the output stays the target's own greedy output, steps that accept every draft
(pending two tokens wide) and steps cut short by the token budget included, and nothing compiles
after warm-up."""

import pytest
import torch
from tiny import greedy_reference, noisy_copy, tiny_lm

from drafttrain.decoding import ChainDecoder, StaticLM
from drafttrain.kinds.draft_lm.decode import DraftModelProposer
from drafttrain.decoding.engines.overhead import step_overhead

K = 4
MAX_NEW = 21
PROMPTS = [[5, 9, 13, 7, 5, 9], [40], [7, 3], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 3, 4, 5]]


@pytest.mark.slow
def test_k_drafts_are_one_compiled_call_per_step(monkeypatch):
    import torch._dynamo
    from torch._dynamo.utils import counters

    monkeypatch.setenv("DRAFTTRAIN_COMPILE_BACKEND", "eager")
    target = tiny_lm(0)
    draft = StaticLM(noisy_copy(target, scale=0.08), max_length=64, compile=True)
    proposer = DraftModelProposer(draft, 64, num_draft_tokens=K)
    decoder = ChainDecoder(StaticLM(target, max_length=64, compile=True), proposer, num_draft_tokens=K)
    decoder.warmup()
    before, accepted = dict(counters["frames"]), []
    with torch._dynamo.config.patch(error_on_recompile=True):
        for prompt in PROMPTS:
            cost = step_overhead(decoder, prompt, MAX_NEW)
            assert cost.syncs == 1 and cost.compiled_calls <= 2 and cost.eager_ops <= 16, cost
            gen = decoder.generate(prompt, MAX_NEW)
            assert gen.tokens == greedy_reference(target, prompt, MAX_NEW)
            accepted += gen.accepted_lengths
    assert dict(counters["frames"]) == before  # both pending widths were compiled at warm-up
    assert K in accepted and any(0 < a < K for a in accepted)  # full and partial acceptance happened
