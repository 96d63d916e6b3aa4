"""Greedy divergences from the target alone (SPEC §2 rev 2): recorded per prompt with the
baseline's top-1/top-2 margin, counted, and judged against the dtype's near-tie tolerance.

Divergences are forced by a verification path that flips the target's top two tokens wherever
their margin is below a threshold, but only in multi-token (verification) forwards: exactly what
low-precision rounding does to near-ties, at a size we choose. Below the dtype's tolerance they
are near-ties (no warning); far above it they are defects (one `warning:` line per prompt).
"""

import json

import pytest
import torch
from eval_helpers import cli, write_jsonl
from tiny import save_pair, tiny_lm, tiny_tokenizer
from transformers import AutoModelForCausalLM

import drafttrain.evaluation.run as run_module
from drafttrain.decoding.engines import CachedLM
from drafttrain.evaluation.metrics import NEAR_TIE_TOLERANCE

MAX_NEW = 24
NUM_PROMPTS = 8


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("divergence")
    save_pair(root / "target", tiny_lm(0, dtype=torch.float32, sharpness=4.0), tiny_tokenizer(64))
    write_jsonl(root / "p.jsonl", [{"id": f"p{i}", "prompt": f"w{5 + i} w{9 + 2 * i} w{13 + i}"}
                                   for i in range(NUM_PROMPTS)])
    return root


class FlippingLM:
    """The target's cached LM, but its multi-token (verification) forwards swap the top two
    logits wherever they are closer than `below`. The run's LM is shared by every decoder, so
    the speculative decoder gets this wrapper and the baseline keeps the real thing."""

    verify = CachedLM.verify  # the reference verification: this forward, then the verdict

    def __init__(self, lm, below):
        self.lm, self.below = lm, below

    def __getattr__(self, name):
        return getattr(self.lm, name)

    def forward(self, tokens, **kw):
        logits, hidden = self.lm.forward(tokens, **kw)
        if tokens.numel() > 1:  # a verification forward over pending + drafts
            top = logits.topk(2, dim=-1)
            close = (top.values[:, 0] - top.values[:, 1]).float() < self.below
            close[0] = False  # the pending token's own prediction: keep, so divergences fall later
            rows = close.nonzero().flatten()
            logits = logits.clone()
            logits[rows, top.indices[rows, 0]] = top.values[rows, 1]
            logits[rows, top.indices[rows, 1]] = top.values[rows, 0]
        return logits, hidden


def flipping_factory(below):
    """make_decoder, with the speculative decoder's verification forwards flipping near-ties."""
    real = run_module.make_decoder

    def factory(cfg, models, *, baseline=False, **kwargs):
        decoder = real(cfg, models, baseline=baseline, **kwargs)
        if not baseline:
            decoder.target = FlippingLM(decoder.target, below)
        return decoder

    return factory


def argv(setup, tmp_path, dtype, command="eval"):
    common = ["--target", str(setup / "target"), "--prompts", str(setup / "p.jsonl"), "--max-new-tokens",
              str(MAX_NEW), "--dtype", dtype, "--out", str(tmp_path / "out"), "--quiet"]
    if command == "eval":
        return ["eval", "--draft", str(setup / "target"), *common]
    return ["compare", "--drafter", f"self=draft:{setup / 'target'}", "--drafter", "ng=ngram", *common]


def read(out):
    report = json.loads((out / "report.json").read_text())
    rows = [json.loads(line) for line in (out / "outputs.jsonl").read_text().splitlines()]
    return report, rows


def recomputed_divergence(row):
    spec, base = row["speculative_token_ids"], row["baseline_token_ids"]
    for i, (a, b) in enumerate(zip(spec, base)):
        if a != b:
            return i
    return None if len(spec) == len(base) else min(len(spec), len(base))


