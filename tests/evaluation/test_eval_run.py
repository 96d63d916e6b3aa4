"""`drafttrain eval` end to end (SPEC §2 and rev 2) on tiny models saved to disk.

Bad input must end in exit 2 with one `error:` line and nothing touched; a good run's report
must be recomputable from its outputs.jsonl, and greedy outputs must equal transformers' own
`generate`.
"""

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import huggingface_hub
import numpy as np
import pytest
import torch
import transformers
from eval_helpers import cli, damaged_copy, one_error_line, snapshot, write_jsonl
from scipy.optimize import brentq
from tiny import noisy_copy, save_pair, tiny_lm, tiny_tokenizer
from transformers import AutoModelForCausalLM

import drafttrain
from drafttrain.cli import build_parser, main
from drafttrain.decoding import NUM_DRAFT_TOKENS

EOS = 2          # `<|im_end|>` in the tiny tokenizer, and the tiny models' eos_token_id
CONTEXT = 64     # the tiny target's max_position_embeddings
K = 3
MAX_NEW = 16
REPORT_FILES = ("outputs.jsonl", "report.json", "report.md")

# The greedy run's prompts: ids come from task_id, the line number, question_id and id.
CODE = [{"task_id": "HumanEval/0", "category": "code", "prompt": "w5 w9 w13 w7"}, "",
        {"category": "code", "prompt": "w40 w41 w40 w41"}]
CHAT = [{"question_id": 81, "category": "chat", "turns": ["w20 w21 w22", "w23 w24"]},
        {"id": "x1", "category": "chat", "prompt": "w30 w31 w32 w33"}]
IDS = ["HumanEval/0", 2, 81, "x1"]
CATEGORIES = ["code", "code", "chat", "chat"]
# The same prompts as token ids, by hand: `w{i}` is id i; a turn is
# "<|im_start|>user ...<|im_end|><|im_start|>assistant " = 1, <unk>, ..., 2, 1, <unk>.
PROMPT_IDS = [[5, 9, 13, 7], [40, 41, 40, 41], [1, 0, 20, 21, 22, 2, 1, 0], [30, 31, 32, 33]]



def swap_token_ids(model_dir, a="w10", b="w11"):
    """Same tokens, but two of them trade ids: a draft trained with some other tokenizer."""
    path = Path(model_dir) / "tokenizer.json"
    spec = json.loads(path.read_text())
    vocab = spec["model"]["vocab"]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    path.write_text(json.dumps(spec))


