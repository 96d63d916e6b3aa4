"""What every recipe's export shares (`Recipe.export_with_served_row`, `trained_info`,
`card_record`): final/ written once without vLLM, and once more with the served row after the
recipe's own where vLLM serves the export. And how a recipe declares itself: `Recipe[Config]`,
the shared settings re-declared with their helpers, its own checks in `validate_own`."""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from types import SimpleNamespace

import pytest

from drafttrain.config import describe_config
from drafttrain.data.config import DataConfig, PromptSourceConfig
from drafttrain.errors import UserError
from drafttrain.training import recipe as recipe_module
from drafttrain.training.recipe import (Recipe, RecipeConfig, RecipeEvalConfig, held_out_eval, run_directory,
                                        training_data)


def bare_recipe(tmp_path) -> Recipe:
    r = Recipe(SimpleNamespace(target="T", export_dtype="float32", eval=SimpleNamespace(max_new_tokens=8),
                               train=SimpleNamespace(keep_best=True)))
    r.out, r.prompts, r.eos_ids = Path(tmp_path), ["p0", "p1"], [2]
    return r


def test_without_vllm_final_is_written_once_without_a_served_row(tmp_path, monkeypatch):
    calls, written = [], []
    monkeypatch.setattr(recipe_module, "served_row", lambda *a, **kw: calls.append((a, kw)))
    bare_recipe(tmp_path).export_with_served_row(written.append, "draft", 3)
    assert written == [[]]
    (export, kind, target, prompts), kw = calls[0]
    assert (export, kind, target, prompts) == (tmp_path / "final", "draft", "T", ["p0", "p1"])
    assert kw == {"dtype": "float32", "num_draft_tokens": 3, "max_new_tokens": 8, "eos_token_ids": {2}}


def test_with_vllm_final_is_written_again_with_the_served_row_last(tmp_path, monkeypatch):
    seen = []

    def served(export, kind, target, prompts, **kw):
        seen.append(target)
        return {"drafter": "served"}

    monkeypatch.setattr(recipe_module, "served_row", served)
    written = []
    bare_recipe(tmp_path).export_with_served_row(written.append, "medusa", 2, verifier="V",
                                                 beside=({"drafter": "chain"},))
    assert written == [[], [{"drafter": "chain"}, {"drafter": "served"}]] and seen == ["V"]


def test_the_card_names_the_exported_weights_and_the_record_holds_the_plans(tmp_path):
    r = bare_recipe(tmp_path)
    info = r.trained_info(SimpleNamespace(step=20, best_step=10), {})
    assert info == {"training steps": 20, "exported weights": "step 10 (best held-out tau)", "held-out prompts": 2}
    chain = {"tau": 2.0, "acceptance_rate": 0.5, "per_position_acceptance": [0.5], "num_draft_tokens": 1}
    assert r.card_record(chain, {"cpu": 1})["plans"] == {"cpu": 1}



@dataclass
class OwnConfig(RecipeConfig):
    """A recipe's config as the recipes declare theirs (module level: describe_config resolves its types)."""

    output_dir: str = run_directory("final/ (the own drafter)")
    data: DataConfig = training_data("Own note.")
    eval: RecipeEvalConfig = held_out_eval()

    def validate_own(self) -> None:
        raise UserError(f"own check of {self.output_dir}")


def test_a_recipe_names_its_config_once_and_checks_it_after_the_shared_settings(tmp_path, monkeypatch):
    """`Recipe[Config]` is the recipe's config_class; `validate_own` runs after the shared checks
    (paths expanded), and the shared settings' docs name the recipe's own exports."""

    class OwnRecipe(Recipe[OwnConfig]):
        pass

    class Later(OwnRecipe):
        pass

    assert OwnRecipe.config_class is OwnConfig and Later.config_class is OwnConfig
    assert Recipe.config_class is RecipeConfig
    docs = {f.name: f.metadata["doc"] for f in fields(OwnConfig)}
    assert "best/, final/ (the own drafter), eval/. Started again" in docs["output_dir"]
    assert docs["data"] == "Prompts and the target's answers to them. Own note."
    assert docs["eval"] == {f.name: f.metadata["doc"] for f in fields(RecipeConfig)}["eval"]
    assert "final/ (the own drafter)" in describe_config(OwnConfig)
    (tmp_path / "t").mkdir()
    monkeypatch.setenv("RUNS", str(tmp_path))
    cfg = OwnConfig(output_dir="${RUNS}/x", target=str(tmp_path / "t"))
    cfg.data.sources = [PromptSourceConfig(path="p.jsonl")]
    with pytest.raises(UserError, match=f"^own check of {tmp_path}/x$"):
        cfg.validate()
