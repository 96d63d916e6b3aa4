"""Batched static-cache generation (the recipes' target answers): greedy rows equal each prompt
decoded alone by `generate()`, top-k log-probs equal a full forward's, sampled rows follow the
target's distribution, each from its own seed whatever its batch; and the hook in data/generation."""

from __future__ import annotations

import pytest
import torch
from sampling_reference import V, chi2_pvalue, exact_two_token_distribution
from tiny import tiny_lm, tiny_tokenizer

from drafttrain.data.generation import cache_key, generate_responses
from drafttrain.decoding.batch import BatchGenerator, row_uniform, sample_rows
from drafttrain.tokens import cut_at_eos, left_pad
from drafttrain.prompts import PromptRecord

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [14], [15, 16, 17], [40, 41, 42, 43]]
MAX_NEW = 14


@pytest.fixture(scope="module")
def target():
    model = tiny_lm(0, vocab_size=64)
    with torch.no_grad():
        model.lm_head.weight[2] *= 1.6  # EOS (id 2) wins at some positions: some rows stop early
    return model


def reference(model, prompt, eos=2):
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW, do_sample=False,
                         eos_token_id=eos, pad_token_id=0)
    return cut_at_eos(out[0, len(prompt):].tolist(), [eos])


@pytest.mark.parametrize("batch_size", [5, 8])  # 8: three rows of batch padding
def test_greedy_rows_equal_each_prompt_alone(target, batch_size):
    ids, mask = left_pad(PROMPTS, 0, "cpu")
    gen = BatchGenerator(target, batch_size=batch_size, max_length=ids.shape[1] + MAX_NEW)
    rows, values, indices = gen.generate(ids, mask, max_new_tokens=MAX_NEW, eos_token_ids=[2])
    assert values is None and indices is None
    refs = [reference(target, p) for p in PROMPTS]
    assert rows == refs
    assert any(r[-1] == 2 for r in refs) and any(len(r) == MAX_NEW and 2 not in r for r in refs)


def test_topk_logprobs_equal_a_full_forward(target):
    ids, mask = left_pad(PROMPTS, 0, "cpu")
    gen = BatchGenerator(target, batch_size=5, max_length=ids.shape[1] + MAX_NEW)
    rows, values, indices = gen.generate(ids, mask, max_new_tokens=MAX_NEW, eos_token_ids=[2], topk=3)
    for b, (prompt, row) in enumerate(zip(PROMPTS, rows)):
        with torch.no_grad():
            full = target(torch.tensor([prompt + row])).logits[0, len(prompt) - 1:-1].log_softmax(-1)
        want_values, want_ids = full.topk(3, dim=-1)
        assert torch.equal(indices[b, :len(row)], want_ids)
        torch.testing.assert_close(values[b, :len(row)], want_values.float(), rtol=0, atol=1e-6)


@pytest.mark.parametrize("layers", [(0, 2), (1,), (2,)])  # (2,): the last layer, after the final norm
def test_hidden_states_along_each_row_equal_a_teacher_forced_forward(target, layers):
    """`greedy_with_hidden`: the same rows as `generate`, and each row's hidden layers along its
    prompt and continuation (EOS included) are one full forward's over them (`teacher_forced`'s)."""
    ids, mask = left_pad(PROMPTS, 0, "cpu")
    gen = BatchGenerator(target, batch_size=8, max_length=ids.shape[1] + MAX_NEW)
    rows, hidden = gen.greedy_with_hidden(ids, mask, max_new_tokens=MAX_NEW, eos_token_ids=[2], hidden_layers=layers)
    assert rows == [reference(target, p) for p in PROMPTS]
    for prompt, row, states in zip(PROMPTS, rows, hidden):
        with torch.no_grad():
            out = target(torch.tensor([prompt + row]), output_hidden_states=True)
        want = torch.cat([out.hidden_states[i][0] for i in layers], dim=-1)
        assert states.shape == want.shape
        torch.testing.assert_close(states, want, rtol=1e-9, atol=1e-9)


def test_too_long_is_a_clear_error(target):
    ids, mask = left_pad(PROMPTS, 0, "cpu")
    gen = BatchGenerator(target, batch_size=5, max_length=10)
    from drafttrain.errors import UserError

    with pytest.raises(UserError, match="max_length 10"):
        gen.generate(ids, mask, max_new_tokens=MAX_NEW, eos_token_ids=[2])


@pytest.mark.slow
@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.8, 0.9)])
def test_sampled_rows_follow_the_target_distribution(temperature, top_p):
    target = tiny_lm(0, vocab_size=V, sharpness=2.0)
    prompt = [1, 3, 1, 3, 1]
    # One batch: every row, with a seed of its own, is an independent sample of the first two tokens. 6000 rows:
    # with 3000 the check of power below passes or fails by the draw (p from 1e-4 to 1e-7 over seeds).
    n = 6000
    ids, mask = left_pad([prompt] * n, 0, "cpu")
    seeds = torch.arange(7, 7 + n)
    gen = BatchGenerator(target, batch_size=n, max_length=len(prompt) + 2)
    rows, _, _ = gen.generate(ids, mask, max_new_tokens=2, eos_token_ids=[], temperature=temperature, top_p=top_p,
                              seeds=seeds)
    counts = {}
    for row in rows:
        counts[tuple(row)] = counts.get(tuple(row), 0) + 1
    assert chi2_pvalue(counts, exact_two_token_distribution(target, prompt, temperature, top_p, V), n) > 1e-3
    # Power: the same samples reject the distribution at another temperature.
    assert chi2_pvalue(counts, exact_two_token_distribution(target, prompt, temperature * 2, top_p, V), n) < 1e-6
    again, _, _ = gen.generate(ids, mask, max_new_tokens=2, eos_token_ids=[], temperature=temperature, top_p=top_p,
                               seeds=seeds)
    assert again == rows


