"""The `--out` directory of `eval` and `compare` (SPEC §2 rev 2): one run per directory, replaced whole.

Checked before any model loads: a path that cannot become a writable directory is refused, and so
is a directory that holds anything unless `--overwrite` is given. The report is then built in a
staging sibling, `.NAME.partial-PID`, and swapped in only when complete: the earlier report (if
any) is renamed to `.NAME.replaced-PID`, the new one takes its name, and the old one is deleted.
So no file or per-drafter folder of an earlier run survives an overwrite, and a crash, a kill or
Ctrl-C leaves the earlier report as it was. A killed run's staging folders are cleaned at the next
start (a swap cut short between its two renames is undone then).
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import signal
import threading
from pathlib import Path
from typing import Iterator

from ..errors import UserError
from ..fileio import check_output_dir

PARTIAL, REPLACED = "partial", "replaced"
REPORT_MARKERS = ("report.json", "comparison.json", "bench.json")


def _sibling(path: Path, kind: str, pid: int | None = None) -> Path:
    return path.parent / f".{path.name}.{kind}-{os.getpid() if pid is None else pid}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def clean_leftovers(path: Path) -> None:
    """Delete the staging folders of dead runs; restore an earlier report whose swap was cut short."""
    if not path.parent.is_dir():
        return
    prefix = f".{path.name}."
    for entry in sorted(path.parent.iterdir()):
        if not entry.name.startswith(prefix):
            continue
        kind, _, pid = entry.name[len(prefix):].rpartition("-")
        if kind not in (PARTIAL, REPLACED) or not pid.isdigit() or _pid_alive(int(pid)):
            continue
        if kind == REPLACED and not path.exists():
            os.replace(entry, path)  # killed between the swap's renames: the earlier report comes back
        else:
            shutil.rmtree(entry, ignore_errors=True)


def prepare_output_dir(out: str | os.PathLike, overwrite: bool) -> Path:
    """Everything about `--out` that can fail, before any model loads."""
    path = check_output_dir(out, "--out")
    try:
        clean_leftovers(path)
    except OSError as e:
        raise UserError(f"cannot clean up an interrupted run next to --out {str(path)!r} ({e.strerror or e}); "
                        "remove its .partial/.replaced folders by hand") from e
    if path.is_dir() and any(path.iterdir()):
        if not overwrite:
            raise UserError(f"--out {str(path)!r} exists and is not empty; pass --overwrite to replace it whole, "
                            "or choose a new directory")
        if not any((path / marker).is_file() for marker in REPORT_MARKERS):
            raise UserError(f"--out {str(path)!r} holds files but no drafttrain report (no report.json or "
                            "comparison.json), so --overwrite will not delete it; choose a new directory")
    return path


class TakenMeanwhile(Exception):
    """Another run wrote a report into `--out` while this one ran (and this one may not replace it)."""


@contextlib.contextmanager
def staged_output(out: str | os.PathLike, overwrite: bool = False) -> Iterator[Path]:
    """Yield an empty staging directory; when the block succeeds, it replaces `out` whole. Without
    `overwrite` it only takes `out`'s place if that is still absent or empty (`prepare_output_dir`
    checked it at the start): a report another run put there meanwhile is kept, this one refused."""
    path = Path(out)
    stage = _sibling(path, PARTIAL)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(stage, ignore_errors=True)
        stage.mkdir()
        yield stage
        if overwrite:
            _swap_in(stage, path)
        else:
            _claim(stage, path)
    except TakenMeanwhile:
        shutil.rmtree(stage, ignore_errors=True)
        raise UserError(f"--out {str(path)!r} was filled by another run while this one ran; its report is kept and "
                        "this one was not written: run again with another --out (or --overwrite to replace it)"
                        ) from None
    except OSError as e:
        shutil.rmtree(stage, ignore_errors=True)
        raise UserError(f"cannot write the report to {str(path)!r} ({e.strerror or e}); free some space or fix the "
                        "permissions, then run again (an earlier report there is unchanged)") from e
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise


def _claim(stage: Path, path: Path) -> None:
    """Rename `stage` to `path` if `path` is absent or an empty directory, atomically: rename(2)
    onto a non-empty directory fails, so two runs racing for one new `--out` cannot both win."""
    if path.exists() and not path.is_dir():
        raise TakenMeanwhile
    try:
        with _sigint_deferred():
            os.replace(stage, path)
    except OSError as e:
        if e.errno in (errno.ENOTEMPTY, errno.EEXIST):
            raise TakenMeanwhile from None
        raise


def _swap_in(stage: Path, path: Path) -> None:
    old = _sibling(path, REPLACED)
    shutil.rmtree(old, ignore_errors=True)
    with _sigint_deferred():
        if path.exists():  # an empty directory or an earlier report, checked at the start
            os.replace(path, old)
        try:
            os.replace(stage, path)
        except BaseException:
            if old.exists() and not path.exists():
                os.replace(old, path)
            raise
    shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def _sigint_deferred():
    """No Ctrl-C between the swap's two renames. One that arrives meanwhile is dropped: by then the
    report is complete and in place, so ending as if nothing had been written would be false."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "pthread_sigmask"):
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        if signal.SIGINT in signal.sigpending():
            signal.sigwait({signal.SIGINT})
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
