"""Helpers of the evaluation tests: damaged weights, directory snapshots, in-process CLI runs."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from safetensors.torch import load_file, save_file

from drafttrain.cli import main


def write_jsonl(path, lines):
    path = Path(path)
    path.write_text("".join((l if isinstance(l, str) else json.dumps(l)) + "\n" for l in lines))
    return str(path)


def truncate(path):
    data = Path(path).read_bytes()
    Path(path).write_bytes(data[: len(data) // 2])


def empty(path):
    Path(path).write_bytes(b"")


def nan_weights(path):
    state = load_file(str(path))
    name = sorted(state)[-1]
    state[name] = state[name].clone()
    state[name].view(-1)[:4] = float("nan")
    save_file(state, str(path), metadata={"format": "pt"})


DAMAGES = {"truncated": truncate, "empty": empty, "nan": nan_weights}


def damaged_copy(src, dst, damage, weights="model.safetensors"):
    """A copy of the model (or heads) directory `src` whose weights file is damaged."""
    import shutil

    shutil.copytree(src, dst)
    DAMAGES[damage](Path(dst) / weights)
    return str(dst)


def snapshot(root) -> dict[str, str]:
    """Every file and directory under `root` with a hash of its bytes: equal snapshots mean untouched."""
    root = Path(root)
    out = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        out[rel] = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
    return out


def cli(capsys, argv):
    """(exit code, stdout, stderr) of `drafttrain ARGV` run in this process."""
    capsys.readouterr()
    try:
        code = main(argv)
    except SystemExit as e:  # argparse usage errors
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def one_error_line(code, out, err, *words):
    assert code == 2, err
    assert out == ""
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("error:"), lines[0]
    for word in words:
        assert word in lines[0], f"{word!r} not in {lines[0]!r}"
    return lines[0]
