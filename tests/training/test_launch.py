"""`drafttrain launch` (accelerate launch, keeping the error contract) with real processes: a bad
input is the recipe's one `error:` line and exit 2; Ctrl-C is its one line and exit 130."""

from __future__ import annotations

import pytest

import os
import signal
import subprocess
import sys
import time

from training_helpers import ACCELERATE_CONFIGS, REPO, RECIPE, recipe_args, subprocess_env


def launch_argv(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "drafttrain.cli", "launch", "--config_file", str(ACCELERATE_CONFIGS / "single.yaml"),
            str(RECIPE), *args]


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