def gpt2_lm():
    """An architecture the static engine does not implement."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=2, n_positions=CONTEXT,
                                      eos_token_id=EOS, bos_token_id=EOS)).eval()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    target = tiny_lm(0, max_positions=CONTEXT)
    with torch.no_grad():
        target.lm_head.weight[EOS] *= 2.0  # some greedy continuations reach EOS within MAX_NEW
    draft = noisy_copy(target)
    tok = tiny_tokenizer()
    dirs = {
        "target": save_pair(root / "target", target, tok),
        "draft": save_pair(root / "draft", draft, tok),
        "plain_target": save_pair(root / "plain", target, tiny_tokenizer(chat_template=False)),
        "other_eos_draft": save_pair(root / "eos1", tiny_lm(1, eos_token_id=1, max_positions=CONTEXT), tok),
        "swapped_vocab_draft": save_pair(root / "swapped", draft, tok),
        "gpt2_target": save_pair(root / "gpt2", gpt2_lm(), tok),
    }
    swap_token_ids(dirs["swapped_vocab_draft"])
    for who in ("target", "draft"):
        for damage in ("truncated", "empty", "nan"):
            dirs[f"{damage}_{who}"] = damaged_copy(dirs[who], root / f"{damage}-{who}", damage)
    return dirs


@pytest.fixture(scope="module")
def prompt_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("prompts")
    return [write_jsonl(root / "code.jsonl", CODE), write_jsonl(root / "chat.jsonl", CHAT)]


@pytest.fixture(scope="module")
def references(models):
    """Greedy continuations by transformers' `generate`, independent of drafttrain's decoder."""
    target = AutoModelForCausalLM.from_pretrained(models["target"], dtype=torch.float64).eval()
    out = []
    for ids in PROMPT_IDS:
        seq = target.generate(torch.tensor([ids]), max_new_tokens=MAX_NEW, do_sample=False,
                              eos_token_id=EOS, pad_token_id=EOS)
        out.append(seq[0, len(ids):].tolist())
    return out


def prompts_argv(files):
    return [x for f in files for x in ("--prompts", str(f))]


def run_ok(argv):
    assert main(argv) == 0
    out = Path(argv[argv.index("--out") + 1])
    report = json.loads((out / "report.json").read_text())
    rows = [json.loads(line) for line in (out / "outputs.jsonl").read_text().splitlines()]
    return out, report, rows


def check_bookkeeping(report, rows, k):
    """Every count of `overall` and `by_category`, recomputed from outputs.jsonl."""
    assert set(report["by_category"]) == {r["category"] for r in rows}
    groups = {"overall": rows, **{c: [r for r in rows if r["category"] == c] for c in report["by_category"]}}
    for name, group in groups.items():
        m = report["overall"] if name == "overall" else report["by_category"][name]
        steps = [a for r in group for a in r["accepted_lengths"]]
        new = sum(len(r["speculative_token_ids"]) for r in group)
        drafted = sum(sum(r["proposed_lengths"]) for r in group)
        assert m["prompts"] == len(group)
        assert m["new_tokens"] == new
        assert m["target_forwards"] == len(steps)
        assert m["accepted_tokens"] == sum(steps)
        assert m["draft_tokens"] == drafted
        assert m["acceptance_rate"] == pytest.approx(sum(steps) / drafted if drafted else 0.0)
        assert m["mean_accepted_length"] == pytest.approx(new / len(steps))
        assert m["per_position_acceptance"] == pytest.approx(
            [sum(a >= i for a in steps) / len(steps) for i in range(1, k + 1)])
    for r in rows:
        tokens, accepted, proposed = r["speculative_token_ids"], r["accepted_lengths"], r["proposed_lengths"]
        assert len(accepted) == len(proposed)
        assert all(0 <= a <= p <= k for a, p in zip(accepted, proposed))
        # each step emits its accepted drafts plus one token, except a step cut short by EOS
        slack = sum(a + 1 for a in accepted) - len(tokens)
        assert slack == 0 or (slack == 1 and tokens[-1] == EOS)


def check_ends(tokens):
    """A continuation ends at its first EOS (included) or after exactly MAX_NEW tokens."""
    if EOS in tokens:
        assert tokens.index(EOS) == len(tokens) - 1 and len(tokens) <= MAX_NEW
        return "eos"
    assert len(tokens) == MAX_NEW
    return "length"


# ---------------------------------------------------------------------------------------------
# Bad input: exit 2, one `error:` line, nothing touched.


def bad_argv(env, *extra, target=None, drafter=None, prompts=None):
    drafter = ["--draft", env.models["draft"]] if drafter is None else drafter
    return ["eval", "--target", target or env.models["target"], *drafter,
            *prompts_argv(prompts or env.prompt_files), "--dtype", "float64", "--max-new-tokens", "8",
            "--num-draft-tokens", str(K), "--quiet", *extra]


def _file(env, name, lines):
    return write_jsonl(env.tmp / name, lines)


def _old_report(env, name="old", report=True):
    """A directory holding an earlier run's files (or, report=False, someone's other files)."""
    old = env.tmp / name
    (old / "drafter-b").mkdir(parents=True)
    (old / ("report.json" if report else "notes.txt")).write_text("{}")
    (old / "drafter-b" / "report.md").write_text("earlier")
    return str(old)


def _a_dir(env):
    (env.tmp / "prompt-dir").mkdir()
    return str(env.tmp / "prompt-dir")


def _a_file(env):
    (env.tmp / "a-file").write_text("not a directory")
    return str(env.tmp / "a-file")


BAD_INPUT = {
    "missing target": lambda e: (bad_argv(e, target=str(e.tmp / "no-such-target")),
                                 ["target", "no-such-target"]),
    "missing draft": lambda e: (bad_argv(e, drafter=["--draft", str(e.tmp / "no-such-draft")]),
                                ["draft", "no-such-draft"]),
    "vocabulary mismatch": lambda e: (bad_argv(e, drafter=["--draft", e.models["swapped_vocab_draft"]]),
                                      ["'w10'", "draft", "target"]),
    "different EOS": lambda e: (bad_argv(e, drafter=["--draft", e.models["other_eos_draft"]]), ["EOS"]),
    "empty prompt file": lambda e: (bad_argv(e, prompts=[_file(e, "empty.jsonl", ["", "  "])]),
                                    ["empty.jsonl", "empty"]),
    "prompt file not found": lambda e: (bad_argv(e, prompts=[str(e.tmp / "nope.jsonl")]),
                                        ["nope.jsonl", "not found"]),
    # issue 40 (G): a directory was "prompt file not found", sending the user looking for a path that is there
    "prompt file is a directory": lambda e: (bad_argv(e, prompts=[_a_dir(e)]),
                                             ["prompt-dir", "is a directory", "--prompts"]),
    "invalid JSON": lambda e: (bad_argv(e, prompts=[p := _file(e, "bad.jsonl", [CODE[0], '{"prompt": "w5"'])]),
                               [f"{p}:2", "JSON"]),
    "no prompt field": lambda e: (bad_argv(e, prompts=[p := _file(e, "q.jsonl", [CODE[0], "", {"question": "w5"}])]),
                                  [f"{p}:3", "prompt", "turns", "messages"]),
    "turns without chat template": lambda e: (
        bad_argv(e, target=e.models["plain_target"], drafter=["--method", "none"],
                 prompts=[p := _file(e, "turns.jsonl", [CHAT[0]])]),
        [f"{p}:1", "chat template"]),
    "prompt longer than context": lambda e: (
        bad_argv(e, prompts=[p := _file(e, "long.jsonl", [{"prompt": " ".join(f"w{3 + i % 60}" for i in range(70))}])]),
        [f"{p}:1", "70 tokens", f"{CONTEXT}"]),
    "binary prompt file": lambda e: (bad_argv(e, prompts=[p := str(e.tmp / "q.jsonl.gz")]), [p, "UTF-8"]),
    "unreachable hub id": lambda e: (bad_argv(e, target="no-such-org/no-such-model"),
                                     ["cannot load", "'no-such-org/no-such-model'"]),
    "unknown dtype": lambda e: (bad_argv(e, "--dtype", "float17"), ["dtype", "float17"]),
    "unknown device": lambda e: (bad_argv(e, "--device", "tpu"), ["device", "tpu"]),
    "cuda without CUDA": lambda e: (bad_argv(e, "--device", "cuda"), ["cuda", "not available"]),
    "draft and method": lambda e: (bad_argv(e, "--method", "ngram"), ["--draft", "--method"]),
    "no drafter": lambda e: (bad_argv(e, drafter=[]), ["--draft", "--method"]),
    "unknown method": lambda e: (bad_argv(e, drafter=["--method", "beam"]), ["--method", "beam"]),
    "zero draft tokens": lambda e: (bad_argv(e, "--num-draft-tokens", "0"), ["--num-draft-tokens"]),
    "negative temperature": lambda e: (bad_argv(e, "--temperature", "-0.5"), ["--temperature"]),
    "nan temperature": lambda e: (bad_argv(e, "--temperature", "nan"), ["--temperature"]),
    "top-p above 1": lambda e: (bad_argv(e, "--top-p", "1.5"), ["--top-p"]),
    "top-p zero": lambda e: (bad_argv(e, "--top-p", "0"), ["--top-p"]),
    "zero max new tokens": lambda e: (bad_argv(e, "--max-new-tokens", "0"), ["--max-new-tokens"]),
    "zero limit": lambda e: (bad_argv(e, "--limit", "0"), ["--limit"]),
    "unknown baseline": lambda e: (bad_argv(e, "--baseline", "hf"), ["--baseline", "hf"]),
    "missing --out (argparse)": lambda e: (bad_argv(e, "--out"), ["--out", "expected one argument"]),
    "no --out (argparse)": lambda e: (bad_argv(e, "--out", None), ["--out", "required"]),
    "truncated target weights": lambda e: (bad_argv(e, target=e.models["truncated_target"]),
                                           ["target", "truncated-target", "damaged"]),
    "empty target weights": lambda e: (bad_argv(e, target=e.models["empty_target"]), ["target", "damaged"]),
    "NaN target weights": lambda e: (bad_argv(e, target=e.models["nan_target"]), ["target", "non-finite"]),
    "truncated draft weights": lambda e: (bad_argv(e, drafter=["--draft", e.models["truncated_draft"]]),
                                          ["draft", "truncated-draft", "damaged"]),
    "empty draft weights": lambda e: (bad_argv(e, drafter=["--draft", e.models["empty_draft"]]),
                                      ["draft", "damaged"]),
    "NaN draft weights": lambda e: (bad_argv(e, drafter=["--draft", e.models["nan_draft"]]),
                                    ["draft", "non-finite"]),
    "--out is a file": lambda e: (bad_argv(e, "--out", _a_file(e)), ["--out", "is a file"]),
    "--out under a file": lambda e: (bad_argv(e, "--out", _a_file(e) + "/report"), ["--out", "lies under", "file"]),
    "--out not writable": lambda e: (bad_argv(e, "--out", "/proc/drafttrain-test/report"), ["--out", "not writable"]),
    "--out holds an earlier report": lambda e: (bad_argv(e, "--out", _old_report(e)),
                                                ["--out", "not empty", "--overwrite"]),
    "--overwrite of a directory that is no report": lambda e: (
        bad_argv(e, "--overwrite", "--out", _old_report(e, report=False)), ["--out", "no drafttrain report"]),
    # The output path is checked before any model loads: the damaged target is never read.
    "--out is a file, damaged target": lambda e: (
        bad_argv(e, "--out", _a_file(e), target=e.models["truncated_target"]), ["--out", "is a file"]),
    "--out holds a report, damaged draft": lambda e: (
        bad_argv(e, "--out", _old_report(e), drafter=["--draft", e.models["nan_draft"]]), ["--out", "not empty"]),
    "static engine, unsupported model": lambda e: (
        bad_argv(e, "--engine", "static", target=e.models["gpt2_target"], drafter=["--method", "ngram"]),
        ["--engine static", "gpt2", "--engine eager"]),
    "unknown engine (argparse)": lambda e: (bad_argv(e, "--engine", "warp"), ["--engine", "warp"]),
    "non-integer K (argparse)": lambda e: (bad_argv(e, "--num-draft-tokens", "three"), ["--num-draft-tokens", "three"]),
}


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_is_one_error_line_and_no_report(case, models, prompt_files, tmp_path, capsys):
    if case == "cuda without CUDA" and torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    if case == "unreachable hub id" and not huggingface_hub.constants.HF_HUB_OFFLINE:
        pytest.skip("needs HF_HUB_OFFLINE=1 (tests/conftest.py sets it) to fail fast")
    (tmp_path / "q.jsonl.gz").write_bytes(b"\x1f\x8b\x08\x00\xff\xfe binary")
    env = SimpleNamespace(models=models, prompt_files=prompt_files, tmp=tmp_path)
    argv, words = BAD_INPUT[case](env)
    if argv[-1] is None:
        argv = argv[:-2]
    elif "--out" not in argv:
        argv += ["--out", str(tmp_path / "out")]
    before = snapshot(tmp_path)
    code, out, err = cli(capsys, argv)
    one_error_line(code, out, err, *words)
    assert snapshot(tmp_path) == before  # nothing written, nothing of an earlier report touched


@pytest.mark.slow
def test_real_process_exits_2_with_an_error_line(models, prompt_files, tmp_path):
    script = Path(sys.executable).with_name("drafttrain")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "drafttrain.cli"]
    long_prompt = write_jsonl(tmp_path / "long.jsonl", [{"prompt": " ".join(["w5"] * 70)}])
    env = SimpleNamespace(models=models, prompt_files=prompt_files, tmp=tmp_path)
    argv = bad_argv(env, "--out", str(tmp_path / "out"), prompts=[long_prompt])
    proc = subprocess.run(command + argv, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 2, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error:") and "context" in last
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------------
# A greedy run with a noisy draft, float64: lossless, so every output equals the target's own.


@pytest.fixture(scope="module")
def greedy_run(models, prompt_files, tmp_path_factory):
    out = tmp_path_factory.mktemp("greedy") / "report"
    argv = ["eval", "--target", models["target"], "--draft", models["draft"], *prompts_argv(prompt_files),
            "--num-draft-tokens", str(K), "--max-new-tokens", str(MAX_NEW), "--temperature", "0",
            "--top-p", "0.9", "--seed", "5", "--dtype", "float64", "--device", "cpu", "--baseline", "ours",
            "--out", str(out), "--quiet"]
    return run_ok(argv)


def test_greedy_run_writes_every_file(greedy_run):
    out, _, _ = greedy_run
    for name in (*REPORT_FILES, "per_position_acceptance.png", "speedup_by_category.png"):
        assert (out / name).is_file(), name
    assert (out / "per_position_acceptance.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")]  # no temp files left


def test_greedy_outputs_rows(greedy_run):
    _, _, rows = greedy_run
    assert [r["id"] for r in rows] == IDS
    assert [r["category"] for r in rows] == CATEGORIES
    for r in rows:
        assert set(r) >= {"id", "category", "baseline_token_ids", "speculative_token_ids", "accepted_lengths"}
    ends = {check_ends(r["speculative_token_ids"]) for r in rows}
    assert ends == {"eos", "length"}  # both ways of ending are exercised


def test_greedy_counts_recompute_from_outputs(greedy_run):
    _, report, rows = greedy_run
    check_bookkeeping(report, rows, K)
    assert report["by_category"]["code"]["prompts"] == 2 and report["by_category"]["chat"]["prompts"] == 2
    overall = report["overall"]
    assert 0 < overall["accepted_tokens"] < overall["draft_tokens"]  # a noisy draft: partial acceptance
    assert len(overall["per_position_acceptance"]) == K


def test_greedy_speculative_and_baseline_equal_transformers_generate(greedy_run, references):
    _, report, rows = greedy_run
    for row, ref in zip(rows, references):
        assert row["baseline_token_ids"] == ref
        assert row["speculative_token_ids"] == ref
    assert report["overall"]["outputs_match_baseline"] == 1.0
    assert all(m["outputs_match_baseline"] == 1.0 for m in report["by_category"].values())


def test_greedy_speedup_is_the_ratio_of_measured_rates(greedy_run):
    _, report, _ = greedy_run
    for m in [report["overall"], *report["by_category"].values()]:
        assert m["baseline_tokens_per_s"] > 0 and m["speculative_tokens_per_s"] > 0
        assert m["speedup"] == pytest.approx(m["speculative_tokens_per_s"] / m["baseline_tokens_per_s"], rel=1e-12)


def test_greedy_config_and_environment(greedy_run, models, prompt_files):
    out, report, _ = greedy_run
    expected = {"target": models["target"], "draft": models["draft"], "method": None,
                "prompts": prompt_files, "limit": None, "num_draft_tokens": K, "temperature": 0.0,
                "top_p": 0.9, "max_new_tokens": MAX_NEW, "seed": 5, "dtype": "float64", "device": "cpu",
                "baseline": "ours", "out": str(out)}
    assert {k: report["config"].get(k, "MISSING") for k in expected} == expected
    env = report["environment"]
    assert set(env) >= {"device", "torch", "transformers", "drafttrain"}
    assert env["torch"] == torch.__version__
    assert env["transformers"] == transformers.__version__
    assert env["drafttrain"] == drafttrain.__version__
    assert env["device"].startswith("cpu")


def test_greedy_report_md(greedy_run):
    out, report, _ = greedy_run
    md = (out / "report.md").read_text()
    pred = report["overall"]["predicted"]
    for text in ("| overall |", "| code |", "| chat |", "per_position_acceptance.png", "speedup_by_category.png",
                 f"{report['overall']['mean_accepted_length']:.3f}", f"{report['overall']['speedup']:.3f}",
                 f"| overall | {pred['alpha']:.3f} | {pred['expected_tokens_per_step']:.3f} |",
                 "All 4 greedy outputs equal the target alone's", "Engine: eager (requested auto)"):
        assert text in md, text
    assert "acceptance alpha" not in md  # the old acceptance_rate-as-alpha formula is gone


def test_greedy_divergence_fields(greedy_run):
    """float64: no divergence, and every outputs.jsonl line says so."""
    _, report, rows = greedy_run
    for r in rows:
        assert r["first_divergence"] is None and r["divergence_margin"] is None
    for m in [report["overall"], *report["by_category"].values()]:
        assert m["divergences"] == 0 and m["divergences_at_near_ties"] == 0
    assert report["numerics"]["dtype"] == "float64"
    assert report["numerics"]["near_tie_tolerance"] == pytest.approx(1e-9)


def test_greedy_predicted_speedup(greedy_run):
    """alpha fitted to tau over the run's own proposed lengths, by an independent root finder."""
    _, report, rows = greedy_run
    groups = {"overall": rows, **{c: [r for r in rows if r["category"] == c] for c in report["by_category"]}}
    for name, group in groups.items():
        m = report["overall"] if name == "overall" else report["by_category"][name]
        pred = m["predicted"]
        assert set(pred) == {"alpha", "expected_tokens_per_step", "cost_ratio", "speedup", "efficiency"}
        proposed = [p for r in group for p in r["proposed_lengths"]]
        tau = m["mean_accepted_length"]
        mean_e = lambda a: np.mean([sum(a**j for j in range(p + 1)) for p in proposed])
        assert 0 < pred["alpha"] < 1
        assert pred["alpha"] == pytest.approx(brentq(lambda a: mean_e(a) - tau, 0.0, 1.0, xtol=1e-13), abs=1e-8)
        assert pred["expected_tokens_per_step"] == pytest.approx(tau)
        assert pred["cost_ratio"] == report["overall"]["predicted"]["cost_ratio"] > 0  # a draft model costs
        assert pred["speedup"] == pytest.approx(tau / (K * pred["cost_ratio"] + 1))
        assert pred["efficiency"] == pytest.approx(m["speedup"] / pred["speedup"])


