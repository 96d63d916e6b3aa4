"""The two config sections every training run has: the optimizer (`optim.*`) and the loop (`train.*`)."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Literal

import torch

from ..config import check_settings, setting
from ..errors import UserError


@dataclass
class OptimConfig:
    lr: float = setting(3e-4, doc="Peak learning rate (AdamW), reached after the warm-up.", above=0)
    weight_decay: float = setting(
        0.0, doc="AdamW weight decay; never applied to biases and norm weights (1-D parameters).", at_least=0)
    betas: tuple[float, float] = setting((0.9, 0.999), doc="AdamW betas (beta1, beta2).", at_least=0, below=1)
    eps: float = setting(1e-8, doc="AdamW epsilon.")
    warmup_steps: int = setting(0, doc="Optimizer steps of linear warm-up from lr/(warmup_steps+1) to lr.",
                                 at_least=0)
    schedule: Literal["cosine", "linear", "constant"] = setting(
        "cosine", doc="Learning-rate decay after the warm-up, down to lr * min_lr_ratio at max_steps.")
    min_lr_ratio: float = setting(0.0, doc="Final learning rate as a fraction of lr (cosine and linear).",
                                   at_least=0, at_most=1)
    max_grad_norm: float | None = setting(
        1.0, doc="Clip the global gradient norm to this value; null or 0 disables clipping.", at_least=0)

    def validate(self) -> None:
        check_settings(self, lambda key: f"optim.{key}")



@dataclass
class TrainConfig:
    max_steps: int = setting(1000, doc="Optimizer steps to train for.", at_least=1)
    micro_batch_size: int = setting(4, doc="Examples per forward/backward pass on each process.", at_least=1)
    gradient_accumulation_steps: int = setting(
        1, doc="Micro-batches per optimizer step; the global batch is processes x micro_batch_size x this.",
        at_least=1)
    mixed_precision: Literal["no", "bf16", "fp16"] = setting(
        "no", doc="Autocast precision of the trained module (master weights stay float32); fp16 needs a GPU.")
    seed: int = setting(0, doc="Seed of the data order and of every random draw of the recipe.")
    log_every: int = setting(10, doc="Write a train_log.jsonl line (mean loss, lr, grad norm) every N steps.",
                             at_least=1)
    eval_every: int = setting(
        100, doc="Evaluate (tau on held-out prompts) every N steps; 0: only before training and at the end.",
        at_least=0)
    checkpoint_every: int = setting(
        100, doc="Save a resumable checkpoint every N steps (and always at the end); 0: only at the end.",
        at_least=0)
    keep_checkpoints: int = setting(
        2, doc="Keep the newest N checkpoints (plus the newest one whose weights passed an evaluation); 0 keeps all.",
        at_least=0)
    keep_best: bool = setting(
        True, doc="Export the weights with the best evaluation tau (false: the last step's weights).")
    num_workers: int = setting(0, doc="DataLoader worker processes (0: load in the training process).",
                               at_least=0)
    report_to: Literal["none", "wandb"] = setting(
        "none", doc="Also log to Weights & Biases (offline unless WANDB_MODE or WANDB_API_KEY is set; "
                    "needs `pip install 'drafttrain[wandb]'`).")
    wandb_project: str = setting("drafttrain", doc="wandb project name (report_to=wandb).")
    run_name: str | None = setting(None, doc="wandb run name; default: the output directory's name.")

    def validate(self) -> None:
        check_settings(self, lambda key: f"train.{key}")
        if self.mixed_precision == "fp16" and not torch.cuda.is_available():
            raise UserError("train.mixed_precision=fp16 needs a GPU; use bf16 or no on CPU")
        if self.report_to == "wandb" and importlib.util.find_spec("wandb") is None:
            raise UserError("train.report_to=wandb needs the wandb package; pip install 'drafttrain[wandb]' "
                            "or set train.report_to=none")


__all__ = ["OptimConfig", "TrainConfig"]
