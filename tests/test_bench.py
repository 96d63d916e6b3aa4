"""`drafttrain bench` on a tiny random model (CPU): the files it writes, the internal consistency
of its figures (never the speeds themselves), and one `error:` line for bad input."""

from __future__ import annotations

import json
from statistics import median

import pytest
from tiny import save_pair, tiny_lm, tiny_tokenizer

from drafttrain.cli import main

K = 2
MAX_NEW = 10


def run(tmp_path, *extra, out="bench", overhead=False):
    """`drafttrain bench` on the CPU; the tiny models' step overhead (15 s) only where asked."""
    argv = ["bench", "--device", "cpu", "--max-new-tokens", str(MAX_NEW), "--num-draft-tokens", str(K),
            "--repeats", "2", "--oracle-alpha", "0,0.6,1", "--quiet", "--out", str(tmp_path / out), *extra,
            *([] if overhead else ["--no-step-overhead"])]
    return main(argv)


def check_summary(s):
    assert s["min"] <= s["median"] <= s["max"]
    assert s["median"] == pytest.approx(median(s["runs"]))


def test_bench_figures_are_consistent(tmp_path):
    assert run(tmp_path, "--shape", "tiny", "--num-prompts", "2", "--prompt-length", "9", overhead=True) == 0
    out = tmp_path / "bench"
    assert sorted(p.name for p in out.iterdir()) == ["bench.json", "bench.md", "bench.png"]
    assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    b = json.loads((out / "bench.json").read_text())

    # Roofline: the bytes one decode step reads over the measured bandwidth.
    check_summary(b["bandwidth"]["seconds"])
    assert b["bandwidth"]["bytes_per_s"] == pytest.approx(b["bandwidth"]["bytes"] / b["bandwidth"]["seconds"]["median"])
    m = b["model"]
    assert not m["tied_embeddings"] and m["read_per_step_bytes"] == m["parameters_bytes"] - 512 * 64 * 4
    assert b["roofline_tokens_per_s"] == pytest.approx(b["bandwidth"]["bytes_per_s"] / m["read_per_step_bytes"])

    plain = b["plain_decoding"]
    assert set(plain) == {"drafttrain eager", "drafttrain static", "transformers dynamic cache",
                          "transformers static cache + compile"}
    assert "CUDA only" in plain["transformers static cache + compile"]["skipped"]
    for r in plain.values():
        if "tokens_per_s" in r:
            check_summary(r["tokens_per_s"])
            assert r["fraction_of_roofline"] == pytest.approx(r["tokens_per_s"]["median"] / b["roofline_tokens_per_s"])
    assert b["outputs"]["all_equal"] is True  # float32, same greedy text on both engines

    engine = b["config"]["engine_resolved"]
    assert engine == "eager"  # auto on CPU
    rows = b["forward"]["rows"]
    assert [(r["tokens"], r["kind"]) for r in rows] == [(n, "chain") for n in range(1, K + 2)] + [(23, "tree")]
    one = rows[0]["seconds"]["median"]
    for r in rows:
        check_summary(r["seconds"])
        assert r["ratio_to_one_token"] == pytest.approx(r["seconds"]["median"] / one)
    cost = rows[K]["ratio_to_one_token"]

    base = plain[f"drafttrain {engine}"]["tokens_per_s"]["median"]
    oracle = {r["alpha"]: r for r in b["oracle"]["rows"]}
    assert set(oracle) == {0.0, 0.6, 1.0} and b["oracle"]["k"] == K
    for alpha, r in oracle.items():
        predicted = K + 1 if alpha == 1 else (1 - alpha ** (K + 1)) / (1 - alpha)
        assert r["predicted_speedup"] == pytest.approx(predicted)
        assert r["measured_speedup"] == pytest.approx(r["tokens_per_s"]["median"] / base)
        assert r["efficiency"] == pytest.approx(r["measured_speedup"] / predicted)
        assert r["predicted_speedup_with_cost"] == pytest.approx(predicted / cost)
        assert r["outputs_match_plain"] is True
    # alpha 1 accepts every draft: 10 tokens per prompt in steps of 3, 3, 3, 1; alpha 0 none.
    assert oracle[1.0]["acceptance"] == 1.0 and oracle[1.0]["tau"] == pytest.approx(10 / 4)
    assert oracle[0.0]["acceptance"] == 0.0 and oracle[0.0]["tau"] == 1.0

    # Every drafter kind's overhead with tiny models: one host sync per step (the floor), plain
    # decoding the fewest eager ops, the node-by-node EAGLE-3 tree's 206 gone.
    overhead = {r["drafter"]: r for r in b["step_overhead"]["rows"]}
    assert len(overhead) == 12 and {"suffix", "DFlash block"} <= set(overhead)  # every kind's rows but the oracle's
    assert all(r["syncs_per_step"] == 1 and r["step_ms"] > 0 for r in overhead.values())
    assert min(overhead.values(), key=lambda r: r["eager_ops_per_step"])["drafter"] == "plain"
    assert overhead["EAGLE-3 dynamic tree"]["eager_ops_per_step"] <= 40

    md = (out / "bench.md").read_text()
    for text in ("## Roofline", "## Plain decoding", "## One forward", "## Oracle speculation", "bench.png",
                 f"{b['roofline_tokens_per_s']:,.1f}", "skipped: transformers compiles", "## Step overhead"):
        assert text in md
    assert b["capture"] == {"cudagraph_skips": None, "cuda_graphs": None}  # nothing captured off CUDA
    assert "CUDA graphs recorded" not in md


