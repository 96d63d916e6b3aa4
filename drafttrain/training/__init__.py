"""Training: the recipe skeleton (`recipe`), the generic loop (`trainer`) and what keeps a long run
safe (`checkpoints`, `run_dir`, `sampler`, `distributed`, and `worker`, a launched recipe process).
The recipes themselves live in `recipes/`.

The names below load on first use, not with the package: `python -m drafttrain.training.worker`
imports this package first, and must be running before torch is imported (a Ctrl-C during those
seconds is the worker's to answer), as `drafttrain launch` must be quick to start."""

from __future__ import annotations

import importlib

_HOMES = {"OptimConfig": "config", "TrainConfig": "config", "build_accelerator": "distributed",
          "Recipe": "recipe", "RecipeConfig": "recipe", "RecipeEvalConfig": "recipe", "recipe_main": "recipe",
          "TrainResult": "trainer", "train": "trainer"}


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_HOMES[name]}", __name__), name)


__all__ = ["OptimConfig", "Recipe", "RecipeConfig", "RecipeEvalConfig", "TrainConfig", "TrainResult",
           "build_accelerator", "recipe_main", "train"]
