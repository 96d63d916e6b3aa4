"""Checkpoints on disk: written atomically, verified before use, pruned without losing the good ones.

A checkpoint is `checkpoints/step-N/`: accelerate's `save_state` files (weights, optimizer,
scheduler, random states of every rank), `trainer_state.json`, and `manifest.json` with the
size and sha256 of every other file. It is written as `checkpoints/.step-N.tmp/`, the manifest
LAST, then renamed: a kill at any moment leaves either no `step-N` or a complete one.

Before a resume the newest checkpoint is checked against its manifest; one whose files were
truncated, emptied, deleted or overwritten is skipped (with a `warning:` line naming it, and set
aside as `step-N.damaged`), and the newest intact one is used. With none intact the resume stops
with one error line rather than train from garbage.

Checkpoints written before drafttrain kept manifests (a `trainer_state.json` and no
`manifest.json`) are still resumed from, with a warning that they are unverified: what can be
checked still is (loading must succeed, and the loaded weights must be finite), but a same-size
overwrite of their files would go unnoticed. Every checkpoint written since carries a manifest.

`best/` holds the weights of the best evaluation so far (not a resumable checkpoint: it has no
optimizer state); `best.json` carries their sha256, checked before they are exported.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..assets import file_sha256
from ..errors import UserError
from ..export import writing
from ..fileio import atomic_dir, atomic_write_json
from ..models import first_line
from .distributed import raise_if_any

CHECKPOINT_DIR = "checkpoints"
STATE_FILE = "trainer_state.json"
MANIFEST_FILE = "manifest.json"
MANIFEST_FORMAT = 1
BEST_DIR = "best"
BEST_WEIGHTS = "model.safetensors"
BEST_META = "best.json"
DAMAGED_SUFFIX = ".damaged"
_STEP_DIR = re.compile(r"^step-(\d+)$")


# ----------------------------------------------------------------------------- manifests


def write_manifest(directory: Path) -> None:
    """`manifest.json`: relative path, size and sha256 of every file under `directory` (written last)."""
    files = {}
    for path in sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST_FILE):
        files[path.relative_to(directory).as_posix()] = {"size": path.stat().st_size, "sha256": file_sha256(path)}
    atomic_write_json(directory / MANIFEST_FILE, {"format": MANIFEST_FORMAT, "files": files})


_verified: dict[str, tuple[tuple, str | None]] = {}  # directory -> (file stats, outcome): hash once per process


def manifest_problem(directory: Path) -> str | None:
    """None if every file the manifest lists is there with its size and checksum; else what is wrong.
    (The outcome is remembered while no file in the directory changes: the run's start-up checks
    and the trainer's resume ask about the same checkpoints.)"""
    stats = tuple(sorted((str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in directory.rglob("*") if p.is_file()))
    key = str(directory.resolve())
    if key in _verified and _verified[key][0] == stats:
        return _verified[key][1]
    problem = _check_manifest(directory)
    _verified[key] = (stats, problem)
    return problem


def _check_manifest(directory: Path) -> str | None:
    try:
        manifest = json.loads((directory / MANIFEST_FILE).read_text())
        files = manifest["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return f"its {MANIFEST_FILE} is unreadable"
    for name, expected in files.items():
        path = directory / name
        if not path.is_file():
            return f"{name} is missing"
        size = path.stat().st_size
        if size != expected["size"]:
            return f"{name} has {size} bytes, not {expected['size']}"
        if file_sha256(path) != expected["sha256"]:
            return f"{name} does not match its checksum"
    return None


# ----------------------------------------------------------------------------- finding checkpoints


def complete_checkpoints(output_dir: str | Path) -> list[tuple[int, Path]]:
    """(step, dir) of every complete checkpoint, oldest first: `step-N` directories with a manifest
    (or, written before manifests, a trainer_state.json). Temp, damaged and foreign dirs are ignored."""
    root = Path(output_dir) / CHECKPOINT_DIR
    found = []
    if root.is_dir():
        for p in root.iterdir():
            m = _STEP_DIR.match(p.name)
            if m and p.is_dir() and ((p / MANIFEST_FILE).is_file() or (p / STATE_FILE).is_file()):
                found.append((int(m.group(1)), p))
    return sorted(found)


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    """The newest complete checkpoint, unverified (see `find_resume_checkpoint`)."""
    found = complete_checkpoints(output_dir)
    return found[-1][1] if found else None


@dataclass
class ResumePoint:
    path: Path | None                        # the checkpoint to resume from; None: start fresh
    verified: bool = True                    # False: written before manifests (see the module docstring)
    skipped: list[tuple[Path, str]] = field(default_factory=list)  # damaged newer checkpoints, and why


def find_resume_checkpoint(output_dir: str | Path) -> ResumePoint:
    """The newest intact checkpoint; damaged newer ones are listed in `skipped`. Raises a UserError
    naming every checkpoint and its damage when there are checkpoints but none is intact."""
    root = Path(output_dir) / CHECKPOINT_DIR
    if root.exists() and not root.is_dir():  # resuming "from nothing" would overwrite best/ and the log
        raise UserError(f"{root} is not a directory (a file took its place), so the run's checkpoints cannot be "
                        "read; put the checkpoints directory back, or start over with --overwrite")
    skipped = []
    for step, path in reversed(complete_checkpoints(output_dir)):
        if not (path / MANIFEST_FILE).is_file():
            return ResumePoint(path, verified=False, skipped=skipped)
        problem = manifest_problem(path) or state_problem(path, step)
        if problem is None:
            return ResumePoint(path, skipped=skipped)
        skipped.append((path, problem))
    if skipped:
        damage = "; ".join(f"{p.name}: {why}" for p, why in skipped)
        raise UserError(f"no intact checkpoint to resume from in {Path(output_dir) / CHECKPOINT_DIR} ({damage}); "
                        "restore them, or start over with --overwrite")
    return ResumePoint(None)


def set_aside(path: Path) -> Path:
    """Rename a damaged checkpoint out of the `step-N` namespace (kept for inspection, never resumed)."""
    aside = path.with_name(path.name + DAMAGED_SUFFIX)
    shutil.rmtree(aside, ignore_errors=True)
    os.replace(path, aside)
    return aside


def read_state(checkpoint: Path) -> dict:
    return json.loads((checkpoint / STATE_FILE).read_text())


def state_problem(checkpoint: Path, step: int) -> str | None:
    """None if trainer_state.json holds what a resume reads, with the directory's step; else what is
    wrong (a checkpoint whose manifest was rewritten to match a bad state is damaged all the same)."""
    try:
        state = read_state(checkpoint)
    except (OSError, ValueError) as e:
        return f"its {STATE_FILE} is unreadable ({e})"
    if not isinstance(state, dict):
        return f"its {STATE_FILE} is not a JSON object"
    number = (int, float)
    checks = {"step": lambda v: isinstance(v, int) and not isinstance(v, bool) and v == step,
              "best_step": lambda v: v is None or (isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= step),
              "best_tau": lambda v: v is None or (isinstance(v, number) and not isinstance(v, bool)),
              "evals": lambda v: isinstance(v, list) and all(isinstance(e, dict) for e in v)}
    bad = [key for key, ok in checks.items() if key not in state or not ok(state[key])]
    return f"its {STATE_FILE} has a missing or bad {', '.join(bad)}" if bad else None


# ----------------------------------------------------------------------------- writing and pruning


def save_checkpoint(accelerator, output_dir: Path, step: int, state: dict) -> Path:
    """Write `checkpoints/step-{step}` (collective: every rank saves its part). A failed write
    (a full disk, say) is a UserError on every rank; what it left is a `.step-N.tmp` directory,
    never taken for a checkpoint and removed at the next start."""
    root = Path(output_dir) / CHECKPOINT_DIR
    final, tmp = root / f"step-{step}", root / f".step-{step}.tmp"
    main = accelerator.is_main_process

    def failed(e: BaseException) -> str:
        return (f"writing checkpoint {final} failed ({first_line(e)}); free disk space (or fix the file system) "
                "and start the same command again: it resumes from the last complete checkpoint")

    error = None
    if main:
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        except OSError as e:
            error = failed(e)
    raise_if_any(accelerator, error)
    try:
        accelerator.save_state(str(tmp))
    except Exception as e:  # OSError, and torch's or safetensors' wrappers around a failed write
        error = failed(e)
    raise_if_any(accelerator, error)
    if main:
        try:
            atomic_write_json(tmp / STATE_FILE, state)
            write_manifest(tmp)
            if final.exists():  # an identical step re-saved after a resume
                shutil.rmtree(final)
            os.replace(tmp, final)
        except OSError as e:
            error = failed(e)
    raise_if_any(accelerator, error)
    return final


def newest_evaluated_checkpoint(output_dir: str | Path, evals: list[dict]) -> int | None:
    """The newest checkpoint that passed an evaluation: the largest step N such that
    `checkpoints/step-N` is complete and an evaluation ran at step N - so on exactly the weights
    that checkpoint holds - and returned a finite tau. None when no checkpoint has one."""
    passed = {int(e["step"]) for e in evals if isinstance(e.get("tau"), (int, float)) and math.isfinite(e["tau"])}
    steps = [s for s, _ in complete_checkpoints(output_dir) if s in passed]
    return max(steps) if steps else None


def prune_checkpoints(output_dir: str | Path, keep: int, protect: int | None = None) -> None:
    """Delete all but the newest `keep` complete checkpoints (0 keeps all), never step `protect`
    (the trainer passes `newest_evaluated_checkpoint`)."""
    if keep <= 0:
        return
    for step, path in complete_checkpoints(output_dir)[:-keep]:
        if step == protect:
            continue
        trash = path.with_name(f".{path.name}.deleting.tmp")
        os.replace(path, trash)  # no longer looks complete, even if the rmtree is interrupted
        shutil.rmtree(trash, ignore_errors=True)


# ----------------------------------------------------------------------------- the best weights


def save_weights(state: dict[str, torch.Tensor], path: Path) -> None:
    save_file({k: v.clone() for k, v in state.items()}, str(path))  # clone: no shared storage


def load_weights(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path))


def save_best(output_dir: Path, weights: dict[str, torch.Tensor], step: int, metrics: dict) -> None:
    with writing(Path(output_dir) / BEST_DIR), atomic_dir(Path(output_dir) / BEST_DIR, overwrite=True) as tmp:
        save_weights(weights, tmp / BEST_WEIGHTS)
        atomic_write_json(tmp / BEST_META, {"step": step, "metrics": metrics,
                                            "sha256": file_sha256(tmp / BEST_WEIGHTS)})


def read_best(output_dir: Path) -> dict | None:
    """best.json, if `best/` exists and its weights match their checksum; a UserError if they don't."""
    best = Path(output_dir) / BEST_DIR
    if not (best / BEST_META).is_file():
        return None
    try:
        meta = json.loads((best / BEST_META).read_text())
        ok = "sha256" not in meta or file_sha256(best / BEST_WEIGHTS) == meta["sha256"]  # older runs: no sum
    except (OSError, ValueError):
        ok = False
    if not ok:
        raise UserError(f"{best} (the weights of the best evaluation so far) is damaged; "
                        "restore it, or start over with --overwrite")
    return meta


def load_best_weights(output_dir: Path) -> dict[str, torch.Tensor]:
    if read_best(output_dir) is None:
        raise UserError(f"{Path(output_dir) / BEST_DIR} is missing; start over with --overwrite")
    return load_weights(Path(output_dir) / BEST_DIR / BEST_WEIGHTS)


__all__ = ["BEST_DIR", "CHECKPOINT_DIR", "MANIFEST_FILE", "STATE_FILE", "ResumePoint", "complete_checkpoints",
           "find_resume_checkpoint", "latest_checkpoint", "load_best_weights", "load_weights", "manifest_problem",
           "newest_evaluated_checkpoint", "prune_checkpoints", "read_best", "read_state", "save_best",
           "save_checkpoint", "save_weights", "set_aside", "write_manifest"]
