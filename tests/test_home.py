"""drafttrain.home: one home directory (with `~` expanded) and `${VAR}` paths in recipe configs."""

from __future__ import annotations

from pathlib import Path

import pytest

from drafttrain.errors import UserError
from drafttrain.home import drafttrain_home, expand_vars


def test_home_comes_from_the_environment_with_tilde_expanded(tmp_path, monkeypatch):
    monkeypatch.setenv("DRAFTTRAIN_HOME", str(tmp_path))
    assert drafttrain_home() == tmp_path
    monkeypatch.setenv("DRAFTTRAIN_HOME", "~/dt")
    assert drafttrain_home() == Path.home() / "dt"
    monkeypatch.setenv("DRAFTTRAIN_HOME", "")
    assert drafttrain_home() == Path.home() / ".cache" / "drafttrain"
    monkeypatch.delenv("DRAFTTRAIN_HOME")
    assert drafttrain_home() == Path.home() / ".cache" / "drafttrain"


def test_paths_expand_environment_variables(monkeypatch, tmp_path):
    monkeypatch.setenv("DRAFTTRAIN_HOME", str(tmp_path))
    assert expand_vars("${DRAFTTRAIN_HOME}/models/x", "target") == f"{tmp_path}/models/x"
    monkeypatch.delenv("DRAFTTRAIN_HOME")
    assert expand_vars("${DRAFTTRAIN_HOME}/m", "target") == str(Path.home() / ".cache" / "drafttrain" / "m")
    assert expand_vars("~/m", "target") == str(Path.home() / "m")
    monkeypatch.delenv("NO_SUCH_VARIABLE", raising=False)
    with pytest.raises(UserError, match="NO_SUCH_VARIABLE"):
        expand_vars("$NO_SUCH_VARIABLE/x", "target")
