"""`drafttrain eval` end to end (SPEC §2) on tiny models saved to disk.

Bad input must end in exit 2 with one `error:` line and no report; a good run's report must be
recomputable from its outputs.jsonl, and greedy outputs must equal transformers' own `generate`.
"""

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import huggingface_hub
import pytest
import torch
import transformers
from tiny import noisy_copy, save_pair, tiny_lm, tiny_tokenizer
from transformers import AutoModelForCausalLM

import drafttrain
from drafttrain.cli import main

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


def write_jsonl(path, lines):
    path.write_text("".join((l if isinstance(l, str) else json.dumps(l)) + "\n" for l in lines))
    return str(path)


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
    }
    swap_token_ids(dirs["swapped_vocab_draft"])
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
# Bad input: exit 2, one `error:` line, no report.


def cli(capsys, argv):
    capsys.readouterr()
    try:
        code = main(argv)
    except SystemExit as e:  # argparse usage errors
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def bad_argv(env, *extra, target=None, drafter=None, prompts=None):
    drafter = ["--draft", env.models["draft"]] if drafter is None else drafter
    return ["eval", "--target", target or env.models["target"], *drafter,
            *prompts_argv(prompts or env.prompt_files), "--dtype", "float64", "--max-new-tokens", "8",
            "--num-draft-tokens", str(K), "--quiet", *extra]


def _file(env, name, lines):
    return write_jsonl(env.tmp / name, lines)


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
    "missing --out (argparse)": lambda e: (bad_argv(e), ["--out", "required"]),
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
    out_dir = tmp_path / "out"
    if "--out" not in case:
        argv += ["--out", str(out_dir)]
    code, out, err = cli(capsys, argv)
    assert code == 2
    assert out == ""
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("error:")
    for word in words:
        assert word in lines[0], f"{word!r} not in {lines[0]!r}"
    assert not out_dir.exists() or not any(out_dir.iterdir())


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
    for text in ("| overall |", "| code |", "| chat |", "per_position_acceptance.png", "speedup_by_category.png",
                 f"{report['overall']['mean_accepted_length']:.3f}", f"{report['overall']['speedup']:.3f}"):
        assert text in md, text


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
