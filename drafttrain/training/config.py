"""The two config sections every training run has: the optimizer (`optim.*`) and the loop (`train.*`)."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Literal

import torch

from ..config import documented
from ..errors import UserError


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
    keep_checkpoints: int = documented(
        2, doc="Keep the newest N checkpoints (plus the newest one whose weights passed an evaluation); 0 keeps all.")
    keep_best: bool = documented(
        True, doc="Export the weights with the best evaluation tau (false: the last step's weights).")
    num_workers: int = documented(0, doc="DataLoader worker processes (0: load in the training process).")
    report_to: Literal["none", "wandb"] = documented(
        "none", doc="Also log to Weights & Biases (offline unless WANDB_MODE or WANDB_API_KEY is set; "
                    "needs `pip install 'drafttrain[wandb]'`).")
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
        if self.report_to == "wandb" and importlib.util.find_spec("wandb") is None:
            raise UserError("train.report_to=wandb needs the wandb package; pip install 'drafttrain[wandb]' "
                            "or set train.report_to=none")


__all__ = ["OptimConfig", "TrainConfig"]
