"""Training: the recipe skeleton (`recipe`), the generic loop (`trainer`) and what keeps a long run
safe (`checkpoints`, `run_dir`, `sampler`, `distributed`). The recipes themselves live in `recipes/`."""

from .config import OptimConfig, TrainConfig
from .distributed import build_accelerator
from .recipe import Recipe, RecipeConfig, RecipeEvalConfig, recipe_main
from .trainer import TrainResult, train

__all__ = ["OptimConfig", "Recipe", "RecipeConfig", "RecipeEvalConfig", "TrainConfig", "TrainResult",
           "build_accelerator", "recipe_main", "train"]
