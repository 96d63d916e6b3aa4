"""A frozen model sharded across ranks: each GPU holds 1/N of a target too large to copy whole.

Drafters that read the target's own features (EAGLE-3) run a frozen target beside the draft at
every step. Under an FSDP or ZeRO-3 launch `shard_frozen` splits it the same way the trainable
model is split: its parameters are partitioned across ranks and gathered layer by layer inside
each forward, then freed again. Nothing of it trains, so no gradients or optimizer state exist.

The price is lockstep: every forward of a sharded model is a collective, so every rank must run
the same forwards in the same order (the same prompts, greedy or seeded sampling, the eager
engine). Whatever reads a weight outside a forward (the draft's initial LM head, the teacher's
rows, the embedding) goes through `gathered`.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from accelerate.utils import DistributedType
from torch import nn

from ..models import is_sharded_module


def shard_frozen(accelerator, model: nn.Module) -> nn.Module:
    """Shard the frozen `model` (whole, on any device) across the ranks of `accelerator`'s FSDP or
    DeepSpeed ZeRO-3 launch, onto `accelerator.device`. Collective; returns `model` itself."""
    model.requires_grad_(False)
    model.eval()
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        _zero3(model, accelerator.device)
    elif accelerator.distributed_type == DistributedType.FSDP:
        fsdp2(model, accelerator.device)
    else:
        raise ValueError(f"sharding needs an FSDP or DeepSpeed ZeRO-3 launch, not {accelerator.distributed_type}")
    return model


def fsdp2(model: nn.Module, device: torch.device) -> None:
    """FSDP2 (`fully_shard`): each decoder layer is one unit (gathered for its own forward), the
    rest (embedding, final norm, LM head) the root unit."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    layer_classes = set(getattr(model, "_no_split_modules", None) or ())
    for module in model.modules():
        if type(module).__name__ in layer_classes:
            fully_shard(module, mesh=mesh, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, reshard_after_forward=True)


def _zero3(model: nn.Module, device: torch.device) -> None:
    """DeepSpeed ZeRO-3 with no optimizer: partitions now, gathers each module for its forward.
    The engine is kept on the model (its hooks need it alive) but never called itself."""
    import deepspeed

    dtype = next(model.parameters()).dtype
    hidden = getattr(getattr(model, "config", None), "hidden_size", None) or 1024
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 10 * hidden,
                              "stage3_prefetch_bucket_size": int(0.9 * hidden * hidden)},
        "bf16": {"enabled": dtype == torch.bfloat16},
        "fp16": {"enabled": dtype == torch.float16},
    }
    # Partition parameter by parameter (each moved to the device, then cut): never the whole model on one GPU.
    deepspeed.zero.Init(module=model, config_dict_or_path=config)
    for module in model.modules():  # buffers (rotary tables) are not partitioned: each rank keeps them whole
        for name, buffer in module.named_buffers(recurse=False):
            if buffer is not None:
                module._buffers[name] = buffer.to(device)
    engine, *_ = deepspeed.initialize(model=model, config=config)
    model.__dict__["_drafttrain_zero3_engine"] = engine  # not a submodule: no state dict, no recursion


@contextlib.contextmanager
def gathered(model: nn.Module, *modules: nn.Module) -> Iterator[None]:
    """Inside, `modules` (submodules of `model`, not decoder layers) hold their full weights on every
    rank, read-only. A no-op for an unsharded model. Collective when sharded."""
    if not is_sharded_module(model):
        yield
        return
    params = list({id(p): p for m in modules for p in m.parameters(recurse=False)}.values())  # tied: once
    if any(hasattr(p, "ds_id") for p in params):
        import deepspeed

        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            yield
        return
    # FSDP2: the root unit owns everything outside the decoder layers.
    model.unshard()
    try:
        yield
    finally:
        model.reshard()


def local_fraction(model: nn.Module) -> float:
    """The share of `model`'s parameters this rank holds (1.0 unsharded)."""
    full = local = 0
    for p in model.parameters():
        n = int(p.ds_numel) if hasattr(p, "ds_numel") else p.numel()
        full += n
        if hasattr(p, "ds_tensor"):
            local += p.ds_tensor.numel()
        elif hasattr(p, "to_local"):
            local += p.to_local().numel()
        else:
            local += n
    return local / max(full, 1)


__all__ = ["gathered", "is_sharded_module", "local_fraction", "shard_frozen"]
