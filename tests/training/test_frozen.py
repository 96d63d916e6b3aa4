"""A frozen target sharded across ranks (training.frozen): the same numbers as the whole model.

FSDP2 runs here on 2 CPU processes over gloo (accelerate itself falls back to DDP without GPUs,
so the recipe's ZeRO-3 test in tests/eagle3 covers the launched path)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from drafttrain.decoding.engines.static import static_support
from drafttrain.training.frozen import gathered, is_sharded_module, local_fraction
from tiny import tiny_lm

WORKER = Path(__file__).with_name("frozen_worker.py")


def test_an_unsharded_model_is_left_alone():
    model = tiny_lm()
    assert not is_sharded_module(model) and local_fraction(model) == 1.0
    with gathered(model, model.lm_head):  # a no-op, not a collective
        assert model.lm_head.weight.shape == (64, 32)


@pytest.mark.slow
def test_fsdp2_sharded_target_matches_the_whole_one(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                          str(WORKER), str(tmp_path)], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for report in reports:
        assert report["sharded"] and report["local_fraction"] <= 0.55, report  # each rank holds about half
        assert report["logits_equal"] and report["hidden_equal"], report     # bit-identical forward
        assert report["head_equal"] and report["embedding_equal"], report    # gathered() gives full weights
        for tree, tokens in report["speculative"].items():                   # lossless on a sharded target
            assert tokens == report["reference"], (tree, tokens, report["reference"])
    assert reports[0]["speculative"] == reports[1]["speculative"]


def test_the_static_engine_declines_a_sharded_target():
    model = tiny_lm()
    next(model.parameters()).ds_id = 0  # what a ZeRO-3 partitioned parameter carries
    assert "sharded" in static_support(model)
