"""The GPU-sized recipes (recipes/configs/smollm2_*_gpu.yaml) load and validate like the shipped demo
configs, share one data section (the target's answers are written once for all three), let the
answer batch be measured, and stay within the sizes their comments reason from."""

from __future__ import annotations

import pytest
from tiny import save_pair, tiny_lm, tiny_tokenizer
from training_helpers import REPO

from drafttrain.config import config_to_dict, load_config
from recipes.distill import DistillConfig
from recipes.train_eagle3 import Eagle3RecipeConfig

CONFIGS = REPO / "recipes" / "configs"
GPU = {"smollm2_distill_gpu.yaml": DistillConfig, "smollm2_eagle3_gpu.yaml": Eagle3RecipeConfig,
       "smollm2_parallel_gpu.yaml": DistillConfig}


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return save_pair(tmp_path_factory.mktemp("gpu-configs") / "target", tiny_lm(), tiny_tokenizer())


def load(name: str, target, tmp_path):
    overrides = ["output_dir=" + str(tmp_path / "run"), f"target={target}", f"data.cache_dir={tmp_path / 'cache'}"]
    if "parallel" in name:
        overrides.append(f"draft.path={target}")  # the distillation's final draft, in a real run
    cfg = load_config(GPU[name], CONFIGS / name, overrides)
    cfg.validate()
    return cfg


@pytest.mark.parametrize("name", sorted(GPU))
def test_gpu_configs_load_and_validate(name, target, tmp_path):
    cfg = load(name, target, tmp_path)
    data = cfg.data
    assert data.generation_batch_size is None and data.generator == "drafttrain"   # the batch is measured
    assert data.max_response_tokens == 128 and 4000 <= sum(s.num_prompts for s in data.sources) <= 6000
    assert {s.kind for s in data.sources} == {"jsonl", "self_instruct"}
    assert (500 if "parallel" in name else 1000) <= cfg.train.max_steps <= 2000
    if "parallel" in name:
        assert cfg.draft.parallel_tokens == 4


def test_gpu_configs_share_their_data_section(target, tmp_path):
    sections = [config_to_dict(load(name, target, tmp_path).data) for name in sorted(GPU)]
    assert sections[0] == sections[1] == sections[2]
