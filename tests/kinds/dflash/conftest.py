"""The DFlash tests' shared fixture: a tiny target and a draft trained on its answers."""

from __future__ import annotations

import pytest

from dflash_helpers import trained_pair as train_pair


@pytest.fixture(scope="session")
def trained_pair():
    """A draft trained for a few seconds on the target's greedy answers (`dflash_helpers.trained_pair`)."""
    return train_pair()
