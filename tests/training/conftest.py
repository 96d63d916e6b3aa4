"""Fixtures of the training tests: tiny target/draft directories, a prompt file, a response cache."""

from __future__ import annotations

import json
import random

import pytest
import torch


@pytest.fixture(scope="session")
def assets(tmp_path_factory) -> dict[str, str]:
    """A 2-layer target, an unrelated 1-layer draft with the same tokenizer, a draft with a foreign
    vocabulary, 120 prompts, and one response cache for every run of the session."""
    from tiny import save_pair, tiny_lm, tiny_tokenizer

    root = tmp_path_factory.mktemp("distill_assets")
    out = {
        "target": save_pair(root / "target", tiny_lm(seed=0, layers=2, dtype=torch.float32), tiny_tokenizer()),
        "draft": save_pair(root / "draft", tiny_lm(seed=1, layers=1, dtype=torch.float32), tiny_tokenizer()),
        "foreign": save_pair(root / "foreign", tiny_lm(seed=2, layers=1, vocab_size=80, dtype=torch.float32),
                             tiny_tokenizer(vocab_size=80)),
        "prompts": str(root / "prompts.jsonl"),
        "cache": str(root / "cache"),
    }
    rng = random.Random(0)
    with open(out["prompts"], "w") as f:
        for i in range(120):
            words = " ".join(f"w{rng.randrange(3, 64)}" for _ in range(rng.randrange(2, 8)))
            f.write(json.dumps({"id": i, "prompt": words}) + "\n")
    return out


@pytest.fixture(scope="session")
def distilled(assets, tmp_path_factory):
    """One finished run of recipes/distill.py on the tiny config (60 steps, checkpoints 50 and 60).
    Tests read it; a test that changes a run works on a copy (`copy_run`)."""
    from training_helpers import load_recipe, recipe_args

    out = tmp_path_factory.mktemp("distilled") / "run"
    assert load_recipe().main(recipe_args(assets, out)) == 0
    return out
