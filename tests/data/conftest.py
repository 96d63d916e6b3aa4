"""A tiny ChatML tokenizer and a tiny random float64 Llama that share it (no downloads)."""

from __future__ import annotations

import pytest
import torch

CHATML = (
    "{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou are helpful .<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<pad>", "<unk>", "<|im_start|>", "<|im_end|>"]
WORDS = ["system", "user", "assistant", "You", "are", "helpful", "."]
VOCAB_SIZE = 96


def build_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    filler = [f"w{i}" for i in range(VOCAB_SIZE - len(SPECIALS) - len(WORDS))]
    vocab = {tok: i for i, tok in enumerate(SPECIALS + WORDS + filler)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", unk_token="<unk>",
                                  eos_token="<|im_end|>", additional_special_tokens=["<|im_start|>"])
    tok.chat_template = CHATML
    assert len(tok) == VOCAB_SIZE
    return tok


def build_model(seed: int = 0, eos_boost: float = 0.0):
    """`eos_boost` scales EOS's output row so that EOS wins greedily at some positions (not all)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB_SIZE, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         pad_token_id=0, eos_token_id=3, bos_token_id=None)
    model = LlamaForCausalLM(config).to(torch.float64).eval()
    model.generation_config.eos_token_id = 3
    model.generation_config.pad_token_id = 0
    if eos_boost:
        with torch.no_grad():
            model.lm_head.weight[3] *= eos_boost
    return model


@pytest.fixture(scope="session")
def tiny_tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="session")
def tiny_model():
    """Greedy answers of 1..12 tokens: some stop with EOS, some run to max_new_tokens."""
    return build_model(eos_boost=3.0)


@pytest.fixture(scope="session")
def chatty_model():
    """Samples end their turn often enough for self-instruct to finish quickly."""
    return build_model(eos_boost=25.0)


@pytest.fixture(scope="session")
def make_tiny_model():
    return build_model
