"""Where drafttrain keeps what it downloads and generates, and `${VAR}` paths in recipe configs."""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

from .errors import UserError

DEFAULT_HOME = "~/.cache/drafttrain"


def drafttrain_home() -> Path:
    """`$DRAFTTRAIN_HOME`, else ~/.cache/drafttrain; a leading `~` is expanded either way."""
    return Path(os.environ.get("DRAFTTRAIN_HOME") or DEFAULT_HOME).expanduser()


def writable_home(home: Path | None = None) -> Path:
    """The cache directory, created if need be, once it is known we can write there: checked
    before anything is downloaded or converted, so a read-only home or one that is a file is one
    line naming DRAFTTRAIN_HOME, not a traceback from deep inside a write."""
    home = Path(home) if home is not None else drafttrain_home()
    try:
        home.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".drafttrain-write-test.", dir=home)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise UserError(f"the drafttrain cache {str(home)!r} (DRAFTTRAIN_HOME) is not a writable directory "
                        f"({e.strerror or e}); set DRAFTTRAIN_HOME to a directory you can write to") from e
    return home


def expand_vars(value: str, key: str) -> str:
    """`${VAR}` / `$VAR` from the environment, then `~`. DRAFTTRAIN_HOME defaults to
    `drafttrain_home()`, so shipped configs work without exporting it. `key` names the config
    key in the error an unset variable raises."""
    env = {"DRAFTTRAIN_HOME": str(drafttrain_home()), **os.environ}

    def sub(m: re.Match) -> str:
        name = m.group(1) or m.group(2)
        if name not in env:
            raise UserError(f"config key {key!r} uses ${{{name}}}, which is not set; export it or write the path out")
        return env[name]

    return os.path.expanduser(re.sub(r"\$\{(\w+)\}|\$(\w+)", sub, str(value)))


__all__ = ["drafttrain_home", "expand_vars", "writable_home"]