def test_greedy_engine_and_drafter_name(greedy_run):
    _, report, _ = greedy_run
    assert report["config"]["engine"] == "eager"  # SPEC §2 rev 2: the engine used
    assert report["engine"]["requested"] == "auto" and report["engine"]["used"] == "eager"
    assert report["engine"]["compile_seconds"] == 0.0
    assert report["engine"]["cudagraph_skips"] is None and report["engine"]["cuda_graphs"] is None  # not on CUDA
    assert report["drafter"] == "draft"  # the draft directory's name


def test_the_engine_block_reports_this_runs_cuda_graph_captures(models, prompt_files, tmp_path, monkeypatch):
    """Issue 36: on CUDA the engine block says how many CUDA graphs the run recorded and how many
    compiled graphs skipped capture, read from torch's counters (here set by hand, the run made to
    read them as on CUDA), counted from the run's own start, and report.md names them."""
    from collections import Counter

    from torch._dynamo.utils import counters

    from drafttrain.decoding.engines import compiled
    from drafttrain.evaluation import run as eval_run

    monkeypatch.setitem(counters, "inductor", Counter(cudagraph_skips=5))  # an earlier run's, not this one's
    monkeypatch.setitem(counters, "drafttrain", Counter(cuda_graphs=7))
    monkeypatch.setattr(eval_run, "capture_counts", lambda device, since=None: compiled.capture_counts("cuda", since))
    real = eval_run.timed_generate

    def recording(*args, **kwargs):  # each generation "records" a graph; one skips capture
        counters["drafttrain"]["cuda_graphs"] += 1
        counters["inductor"]["cudagraph_skips"] = 6
        return real(*args, **kwargs)

    monkeypatch.setattr(eval_run, "timed_generate", recording)
    out, report, _ = run_ok(["eval", "--target", models["target"], "--method", "ngram", *prompts_argv(prompt_files),
                             "--num-draft-tokens", str(K), "--max-new-tokens", "4", "--dtype", "float64",
                             "--out", str(tmp_path / "out"), "--quiet"])
    generations = 2 * len(IDS)  # the target alone and the drafter, each prompt
    assert report["engine"]["cudagraph_skips"] == 1 and report["engine"]["cuda_graphs"] == generations
    assert f"{generations} CUDA graphs recorded, cudagraph_skips 1" in (out / "report.md").read_text()


