"""`drafttrain` as a real process: one line and exit 130 for a Ctrl-C at any moment, start-up included."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest


def drafttrain_command() -> list[str]:
    script = Path(sys.executable).with_name("drafttrain")
    return [str(script)] if script.exists() else [sys.executable, "-m", "drafttrain.cli"]


def importing_torch(pid: int) -> bool:
    """Whether the process has mapped torch's C library: its `import torch` is under way (what
    follows, the rest of torch and transformers, takes seconds more before any argument is read)."""
    try:
        return "libtorch" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


def test_ctrl_c_while_torch_is_imported_is_one_line_and_exit_130(tmp_path):
    """A Ctrl-C during `drafttrain eval`'s start-up printed a 44-line KeyboardInterrupt traceback."""
    argv = ["eval", "--target", str(tmp_path / "none"), "--method", "none", "--prompts", str(tmp_path / "p.jsonl"),
            "--out", str(tmp_path / "out")]
    proc = subprocess.Popen(drafttrain_command() + argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"},
                            # a shell without job control may start us with SIGINT ignored; Ctrl-C works in a terminal
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 120
    while not importing_torch(proc.pid):
        assert proc.poll() is None, proc.stderr.read().decode()
        assert time.monotonic() < deadline, "torch was never imported"
        time.sleep(0.005)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    err = err.decode()
    assert "Traceback" not in err, err
    assert proc.returncode == 130, err
    assert err.splitlines() == ["interrupted"] and out == b""  # before any argument was read: the plain line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("command", ["eval", "compare", "replay", "preflight", "assets", "bench", "launch"])
def test_every_subcommand_prints_its_help(command, capsys):
    """Flags are generated from the settings dataclasses: --help must render every one of them."""
    from drafttrain.cli import main

    with pytest.raises(SystemExit) as e:
        main([command, "--help"])
    assert e.value.code == 0
    assert "usage: drafttrain " + command in capsys.readouterr().out