def test_a_sampled_row_does_not_depend_on_its_batch(target):
    """Row b draws from its own seed: alone, or in another batch at another place, it samples the same."""
    ids, mask = left_pad(PROMPTS, 0, "cpu")
    seeds = torch.tensor([11, 22, 33, 44, 55])
    gen = BatchGenerator(target, batch_size=8, max_length=ids.shape[1] + MAX_NEW)
    rows, _, _ = gen.generate(ids, mask, max_new_tokens=MAX_NEW, eos_token_ids=[2], temperature=1.0, seeds=seeds)
    for b in (0, 3):
        one_ids, one_mask = left_pad([PROMPTS[b]], 0, "cpu")
        alone, _, _ = gen.generate(one_ids, one_mask, max_new_tokens=MAX_NEW, eos_token_ids=[2], temperature=1.0,
                                   seeds=seeds[b:b + 1])
        assert alone == [rows[b]]
    assert len(set(map(tuple, rows))) > 1


def test_a_rows_draw_is_a_pure_function_of_its_seed_and_step():
    seeds = torch.tensor([3, 2**62, 0])
    u = row_uniform(seeds, 5)
    assert u.shape == (3,) and bool(((u > 0) & (u < 1)).all())
    assert torch.equal(row_uniform(seeds[1:2], 5), u[1:2])              # alone, the same draw
    assert not torch.equal(row_uniform(seeds, 6), u)                     # another step, other draws
    many = row_uniform(torch.arange(20000), 0)
    assert abs(many.mean().item() - 0.5) < 0.01 and abs(many.var().item() - 1 / 12) < 0.002  # U(0, 1)


def test_a_token_of_probability_zero_is_never_drawn():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]]).repeat(4000, 1)
    tokens = sample_rows(probs, torch.arange(4000), 0)
    assert set(tokens.tolist()) == {1, 3}


# --- the hook in data/generation --------------------------------------------------------------


def records():
    return [PromptRecord(id=i, category="d", source=f"t:{i}", text=" ".join(f"w{(7 * i + j) % 50 + 4}"
                                                                             for j in range(1 + i % 4)))
            for i in range(6)]


def data_cfg(tmp_path, **kw):
    from drafttrain.data.config import DataConfig

    return DataConfig(**{"max_response_tokens": MAX_NEW, "generation_batch_size": 4, "cache_dir": str(tmp_path / "cache"),
                         **kw})


def test_generate_responses_on_the_static_engine(target, tmp_path, monkeypatch):
    tok = tiny_tokenizer()
    cfg = data_cfg(tmp_path, store_topk=2)
    static = generate_responses(target, tok, records(), cfg, eos_token_id=2, target_fingerprint="fp", engine="static")
    eager = generate_responses(target, tok, records(), data_cfg(tmp_path / "other", store_topk=2), eos_token_id=2,
                               target_fingerprint="fp", engine="eager")
    assert static["response_ids"] == eager["response_ids"]
    assert static["topk_ids"] == eager["topk_ids"]
    for a, b in zip(static["topk_logprobs"], eager["topk_logprobs"]):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=0, atol=1e-5)
    # Greedy answers do not depend on the engine: the static run's cache serves an eager request.
    monkeypatch.setattr(target, "generate", lambda *a, **k: (_ for _ in ()).throw(AssertionError("generated")))
    again = generate_responses(target, tok, records(), cfg, eos_token_id=2, target_fingerprint="fp", engine="eager")
    assert again["response_ids"] == static["response_ids"]


def test_sampled_answers_are_the_same_on_both_engines(target, tmp_path):
    """Both engines sample a row from its prompt's seed with the same race, so the cache key names
    no engine (and no batch size): a sample does not depend on either."""
    tok = tiny_tokenizer()
    static = generate_responses(target, tok, records(), data_cfg(tmp_path / "s", response_temperature=1.0),
                                eos_token_id=2, target_fingerprint="fp", engine="static")
    eager = generate_responses(target, tok, records(), data_cfg(tmp_path / "e", response_temperature=1.0,
                                                                generation_batch_size=3),
                               eos_token_id=2, target_fingerprint="fp", engine="eager")
    assert static["response_ids"] == eager["response_ids"]
    prompts = [[4, 5], [6]]
    greedy, sampled = data_cfg(tmp_path), data_cfg(tmp_path, response_temperature=0.7)
    assert cache_key("fp", prompts, sampled, [2]) != cache_key("fp", prompts, greedy, [2])
    assert cache_key("fp", prompts, sampled, [2]) == \
        cache_key("fp", prompts, data_cfg(tmp_path, response_temperature=0.7, generation_batch_size=None), [2])
