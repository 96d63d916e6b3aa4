"""Training: a generic accelerate loop (`trainer`) and the recipes built on it (`distill`)."""

from .trainer import OptimConfig, TrainConfig, TrainResult, build_accelerator, train

__all__ = ["OptimConfig", "TrainConfig", "TrainResult", "build_accelerator", "train"]