# ---------------------------------------------------------------------------------------------
# Other drafters, no baseline, --limit, sampling.


def test_ngram_is_lossless_and_counted(models, prompt_files, references, tmp_path):
    out, report, rows = run_ok(["eval", "--target", models["target"], "--method", "ngram",
                                *prompts_argv(prompt_files), "--num-draft-tokens", str(K),
                                "--max-new-tokens", str(MAX_NEW), "--dtype", "float64",
                                "--out", str(tmp_path / "out"), "--quiet"])
    assert [r["speculative_token_ids"] for r in rows] == references
    assert [r["baseline_token_ids"] for r in rows] == references
    check_bookkeeping(report, rows, K)
    assert report["overall"]["draft_tokens"] > 0  # the repetitive outputs give lookups something to find
    assert report["config"]["method"] == "ngram" and report["config"]["draft"] is None


@pytest.mark.parametrize("drafter", [["--draft", "DRAFT"], ["--method", "ngram"]])
def test_static_engine_is_lossless_and_recorded(models, prompt_files, references, tmp_path, drafter):
    """--engine static on CPU (uncompiled steps): the same tokens as generate(), engine recorded."""
    drafter = [models["draft"] if a == "DRAFT" else a for a in drafter]
    out, report, rows = run_ok(["eval", "--target", models["target"], *drafter, *prompts_argv(prompt_files),
                                "--num-draft-tokens", str(K), "--max-new-tokens", str(MAX_NEW), "--dtype", "float64",
                                "--engine", "static", "--out", str(tmp_path / "out"), "--quiet"])
    assert [r["speculative_token_ids"] for r in rows] == references
    assert [r["baseline_token_ids"] for r in rows] == references
    check_bookkeeping(report, rows, K)
    assert report["config"]["engine"] == "static"
    assert report["engine"]["requested"] == "static" and report["engine"]["used"] == "static"
    # The uncompiled static engine still runs each registered step once before timing: that time is
    # reported on its own (the eager engine's is exactly 0), never in tokens/s.
    assert report["engine"]["compile_seconds"] > 0.0
    if drafter[0] == "--draft":
        assert report["overall"]["predicted"]["cost_ratio"] > 0


