"""`CachedLM.keeping_prefills`: while a plan times its decodes and forward curves, a prompt prefilled
before (from an empty cache, with the same hidden layers) is restored from a kept copy instead of
computed again. What follows a restored prefill must be what follows a fresh one: the decode's
tokens equal the target's own greedy ones, and the hidden states equal a fresh prefill's."""

from __future__ import annotations

import pytest
import torch
from tiny import greedy_reference, noisy_copy, tiny_gemma3, tiny_lm

from drafttrain.decoding import ChainDecoder, EagerLM, StaticLM
from drafttrain.decoding.engines.eager import KEPT_PREFILLS
from drafttrain.kinds.draft_lm.decode import DraftModelProposer


def embedded_rows(model) -> list[int]:
    """The tokens each forward of `model` embeds, appended as it runs."""
    rows: list[int] = []
    model.get_input_embeddings().register_forward_hook(lambda _m, args, _out: rows.append(args[0].numel()))
    return rows


@pytest.mark.parametrize("build", [tiny_lm, tiny_gemma3], ids=["llama", "gemma3"])
def test_a_kept_prefill_decodes_as_a_fresh_one_without_the_forward(build):
    target = build(0)
    draft = noisy_copy(target, scale=0.08)  # rejects some drafts: the decode rolls its cache back
    lm = EagerLM(target)
    decoder = ChainDecoder(lm, DraftModelProposer(EagerLM(draft), 64, num_draft_tokens=3), num_draft_tokens=3)
    prompt = list(range(5, 30))
    expected = greedy_reference(target, prompt, 16)
    rows = embedded_rows(target)
    with lm.keeping_prefills():
        first = decoder.generate(prompt, 16).tokens
        prefilled = rows[0]
        rows.clear()
        second = decoder.generate(prompt, 16).tokens  # the kept cache, copied: the first decode left it as it was
    assert first == second == expected
    assert prefilled == len(prompt) - 1 and len(prompt) - 1 not in rows  # the second decode ran no prefill
    rows.clear()
    assert decoder.generate(prompt, 16).tokens == expected
    assert rows[0] == len(prompt) - 1  # out of the context nothing is kept


def test_a_kept_prefill_is_kept_per_hidden_layers_and_returns_a_fresh_ones_states():
    target = tiny_gemma3(0)
    ids = torch.arange(4, 21)
    layers = (1, target.config.num_hidden_layers)
    fresh = EagerLM(target)
    fresh.reset()
    expected = fresh.prefill(ids, hidden_layers=layers)
    lm = EagerLM(target)
    rows = embedded_rows(target)
    with lm.keeping_prefills():
        for hidden_layers in ((), layers, layers, ()):
            lm.reset()
            hidden = lm.prefill(ids, hidden_layers=hidden_layers)
            assert lm.length == ids.numel()
            if hidden_layers:
                torch.testing.assert_close(hidden, expected, rtol=0, atol=0)
            else:
                assert hidden is None
    assert rows == [ids.numel()] * 2  # once without layers, once with them


def test_only_an_empty_caches_prefill_is_kept_and_the_oldest_goes_first():
    target = tiny_lm(0)
    lm = EagerLM(target)
    rows = embedded_rows(target)
    with lm.keeping_prefills():
        lm.reset()
        lm.prefill(torch.arange(3, 9))
        lm.prefill(torch.arange(3, 9))  # onto a cache that holds tokens: a draft catching up, computed
        assert rows == [6, 6] and lm.length == 12
        prompts = [torch.arange(3, 10 + n) for n in range(KEPT_PREFILLS + 1)]
        for ids in prompts + prompts[-1:] + prompts[:1]:
            lm.reset()
            lm.prefill(ids)
    # every prompt once; the last again from the copy; the first dropped as the oldest, computed again
    assert rows[2:] == [ids.numel() for ids in prompts] + [prompts[0].numel()]


def test_the_static_engine_keeps_none():
    target = tiny_lm(0)
    lm = StaticLM(target, max_length=64)
    rows = embedded_rows(target)
    with lm.keeping_prefills():
        for _ in range(2):
            lm.reset()
            lm.prefill(torch.arange(3, 12))
    assert sum(rows) == 2 * 9
