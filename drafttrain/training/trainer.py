"""A generic accelerate training loop with atomic checkpoints, exact resume and best-by-tau selection.

The loop knows nothing about distillation: a recipe hands it the trainable module, a map-style
dataset with its collate function, `loss_fn(model, batch) -> (loss, logs)` and
`evaluate_fn(model) -> {"tau": ..., ...}`. Everything that makes a long run safe lives here:

- Data order is a pure function of (seed, epoch, position): each epoch is a seeded permutation cut
  into micro-batches, dealt to the ranks in turn (`MicroBatches`). So 2 processes x micro-batch 2
  see the same global batches as 1 process x micro-batch 2 x 2 accumulation steps, and a resumed
  run skips exactly the micro-batches already consumed.
- Checkpoints are written by `accelerator.save_state` into `checkpoints/.step-N.tmp`, completed
  with `trainer_state.json`, then renamed to `checkpoints/step-N`: a directory named `step-N`
  with a `trainer_state.json` is always complete, anything else is ignored (and cleaned up).
- Evaluation runs on the main process (other ranks wait); the weights with the best `tau`
  (mean accepted length, not the loss) are kept in `best/`, so the export is the best draft.
  Under ZeRO-3 / FSDP the full weights are gathered into a plain copy of the module first.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import re
import shutil
import time
import warnings
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Literal

import torch

from ..config import documented
from ..errors import UserError
from ..fileio import atomic_dir, atomic_write_json, atomic_write_text

CHECKPOINT_DIR = "checkpoints"
STATE_FILE = "trainer_state.json"
LOG_FILE = "train_log.jsonl"
BEST_DIR = "best"
BEST_WEIGHTS = "model.safetensors"
BEST_META = "best.json"
_STEP_DIR = re.compile(r"^step-(\d+)$")

LossFn = Callable[[torch.nn.Module, dict], "tuple[torch.Tensor, dict]"]
EvalFn = Callable[[torch.nn.Module], dict]


# ----------------------------------------------------------------------------- configs


@dataclass
class OptimConfig:
    lr: float = documented(3e-4, doc="Peak learning rate (AdamW), reached after the warm-up.")
    weight_decay: float = documented(
        0.0, doc="AdamW weight decay; never applied to biases and norm weights (1-D parameters).")
    betas: tuple[float, float] = documented((0.9, 0.999), doc="AdamW betas (beta1, beta2).")
    eps: float = documented(1e-8, doc="AdamW epsilon.")
    warmup_steps: int = documented(0, doc="Optimizer steps of linear warm-up from lr/(warmup_steps+1) to lr.")
    schedule: Literal["cosine", "linear", "constant"] = documented(
        "cosine", doc="Learning-rate decay after the warm-up, down to lr * min_lr_ratio at max_steps.")
    min_lr_ratio: float = documented(0.0, doc="Final learning rate as a fraction of lr (cosine and linear).")
    max_grad_norm: float | None = documented(
        1.0, doc="Clip the global gradient norm to this value; null or 0 disables clipping.")

    def validate(self) -> None:
        if not self.lr > 0:
            raise UserError(f"optim.lr must be > 0, got {self.lr}")
        if self.weight_decay < 0:
            raise UserError(f"optim.weight_decay must be >= 0, got {self.weight_decay}")
        if not all(0.0 <= b < 1.0 for b in self.betas):
            raise UserError(f"optim.betas must both be in [0, 1), got {list(self.betas)}")
        if self.warmup_steps < 0:
            raise UserError(f"optim.warmup_steps must be >= 0, got {self.warmup_steps}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise UserError(f"optim.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.max_grad_norm is not None and self.max_grad_norm < 0:
            raise UserError(f"optim.max_grad_norm must be >= 0 (or null), got {self.max_grad_norm}")


@dataclass
class TrainConfig:
    max_steps: int = documented(1000, doc="Optimizer steps to train for.")
    micro_batch_size: int = documented(4, doc="Examples per forward/backward pass on each process.")
    gradient_accumulation_steps: int = documented(
        1, doc="Micro-batches per optimizer step; the global batch is processes x micro_batch_size x this.")
    mixed_precision: Literal["no", "bf16", "fp16"] = documented(
        "no", doc="Autocast precision of the trained module (master weights stay float32); fp16 needs a GPU.")
    seed: int = documented(0, doc="Seed of the data order and of every random draw of the recipe.")
    log_every: int = documented(10, doc="Write a train_log.jsonl line (mean loss, lr, grad norm) every N steps.")
    eval_every: int = documented(
        100, doc="Evaluate (tau on held-out prompts) every N steps; 0: only before training and at the end.")
    checkpoint_every: int = documented(
        100, doc="Save a resumable checkpoint every N steps (and always at the end); 0: only at the end.")
    keep_checkpoints: int = documented(2, doc="Keep the newest N checkpoints; 0 keeps all.")
    keep_best: bool = documented(
        True, doc="Export the weights with the best evaluation tau (false: the last step's weights).")
    num_workers: int = documented(0, doc="DataLoader worker processes (0: load in the training process).")
    report_to: Literal["none", "wandb"] = documented(
        "none", doc="Also log to Weights & Biases (offline unless WANDB_MODE or WANDB_API_KEY is set).")
    wandb_project: str = documented("drafttrain", doc="wandb project name (report_to=wandb).")
    run_name: str | None = documented(None, doc="wandb run name; default: the output directory's name.")

    def validate(self) -> None:
        for key in ("max_steps", "micro_batch_size", "gradient_accumulation_steps", "log_every"):
            if getattr(self, key) < 1:
                raise UserError(f"train.{key} must be >= 1, got {getattr(self, key)}")
        for key in ("eval_every", "checkpoint_every", "keep_checkpoints", "num_workers"):
            if getattr(self, key) < 0:
                raise UserError(f"train.{key} must be >= 0, got {getattr(self, key)}")
        if self.mixed_precision == "fp16" and not torch.cuda.is_available():
            raise UserError("train.mixed_precision=fp16 needs a GPU; use bf16 or no on CPU")


# ----------------------------------------------------------------------------- accelerator


def is_deepspeed_launch() -> bool:
    return os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"


def build_accelerator(cfg: TrainConfig):
    """An Accelerator for `cfg`, usable under `accelerate launch` (any config) and plain `python`.

    Without CUDA it trains on CPU: DDP over gloo (launch with `--multi_gpu --num_processes N`),
    and DeepSpeed over gloo too (DeepSpeed's own CPU path). wandb stays offline unless the user
    configured it.
    """
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

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
    from accelerate.utils import DistributedType

    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        return accelerator.state.deepspeed_plugin.zero_stage == 3
    return accelerator.distributed_type == DistributedType.FSDP


def _configure_deepspeed(accelerator, cfg: TrainConfig, optim: OptimConfig) -> None:
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


# ----------------------------------------------------------------------------- optimizer, schedule


def build_optimizer(model: torch.nn.Module, cfg: OptimConfig) -> torch.optim.AdamW:
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    if not decay and not no_decay:
        raise ValueError("the model has no trainable parameters")
    groups = [{"params": decay, "weight_decay": cfg.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps)


def lr_factor(step: int, cfg: OptimConfig, max_steps: int) -> float:
    """Multiplier of `cfg.lr` for the optimizer step that follows `step` completed steps."""
    if step < cfg.warmup_steps:
        return (step + 1) / (cfg.warmup_steps + 1)
    if cfg.schedule == "constant":
        return 1.0
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, max_steps - cfg.warmup_steps))
    if cfg.schedule == "linear":
        shape = 1.0 - progress
    else:
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * shape


def build_scheduler(optimizer, cfg: OptimConfig, max_steps: int):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, cfg, max_steps))


# ----------------------------------------------------------------------------- data order


def epoch_permutation(n: int, seed: int, epoch: int) -> list[int]:
    g = torch.Generator().manual_seed(seed * 100_003 + epoch)
    return torch.randperm(n, generator=g).tolist()


class MicroBatches(torch.utils.data.Sampler):
    """This rank's micro-batches (lists of example indices), from its micro-batch `start` on, forever.

    An epoch is a seeded permutation of the examples, cut into whole global batches of
    world_size x gradient_accumulation_steps x micro_batch_size examples (the remainder is
    dropped, so every process count that gives the same global batch drops the same examples).
    Rank r's j-th micro-batch of an epoch holds positions [g*b, (g+1)*b) of the permutation,
    with g = j * world_size + r: with 2 processes the two ranks' j-th micro-batches are the
    1-process run's micro-batches 2j and 2j+1.
    """

    def __init__(self, n: int, micro_batch_size: int, world_size: int, rank: int, seed: int,
                 gradient_accumulation_steps: int = 1, start: int = 0):
        self.n, self.b, self.world, self.rank, self.seed, self.start = n, micro_batch_size, world_size, rank, seed, start
        global_batch = micro_batch_size * world_size * gradient_accumulation_steps
        self.per_epoch = (n // global_batch) * gradient_accumulation_steps  # this rank's micro-batches
        if self.per_epoch < 1:
            raise UserError(f"the training set has {n} examples, fewer than one global batch of {global_batch} "
                            f"({world_size} process(es) x micro_batch_size {micro_batch_size} x "
                            f"gradient_accumulation_steps {gradient_accumulation_steps}); add prompts or make "
                            "the batch smaller")

    def __iter__(self):
        u = self.start
        while True:
            epoch, j = divmod(u, self.per_epoch)
            perm = epoch_permutation(self.n, self.seed, epoch)
            for j in range(j, self.per_epoch):
                lo = (j * self.world + self.rank) * self.b
                yield perm[lo:lo + self.b]
            u = (epoch + 1) * self.per_epoch

    def __len__(self):  # endless; the loop stops at max_steps
        return 2**62


# ----------------------------------------------------------------------------- checkpoints on disk


def complete_checkpoints(output_dir: str | Path) -> list[tuple[int, Path]]:
    """(step, dir) of every complete checkpoint, oldest first. Temp and foreign dirs are ignored."""
    root = Path(output_dir) / CHECKPOINT_DIR
    found = []
    if root.is_dir():
        for p in root.iterdir():
            m = _STEP_DIR.match(p.name)
            if m and p.is_dir() and (p / STATE_FILE).is_file():
                found.append((int(m.group(1)), p))
    return sorted(found)


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    found = complete_checkpoints(output_dir)
    return found[-1][1] if found else None


def _remove_partial_checkpoints(output_dir: Path) -> None:
    root = output_dir / CHECKPOINT_DIR
    if root.is_dir():
        for p in root.iterdir():
            if p.name.startswith(".") and p.name.endswith(".tmp"):
                shutil.rmtree(p, ignore_errors=True)


def _prune(output_dir: Path, keep: int) -> None:
    if keep <= 0:
        return
    for _, path in complete_checkpoints(output_dir)[:-keep]:
        trash = path.with_name(f".{path.name}.deleting.tmp")
        os.replace(path, trash)  # no longer looks complete, even if the rmtree is interrupted
        shutil.rmtree(trash, ignore_errors=True)


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


def save_weights(state: dict[str, torch.Tensor], path: Path) -> None:
    from safetensors.torch import save_file

    save_file({k: v.clone() for k, v in state.items()}, str(path))  # clone: no shared storage


def load_weights(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


# ----------------------------------------------------------------------------- the loop


@dataclass
class TrainResult:
    step: int                    # optimizer steps done
    best_step: int               # step whose weights `model` holds (the last one if keep_best is off)
    best_metrics: dict           # evaluate_fn's result for those weights
    evals: list[dict]            # every evaluation: {"step": s, **metrics}, step 0 first
    model: torch.nn.Module | None  # a plain module with the chosen weights (main process; None elsewhere)
    resumed_from: int | None = None


@dataclass
class _State:
    step: int = 0
    best_step: int | None = None
    best_tau: float | None = None
    evals: list[dict] = field(default_factory=list)

    def to_json(self, cfg: TrainConfig, world_size: int) -> dict:
        per_step = cfg.micro_batch_size * cfg.gradient_accumulation_steps * world_size
        return {"step": self.step, "best_step": self.best_step, "best_tau": self.best_tau, "evals": self.evals,
                "data": {"micro_batches_per_rank": self.step * cfg.gradient_accumulation_steps,
                         "examples_seen": self.step * per_step, "world_size": world_size,
                         "micro_batch_size": cfg.micro_batch_size,
                         "gradient_accumulation_steps": cfg.gradient_accumulation_steps, "seed": cfg.seed}}


def train(
    accelerator,
    model: torch.nn.Module,
    dataset,
    collate_fn: Callable[[list], dict],
    loss_fn: LossFn,
    evaluate_fn: EvalFn,
    cfg: TrainConfig,
    optim: OptimConfig,
    output_dir: str | Path,
    *,
    run_config: dict | None = None,
) -> TrainResult:
    """Train `model` (its `requires_grad` parameters) for `cfg.max_steps` optimizer steps.

    `dataset` is map-style (`len`, integer indexing); `collate_fn` turns a list of its rows into a
    dict of tensors. The trainer moves tensors to the device and adds two ints to every batch:
    `step` (the optimizer step being computed) and `batch_index` (the micro-batch's position in
    the global data stream, identical for any process count), so a `loss_fn` can seed its own
    randomness reproducibly. `loss_fn` returns the micro-batch's mean loss and a dict of floats
    (the same keys every call), averaged into the log. `evaluate_fn` gets a plain module with the
    full weights, in eval mode under no_grad, on the main process only; it returns a dict with
    at least `tau` (higher is better) and JSON-friendly values.

    Started again with the same `output_dir`, it resumes from the newest complete checkpoint.
    """
    cfg.validate()
    optim.validate()
    output_dir = Path(output_dir)
    main = accelerator.is_main_process
    world, rank = accelerator.num_processes, accelerator.process_index

    if main:
        _remove_partial_checkpoints(output_dir)
    accelerator.wait_for_everyone()
    resume = latest_checkpoint(output_dir)

    # A plain copy holds gathered weights for evaluation/export when no rank holds them all.
    sharded = is_sharded(accelerator)
    shadow = copy.deepcopy(model) if sharded and main else None
    optimizer = build_optimizer(model, optim)
    scheduler = build_scheduler(optimizer, optim, cfg.max_steps)
    _configure_deepspeed(accelerator, cfg, optim)
    model, optimizer = accelerator.prepare(model, optimizer)
    # Our scheduler, stepped once per optimizer step: accelerate's wrapper would step it once
    # per process, which makes the schedule depend on the process count.
    accelerator.register_for_checkpointing(scheduler)

    state = _State()
    if resume is not None:
        accelerator.load_state(str(resume))
        saved = json.loads((resume / STATE_FILE).read_text())
        state = _State(step=saved["step"], best_step=saved["best_step"], best_tau=saved["best_tau"],
                       evals=saved["evals"])
        _warn_if_order_changed(saved.get("data", {}), cfg, world)
        if main:
            accelerator.print(f"resuming from {resume} (step {state.step})")
            _truncate_log(output_dir / LOG_FILE, state.step)
            _adopt_best_from_disk(output_dir, state)
    elif main:
        shutil.rmtree(output_dir / BEST_DIR, ignore_errors=True)  # from an earlier run that never checkpointed
        (output_dir / LOG_FILE).unlink(missing_ok=True)
    state = _broadcast(accelerator, state)

    def plain_model():
        """The module evaluate_fn and the export see: the unwrapped one, or the filled shadow."""
        if not sharded:
            return accelerator.unwrap_model(model) if main else None
        weights = full_state_dict(accelerator, model)  # collective: every rank gathers
        if main:
            load_full_state_dict(shadow, weights)
        return shadow

    def evaluate() -> None:
        target = plain_model()
        metrics = None
        if main:
            was_training = target.training
            target.eval()
            start = time.perf_counter()
            with torch.no_grad():
                metrics = dict(evaluate_fn(target))
            target.train(was_training)
            if "tau" not in metrics:
                raise TypeError("evaluate_fn must return a dict with a 'tau' entry")
            metrics["eval_seconds"] = round(time.perf_counter() - start, 3)
        metrics = _broadcast(accelerator, metrics)
        entry = {"step": state.step, **metrics}
        state.evals.append(entry)
        tau = float(metrics["tau"])
        improved = not cfg.keep_best or state.best_tau is None or tau > state.best_tau
        if improved:
            state.best_step, state.best_tau = state.step, tau
        if main:
            if improved and cfg.keep_best:
                weights = {k: v.detach().cpu() for k, v in target.state_dict().items()}
                with atomic_dir(output_dir / BEST_DIR, overwrite=True) as tmp:
                    save_weights(weights, tmp / BEST_WEIGHTS)
                    atomic_write_json(tmp / BEST_META, {"step": state.step, "metrics": metrics})
            _append_log(output_dir, {"type": "eval", **entry, "best_step": state.best_step})
            accelerator.log({f"eval/{k}": v for k, v in metrics.items() if isinstance(v, (int, float))},
                            step=state.step)
        accelerator.wait_for_everyone()

    def checkpoint() -> None:
        final = output_dir / CHECKPOINT_DIR / f"step-{state.step}"
        tmp = output_dir / CHECKPOINT_DIR / f".step-{state.step}.tmp"
        if main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        accelerator.wait_for_everyone()
        accelerator.save_state(str(tmp))
        accelerator.wait_for_everyone()
        if main:
            atomic_write_json(tmp / STATE_FILE, state.to_json(cfg, world))
            if final.exists():  # an identical step re-saved after a resume
                shutil.rmtree(final)
            os.replace(tmp, final)
            _prune(output_dir, cfg.keep_checkpoints)
        accelerator.wait_for_everyone()

    if cfg.report_to == "wandb":
        accelerator.init_trackers(cfg.wandb_project, config=run_config or {},
                                  init_kwargs={"wandb": {"name": cfg.run_name or output_dir.resolve().name,
                                                         "dir": str(output_dir)}})

    resumed_from = state.step if resume is not None else None
    if state.step == 0 and not state.evals:
        evaluate()  # step 0: the "before" figure, and a candidate for best

    from tqdm.auto import tqdm

    ga = cfg.gradient_accumulation_steps
    sampler = MicroBatches(len(dataset), cfg.micro_batch_size, world, rank, cfg.seed, ga, start=state.step * ga)
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, collate_fn=collate_fn,
                                         num_workers=cfg.num_workers)
    batches = iter(loader)
    bar = tqdm(total=cfg.max_steps, initial=state.step, desc="train", unit="step", disable=not main,
               dynamic_ncols=True)
    window: dict[str, list[float]] = {}
    window_seconds = 0.0
    model.train()
    while state.step < cfg.max_steps:
        grad_norm = None
        step_start = time.perf_counter()
        for micro in range(ga):
            batch = _to_device(next(batches), accelerator.device)
            batch["step"] = state.step
            batch["batch_index"] = (state.step * ga + micro) * world + rank
            with accelerator.accumulate(model):
                loss, logs = loss_fn(model, batch)
                accelerator.backward(loss)
                if micro == ga - 1 and not accelerator.sync_gradients:
                    raise RuntimeError("gradient accumulation fell out of step with the optimizer steps")
                if accelerator.sync_gradients:
                    max_norm = optim.max_grad_norm or float("inf")
                    grad_norm = accelerator.clip_grad_norm_(model.parameters(), max_norm)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            for k, v in {"loss": loss, **logs}.items():  # tensors stay on the device until the log line
                window.setdefault(k, []).append(v.detach() if torch.is_tensor(v) else float(v))
        lr = scheduler.get_last_lr()[0]
        scheduler.step()
        state.step += 1
        window_seconds += time.perf_counter() - step_start
        bar.update(1)

        if state.step % cfg.log_every == 0 or state.step == cfg.max_steps:
            keys = sorted(window)
            means = torch.tensor([sum(float(v) for v in window[k]) / len(window[k]) for k in keys],
                                 dtype=torch.float64, device=accelerator.device)
            means = accelerator.reduce(means, reduction="mean").tolist() if world > 1 else means.tolist()
            entry = {"type": "train", "step": state.step, "lr": lr, **dict(zip(keys, means)),
                     "grad_norm": None if grad_norm is None else float(grad_norm),
                     "steps_per_s": round(len(window.get("loss", [])) / ga / max(window_seconds, 1e-9), 4)}
            if main:
                _append_log(output_dir, entry)
                accelerator.log({k: v for k, v in entry.items() if isinstance(v, (int, float))}, step=state.step)
                bar.set_postfix(loss=f"{entry['loss']:.4f}", lr=f"{lr:.2e}")
            window, window_seconds = {}, 0.0
        if (cfg.eval_every and state.step % cfg.eval_every == 0) or state.step == cfg.max_steps:
            evaluate()
            if main:
                bar.set_postfix(tau=f"{state.evals[-1]['tau']:.3f}", best=f"{state.best_tau:.3f}")
        if (cfg.checkpoint_every and state.step % cfg.checkpoint_every == 0) or state.step == cfg.max_steps:
            checkpoint()
    bar.close()

    result_model = plain_model()  # the last step's weights (main process)
    best_metrics = next((e for e in reversed(state.evals) if e["step"] == state.best_step), None)
    if main and cfg.keep_best:
        best = output_dir / BEST_DIR
        load_full_state_dict(result_model, load_weights(best / BEST_WEIGHTS))
        if best_metrics is None:  # best/ was evaluated after max_steps of this run (max_steps lowered)
            best_metrics = {"step": state.best_step, **json.loads((best / BEST_META).read_text())["metrics"]}
    best_metrics = _broadcast(accelerator, best_metrics)
    if cfg.report_to == "wandb":
        accelerator.end_training()
    return TrainResult(step=state.step, best_step=state.best_step, best_metrics=best_metrics,
                       evals=state.evals, model=result_model, resumed_from=resumed_from)


# ----------------------------------------------------------------------------- helpers


def _to_device(batch: dict, device: torch.device) -> dict:
    return {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}


def _broadcast(accelerator, obj: Any) -> Any:
    if accelerator.num_processes == 1:
        return obj
    from accelerate.utils import broadcast_object_list

    return broadcast_object_list([obj], from_process=0)[0]


def _append_log(output_dir: Path, entry: dict) -> None:
    output_dir.mkdir(parents=True, exist_ok=True)
    with open(output_dir / LOG_FILE, "a") as f:
        f.write(json.dumps(entry, default=float) + "\n")


def _truncate_log(path: Path, step: int) -> None:
    """Drop log lines of steps after the checkpoint: the resumed run writes them again."""
    if not path.is_file():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by the crash
        if entry.get("step", 0) <= step:
            kept.append(line + "\n")
    atomic_write_text(path, "".join(kept))


def _adopt_best_from_disk(output_dir: Path, state: _State) -> None:
    """`best/` may be newer than the checkpoint (evaluated after it, before the crash). Those
    weights were really measured, so keep them as the best when they beat the checkpoint's."""
    meta_path = output_dir / BEST_DIR / BEST_META
    if not meta_path.is_file():
        return
    meta = json.loads(meta_path.read_text())
    tau = float(meta["metrics"]["tau"])
    if state.best_tau is None or tau > state.best_tau or meta["step"] == state.best_step:
        state.best_step, state.best_tau = meta["step"], tau


def _warn_if_order_changed(saved: dict, cfg: TrainConfig, world: int) -> None:
    now = {"world_size": world, "micro_batch_size": cfg.micro_batch_size,
           "gradient_accumulation_steps": cfg.gradient_accumulation_steps, "seed": cfg.seed}
    changed = [f"{k} {saved[k]} -> {v}" for k, v in now.items() if k in saved and saved[k] != v]
    if changed:
        warnings.warn("resuming with a different " + ", ".join(changed) + ": the data order after the "
                      "checkpoint differs from an uninterrupted run")


__all__ = ["OptimConfig", "TrainConfig", "TrainResult", "build_accelerator", "build_optimizer", "build_scheduler",
           "complete_checkpoints", "epoch_permutation", "full_state_dict", "is_sharded",
           "latest_checkpoint", "load_full_state_dict", "lr_factor", "MicroBatches", "train", "zero3_init_disabled"]