def test_a_home_that_cannot_keep_compiled_steps_is_one_warning_and_the_cache_off(models, prompt_files, tmp_path,
                                                                                  monkeypatch, capsys):
    """Issue 40 (F): DRAFTTRAIN_HOME pointing at a file ran silently and reported compile_cache "cold",
    as if a next run would find what this one compiled; nothing could be cached there."""
    home = tmp_path / "home"
    home.write_text("a file, not a directory")
    monkeypatch.setenv("DRAFTTRAIN_HOME", str(home))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)  # restored after the test, whatever eval sets
    monkeypatch.delenv("DRAFTTRAIN_COMPILE_BACKEND", raising=False)
    capsys.readouterr()
    _, report, _ = run_ok(["eval", "--target", models["target"], "--method", "ngram", *prompts_argv(prompt_files),
                           "--max-new-tokens", str(MAX_NEW), "--dtype", "float64", "--engine", "static",
                           "--out", str(tmp_path / "out"), "--quiet"])
    err = capsys.readouterr().err.splitlines()
    warnings = [line for line in err if line.startswith("warning:")]
    assert len(warnings) == 1 and str(home) in warnings[0] and "DRAFTTRAIN_HOME" in warnings[0], err
    assert report["engine"]["compile_seconds"] > 0 and report["engine"]["compile_cache"] == "off"
    assert home.read_text() == "a file, not a directory"


