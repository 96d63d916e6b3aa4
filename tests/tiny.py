"""Tiny random models and tokenizers that the tests build themselves (no hub access)."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + ' ' + message['content'] + "
    "'<|im_end|>' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant ' }}{% endif %}"
)
SPECIALS = ["<unk>", "<|im_start|>", "<|im_end|>"]


def tiny_lm(seed: int = 0, vocab_size: int = 64, layers: int = 2, hidden: int = 32,
            dtype: torch.dtype = torch.float64, eos_token_id: int = 2, max_positions: int = 256,
            sharpness: float = 8.0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=max_positions, eos_token_id=eos_token_id,
                      bos_token_id=None, pad_token_id=eos_token_id, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).to(dtype).eval()
    # Sharper distributions than the default init, so greedy paths are not knife-edge ties.
    with torch.no_grad():
        model.lm_head.weight.mul_(sharpness)
    return model


GEMMA3_LAYER_TYPES = ("sliding_attention", "sliding_attention", "full_attention", "sliding_attention",
                      "full_attention")


# Gemma-3-270M's own pattern: five sliding layers, then a global one (18 layers: globals 5, 11, 17).
GEMMA3_270M_LAYER_TYPES = ("sliding_attention",) * 5 + ("full_attention",)


def tiny_gemma3(seed: int = 0, vocab_size: int = 64, layers: int = 5, hidden: int = 32, window: int = 4,
                dtype: torch.dtype = torch.float64, eos_token_id: int = 2, max_positions: int = 256,
                sharpness: float = 8.0, pattern: tuple[str, ...] = GEMMA3_LAYER_TYPES, head_dim: int = 16, **extra):
    """A Gemma-3 text model with every part that differs from Llama switched on: sliding and
    global layers (a 4-token window, so short prompts already pass it), local/global rotary bases
    (the global one linearly scaled), q/k norms, `query_pre_attn_scalar` != head_dim, the final
    logit soft-cap, and non-zero (1 + w) norm weights (Gemma initialises them to zero)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(seed)
    types = [pattern[i % len(pattern)] for i in range(layers)]
    rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 2.0}}
    cfg = Gemma3TextConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                           num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim,
                           query_pre_attn_scalar=24, sliding_window=window, layer_types=types,
                           rope_parameters=rope, final_logit_softcapping=30.0, max_position_embeddings=max_positions,
                           eos_token_id=eos_token_id, bos_token_id=None, pad_token_id=eos_token_id,
                           tie_word_embeddings=False, **extra)
    model = Gemma3ForCausalLM(cfg).to(dtype).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(sharpness)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0, 0.3)
    return model


def tiny_tokenizer(vocab_size: int = 64, chat_template: bool = True) -> PreTrainedTokenizerFast:
    """Word-level tokenizer: token i is the word `w{i}` (specials first), split on whitespace."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for i in range(len(SPECIALS), vocab_size):
        vocab[f"w{i}"] = i
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="<|im_end|>",
                                  pad_token="<|im_end|>", additional_special_tokens=SPECIALS[1:])
    if chat_template:
        tok.chat_template = CHATML
    return tok


def tiny_causal_lm(arch: str, seed: int = 0, **kw):
    """`tiny_lm` (arch "llama") or `tiny_gemma3` ("gemma3") with the same arguments: tests that run
    on both families take the architecture as a parameter."""
    return (tiny_gemma3 if arch == "gemma3" else tiny_lm)(seed, **kw)


GEMMA3_SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"]


def tiny_gemma3_tokenizer(vocab_size: int = 64, unused: int = 4) -> PreTrainedTokenizerFast:
    """A base model's tokenizer laid out like Gemma-3's: <pad> <eos> <bos> <unk> <mask>, then
    `<unused0>` .. as added tokens, then words `w{i}`; BOS added to every text; no chat template."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers, processors

    names = GEMMA3_SPECIALS + [f"<unused{i}>" for i in range(unused)]
    vocab = {tok: i for i, tok in enumerate(names)} | {f"w{i}": i for i in range(len(names), vocab_size)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 2)])
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>",
                                  unk_token="<unk>", mask_token="<mask>")
    tok.add_tokens([AddedToken(name, special=True, normalized=False) for name in names[5:]])  # as Gemma's: added,
    return tok                                                                               # not named special


def tiny_gemma3_270m(seed: int = 0, vocab_size: int = 40000, **kw):
    """Gemma-3-270M's shape where the recipes' choices depend on it (18 layers in its sliding/global
    pattern, a vocabulary above EAGLE-3's 32k draft vocabulary, EOS 1, BOS 2), everything else tiny:
    the demo configs run on it unchanged but for their sizes."""
    return tiny_gemma3(seed, vocab_size=vocab_size, layers=18, hidden=32, pattern=GEMMA3_270M_LAYER_TYPES,
                       eos_token_id=1, dtype=torch.float32, **kw)


def save_pair(path, model, tokenizer):
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def noisy_copy(model, scale: float = 0.1, seed: int = 7):
    """A draft close to the target: partial acceptance, so rollbacks of every length happen."""
    import copy

    draft = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g, dtype=p.dtype) * p.std())
    return draft


def greedy_reference(target, prompt: list[int], max_new: int, eos: int | None = None) -> list[int]:
    """transformers' own greedy `generate()`: the reference every lossless test compares with."""
    out = target.generate(torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False,
                          eos_token_id=eos, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def vllm_medusa_shapes(hidden: int, vocab: int, num_heads: int, num_layers: int) -> dict:
    """vLLM's Medusa weight names and shapes, written out by hand as the reference."""
    expected = {}
    for i in range(num_heads):
        for j in range(num_layers):
            expected[f"blocks.{i}.layers.{j}.weight"] = (hidden, hidden)
            expected[f"blocks.{i}.layers.{j}.bias"] = (hidden,)
        expected[f"lm_heads.{i}.weight"] = (vocab, hidden)
    return expected
