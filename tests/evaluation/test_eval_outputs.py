"""`--out` of eval/compare (SPEC §2 rev 2): refused when not empty, replaced whole with --overwrite,
untouched by a crash, a full disk or Ctrl-C; staging folders of killed runs cleaned at the next start."""

import errno
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from eval_helpers import cli, one_error_line, snapshot, write_jsonl
from tiny import noisy_copy, save_pair, tiny_lm, tiny_tokenizer

import drafttrain.evaluation.report as report_module
import drafttrain.evaluation.run as run_module
from drafttrain.cli import main
from drafttrain.evaluation.cli import INTERRUPTED_REPORT
from drafttrain.evaluation.config import EvalConfig
from drafttrain.evaluation.outputs import clean_leftovers, prepare_output_dir
from drafttrain.errors import UserError


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("outputs")
    tok = tiny_tokenizer(64)
    target = tiny_lm(0, dtype=torch.float32)
    save_pair(root / "target", target, tok)
    save_pair(root / "draft", noisy_copy(target), tok)
    write_jsonl(root / "p.jsonl", [{"id": i, "prompt": f"w{5 + i} w{9 + i} w{13 + i}", "category": "ab"[i % 2]}
                                   for i in range(4)])
    return root


def eval_argv(setup, out, *extra, drafter=None):
    drafter = drafter or ["--draft", str(setup / "draft")]
    return ["eval", "--target", str(setup / "target"), *drafter, "--prompts", str(setup / "p.jsonl"),
            "--max-new-tokens", "8", "--out", str(out), "--quiet", *extra]


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_overwrite_replaces_an_earlier_report_whole(setup, tmp_path):
    out = tmp_path / "report"
    assert main(eval_argv(setup, out)) == 0
    assert (out / "speedup_by_category.png").is_file()
    (out / "extra").mkdir()
    (out / "extra" / "stale.txt").write_text("from an earlier run")
    assert main(eval_argv(setup, out, "--overwrite", "--baseline", "none", drafter=["--method", "none"])) == 0
    assert sorted(p.name for p in out.iterdir()) == ["outputs.jsonl", "report.json", "report.md"]
    assert json.loads((out / "report.json").read_text())["config"]["method"] == "none"
    assert sorted(os.listdir(tmp_path)) == ["report"]  # no staging or replaced folder beside it


def test_an_empty_existing_directory_needs_no_overwrite(setup, tmp_path):
    (tmp_path / "report").mkdir()
    assert main(eval_argv(setup, tmp_path / "report", drafter=["--method", "ngram"])) == 0
    assert (tmp_path / "report" / "report.json").is_file()


def test_leftovers_of_killed_runs_are_cleaned_at_the_next_start(setup, tmp_path):
    out = tmp_path / "report"
    out.mkdir()
    dead = dead_pid()
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        for name in (f".report.partial-{dead}", f".report.replaced-{dead}", f".report.partial-{sleeper.pid}"):
            (tmp_path / name).mkdir()
            (tmp_path / name / "report.json").write_text("{}")
        (tmp_path / ".other.partial-1").mkdir()  # another directory's: not ours to touch
        assert main(eval_argv(setup, out, drafter=["--method", "ngram"])) == 0
        assert sorted(os.listdir(tmp_path)) == [".other.partial-1", f".report.partial-{sleeper.pid}", "report"]
    finally:
        sleeper.kill()
        sleeper.wait()


def test_a_swap_cut_short_by_a_kill_is_undone(tmp_path):
    """Killed between the swap's two renames: the earlier report sits under its `replaced` name and
    --out is gone. The next start puts it back (and then refuses to overwrite it silently)."""
    replaced = tmp_path / f".report.replaced-{dead_pid()}"
    replaced.mkdir()
    (replaced / "report.json").write_text('{"earlier": true}')
    clean_leftovers(tmp_path / "report")
    assert json.loads((tmp_path / "report" / "report.json").read_text()) == {"earlier": True}
    with pytest.raises(UserError, match="not empty"):
        prepare_output_dir(tmp_path / "report", overwrite=False)


