"""Shared fixtures: the multi-process pools (see harness.py)."""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from harness import Pools  # noqa: E402


@pytest.fixture(scope="session")
def pools():
    """Runs ``fn(rank, world_size, *args)`` on N gloo ranks: ``pools.run(N, fn, ...)``."""
    live = Pools()
    yield live
    live.close()