def test_plain_decoding_without_baseline(models, prompt_files, references, tmp_path):
    out, report, rows = run_ok(["eval", "--target", models["target"], "--method", "none",
                                *prompts_argv(prompt_files), "--max-new-tokens", str(MAX_NEW),
                                "--dtype", "float64", "--baseline", "none", "--out", str(tmp_path / "out"), "--quiet"])
    assert [r["speculative_token_ids"] for r in rows] == references
    check_bookkeeping(report, rows, 0)
    for m in [report["overall"], *report["by_category"].values()]:
        assert m["mean_accepted_length"] == 1.0
        assert m["per_position_acceptance"] == []
        assert m["accepted_tokens"] == m["draft_tokens"] == 0
        assert m["target_forwards"] == m["new_tokens"]
        assert m["baseline_tokens_per_s"] is None and m["speedup"] is None and m["outputs_match_baseline"] is None
    assert all(r["baseline_token_ids"] is None for r in rows)
    assert not (out / "per_position_acceptance.png").exists() and not (out / "speedup_by_category.png").exists()
    assert (out / "report.md").is_file()


def test_default_k_is_the_one_default(models, prompt_files, tmp_path):
    _, report, _ = run_ok(["eval", "--target", models["target"], "--method", "ngram", *prompts_argv(prompt_files),
                           "--limit", "1", "--max-new-tokens", "6", "--baseline", "none",
                           "--out", str(tmp_path / "out"), "--quiet"])
    assert report["config"]["num_draft_tokens"] == NUM_DRAFT_TOKENS == 4
    assert len(report["overall"]["per_position_acceptance"]) == NUM_DRAFT_TOKENS
    parser = build_parser()
    common = ["--target", "T", "--prompts", "p", "--out", "o"]
    assert parser.parse_args(["compare", "--drafter", "n=ngram", *common]).num_draft_tokens == NUM_DRAFT_TOKENS
    assert parser.parse_args(["replay", "--target", "T", "--prompts", "p", "--outputs", "o",
                              "--draft", "a=b"]).num_draft_tokens == NUM_DRAFT_TOKENS


