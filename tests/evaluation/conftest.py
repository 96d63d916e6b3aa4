import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # `import eval_helpers`


@pytest.fixture(autouse=True)
def own_plan_cache(tmp_path_factory, monkeypatch):
    """Every test plans with a `$DRAFTTRAIN_HOME` of its own: a plan kept by another test (or by a
    run on this machine) would be read instead of measured (`evaluation.plan_cache`)."""
    monkeypatch.setenv("DRAFTTRAIN_HOME", str(tmp_path_factory.mktemp("home")))
