"""Shared fixtures: the multi-process pools (see harness.py)."""

import pytest

from harness import Pools


@pytest.fixture(scope="session")
def pools():
    """Runs ``fn(rank, world_size, *args)`` on N gloo ranks: ``pools.run(N, fn, ...)``."""
    live = Pools()
    yield live
    live.close()


# The torch range's subsets (scripts/torch_range.sh runs them on other torch releases; `pytest -m core`):
# "core", the library's own behaviour against one-process references; "ddp", the tests that compare with
# the installed DDP (tests/ddp_versions.py says where DDP itself changed across the range).
SUBSETS = {
    "core": (
        *("test_api", "test_parity", "test_seed_contract", "test_dynamic_graphs", "test_nested"),
        *("test_compiled_autograd", "test_mesh"),
    ),
    "ddp": (
        *("test_ddp_bits", "test_ddp_args", "test_ddp_attributes", "test_ddp_surface", "test_ddp_recipes"),
        *("test_buffers", "test_comm_hooks", "test_join", "test_tied", "test_inert"),
    ),
}


def pytest_collection_modifyitems(items):
    for item in items:
        for marker, modules in SUBSETS.items():
            if item.module is not None and item.module.__name__ in modules:
                item.add_marker(marker)
