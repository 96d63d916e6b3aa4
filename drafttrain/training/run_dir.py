"""A run's output directory: one run at a time, the same config on every resume, no leftovers.

- **The lock.** A run holds an exclusive `flock` on `output_dir/.lock` for its whole life, with
  its pid written inside. A second run into the same directory is refused, naming that pid.
  The kernel drops the lock when its holder dies, so the lock of a killed run is simply taken
  over (the pid it left says which run that was); a run that ends cleanly empties the file.
  (`flock` is honoured across machines on local and most cluster file systems, not on every NFS
  setup: runs on several nodes should keep distinct output directories.)
  The main process takes it before writing anything; other ranks learn the outcome.
- **The config.** `config.yaml` is the run's identity. Started again with a different config,
  a run is refused, naming the keys, and nothing in the directory changes. Only the keys in
  `SAFE_TO_CHANGE` may differ: they change how a run is observed, never what it computes.
  Starting over is explicit: `--overwrite` deletes the earlier run (under the lock) first.
- **Leftovers.** Temporary `.NAME.*.tmp` / `.NAME.old` entries that a killed run left (half-written
  checkpoints, `best/` and `final/` exports, files) are removed at the next start, under the
  lock, so never another live run's.
"""

from __future__ import annotations

import fcntl
import os
import shutil
from pathlib import Path

import yaml

from ..config import config_to_dict, dump_config_yaml
from ..errors import UserError
from ..fileio import atomic_write_text, check_output_dir
from .checkpoints import CHECKPOINT_DIR, complete_checkpoints, find_resume_checkpoint
from .distributed import on_main

LOCK_FILE = ".lock"
CONFIG_FILE = "config.yaml"
EVAL_DIR = "eval"

# Config keys a resumed run may change, and why that is safe. Every other key changes what the
# run computes: e.g. train.max_steps moves the end of the learning-rate schedule (so every step
# after the checkpoint would differ from the run's first start), micro_batch_size and seed the
# data order, eval.* and train.eval_every / keep_best which weights are measured and exported,
# data.* the examples, loss.* and optim.* the updates themselves.
SAFE_TO_CHANGE = {
    "output_dir": "where the run lives; a moved run directory resumes in its new place",
    "train.log_every": "how often the log gets a line; the steps are the same",
    "train.checkpoint_every": "how often the state is saved; a resume is exact from any checkpoint",
    "train.keep_checkpoints": "how many checkpoints stay on disk",
    "train.num_workers": "how many processes build batches; the batches are the same",
    "train.report_to": "where metrics are also sent",
    "train.wandb_project": "where metrics are also sent",
    "train.run_name": "the wandb run's name",
}

# What a run writes into its directory; --overwrite deletes only these (and hidden leftovers).
RUN_ENTRIES = {CONFIG_FILE, "heldout.jsonl", "train_log.jsonl", CHECKPOINT_DIR, "best", "initial", "final",
               EVAL_DIR, "wandb"}


# ----------------------------------------------------------------------------- the lock