@pytest.mark.parametrize("command", ["eval", "compare", "replay"])
def test_help_shows_every_default(command, capsys):
    with pytest.raises(SystemExit):
        main([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    sub = next(a for a in build_parser()._actions if a.dest == "command").choices[command]
    for action in sub._actions:
        if action.dest == "help":
            continue
        if action.required:
            assert "(required)" in " ".join((action.help or "").split())
        elif isinstance(action.default, bool):
            assert "(default: off)" in action.help
        elif isinstance(action.default, list):  # a comma-separated flag (--concurrency 1,4,16) shows its list so
            assert f"(default: {','.join(map(str, action.default))})" in text, action.dest
        elif action.default is not None:
            assert f"(default: {action.default})" in text, action.dest
    if command != "replay":
        assert "--num-draft-tokens K|auto K: draft tokens per verification step" in text and "(default: 4)" in text


def test_one_category_report_has_no_overall_vs_category_pair(models, tmp_path):
    prompts = write_jsonl(tmp_path / "code.jsonl", [c for c in CODE if c])
    out, report, _ = run_ok(["eval", "--target", models["target"], "--method", "ngram", "--prompts", prompts,
                             "--max-new-tokens", "8", "--dtype", "float64", "--out", str(tmp_path / "out"), "--quiet"])
    assert list(report["by_category"]) == ["code"] and report["overall"]["speedup"] is not None
    assert (out / "per_position_acceptance.png").is_file()
    assert not (out / "speedup_by_category.png").exists()
    md = (out / "report.md").read_text()
    assert "speedup_by_category" not in md and "| code |" not in md and "| overall |" in md
    assert report["drafter"] == "ngram"


def test_limit_takes_the_first_prompts_of_each_file(models, prompt_files, tmp_path):
    _, report, rows = run_ok(["eval", "--target", models["target"], "--method", "none", *prompts_argv(prompt_files),
                              "--limit", "1", "--max-new-tokens", "4", "--baseline", "none",
                              "--out", str(tmp_path / "out"), "--quiet"])
    assert [r["id"] for r in rows] == ["HumanEval/0", 81]
    assert report["overall"]["prompts"] == 2 and report["config"]["limit"] == 1
    assert report["config"]["dtype"] == "auto"  # float32 on CPU, from the float64 checkpoint
    assert all(len(r["speculative_token_ids"]) <= 4 for r in rows)


def test_sampling_is_reproducible_by_seed(models, tmp_path):
    # The same prompt three times: one seeded run must still give independent samples.
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"id": f"r{i}", "prompt": "w5 w9"} for i in range(3)]
                          + [{"id": "o", "prompt": "w30 w31 w32"}])

    def run(seed, name):
        _, report, rows = run_ok(["eval", "--target", models["target"], "--draft", models["draft"],
                                  "--prompts", prompts, "--temperature", "1", "--seed", str(seed),
                                  "--num-draft-tokens", str(K), "--max-new-tokens", "12", "--dtype", "float64",
                                  "--out", str(tmp_path / name), "--quiet"])
        return report, [(r["speculative_token_ids"], r["baseline_token_ids"], r["accepted_lengths"]) for r in rows]

    report, first = run(3, "a")
    _, again = run(3, "b")
    _, other = run(4, "c")
    assert first == again
    assert [f[0] for f in first] != [o[0] for o in other]
    assert len({tuple(first[i][0]) for i in range(3)}) > 1
    assert report["overall"]["outputs_match_baseline"] is None
    assert report["overall"]["speedup"] is not None
    assert all(0 <= t < 64 for f in first for t in f[0] + f[1])