def test_bf16_near_ties_are_counted_and_not_warned(setup, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(run_module, "make_decoder", flipping_factory(below=0.3))  # well below bf16's tolerance
    code, out, err = cli(capsys, argv(setup, tmp_path, "bfloat16"))
    assert code == 0, err
    assert "warning:" not in err
    report, rows = read(tmp_path / "out")
    tolerance = report["numerics"]["near_tie_tolerance"]
    assert report["numerics"]["dtype"] == "bfloat16" and tolerance == NEAR_TIE_TOLERANCE["bfloat16"]
    diverged = [r for r in rows if r["first_divergence"] is not None]
    assert len(diverged) >= NUM_PROMPTS // 2
    assert any(r["first_divergence"] > 0 for r in diverged)
    for r in rows:
        assert r["first_divergence"] == recomputed_divergence(r)
    for r in diverged:
        assert 0 <= r["divergence_margin"] <= tolerance
    overall = report["overall"]
    assert overall["divergences"] == overall["divergences_at_near_ties"] == len(diverged)
    assert overall["outputs_match_baseline"] == pytest.approx(1 - len(diverged) / NUM_PROMPTS)
    md = (tmp_path / "out" / "report.md").read_text()
    assert (f"{len(diverged)} of {NUM_PROMPTS} greedy outputs differ from the target alone's; {len(diverged)} of "
            "these divergences are at near-ties") in md
    assert "different rounding of a k-token and a 1-token forward in low precision, not from the decoder" in md


def test_float32_divergences_beyond_the_tolerance_are_defects(setup, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(run_module, "make_decoder", flipping_factory(below=2.0))  # far above float32's 1e-3
    code, out, err = cli(capsys, argv(setup, tmp_path, "float32"))
    assert code == 0, err  # a warning, not an error: the report is written
    report, rows = read(tmp_path / "out")
    diverged = [r for r in rows if r["first_divergence"] is not None]
    assert len(diverged) >= NUM_PROMPTS // 2
    # The margin is the baseline's at the first differing token: check it against a plain float64
    # forward of the target over the prompt plus the baseline's tokens before it.
    target = AutoModelForCausalLM.from_pretrained(setup / "target", dtype=torch.float64).eval()
    tok = tiny_tokenizer(64)
    records = [json.loads(line) for line in (setup / "p.jsonl").read_text().splitlines()]
    ids = {r["id"]: tok(r["prompt"])["input_ids"] for r in records}
    for r in diverged:
        prefix = ids[r["id"]] + r["baseline_token_ids"][:r["first_divergence"]]
        with torch.no_grad():
            top = target(torch.tensor([prefix])).logits[0, -1].topk(2).values
        assert r["divergence_margin"] == pytest.approx(float(top[0] - top[1]), abs=1e-4)
    defects = [r for r in diverged if r["divergence_margin"] > NEAR_TIE_TOLERANCE["float32"]]
    assert defects
    assert report["overall"]["divergences"] == len(diverged)
    assert report["overall"]["divergences_at_near_ties"] == len(diverged) - len(defects)
    warnings = err.splitlines()
    assert len(warnings) == len(defects)
    for line, r in zip(warnings, defects):
        assert line.startswith(f"warning: prompt {r['id']!r}: ")
        assert f"at token {r['first_divergence']}" in line and "decoder defect" in line
    assert "point to a decoder defect" in (tmp_path / "out" / "report.md").read_text()


def test_compare_warns_with_the_drafters_name(setup, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(run_module, "make_decoder", flipping_factory(below=2.0))
    code, out, err = cli(capsys, argv(setup, tmp_path, "float32", command="compare"))
    assert code == 0, err
    table = {r["drafter"]: r for r in json.loads((tmp_path / "out" / "comparison.json").read_text())["drafters"]}
    warnings = err.splitlines()
    expected = sum(table[name]["divergences"] - table[name]["divergences_at_near_ties"] for name in table)
    assert expected > 0 and len(warnings) == expected
    assert all(line.startswith(("warning: self: prompt ", "warning: ng: prompt ")) for line in warnings)
    assert "near-ties" in (tmp_path / "out" / "comparison.md").read_text()


def test_natural_bf16_divergences_are_near_ties(setup, tmp_path, capsys):
    """No forcing: the target drafting for itself in bf16, so every step runs multi-token forwards.
    Whatever diverges (rounding flips ties here) must fall within the bf16 tolerance."""
    code, out, err = cli(capsys, argv(setup, tmp_path, "bfloat16"))
    assert code == 0 and "warning:" not in err
    report, rows = read(tmp_path / "out")
    for r in rows:
        assert r["first_divergence"] == recomputed_divergence(r)
        if r["first_divergence"] is not None:
            assert r["divergence_margin"] <= NEAR_TIE_TOLERANCE["bfloat16"]
    assert report["overall"]["divergences"] == report["overall"]["divergences_at_near_ties"]