class RunLock:
    """An exclusive, non-blocking `flock` on `directory/.lock` holding the holder's pid."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        self.path = self.directory / LOCK_FILE
        self._fd: int | None = None
        self.taken_over_from: int | None = None  # pid of a run that died holding it

    def acquire(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_pid(fd)
            os.close(fd)
            who = f"pid {holder}" if holder else "a process that is just starting"
            raise UserError(f"{self.directory} is in use by another run ({who}); wait for it to end, "
                            "or pick another output_dir") from None
        previous = _read_pid(fd)
        self.taken_over_from = previous if previous and previous != os.getpid() else None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            os.ftruncate(self._fd, 0)  # a clean end leaves no pid behind
        except OSError:
            pass
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None


def _read_pid(fd: int) -> int | None:
    try:
        return int(os.pread(fd, 32, 0).decode().strip() or 0) or None
    except (OSError, ValueError):
        return None


_held: dict[str, list] = {}  # resolved directory -> [RunLock, holders in this process]


def acquire_run_lock(directory: str | Path) -> RunLock:
    """Take the directory's lock, or join this process's hold on it (the recipe holds it, and the
    trainer it calls takes it again); every acquire needs a `release_run_lock`."""
    key = str(Path(directory).resolve())
    if key in _held:
        _held[key][1] += 1
        return _held[key][0]
    lock = RunLock(directory)
    lock.acquire()
    _held[key] = [lock, 1]
    if lock.taken_over_from:
        print(f"note: {lock.directory} was locked by a run (pid {lock.taken_over_from}) that ended without "
              "releasing it; taking it over", flush=True)
    return lock


def release_run_lock(directory: str | Path) -> None:
    key = str(Path(directory).resolve())
    entry = _held.get(key)
    if entry is None:
        return
    entry[1] -= 1
    if entry[1] == 0:
        del _held[key]
        entry[0].release()


# ----------------------------------------------------------------------------- leftovers and config


def remove_leftovers(output_dir: str | Path) -> None:
    """Temporary entries of killed runs: `.NAME.*.tmp` and `.NAME.old` in the run directory, its
    checkpoints/ and eval/ (atomic writes name their temporaries so). Call it holding the lock."""
    root = Path(output_dir)
    for folder in (root, root / CHECKPOINT_DIR, root / EVAL_DIR):
        if not folder.is_dir():
            continue
        for p in folder.iterdir():
            if p.name.startswith(".") and p.name.endswith((".tmp", ".old")):
                if p.is_dir() and not p.is_symlink():
                    shutil.rmtree(p, ignore_errors=True)
                else:
                    p.unlink(missing_ok=True)


def config_changes(saved: dict, current: dict) -> list[tuple[str, object, object]]:
    """(dotted key, saved value, current value) for every key that differs and is not safe to change."""
    old, new = _flatten(saved), _flatten(current)
    return [(k, old.get(k), new.get(k)) for k in sorted(set(old) | set(new))
            if old.get(k) != new.get(k) and k not in SAFE_TO_CHANGE]


def check_same_config(output_dir: str | Path, cfg) -> None:
    """Refuse to resume a run whose config.yaml differs from `cfg` in a key that is not safe to change.
    A run that never saved a checkpoint has nothing to resume (a start refused for bad input, say):
    a corrected config starts it over."""
    path = Path(output_dir) / CONFIG_FILE
    if not path.is_file() or not complete_checkpoints(output_dir):
        return
    try:
        saved = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as e:
        raise UserError(f"{path} (the earlier run's config) cannot be read ({type(e).__name__}); "
                        "start over with --overwrite") from e
    changed = config_changes(saved if isinstance(saved, dict) else {}, config_to_dict(cfg))
    if changed:
        shown = ", ".join(f"{k} ({_short(old)} -> {_short(new)})" for k, old, new in changed[:8])
        more = f" and {len(changed) - 8} more" if len(changed) > 8 else ""
        raise UserError(f"{output_dir} holds a run with another config: {shown}{more}; resume it with the config "
                        f"in {path}, pick another output_dir, or start over with --overwrite (deletes that run)")


def _flatten(d, prefix: str = "") -> dict:
    if not isinstance(d, dict):
        return {prefix[:-1]: d}
    out = {}
    for k, v in d.items():
        out |= _flatten(v, f"{prefix}{k}.")
    return out


def _short(value, width: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= width else text[:width - 3] + "..."


# ----------------------------------------------------------------------------- the run directory


class RunDirectory:
    """A recipe's output directory from the first check to the end of the run.

        run = RunDirectory(cfg.output_dir, accelerator)
        run.open(cfg, overwrite)   # before any model loads: path usable, lock, same config, a checkpoint to resume
        ...load models...
        run.start(cfg, overwrite)  # now writing: --overwrite clears, leftovers go, config.yaml
        ...
        run.close()                # unlock; a directory this run made and left empty goes
    """

    def __init__(self, path: str | Path, accelerator, extra_entries: set[str] = frozenset()):
        self.path = Path(path)
        self.accelerator = accelerator
        self.entries = RUN_ENTRIES | set(extra_entries)
        self._created: Path | None = None  # the topmost directory this run created, if any
        self._locked = False

    def open(self, cfg, overwrite: bool) -> None:
        on_main(self.accelerator, lambda: self._open(cfg, overwrite))

    def _open(self, cfg, overwrite: bool) -> None:
        check_output_dir(self.path)
        top = self.path
        while not top.parent.exists():
            top = top.parent
        self._created = None if self.path.exists() else top
        acquire_run_lock(self.path)
        self._locked = True
        try:
            if overwrite:
                self._foreign_entries()
            else:
                check_same_config(self.path, cfg)
                find_resume_checkpoint(self.path)  # none intact: refuse now, before anything is written
        except BaseException:
            self.close()
            raise

    def _foreign_entries(self) -> None:
        foreign = sorted(p.name for p in self.path.iterdir() if p.name not in self.entries and not p.name.startswith("."))
        if foreign:
            raise UserError(f"--overwrite would delete {self.path}, but it holds files no run wrote "
                            f"({', '.join(foreign[:5])}); move them away or pick another output_dir")

    def start(self, cfg, overwrite: bool) -> None:
        """Clear an earlier run (--overwrite), remove leftovers, write the resolved config.yaml."""
        resolved = dump_config_yaml(cfg)
        if self.accelerator.is_main_process:
            if overwrite:
                for p in self.path.iterdir():
                    if p.name in self.entries:
                        shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
            remove_leftovers(self.path)
            atomic_write_text(self.path / CONFIG_FILE, resolved)
            print(f"resolved config (saved to {self.path / CONFIG_FILE}):\n{resolved}", flush=True)
        self.accelerator.wait_for_everyone()

    def close(self) -> None:
        if not self._locked:
            return
        self._locked = False
        release_run_lock(self.path)
        if self._created is not None and self.path.is_dir() and {p.name for p in self.path.iterdir()} <= {LOCK_FILE}:
            (self.path / LOCK_FILE).unlink(missing_ok=True)  # nothing written: leave no trace
            d = self.path
            while True:
                try:
                    d.rmdir()
                except OSError:
                    break
                if d == self._created:
                    break
                d = d.parent


__all__ = ["CONFIG_FILE", "LOCK_FILE", "RUN_ENTRIES", "RunDirectory", "RunLock", "SAFE_TO_CHANGE",
           "acquire_run_lock", "check_same_config", "config_changes", "release_run_lock", "remove_leftovers"]