def test_a_parallel_draft_is_detected_and_drafts_with_one_forward_per_step(models, prompt_files, references,
                                                                           tmp_path):
    """SPEC §7: a draft whose config names pard_token is a parallel draft; every report counts
    draft_forwards (a sequential draft: one per draft token, n-gram: none)."""
    from drafttrain.kinds.parallel_lm.model import mark_parallel

    draft = AutoModelForCausalLM.from_pretrained(models["draft"], dtype=torch.float32)
    mark_parallel(draft, 9, K)
    parallel_dir = save_pair(tmp_path / "parallel", draft, tiny_tokenizer())
    _, report, rows = run_ok(["eval", "--target", models["target"], "--draft", str(parallel_dir),
                              *prompts_argv(prompt_files), "--num-draft-tokens", str(K), "--max-new-tokens",
                              str(MAX_NEW), "--dtype", "float64", "--out", str(tmp_path / "out"), "--quiet"])
    assert [r["speculative_token_ids"] for r in rows] == references
    assert report["parallel_draft"] == {"pard_token": 9, "parallel_tokens": K}
    drafting_steps = sum(p > 0 for r in rows for p in r["proposed_lengths"])
    assert report["overall"]["draft_forwards"] == drafting_steps > 0
    _, sequential, _ = run_ok(["eval", "--target", models["target"], "--draft", models["draft"],
                               *prompts_argv(prompt_files), "--num-draft-tokens", str(K), "--max-new-tokens",
                               str(MAX_NEW), "--dtype", "float64", "--out", str(tmp_path / "seq"), "--quiet"])
    assert "parallel_draft" not in sequential
    assert sequential["overall"]["draft_forwards"] >= sequential["overall"]["draft_tokens"] > drafting_steps
    _, ngram, _ = run_ok(["eval", "--target", models["target"], "--method", "ngram", *prompts_argv(prompt_files),
                          "--max-new-tokens", str(MAX_NEW), "--out", str(tmp_path / "ngram"), "--quiet"])
    assert ngram["overall"]["draft_forwards"] == 0


PARALLEL_DAMAGES = {  # config.json edits of a parallel-draft export, and words its one error line holds
    "pard_token past the vocabulary": ({"pard_token": 9999}, ["pard_token 9999", "vocabulary of 64"]),
    "negative pard_token": ({"pard_token": -1}, ["pard_token -1"]),
    "pard_token not an integer": ({"pard_token": "x"}, ["pard_token 'x'"]),
    "pard_token removed, spd_type pard": ({"pard_token": None}, ["pard_token None"]),
    "parallel_tokens 0": ({"drafttrain": {"parallel_tokens": 0}}, ["parallel_tokens 0", "2 to 16"]),
    "parallel_tokens negative": ({"drafttrain": {"parallel_tokens": -2}}, ["parallel_tokens -2"]),
    "parallel_tokens past the bound": ({"drafttrain": {"parallel_tokens": 100000}}, ["parallel_tokens 100000"]),
    "parallel_tokens not an integer": ({"drafttrain": {"parallel_tokens": 2.5}}, ["parallel_tokens 2.5"]),
}


@pytest.mark.parametrize("case", sorted(PARALLEL_DAMAGES))
def test_a_parallel_export_is_checked_on_load_like_an_eagle3_one(models, prompt_files, tmp_path, capsys, case):
    """Issue 30 (C, D): pard_token 9999 or -1 was an IndexError traceback; pard_token removed or "x"
    beside spd_type "pard" decoded the draft as a sequential one (63 draft forwards instead of 19),
    silently; parallel_tokens 0, -2 or 100000 went into the report. Each is one error line naming
    the field, before any prompt is decoded, and nothing is written."""
    from drafttrain.kinds.parallel_lm.model import mark_parallel

    draft = AutoModelForCausalLM.from_pretrained(models["draft"], dtype=torch.float32)
    mark_parallel(draft, 9, K)
    path = Path(save_pair(tmp_path / "parallel", draft, tiny_tokenizer()))
    edit, words = PARALLEL_DAMAGES[case]
    config = json.loads((path / "config.json").read_text())
    config.update(edit)
    if config["pard_token"] is None:
        del config["pard_token"]
    (path / "config.json").write_text(json.dumps(config))
    argv = ["eval", "--target", models["target"], "--draft", str(path), *prompts_argv(prompt_files),
            "--num-draft-tokens", str(K), "--max-new-tokens", "4", "--dtype", "float64", "--out", str(tmp_path / "o"),
            "--quiet"]
    one_error_line(*cli(capsys, argv), str(path), *words)
    assert not (tmp_path / "o").exists()
