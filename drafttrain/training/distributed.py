"""Distributed set-up: the Accelerator, DeepSpeed/FSDP details, and how ranks agree.

Everything that differs between one process, DDP, DeepSpeed ZeRO and FSDP lives here, so the
loop reads the same for all of them. Without CUDA, DDP and DeepSpeed run over gloo on the CPU.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from datetime import timedelta
from typing import Any, Callable, TypeVar

import torch
import torch.distributed as dist
import torch.distributed.nn.functional  # noqa: F401  before any process group: see close_process_group
from accelerate import Accelerator
from accelerate.utils import DistributedType, InitProcessGroupKwargs, broadcast_object_list, gather_object

from ..errors import UserError
from .config import OptimConfig, TrainConfig

T = TypeVar("T")


def is_deepspeed_launch() -> bool:
    return os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"


def build_accelerator(cfg: TrainConfig):
    """An Accelerator for `cfg`, usable under `accelerate launch` (any config) and plain `python`.

    Without CUDA it trains on CPU: DDP over gloo (launch with `--multi_gpu --num_processes N`),
    and DeepSpeed over gloo too (DeepSpeed's own CPU path). wandb stays offline unless the user
    configured it.
    """
    if is_deepspeed_launch() and importlib.util.find_spec("deepspeed") is None:
        raise UserError("this launch config uses DeepSpeed, which is not installed; "
                        "pip install 'drafttrain[deepspeed]' or launch with recipes/accelerate/ddp.yaml")
    launched = int(os.environ.get("LOCAL_RANK", -1)) != -1
    no_cuda = not torch.cuda.is_available()
    init = {"timeout": timedelta(hours=2)}  # the main process evaluates while the others wait
    if launched and no_cuda and is_deepspeed_launch():
        init["backend"] = "gloo"
    log_with = None
    if cfg.report_to == "wandb":
        if not (os.environ.get("WANDB_MODE") or os.environ.get("WANDB_API_KEY")):
            os.environ["WANDB_MODE"] = "offline"
        log_with = "wandb"
    return Accelerator(
        cpu=no_cuda and not is_deepspeed_launch(),
        mixed_precision=cfg.mixed_precision,
        gradient_accumulation_steps=cfg.gradient_accumulation_steps,
        log_with=log_with,
        kwargs_handlers=[InitProcessGroupKwargs(**init)],
    )


@contextlib.contextmanager
def zero3_init_disabled(accelerator):
    """Load models whole on every rank, even under a ZeRO-3 config.

    accelerate registers its DeepSpeed config with transformers whatever `zero3_init_flag` says,
    and under ZeRO-3 `from_pretrained` then partitions every model it builds. The frozen target
    must stay whole (each rank runs it alone) and `accelerator.prepare` shards the draft itself.
    """
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if plugin is None:
        yield
        return
    from transformers.integrations import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    try:
        yield
    finally:
        plugin.set_deepspeed_weakref()


def is_sharded(accelerator) -> bool:
    """True when no single rank holds the full weights (DeepSpeed ZeRO-3, FSDP)."""
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        return accelerator.state.deepspeed_plugin.zero_stage == 3
    return accelerator.distributed_type == DistributedType.FSDP


def configure_deepspeed(accelerator, cfg: TrainConfig, optim: OptimConfig) -> None:
    """Fill the DeepSpeed config from ours, since we prepare no DataLoader and own the scheduler."""
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if plugin is None:
        return
    ds = plugin.deepspeed_config
    if ds.get("train_micro_batch_size_per_gpu", "auto") == "auto":
        ds["train_micro_batch_size_per_gpu"] = cfg.micro_batch_size
    if ds.get("gradient_clipping", "auto") == "auto":
        ds["gradient_clipping"] = float(optim.max_grad_norm or 0.0)
    zero = ds.setdefault("zero_optimization", {})
    if zero.get("stage") == 3:  # evaluation and export need the full 16-bit (or fp32) weights
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    if (zero.get("offload_optimizer") or {}).get("device") in ("cpu", "nvme"):
        # Our AdamW runs on the offloaded fp32 partitions; DeepSpeedCPUAdam would need a JIT build.
        ds.setdefault("zero_force_ds_cpu_optimizer", False)


# ----------------------------------------------------------------------------- ranks agreeing


def broadcast(accelerator, obj: Any) -> Any:
    """The main process's `obj` on every rank."""
    if accelerator.num_processes == 1:
        return obj
    return broadcast_object_list([obj], from_process=0)[0]


def on_main(accelerator, fn: Callable[[], T]) -> T:
    """`fn()` on the main process; every rank gets its result, or raises the UserError it raised.
    (A check only the main process can make - a lock, a file - must still stop every rank.)"""
    result, error = None, None
    if accelerator.is_main_process:
        try:
            result = fn()
        except UserError as e:
            error = str(e)
    result, error = broadcast(accelerator, (result, error))
    if error is not None:
        raise UserError(error)
    return result


def raise_if_any(accelerator, error: str | None) -> None:
    """Collective: every rank raises a UserError if ANY rank reports one (the first rank's message)."""
    if accelerator.num_processes > 1:
        errors = [e for e in gather_object([error]) if e is not None]
        error = errors[0] if errors else None
    if error is not None:
        raise UserError(error)


def answer_ranks(accelerator, *, lockstep: bool = False):
    """The launch's processes as the data pipeline sees them (`data.ranks.Ranks`), so that every
    rank writes a share of the target's answers. `lockstep`: a target sharded across the ranks,
    whose every forward they must run together."""
    from ..data.ranks import Ranks

    return Ranks(rank=accelerator.process_index, size=accelerator.num_processes,
                 broadcast=lambda obj: broadcast(accelerator, obj),
                 all_gather=lambda obj: gather_object([obj]) if accelerator.num_processes > 1 else [obj],
                 barrier=accelerator.wait_for_everyone, lockstep=lockstep)


def any_rank(accelerator, flag: torch.Tensor) -> bool:
    """Collective: True if the boolean tensor `flag` is true on any rank."""
    value = flag.detach().to(accelerator.device, torch.float32).reshape(1)
    if accelerator.num_processes > 1:
        value = accelerator.reduce(value, reduction="sum")
    return bool(value.item() > 0)


def close_process_group() -> None:
    """Tear the process group down before the interpreter does: left to exit, gloo's threads can
    die un-joined ("terminate called without an active exception", SIGABRT) after a finished run.

    Destroying frees the group only if nothing else holds it. `torch.distributed.nn.functional`
    binds the world group into ten default arguments when it is first imported (torch._dynamo
    imports it, which transformers does lazily); imported after the group exists, it keeps the
    group and its worker threads alive into interpreter shutdown, where a thread releasing the last
    collective's tensors aborts the process (5 runs in 72 of tests/data/answers_worker.py here).
    This module imports it first, before any group exists."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


# ----------------------------------------------------------------------------- full weights


def full_state_dict(accelerator, model) -> dict[str, torch.Tensor] | None:
    """CPU copies of the full weights on the main process (None elsewhere). Collective: every
    rank must call it, since ZeRO-3 / FSDP gather the shards."""
    if is_sharded(accelerator):
        state = accelerator.get_state_dict(model)
    else:
        state = accelerator.unwrap_model(model).state_dict() if accelerator.is_main_process else None
    if not accelerator.is_main_process:
        return None
    return {k: v.detach().to("cpu", copy=True).contiguous() for k, v in state.items()}


def broadcast_weights(accelerator, module: torch.nn.Module) -> None:
    """Collective: every rank's `module` (a plain copy on each rank, same shapes) takes the main
    process's weights and buffers, in place."""
    if accelerator.num_processes == 1:
        return
    with torch.no_grad():
        for tensor in module.state_dict().values():
            dist.broadcast(tensor, src=0)


def load_full_state_dict(module: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Strict load, except that a tied weight (e.g. an LM head sharing the embedding) may be
    missing from gathered state dicts that store shared tensors once."""
    result = module.load_state_dict(state, strict=False)
    if result.unexpected_keys:
        raise RuntimeError(f"unexpected weights: {result.unexpected_keys[:5]}")
    if result.missing_keys:
        params = dict(module.named_parameters(remove_duplicate=False))
        loaded = {params[k].data_ptr() for k in state if k in params}
        untied = [k for k in result.missing_keys if k not in params or params[k].data_ptr() not in loaded]
        if untied:
            raise RuntimeError(f"missing weights: {untied[:5]}")


__all__ = ["any_rank", "broadcast", "broadcast_weights", "build_accelerator", "close_process_group", "configure_deepspeed",
           "full_state_dict", "is_deepspeed_launch", "is_sharded", "load_full_state_dict", "on_main",
           "raise_if_any", "zero3_init_disabled"]
