"""What `drafttrain bench` measures on: the target (a model directory, or a random-weight shape
built on the device after a memory check) and its prompts."""

from __future__ import annotations

import os

import torch

from ..errors import UserError
from .config import SHAPES, BenchConfig

MEMORY_HEADROOM = 1.2  # weights plus caches, activations and the allocator's slack: a floor, not a forecast


def shape_parameters(name: str) -> int:
    """Parameters of a named shape, counted on the meta device: nothing is allocated."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**SHAPES[name], bos_token_id=None, eos_token_id=None, pad_token_id=None)
    with torch.device("meta"):
        model = LlamaForCausalLM._from_config(config)
    return sum(p.numel() for p in model.parameters())


def available_memory(device: torch.device) -> int | None:
    """Bytes the device can still give: free CUDA memory, else the host's available memory
    (None where neither can be read)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        import psutil

        return psutil.virtual_memory().available
    except ImportError:
        try:
            return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError):
            return None


def check_shape_fits(name: str, dtype: torch.dtype, device: torch.device) -> None:
    """Refuse a shape whose weights alone do not fit the device, before building it: on the CPU
    the kernel kills such a run minutes later with no message (llama-8b in float32 is ~30 GiB)."""
    params = shape_parameters(name)
    needed = int(params * torch.empty((), dtype=dtype, device="meta").element_size() * MEMORY_HEADROOM)
    available = available_memory(device)
    if available is not None and needed > available:
        dtype_name = str(dtype).removeprefix("torch.")
        raise UserError(f"--shape {name} needs about {needed / 2**30:.1f} GiB on {device} ({params / 1e9:.2f} B "
                        f"parameters in {dtype_name}, plus {MEMORY_HEADROOM - 1:.0%} for caches), but only "
                        f"{available / 2**30:.1f} GiB is available; use a device with more memory, a smaller "
                        "--dtype, or --shape tiny")


def build_shape(name: str, dtype: torch.dtype, device: torch.device):
    """A Llama of the named shape with random weights, initialised on the device itself."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**SHAPES[name], bos_token_id=None, eos_token_id=None, pad_token_id=None)
    with torch.device(device):
        model = LlamaForCausalLM._from_config(config, dtype=dtype)
    return model.eval()


def load_target(cfg: BenchConfig, device: torch.device, dtype: torch.dtype):
    from ..models import load_causal_lm, load_tokenizer

    if cfg.shape:
        check_shape_fits(cfg.shape, dtype, device)
        return build_shape(cfg.shape, dtype, device), None, f"random {cfg.shape}-shaped Llama"
    tokenizer = load_tokenizer(cfg.target, "target") if cfg.prompts else None
    return load_causal_lm(cfg.target, dtype, device, "target"), tokenizer, cfg.target


def bench_prompts(cfg: BenchConfig, tokenizer, model) -> list[list[int]]:
    """The prompts, each of which with --max-new-tokens must fit the model's context, as `eval`
    demands (its check, for prompt files): past it positions are undefined, the figures meaningless."""
    from ..models import context_length

    limit = context_length(model)
    if cfg.prompts:
        from ..prompts import encode_prompts, read_prompts

        return [p.ids for p in encode_prompts(read_prompts(cfg.prompts, cfg.prompts_per_file), tokenizer,
                                              max_new_tokens=cfg.max_new_tokens, context_limit=limit)]
    count, length = cfg.random_prompts
    if limit is not None and length + cfg.max_new_tokens > limit:
        raise UserError(f"--prompt-length {length} plus --max-new-tokens {cfg.max_new_tokens} exceeds the "
                        f"target's context of {limit} tokens; lower --prompt-length or --max-new-tokens")
    vocab = model.get_output_embeddings().weight.shape[0]
    g = torch.Generator().manual_seed(cfg.seed)
    return torch.randint(vocab, (count, length), generator=g).tolist()


