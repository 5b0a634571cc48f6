"""Graphs that differ by rank or by step, with no flag: parity every step."""

import pytest

from dynamic_cases import CASES, run_case

TINY = {"bucket_cap_mb": 0.0002, "first_bucket_cap_mb": 0.0001}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("world_size", [2, 3])
def test_case_matches_reference(pools, case, world_size):
    results = pools.run(world_size, run_case, case)
    assert len({r["digest"] for r in results}) == 1, "replicas diverged"


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("as_view", [True, False])
def test_case_with_tiny_buckets(pools, case, as_view):
    options = dict(TINY, gradient_as_bucket_view=as_view)
    results = pools.run(2, run_case, case, options=options)
    assert len({r["digest"] for r in results}) == 1, "replicas diverged"


def test_never_used_parameter_keeps_none(pools):
    results = pools.run(2, run_case, "moe")
    for per_step in results[0]["none_grads"]:
        assert "never.weight" in per_step and "experts.3.weight" in per_step
        assert "trunk.weight" not in per_step


def test_head_used_every_other_step(pools):
    results = pools.run(2, run_case, "alternating_head")
    steps = results[0]["none_grads"]
    assert all("aux_head.weight" not in s for s in steps[0::2])
    assert all("aux_head.weight" in s for s in steps[1::2])
