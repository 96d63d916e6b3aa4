"""Helpers of the training tests: recipe command lines, subprocess runners, weight comparisons."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "recipes" / "distill.py"
TINY_CONFIG = REPO / "recipes" / "configs" / "tiny_test.yaml"
ACCELERATE_CONFIGS = REPO / "recipes" / "accelerate"


def recipe_args(assets: dict, output_dir, *overrides: str) -> list[str]:
    return ["--config", str(TINY_CONFIG), f"output_dir={output_dir}", f"target={assets['target']}",
            f"draft.path={assets['draft']}", f"data.sources=[{{kind: jsonl, path: {assets['prompts']}}}]",
            f"data.cache_dir={assets['cache']}", *overrides]


def load_recipe():
    """recipes/distill.py as a module, to call its `main(argv)` in-process."""
    import recipes.distill

    return recipes.distill


def subprocess_env() -> dict:
    env = dict(os.environ)
    env.update(PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""), TOKENIZERS_PARALLELISM="false",
               HF_HUB_OFFLINE="1", WANDB_MODE="offline", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return env


def run_python_recipe(args: list[str], timeout: float = 120, recipe: Path = RECIPE) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(recipe), *args], capture_output=True, text=True,
                          env=subprocess_env(), timeout=timeout, cwd=REPO)


def run_launched_recipe(accelerate_config: str, num_processes: int, args: list[str], timeout: float = 300,
                        recipe: Path = RECIPE) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(ACCELERATE_CONFIGS / accelerate_config), "--num_processes", str(num_processes),
           "--main_process_port", str(free_port()), str(recipe), *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=subprocess_env(), timeout=timeout, cwd=REPO)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def load_weights(model_dir) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(Path(model_dir) / "model.safetensors"))


def assert_same_weights(a: dict, b: dict, rtol: float = 0.0, atol: float = 0.0) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=rtol, atol=atol, msg=lambda m, k=k: f"{k}: {m}")