def test_a_full_disk_while_writing_is_one_error_line_and_the_earlier_report_stays(setup, tmp_path, capsys,
                                                                                  monkeypatch):
    out = tmp_path / "report"
    assert main(eval_argv(setup, out, drafter=["--method", "ngram"])) == 0
    before = snapshot(tmp_path)
    real = report_module.write_jsonl

    def disk_full(path, rows):
        real(path, rows[:1])  # part of the file is written, then the disk is full
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(report_module, "write_jsonl", disk_full)
    one_error_line(*cli(capsys, eval_argv(setup, out, "--overwrite")), "cannot write the report",
                   "No space left on device")
    assert snapshot(tmp_path) == before


def test_a_crash_mid_run_leaves_the_earlier_report_intact(setup, tmp_path):
    out = tmp_path / "report"
    assert main(eval_argv(setup, out, drafter=["--method", "ngram"])) == 0
    before = snapshot(tmp_path)

    def crashing(cfg, models, **kwargs):
        raise RuntimeError("simulated crash")

    cfg = EvalConfig(target=str(setup / "target"), method="ngram", prompts=[str(setup / "p.jsonl")], out=str(out),
                     max_new_tokens=8, overwrite=True)
    with pytest.raises(RuntimeError, match="simulated crash"):
        run_module.run_eval(cfg, progress=False, decoder_factory=crashing)
    assert snapshot(tmp_path) == before


def interrupting_factory(after_calls):
    """A decoder factory whose decoders raise KeyboardInterrupt (what Ctrl-C raises) mid-run."""
    real = run_module.make_decoder
    calls = {"n": 0}

    def factory(*args, **kwargs):
        decoder = real(*args, **kwargs)
        generate = decoder.generate

        def interrupted_generate(prompt, max_new):
            calls["n"] += 1
            if calls["n"] > after_calls:
                raise KeyboardInterrupt
            return generate(prompt, max_new)

        decoder.generate = interrupted_generate
        return decoder

    return factory


@pytest.mark.parametrize("command", ["eval", "compare"])
def test_ctrl_c_in_process_is_one_line_exit_130_and_no_report(command, setup, tmp_path, capsys, monkeypatch):
    out = tmp_path / "report"
    (out / "old").mkdir(parents=True)
    (out / "report.json").write_text('{"earlier": true}')
    before = snapshot(tmp_path)
    monkeypatch.setattr(run_module, "make_decoder", interrupting_factory(after_calls=5))
    if command == "eval":
        argv = eval_argv(setup, out, "--overwrite")
    else:
        argv = ["compare", "--target", str(setup / "target"), "--drafter", "a=ngram", "--drafter",
                f"b=draft:{setup / 'draft'}", "--prompts", str(setup / "p.jsonl"), "--max-new-tokens", "8",
                "--out", str(out), "--quiet", "--overwrite"]
    code, stdout, stderr = cli(capsys, argv)
    assert code == 130
    assert stdout == "" and stderr.splitlines() == [INTERRUPTED_REPORT]
    assert snapshot(tmp_path) == before


def test_ctrl_c_during_replay_is_one_line_exit_130(setup, tmp_path, capsys, monkeypatch):
    import drafttrain.evaluation.replay as replay_module

    assert main(eval_argv(setup, tmp_path / "report", drafter=["--method", "ngram"])) == 0

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(replay_module, "teacher_forced_steps", interrupted)
    code, stdout, stderr = cli(capsys, ["replay", "--target", str(setup / "target"), "--prompts",
                                        str(setup / "p.jsonl"), "--outputs", str(tmp_path / "report" / "outputs.jsonl"),
                                        "--draft", f"d={setup / 'draft'}", "--quiet"])
    assert code == 130 and stdout == "" and stderr.splitlines() == ["interrupted"]


