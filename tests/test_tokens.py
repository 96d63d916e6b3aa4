"""drafttrain.tokens: the one rule for EOS ids, the pad id and the output vocabulary, on tiny models."""

from __future__ import annotations

import pytest
import torch
from tiny import tiny_lm, tiny_tokenizer

from drafttrain.errors import UserError
from drafttrain.tokens import cut_at_eos, eos_token_ids, left_pad, output_vocab_size, pad_token_id


def test_eos_ids_are_the_tokenizers_then_the_generation_configs():
    tokenizer, model = tiny_tokenizer(), tiny_lm()
    assert tokenizer.eos_token_id == 2 and model.generation_config.eos_token_id == 2
    assert eos_token_ids(tokenizer, model) == [2]
    model.generation_config.eos_token_id = [5, 2, 7]
    assert eos_token_ids(tokenizer, model) == [2, 5, 7]  # the tokenizer's first, no duplicates
    model.generation_config.eos_token_id = 9
    assert eos_token_ids(tokenizer, model) == [2, 9]


def test_eos_ids_fall_back_to_the_model_config_and_may_be_required():
    model = tiny_lm()
    model.generation_config.eos_token_id = None
    model.config.eos_token_id = 4
    assert eos_token_ids(None, model) == [4]  # what generate() itself would stop on
    model.config.eos_token_id = None
    assert eos_token_ids(None, model) == []
    with pytest.raises(UserError, match="no end-of-sequence token"):
        eos_token_ids(None, model, required=True)


def test_pad_id_is_the_tokenizers_else_the_first_eos():
    tokenizer, model = tiny_tokenizer(), tiny_lm()
    tokenizer.pad_token = "w7"
    assert pad_token_id(tokenizer, model) == 7
    tokenizer.pad_token = None
    model.generation_config.eos_token_id = [5, 2]
    assert pad_token_id(tokenizer, model) == 2  # the tokenizer's EOS comes first
    tokenizer.eos_token = None
    assert pad_token_id(tokenizer, model) == 5


def test_output_vocab_size_counts_logits_not_tokens():
    model = tiny_lm(vocab_size=80)
    assert output_vocab_size(model) == 80 == model(torch.tensor([[1, 2]])).logits.shape[-1]


def test_left_pad_and_cut_at_eos():
    ids, mask = left_pad([[5, 6, 7], [8]], pad_id=0, device="cpu")
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    assert cut_at_eos([4, 2, 9, 2], [2]) == [4, 2] and cut_at_eos([4, 9], [2]) == [4, 9]
