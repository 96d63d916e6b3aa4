"""The Gemma-3 demo recipes (recipes/configs/gemma3_*_demo.yaml) end to end on a tiny random
Gemma-3 shaped like Gemma-3-270M where their choices depend on it: 18 layers in its sliding/global
pattern, a vocabulary above the 16k EAGLE-3 draft vocabulary, a base tokenizer with `<unusedN>`
tokens and no chat template. Only sizes (steps, data, lengths) are overridden; what each config
chooses for Gemma (the draft's layers, the parallel draft's mask, the heads' shared LM head, the
EAGLE-3 vocabulary and feature layers) runs as written."""

from __future__ import annotations

import json
import random

import pytest
from safetensors import safe_open
from tiny import save_pair, tiny_gemma3_270m, tiny_gemma3_tokenizer
from training_helpers import REPO

import recipes.distill as distill_recipe
import recipes.train_eagle3 as eagle3_recipe
import recipes.train_heads as heads_recipe
from drafttrain.kinds.parallel_lm.model import parallel_info

CONFIGS = REPO / "recipes" / "configs"
VOCAB = 40000
# The sizes of a few-second run; every other setting is the demo config's.
SMALL = ["data.heldout_size=4", "data.max_response_tokens=8", "data.max_seq_len=40", "train.max_steps=4",
         "train.micro_batch_size=4", "train.log_every=2", "train.eval_every=4", "train.checkpoint_every=4",
         "optim.warmup_steps=1", "eval.num_prompts=2", "eval.max_new_tokens=8"]


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma3-demo")
    save_pair(root / "target", tiny_gemma3_270m(), tiny_gemma3_tokenizer(VOCAB))
    rng = random.Random(0)
    rows = [{"id": i, "prompt": " ".join(f"w{rng.randrange(10, 200)}" for _ in range(rng.randrange(3, 9)))}
            for i in range(24)]
    (root / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def run(recipe, config: str, gemma, out, *overrides: str) -> None:
    argv = ["--config", str(CONFIGS / config), f"output_dir={out}", f"target={gemma / 'target'}",
            f"data.sources=[{{kind: jsonl, path: {gemma / 'prompts.jsonl'}}}]", f"data.cache_dir={gemma / 'cache'}",
            *SMALL, *overrides]
    assert recipe.main(argv) == 0


@pytest.mark.parametrize("parallel", [False, True])
def test_distill_demo_on_a_tiny_gemma3(gemma, tmp_path, parallel):
    """copy:6's probe picks layers 0-5 on the real model (the config says why); a random tiny model has
    no copying circuit to find, so those layers are named here. The parallel draft's mask is the
    config's <unused0>, exported as pard_token."""
    extra = ["draft.parallel_tokens=4"] if parallel else []
    run(distill_recipe, "gemma3_distill_demo.yaml", gemma, tmp_path / "run",
        "draft.from_target_layers=0,1,2,3,4,5", *extra)
    config = json.loads((tmp_path / "run" / "final" / "config.json").read_text())
    assert config["num_hidden_layers"] == 6 and config["model_type"] == "gemma3_text"
    assert config["layer_types"] == ["sliding_attention"] * 5 + ["full_attention"]
    info = parallel_info(type("C", (), config))
    assert (info and info["pard_token"]) == (tiny_gemma3_tokenizer(VOCAB).convert_tokens_to_ids("<unused0>")
                                             if parallel else None)


def test_heads_demo_on_a_tiny_gemma3_shares_one_lm_head(gemma, tmp_path):
    run(heads_recipe, "gemma3_heads_demo.yaml", gemma, tmp_path / "run", "eval.tree_nodes=4")
    final = tmp_path / "run" / "final"
    config = json.loads((final / "config.json").read_text())
    assert config["original_lm_head"] is True and config["num_heads"] == 3
    with safe_open(str(final / "model.safetensors"), "pt") as f:
        heads = {k: f.get_slice(k).get_shape() for k in f.keys() if "lm_head" in k}
    assert heads == {"lm_heads.0.weight": [VOCAB, 32]}


def test_eagle3_demo_on_a_tiny_gemma3(gemma, tmp_path):
    run(eagle3_recipe, "gemma3_eagle3_demo.yaml", gemma, tmp_path / "run")
    config = json.loads((tmp_path / "run" / "final" / "config.json").read_text())
    assert config["draft_vocab_size"] == 16384 and config["drafttrain"]["aux_layer_ids"] == [2, 9, 15]