@pytest.mark.slow
def test_sigint_to_a_real_process_mid_run(setup, tmp_path):
    """Ctrl-C is SIGINT to the process: exit 130, one line, no traceback, the earlier report untouched."""
    prompts = write_jsonl(tmp_path / "many.jsonl", [{"id": i, "prompt": f"w{5 + i % 50} w{9 + i % 40} w{13}"}
                                                   for i in range(400)])
    out = tmp_path / "report"
    out.mkdir()
    (out / "report.json").write_text('{"earlier": true}')
    before = snapshot(tmp_path)
    script = Path(sys.executable).with_name("drafttrain")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "drafttrain.cli"]
    argv = ["eval", "--target", str(setup / "target"), "--draft", str(setup / "draft"), "--prompts", prompts,
            "--max-new-tokens", "48", "--out", str(out), "--overwrite"]  # progress bar on: it says when the run is on
    proc = subprocess.Popen(command + argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"},
                            # a shell without job control may start us with SIGINT ignored; Ctrl-C works in a terminal
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    chunks = []

    def read():
        while chunk := proc.stderr.read1(4096):
            chunks.append(chunk)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    deadline = time.monotonic() + 240
    while b"prompt" not in b"".join(chunks) or b"/400" not in b"".join(chunks):
        assert proc.poll() is None, b"".join(chunks).decode()
        assert time.monotonic() < deadline, "the run never started decoding"
        time.sleep(0.1)
    time.sleep(0.5)
    assert proc.poll() is None, "the run finished before it could be interrupted"
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=120)
    reader.join(timeout=10)
    stdout = proc.stdout.read()
    err = b"".join(chunks).decode()
    assert proc.returncode == 130, err
    assert "Traceback" not in err and stdout == b""
    last = [line for line in err.replace("\r", "\n").splitlines() if line.strip()][-1]
    assert last == INTERRUPTED_REPORT
    assert snapshot(tmp_path) == before  # the earlier report as it was, no staging folder left


def test_a_report_written_into_a_new_out_during_the_run_is_kept(setup, tmp_path, capsys, monkeypatch):
    """Another run filling --out while this one decodes: this one refuses, the other's report stays."""
    out = tmp_path / "report"
    real = run_module.make_decoder

    def another_run_finishes_meanwhile(cfg, models, **kwargs):
        if not out.exists():
            out.mkdir()
            (out / "report.json").write_text('{"other": true}')
        return real(cfg, models, **kwargs)

    monkeypatch.setattr(run_module, "make_decoder", another_run_finishes_meanwhile)
    one_error_line(*cli(capsys, eval_argv(setup, out, drafter=["--method", "ngram"])), "filled by another run")
    assert os.listdir(out) == ["report.json"] and json.loads((out / "report.json").read_text()) == {"other": True}
    assert sorted(os.listdir(tmp_path)) == ["report"]  # no staging folder left behind


@pytest.mark.slow
def test_two_real_runs_into_one_new_out_leave_one_report_and_one_error(setup, tmp_path):
    out = tmp_path / "report"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2]) + os.pathsep
           + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, "-m", "drafttrain.cli", *eval_argv(setup, out, drafter=["--method", "ngram"])]
    runs = [subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
            for _ in range(2)]
    results = [(p.wait(timeout=300), p.stderr.read()) for p in runs]
    codes = sorted(code for code, _ in results)
    assert codes == [0, 2], results
    loser = next(err for code, err in results if code == 2).strip().splitlines()
    # refused at the end (it lost the race), or at the start if the other was already done
    assert len(loser) == 1 and loser[0].startswith("error:")
    assert "filled by another run" in loser[0] or "exists and is not empty" in loser[0]
    report = json.loads((out / "report.json").read_text())
    assert report["overall"]["prompts"] == 4
    assert sorted(os.listdir(tmp_path)) == ["report"]