def test_bench_reports_the_cuda_graphs_its_own_steps_recorded(tmp_path, monkeypatch):
    """Issue 36: bench.json's `capture` and a bench.md line say how many CUDA graphs the run's own
    compiled steps recorded and how many graphs skipped capture, read from torch's counters (set by
    hand here, the run made to read them as on CUDA) since the run's start; transformers' compiled
    `generate` graphs are not ours and not counted."""
    from collections import Counter

    from torch._dynamo.utils import counters

    from drafttrain.bench import measure
    from drafttrain.bench import run as bench_run
    from drafttrain.decoding.engines import compiled

    monkeypatch.setitem(counters, "inductor", Counter(cudagraph_skips=4))  # before the run: not its own
    monkeypatch.setitem(counters, "drafttrain", Counter(cuda_graphs=9))
    monkeypatch.setattr(bench_run, "capture_counts", lambda device, since=None: compiled.capture_counts("cuda", since))

    def counting(fn, graphs, skips):
        def wrapped(*args, **kwargs):
            counters["drafttrain"]["cuda_graphs"] += graphs
            counters["inductor"]["cudagraph_skips"] += skips
            return fn(*args, **kwargs)
        return wrapped

    monkeypatch.setattr(measure, "forward_times", counting(measure.forward_times, 5, 0))
    monkeypatch.setattr(measure, "hf_generate_rate", counting(measure.hf_generate_rate, 100, 1))
    assert run(tmp_path, "--shape", "tiny", "--num-prompts", "1", "--prompt-length", "9") == 0
    out = tmp_path / "bench"
    assert json.loads((out / "bench.json").read_text())["capture"] == {"cudagraph_skips": 0, "cuda_graphs": 5}
    assert "**5** CUDA graphs recorded, cudagraph_skips **0**" in (out / "bench.md").read_text()


def test_bench_on_a_model_directory_with_a_prompt_file(tmp_path):
    target = save_pair(tmp_path / "target", tiny_lm(0), tiny_tokenizer())
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "w5 w9 w13 w7"}\n{"turns": ["w20 w21"]}\n{"prompt": "w30"}\n')
    assert run(tmp_path, "--target", target, "--prompts", str(prompts), "--limit", "2", "--engine", "static",
               "--no-hf-generate", "--dtype", "float64") == 0
    b = json.loads((tmp_path / "bench" / "bench.json").read_text())
    assert b["config"]["num_prompts"] == 2 and b["model"]["dtype"] == "float64"
    assert b["forward"]["engine"] == b["oracle"]["engine"] == "static"
    assert set(b["plain_decoding"]) == {"drafttrain eager", "drafttrain static"}
    assert b["forward"]["prompt_tokens"] == 4  # the first prompt, tokenized verbatim


