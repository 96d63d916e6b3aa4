"""`drafttrain launch` (accelerate launch, keeping the error contract) with real processes: a bad
input is the recipe's one `error:` line and exit 2; Ctrl-C is one line and exit 130, with one
process or two (gloo, on the CPU); workers die with a killed launcher, and the run resumes."""

from __future__ import annotations

import pytest

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
from training_helpers import ACCELERATE_CONFIGS, REPO, RECIPE, free_port, recipe_args, subprocess_env

from drafttrain.training.worker import INTERRUPTED


def launch_argv(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "drafttrain.cli", "launch", "--config_file", str(ACCELERATE_CONFIGS / "single.yaml"),
            str(RECIPE), *args]


def two_process_argv(args: list[str]) -> list[str]:
    """`drafttrain launch` of the recipe on two processes (DDP over gloo on the CPU): torch's elastic
    agent starts each worker in a session of its own."""
    return [sys.executable, "-m", "drafttrain.cli", "launch", "--config_file", str(ACCELERATE_CONFIGS / "ddp.yaml"),
            "--num_processes", "2", "--main_process_port", str(free_port()), str(RECIPE), *args]


def start(argv: list[str]) -> subprocess.Popen:
    """`argv` in a process group of its own, as a terminal starts a command: the terminal's Ctrl-C
    goes to that group."""
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=subprocess_env(),
                            cwd=REPO, start_new_session=True)


def workers(launcher: subprocess.Popen) -> list[int]:
    try:
        return [child.pid for child in psutil.Process(launcher.pid).children()]
    except psutil.NoSuchProcess:
        return []


def running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def gone(pids: list[int], timeout: float) -> bool:
    deadline = time.time() + timeout
    while any(map(running, pids)) and time.time() < deadline:
        time.sleep(0.1)
    return not any(map(running, pids))


def importing_torch(pid: int) -> bool:
    """Whether the process has mapped torch's C library: its `import torch` is under way (the rest of
    torch and transformers takes seconds more before the recipe's own code runs)."""
    try:
        return "libtorch" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


def wait_for(moment, launcher: subprocess.Popen, timeout: float = 240) -> None:
    deadline = time.time() + timeout
    while not moment():
        assert launcher.poll() is None, launcher.communicate()  # it ended before the moment came
        assert time.time() < deadline, "the moment never came"
        time.sleep(0.05)


def stop(launcher: subprocess.Popen) -> None:
    """Whatever a failed test left running: the launcher's group, and its workers' own groups."""
    for pid in [*workers(launcher), launcher.pid]:
        try:
            os.killpg(pid, signal.SIGKILL)
        except OSError:
            pass


def stderr_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip() and "%|" not in line]


@pytest.mark.slow
def test_bad_input_is_the_recipes_one_line_and_exit_2(assets, tmp_path):
    run = subprocess.run(launch_argv(recipe_args(assets, tmp_path / "run", "optim.lr=-1")), capture_output=True,
                         text=True, env=subprocess_env(), timeout=300, cwd=REPO)
    lines = stderr_lines(run.stderr)
    assert run.returncode == 2, run.stderr
    assert len(lines) == 1 and lines[0] == "error: optim.lr must be > 0, got -1.0", lines
    assert "Traceback" not in run.stderr


@pytest.mark.slow
def test_ctrl_c_is_the_recipes_one_line_and_exit_130(assets, tmp_path):
    out = tmp_path / "run"
    proc = subprocess.Popen(launch_argv(recipe_args(assets, out, "train.max_steps=100000", "train.eval_every=0",
                                                    "train.checkpoint_every=0")),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=subprocess_env(), cwd=REPO,
                            start_new_session=True)  # its own process group: the terminal's Ctrl-C reaches all
    try:
        deadline = time.time() + 240
        while not (out / "train_log.jsonl").exists() and time.time() < deadline and proc.poll() is None:
            time.sleep(0.5)
        assert proc.poll() is None, proc.communicate()
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    lines = stderr_lines(err)
    assert proc.returncode == 130, err
    assert len(lines) == 1 and lines[0].startswith("interrupted"), lines
    assert "Traceback" not in err


# When the terminal's Ctrl-C comes, and what shows that it has come (out: the run's output directory).
MOMENTS = {
    # B: both workers still import torch and transformers, before any recipe code runs
    "importing": lambda launcher, out: len(ws := workers(launcher)) == 2 and all(map(importing_torch, ws)),
    # A: the target's answers are being written, every rank a share (a fresh cache)
    "answering": lambda launcher, out: (out.parent / "cache").exists(),
    "training": lambda launcher, out: (out / "train_log.jsonl").exists(),
}


