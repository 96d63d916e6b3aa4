"""The target's answers written by vLLM's offline engine (`data.generator: vllm`): on a tiny float32
target its greedy answers and top-k log-probs are drafttrain's, and where vLLM is missing or cannot
run the target the run stops with one `error:` line before writing anything.

The agreement test needs vLLM (`bash scripts/setup_vllm.sh`, then `.venv-vllm/bin/python -m pytest
tests/data/test_vllm_answers.py`): skipped where it is not installed, as in the main environment
(vLLM's CPU build pins transformers below the suite's); one engine start, about a minute on 2 cores."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from tiny import save_pair, tiny_lm, tiny_tokenizer

from drafttrain.data.config import DataConfig
from drafttrain.data.generation import generate_responses
from drafttrain.errors import UserError
from drafttrain.prompts import PromptRecord

VOCAB = 96


def records(n: int = 6) -> list[PromptRecord]:
    return [PromptRecord(id=i, category="d", source=f"t:{i}",
                         text=" ".join(f"w{(7 * i + 3 * j) % 80 + 4}" for j in range(3 + i % 9))) for i in range(n)]


@pytest.mark.slow
def test_vllm_greedy_answers_equal_drafttrains(tmp_path):
    pytest.importorskip("vllm")
    # head_dim 32: the smallest vLLM's CPU attention takes.
    model = tiny_lm(0, vocab_size=VOCAB, layers=4, hidden=128, dtype=torch.float32)
    tok = tiny_tokenizer(VOCAB)
    target = save_pair(tmp_path / "target", model, tok)
    cfg = DataConfig(max_response_tokens=24, store_topk=3, generation_batch_size=4, cache_dir=str(tmp_path / "ours"))
    kwargs = dict(eos_token_id=2, target_fingerprint="fp", target_path=target)
    ours = generate_responses(model, tok, records(), cfg, **kwargs)
    theirs = generate_responses(model, tok, records(), replace(cfg, generator="vllm", cache_dir=str(tmp_path / "v")),
                                **kwargs)
    assert theirs["response_ids"] == ours["response_ids"]
    assert theirs["topk_ids"] == ours["topk_ids"]
    for a, b in zip(theirs["topk_logprobs"], ours["topk_logprobs"]):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=0, atol=1e-4)


def test_without_vllm_the_generator_is_one_clear_error(tmp_path, monkeypatch):
    from drafttrain.evaluation import vllm_backend

    monkeypatch.setattr(vllm_backend, "vllm_version", lambda: None)
    model, tok = tiny_lm(0, dtype=torch.float32), tiny_tokenizer()
    cfg = DataConfig(max_response_tokens=4, generator="vllm", cache_dir=str(tmp_path / "cache"))
    with pytest.raises(UserError, match="needs vLLM"):  # a recipe's config check, before any model loads
        cfg.validate()
    with pytest.raises(UserError, match=r"data.generator=vllm needs vLLM, which is not installed here: pip install"):
        generate_responses(model, tok, records(2), cfg, eos_token_id=2, target_fingerprint="fp", target_path="t")
    assert not (tmp_path / "cache").exists()  # nothing written


def test_vllm_refuses_a_float64_target_in_words(tmp_path, monkeypatch):
    from drafttrain.evaluation import vllm_backend

    monkeypatch.setattr(vllm_backend, "vllm_version", lambda: "0.32.0")
    cfg = DataConfig(max_response_tokens=4, generator="vllm", cache_dir=str(tmp_path / "cache"))
    with pytest.raises(UserError, match="float64 target; set target_dtype=float32"):
        generate_responses(tiny_lm(0), tiny_tokenizer(), records(2), cfg, eos_token_id=2, target_fingerprint="fp",
                           target_path="t")