@pytest.mark.parametrize("args,message", [
    (["--shape", "huge"], "unknown --shape 'huge'"),
    (["--shape", "tiny", "--prompts", "x.jsonl"], "--prompts needs --target"),
    (["--shape", "tiny", "--oracle-alpha", "0.5,1.5"], "--oracle-alpha must list acceptance rates in [0, 1]"),
    (["--shape", "tiny", "--oracle-alpha", "half"], "not a comma-separated list"),
    (["--shape", "tiny", "--num-draft-tokens", "0"], "--num-draft-tokens must be at least 1"),
    (["--shape", "tiny", "--engine", "fast"], "unknown --engine 'fast'"),
    ([], "exactly one of --target DIR and --shape"),
    (["--target", "a", "--shape", "tiny"], "not allowed with argument"),
])
def test_bad_input_is_one_error_line(tmp_path, capsys, args, message):
    try:
        code = run(tmp_path, *args)
    except SystemExit as e:  # argparse's own checks exit from the parser
        code = e.code
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and message in err[0]
    assert not (tmp_path / "bench").exists()


def test_a_non_empty_out_is_refused_without_overwrite(tmp_path, capsys):
    out = tmp_path / "bench"
    out.mkdir()
    (out / "keep.txt").write_text("earlier run")
    assert run(tmp_path, "--shape", "tiny", "--num-prompts", "1", "--prompt-length", "4") == 2
    assert "pass --overwrite" in capsys.readouterr().err
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    assert run(tmp_path, "--shape", "tiny", "--num-prompts", "1", "--prompt-length", "4", "--no-hf-generate",
               "--oracle-alpha", "0.5", "--overwrite") == 0
    assert sorted(p.name for p in out.iterdir()) == ["bench.json", "bench.md", "bench.png"]


def one_error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:"), err
    return err[0]


def test_a_prompt_longer_than_the_context_is_refused_as_eval_refuses_it(tmp_path, capsys):
    """bench measured a prompt past the model's context, which eval refuses: now the same check."""
    target = save_pair(tmp_path / "target", tiny_lm(0, max_positions=32), tiny_tokenizer())
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "w5 w9"}\n' + '{"prompt": "%s"}\n' % " ".join(["w7"] * 25))  # 25 + 10 > 32
    capsys.readouterr()  # save_pair's progress bar
    assert run(tmp_path, "--target", target, "--prompts", str(prompts), "--no-hf-generate") == 2
    line = one_error(capsys)
    assert f"{prompts}:2" in line and "context of 32 tokens" in line
    assert not (tmp_path / "bench").exists()


def test_a_random_prompt_length_past_the_context_is_refused(tmp_path, capsys):
    assert run(tmp_path, "--shape", "tiny", "--prompt-length", "2040", "--no-hf-generate") == 2  # 2040 + 10 > 2048
    line = one_error(capsys)
    assert "--prompt-length 2040" in line and "context of 2048 tokens" in line
    assert not (tmp_path / "bench").exists()


def test_llama_8b_parameters_are_counted_without_allocating():
    from drafttrain.bench import shape_parameters

    assert shape_parameters("llama-8b") == 8_030_261_248  # Meta's published Llama-3-8B size


def test_a_shape_that_does_not_fit_in_memory_is_refused_before_it_is_built(tmp_path, capsys, monkeypatch):
    """llama-8b on the CPU was killed by the kernel at ~20 GB after 205 s, with no message."""
    import drafttrain.bench.target as bench

    def never(*args, **kwargs):
        raise AssertionError("the shape was built although it does not fit")

    monkeypatch.setattr(bench, "available_memory", lambda device: 16 * 2**30)
    monkeypatch.setattr(bench, "build_shape", never)
    assert run(tmp_path, "--shape", "llama-8b", "--dtype", "float32") == 2
    line = one_error(capsys)
    # 8.03e9 parameters x 4 bytes x 1.2 headroom = 35.9 GiB
    assert "--shape llama-8b needs about 35.9 GiB" in line and "16.0 GiB is available" in line, line
    assert not (tmp_path / "bench").exists()