@pytest.mark.slow
@pytest.mark.parametrize("moment", list(MOMENTS))
def test_ctrl_c_to_a_two_process_launch_is_one_line_and_exit_130(moment, assets, tmp_path):
    """Issue 40 (A, B): torch's agent caught the Ctrl-C in the launcher and stopped the workers
    itself: exit 1 and its "Received 2 death signal" line, then a SignalException traceback; during
    the workers' imports three tracebacks (87 lines) and no `interrupted` line. Now the Ctrl-C
    reaches every worker, the launcher waits for them, and ends as a one-process run does."""
    out = tmp_path / "run"
    launcher = start(two_process_argv(recipe_args(assets, out, "train.max_steps=100000", "train.eval_every=0",
                                                  "train.checkpoint_every=0", f"data.cache_dir={tmp_path / 'cache'}")))
    try:
        wait_for(lambda: MOMENTS[moment](launcher, out), launcher)
        started = workers(launcher)
        os.killpg(launcher.pid, signal.SIGINT)
        _, err = launcher.communicate(timeout=120)
    finally:
        stop(launcher)
    lines = stderr_lines(err)
    assert launcher.returncode == 130, err
    assert lines == [INTERRUPTED], err
    assert "Traceback" not in err
    assert len(started) == 2 and gone(started, timeout=1)


def checkpoints(out) -> list[int]:
    """The steps of the run's complete checkpoints (one being written is a hidden .step-N.tmp)."""
    return sorted(int(p.name.removeprefix("step-")) for p in (out / "checkpoints").glob("step-*") if p.is_dir())


@pytest.mark.slow
def test_workers_die_with_their_killed_launcher_and_the_run_resumes(assets, tmp_path):
    """Issue 40 (C): SIGKILL to the launcher's process group left both workers, each in a process
    group of its own, to finish the answers and the training and write final/ with nobody watching.
    Now they die with it, and the same command resumes from the newest complete checkpoint."""
    out = tmp_path / "run"
    args = recipe_args(assets, out, "train.max_steps=60", "train.eval_every=0", "train.checkpoint_every=5",
                       "train.keep_checkpoints=100", "eval.num_prompts=2")
    launcher = start(two_process_argv(args))
    try:
        wait_for(lambda: (out / "checkpoints").is_dir() and checkpoints(out), launcher)
        started = workers(launcher)
        os.killpg(launcher.pid, signal.SIGKILL)
        launcher.communicate(timeout=60)
        assert len(started) == 2 and gone(started, timeout=10), "the workers outlived their launcher"
    finally:
        stop(launcher)
    assert not (out / "final").exists(), "the orphaned workers finished the run"
    newest = checkpoints(out)[-1]
    resumed = subprocess.run(two_process_argv(args), capture_output=True, text=True, env=subprocess_env(), cwd=REPO,
                             timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming from {out / 'checkpoints' / f'step-{newest}'} (step {newest})" in resumed.stdout
    assert (out / "final" / "model.safetensors").is_file() and checkpoints(out)[-1] == 60


# A launch whose child dies by a signal (accelerate's launcher stood in for), then a Ctrl-C that
# reaches the launcher during interpreter shutdown, as the terminal's does just after a recipe ends.
SIGNAL_DEATH = """
import atexit, os, signal, subprocess, sys, time, types
import accelerate.commands.launch as accelerate_launch

def died(args):
    if {multi}:
        error = RuntimeError("ChildFailedError")
        error.failures = {{0: types.SimpleNamespace(exitcode=0), 1: types.SimpleNamespace(exitcode=-{signal})}}
        raise error
    raise subprocess.CalledProcessError(-{signal}, ["python", "recipe.py"])

def ctrl_c_at_exit():
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.2)

accelerate_launch.launch_command = died
atexit.register(ctrl_c_at_exit)
from drafttrain.cli import main
sys.exit(main(["launch", "recipe.py"]))
"""


@pytest.mark.parametrize("multi", [False, True])
@pytest.mark.parametrize("sig, code, word", [(signal.SIGINT, 130, "interrupted"), (signal.SIGKILL, 137, "killed")])
def test_a_child_killed_by_a_signal_is_128_plus_the_signal_and_one_line(multi, sig, code, word):
    """Issue 30 (F): a single process's returncode -2 came back unchanged (sys.exit(-2): exit 254)
    where the multi-process branch mapped it to 130, and a Ctrl-C during the launcher's shutdown
    was an `Exception ignored in atexit` KeyboardInterrupt traceback. Any signal death of a child is
    now the shell's 128 + N in both branches, with one line, and nothing after it."""
    script = SIGNAL_DEATH.format(multi=multi, signal=int(sig))
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=subprocess_env(),
                         timeout=120, cwd=REPO)
    lines = stderr_lines(run.stderr)
    assert run.returncode == code, run.stderr
    assert len(lines) == 1 and lines[0].startswith(word) and sig.name in lines[0], lines
