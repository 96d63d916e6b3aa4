"""Two processes (DDP, DeepSpeed ZeRO-2, ZeRO-3) end with the weights of one process on the same global batch.

One process with micro-batch 2 and 2 accumulation steps sees exactly the global batches of two
processes with micro-batch 2 each (see `MicroBatches`), so the runs differ only in the order of
float additions. On-policy sampling is off, and the tiny Llamas have no dropout. The processes
run on the CPU over gloo; DeepSpeed compiles a small communication op on its very first start
(about a minute, then cached in TORCH_EXTENSIONS_DIR). And a closed process group is really freed,
whatever was imported after it began (`close_process_group`).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys

import pytest
from training_helpers import (assert_same_weights, load_weights, recipe_args, run_launched_recipe,
                              run_python_recipe)

COMMON = ["train.max_steps=6", "train.micro_batch_size=2", "train.eval_every=0", "train.checkpoint_every=3",
          "train.keep_best=false", "train.log_every=1", "optim.warmup_steps=2", "optim.max_grad_norm=0.5",
          "eval.num_prompts=2"]


@pytest.fixture(scope="module")
def reference(assets, tmp_path_factory):
    out = tmp_path_factory.mktemp("one_process") / "run"
    result = run_python_recipe(recipe_args(assets, out, *COMMON, "train.gradient_accumulation_steps=2"))
    assert result.returncode == 0, result.stderr[-3000:]
    return out


FREED_AFTER_CLOSE = """
import gc, sys, weakref
import torch.distributed as dist
from drafttrain.training.distributed import close_process_group
dist.init_process_group("gloo", init_method=sys.argv[1], rank=0, world_size=1)
group = weakref.ref(dist.distributed_c10d._get_default_group())
import torch._dynamo  # what a transformers model's first load imports, after the group exists
close_process_group()
gc.collect()
print("freed" if group() is None else "alive")
"""


def test_closing_the_process_group_frees_it_after_torch_dynamo_is_imported(tmp_path):
    """A group still alive after close_process_group keeps gloo's threads into interpreter shutdown,
    where they can abort a finished run (see its docstring). A fresh interpreter: this one has
    imported torch._dynamo long ago."""
    run = subprocess.run([sys.executable, "-c", FREED_AFTER_CLOSE, f"file://{tmp_path / 'store'}"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split()[-1] == "freed"


def train_losses(out) -> list[float]:
    lines = (out / "train_log.jsonl").read_text().splitlines()
    return [e["loss"] for e in map(json.loads, lines) if e["type"] == "train"]


def launch(config: str, args: list[str]):
    result = run_launched_recipe(config, 2, args)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return result


@pytest.mark.slow
@pytest.mark.parametrize("config", ["ddp.yaml", "deepspeed_zero2.yaml", "deepspeed_zero3.yaml"])
def test_two_processes_end_with_the_weights_of_one(config, reference, assets, tmp_path):
    out = tmp_path / "run"
    args = recipe_args(assets, out, *COMMON)
    launch(config, args)
    assert_same_weights(load_weights(out / "final"), load_weights(reference / "final"), rtol=1e-5, atol=1e-6)
    assert train_losses(out) == pytest.approx(train_losses(reference), rel=1e-5)
    assert json.loads((out / "eval" / "final.json").read_text())["tau"] == \
        json.loads((reference / "eval" / "final.json").read_text())["tau"]

    if config == "deepspeed_zero3.yaml":
        # Resuming reads DeepSpeed's sharded checkpoint: drop the last one and run again.
        shutil.rmtree(out / "checkpoints" / "step-6")
        shutil.rmtree(out / "final")
        result = launch(config, args)
        assert "resuming from" in result.stdout
        assert_same_weights(load_weights(out / "final"), load_weights(reference / "final"), rtol=1e-5, atol=1e-6)


def tree_bytes(root) -> dict[str, bytes]:
    return {str(f.relative_to(root)): f.read_bytes() for f in sorted(root.rglob("*")) if f.is_file()}


@pytest.mark.slow
def test_two_processes_write_the_answers_of_one(assets, tmp_path):
    """Under `accelerate launch` every rank writes a share of the target's answers (data.shards) into
    the cache entry one process writes, byte for byte; the log says how fast answers were written."""
    common = ["train.max_steps=2", "train.eval_every=0", "train.checkpoint_every=2", "eval.num_prompts=2",
              "data.generation_batch_size=8", "data.store_topk=4"]
    one = run_python_recipe(recipe_args(assets, tmp_path / "one", *common, f"data.cache_dir={tmp_path / 'c1'}"))
    assert one.returncode == 0, one.stderr[-3000:]
    two = launch("ddp.yaml", recipe_args(assets, tmp_path / "two", *common, f"data.cache_dir={tmp_path / 'c2'}"))
    assert tree_bytes(tmp_path / "c2") == tree_bytes(tmp_path / "c1")
    per_rank = [int(n) for n in re.search(r"chunks written per rank \[(\d+), (\d+)\]", two.stdout).groups()]
    assert min(per_rank) >= 1 and abs(per_rank[0] - per_rank[1]) <= 1  # about half each
    assert re.search(r"\(\d+\.\d tokens/s\) by 2 process", two.stdout)