def test_a_shape_that_fits_passes_the_memory_check(monkeypatch):
    import torch

    import drafttrain.bench.target as bench

    monkeypatch.setattr(bench, "available_memory", lambda device: 64 * 2**30)
    bench.check_shape_fits("llama-8b", torch.bfloat16, torch.device("cpu"))  # 8.03e9 x 2 x 1.2 = 17.9 GiB


def test_a_busy_machine_is_a_warning_and_a_note(tmp_path, capsys, monkeypatch):
    """A forward curve whose repeats spread wide (another job on the cores) is never turned into
    ratios silently: one `warning:` line naming the busy machine, and a note in bench.json."""
    from drafttrain.bench import measure

    real = measure.forward_times

    def busy(*args, **kwargs):
        rows, seconds = real(*args, **kwargs)
        rows[0]["repeats"] = [1.0, 1.0, 9.0, 20.0, 1.0]  # 1 token: a spread far above its median
        return rows, seconds

    monkeypatch.setattr(measure, "forward_times", busy)
    assert run(tmp_path, "--shape", "tiny", "--num-prompts", "1", "--prompt-length", "9") == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "busy machine" in warnings[0]
    notes = json.loads((tmp_path / "bench" / "bench.json").read_text())["notes"]
    assert any(n.startswith("busy machine") for n in notes)
    assert all("repeats" not in r for r in json.loads((tmp_path / "bench" / "bench.json").read_text())["forward"]["rows"])


@pytest.mark.parametrize("flags, words", [(["--num-prompts", "2"], ["--num-prompts", "--limit N"]),
                                          (["--prompt-length", "9"], ["--prompt-length", "--limit N"]),
                                          (["--limit", "2"], ["--limit", "--num-prompts N"])])
def test_prompt_flags_that_do_not_apply_are_refused(tmp_path, capsys, flags, words):
    """Issue 30 (I): `--prompts P --num-prompts 2` benched every prompt of P, silently. --num-prompts
    and --prompt-length shape random prompts and --limit samples files; `vllm bench` users expect
    --num-prompts to cap what is benched, so a cap that would not be applied is refused, naming the
    flag that does apply, before any model loads."""
    target = save_pair(tmp_path / "target", tiny_lm(0), tiny_tokenizer())
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "w5 w9"}\n{"prompt": "w7 w8"}\n{"prompt": "w9 w10"}\n')
    capsys.readouterr()
    source = ["--target", target, "--prompts", str(prompts)] if flags[0] != "--limit" else ["--shape", "tiny"]
    assert run(tmp_path, *source, *flags) == 2
    line = one_error(capsys)
    assert all(w in line for w in words), line
    assert not (tmp_path / "bench").exists()


def test_a_run_stopped_in_the_step_overhead_section_leaves_the_targets_figures(tmp_path, monkeypatch):
    """The tiny models' section runs last and compiles a graph per drafter kind (minutes on a GPU,
    where a device's time limit stopped it twice before any figure was written): the target's
    figures are written before it, and say that the section did not finish."""
    from drafttrain.bench import run as bench_run

    def stopped(*args, **kwargs):
        raise KeyboardInterrupt  # what a timeout's signal does to the run

    monkeypatch.setattr(bench_run, "step_overheads", stopped)
    assert run(tmp_path, "--shape", "tiny", "--num-prompts", "1", "--prompt-length", "9", overhead=True) != 0
    out = tmp_path / "bench"
    assert sorted(p.name for p in out.iterdir()) == ["bench.json", "bench.md", "bench.png"]
    b = json.loads((out / "bench.json").read_text())
    assert b["step_overhead"] is None and b["plain_decoding"]["drafttrain static"]["tokens_per_s"]["median"] > 0
    assert any("step overhead not yet measured" in n for n in b["notes"])
    assert not list(tmp_path.glob("*partial*"))  # no staging directory left beside it
