"""Shared fixtures: the multi-process pools (see harness.py)."""

import pytest

from harness import Pools


@pytest.fixture(scope="session")
def pools():
    """Runs ``fn(rank, world_size, *args)`` on N gloo ranks: ``pools.run(N, fn, ...)``."""
    live = Pools()
    yield live
    live.close()
