"""`CachedLM.prefill`: tokens whose logits no one reads (a prompt but its last token) go into the
cache without the LM head over them, on the eager engine (transformers' `logits_to_keep`) and in a
batch's prefill (`static_step(last_only=True)`). The cache and the hidden states are a forward's,
so decoding after it is unchanged; the head reads one row a prompt, where it read every row (a
batch's rows in one product, as its decode steps read them)."""

from __future__ import annotations

import pytest
import torch
from tiny import greedy_reference, noisy_copy, tiny_gemma3, tiny_lm

from drafttrain.decoding import ChainDecoder, EagerLM, StaticLM
from drafttrain.decoding.batch import BatchGenerator
from drafttrain.kinds.draft_lm.decode import DraftModelProposer
from drafttrain.tokens import left_pad


def head_rows(model) -> list[int]:
    """The rows each call of `model`'s LM head reads, appended as it runs."""
    rows: list[int] = []
    model.lm_head.register_forward_hook(lambda _m, args, _out: rows.append(args[0].shape[:-1].numel()))
    return rows


@pytest.mark.parametrize("build", [tiny_lm, tiny_gemma3], ids=["llama", "gemma3"])
def test_eager_prefill_is_a_forward_without_the_head(build):
    model = build(0)
    ids = torch.randint(3, 64, (23,), generator=torch.Generator().manual_seed(1))
    layers = (1, model.config.num_hidden_layers)
    reference, prefilled = EagerLM(model), EagerLM(model)
    reference.reset()
    prefilled.reset()
    _, expected_hidden = reference.forward(ids[:-1], hidden_layers=layers)
    rows = head_rows(model)
    hidden = prefilled.prefill(ids[:-1], hidden_layers=layers)
    assert rows == [1] and prefilled.length == reference.length == 22
    torch.testing.assert_close(hidden, expected_hidden, rtol=0, atol=0)
    # the caches are the same: the next forward's logits equal the reference's, row for row
    logits, _ = prefilled.forward(ids[-1:])
    expected, _ = reference.forward(ids[-1:])
    torch.testing.assert_close(logits, expected, rtol=0, atol=0)


def test_a_decode_prefills_target_and_draft_without_the_head():
    target = tiny_lm(0)
    draft = noisy_copy(target, scale=0.08)
    prompt = list(range(5, 35))
    target_rows, draft_rows = head_rows(target), head_rows(draft)
    decoder = ChainDecoder(EagerLM(target), DraftModelProposer(EagerLM(draft), 64, num_draft_tokens=3),
                           num_draft_tokens=3)
    tokens = decoder.generate(prompt, 12).tokens
    assert tokens == greedy_reference(target, prompt, 12)
    # the prompt's first 29 tokens: neither head read them (the decode's own rows are 1 to 4 a call)
    assert target_rows[0] == 1 and draft_rows[0] == 1 and max(draft_rows) <= 4


def test_a_batch_prefill_reads_one_row_of_the_head_a_prompt_all_in_one_product():
    model = tiny_lm(0, dtype=torch.float64)
    prompts = [list(range(4, 4 + n)) for n in (3, 9, 6)]
    generator = BatchGenerator(model, batch_size=4, max_length=32, compile=False)
    rows = head_rows(model)
    ids, mask = left_pad(prompts, 0, torch.device("cpu"))
    out, _, _ = generator.generate(ids, mask, max_new_tokens=5, eos_token_ids=[])
    # the prompts' last tokens together (none for the batch's padding row), then [batch, 1] a step
    assert rows == [3] + [4] * 4
    assert out == [greedy_reference(model, p, 5) for p in prompts]


def test_the_static_engines_prefill_is_its_forward():
    """The static engine keeps its compiled prefill chunks, which return every row (on a GPU the head
    over a prompt is a small part of it): `prefill` returns `forward`'s hidden states and fills the
    same cache length."""
    model = tiny_lm(0)
    ids = torch.arange(3, 20)
    lm, reference = StaticLM(model, max_length=64), StaticLM(model, max_length=64)
    lm.reset()
    reference.reset()
    hidden = lm.prefill(ids, hidden_layers=(1,))
    _, expected = reference.forward(ids, hidden_layers=(1,))
    torch.testing.assert_close(hidden, expected, rtol=0, atol=0)
    assert lm.length == reference.length == ids.numel()
