"""Long answers (issue 39): `--max-new-tokens` past 1024 on every drafter kind and both engines, as
`compare` runs them. Every cache (the target's, a draft model's, an EAGLE-3 or DFlash draft's own)
is sized once for the run; an output this long must come out whole, equal to the target's own,
without any cache growing past its size. Slow: thousands of tiny steps per drafter and engine."""

import json
import sys
from pathlib import Path

import pytest
import torch
from tiny import greedy_reference, noisy_copy, save_pair, tiny_lm, tiny_tokenizer

from drafttrain.cli import main
from drafttrain.kinds.dflash.export import save_dflash
from drafttrain.kinds.eagle3.export import save_eagle3
from drafttrain.kinds.eagle3.model import Eagle3Draft
from drafttrain.kinds.medusa.export import save_medusa
from drafttrain.kinds.medusa.model import MedusaHeads
from drafttrain.kinds.vocab import build_draft_vocab

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kinds" / "dflash"))
from dflash_helpers import tiny_draft as tiny_dflash  # noqa: E402

pytestmark = pytest.mark.slow
VOCAB, K, MAX_NEW = 64, 3, 1100


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    root = tmp_path_factory.mktemp("long")
    tok = tiny_tokenizer(VOCAB)
    target = tiny_lm(0, vocab_size=VOCAB, layers=4, max_positions=2048)
    with torch.no_grad():
        target.lm_head.weight[2] = 0.0  # no EOS: every output runs the whole MAX_NEW tokens
    save_pair(root / "target", target, tok)
    save_pair(root / "draft", noisy_copy(target, scale=0.05), tok)
    counts = [[t] * (1 + t % 4) for t in range(VOCAB)]
    eagle3 = Eagle3Draft.from_target(target, build_draft_vocab(counts, VOCAB, 48, always_include=(2,)),
                                     aux_layer_ids=[1, 2, 3], dtype=torch.float64, seed=0)
    save_eagle3(eagle3, root / "eagle3", base_info={"target": str(root / "target")})
    save_medusa(MedusaHeads.from_target(target, num_heads=K, num_layers=1), root / "heads")
    save_dflash(tiny_dflash(target, scale=0.5, block_size=K + 1, vocab_size=VOCAB), root / "dflash",
                base_info={"target": str(root / "target")})
    (root / "p.jsonl").write_text(json.dumps({"id": 0, "prompt": "w5 w9 w13 w7 w5 w9"}) + "\n")
    return root, target, tok


@pytest.mark.parametrize("engine", ["eager", "static"])
def test_every_drafter_decodes_a_long_answer_whole(exports, tmp_path, engine, monkeypatch):
    root, target, tok = exports
    monkeypatch.setenv("DRAFTTRAIN_COMPILE_BACKEND", "eager")  # the static engine's graphs, without codegen
    drafters = [f"draft=draft:{root / 'draft'}", f"eagle3=eagle3:{root / 'eagle3'}",
                f"heads=heads:{root / 'heads'}", f"dflash=dflash:{root / 'dflash'}",
                f"dflash+ngram=dflash:{root / 'dflash'}+ngram", "ngram=ngram", "suffix=suffix"]
    out = tmp_path / "cmp"
    assert main(["compare", "--target", str(root / "target"), *[x for d in drafters for x in ("--drafter", d)],
                 "--prompts", str(root / "p.jsonl"), "--max-new-tokens", str(MAX_NEW), "--num-draft-tokens", str(K),
                 "--engine", engine, "--dtype", "float64", "--out", str(out), "--quiet"]) == 0
    from drafttrain.prompts import encode_prompt, read_prompt_file

    prompt = encode_prompt(read_prompt_file(root / "p.jsonl")[0], tok)
    expected = greedy_reference(target, prompt, MAX_NEW)
    assert len(expected) == MAX_NEW
    for d in drafters:
        name = d.split("=")[0]
        report = json.loads((out / name / "report.json").read_text())
        assert report["engine"]["used"] == engine
        (row,) = [json.loads(line) for line in (out / name / "outputs.jsonl").read_text().splitlines()]
        assert row["speculative_token_ids"] == expected, name
        windows = report["by_window"]
        assert [w["start"] for w in windows] == list(range(0, MAX_NEW, 128)), name
