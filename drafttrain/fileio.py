"""Atomic writes: a reader (or a resumed run) never sees a half-written file or directory."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

from .errors import UserError


def check_output_dir(path: str | os.PathLike, what: str = "output directory") -> Path:
    """Refuse, before any model loads, an output path that cannot become a writable directory:
    one that is a file, sits under a file, or lies in a directory we may not write to."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise UserError(f"{what} {str(path)!r} is a file; pass a directory path")
    existing = path
    while not existing.exists():
        if existing.parent == existing:
            break
        existing = existing.parent
    if not existing.is_dir():
        raise UserError(f"{what} {str(path)!r} lies under {str(existing)!r}, which is a file; pass a directory path")
    try:  # try it: permission bits say nothing for root, or on a read-only file system
        fd, probe = tempfile.mkstemp(prefix=".drafttrain-write-test.", dir=existing)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise UserError(f"{what} {str(path)!r} is not writable ({e.strerror} in {str(existing)!r}); "
                        "pass a directory you can write to") from e
    return path


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp's 0600 would make reports private to their writer
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _usual_permissions(root: Path) -> None:
    """mkdtemp's and mkstemp's 0700/0600 would make an exported model private to its writer (a
    serving engine running as another user could not read it): give what plain mkdir/open would."""
    mask = _umask()
    for d, _, files in os.walk(root):
        os.chmod(d, 0o777 & ~mask)
        for f in files:
            file = os.path.join(d, f)
            if not os.path.islink(file):
                os.chmod(file, (0o777 if os.stat(file).st_mode & 0o111 else 0o666) & ~mask)


def atomic_write_json(path: str | os.PathLike, obj) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2) + "\n")


def atomic_write_jsonl(path: str | os.PathLike, rows) -> None:
    atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in rows))


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary sibling directory; rename it to `path` only if the block succeeds."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    try:
        yield tmp
        _usual_permissions(tmp)
        if path.exists():
            if not overwrite:
                raise FileExistsError(path)
            old = path.with_name(f".{path.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            try:
                os.replace(tmp, path)
            except OSError:  # another process renamed its copy into place first (ENOTEMPTY)
                if path.is_dir() and not overwrite:
                    raise FileExistsError(path) from None
                raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
