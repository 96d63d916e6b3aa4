"""What every recipe's export shares (`Recipe.export_with_served_row`, `trained_info`,
`card_record`): final/ written once without vLLM, and once more with the served row after the
recipe's own where vLLM serves the export."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from drafttrain.training import recipe as recipe_module
from drafttrain.training.recipe import Recipe


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
