"""Graphs that differ by rank or by step, with no flag: parity every step."""

import pytest

from dynamic_cases import CASES, run_case
from models import Branches, data
from parity import assert_grads_match, seeded
from torchreplicate import replicate

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


# -- steps that reach no parameter ----------------------------------------------------


def odd_steps(rank, world_size):
    """Forward without backward, outputs not used, backwards that reach no parameter."""
    model = seeded(Branches, 3 + rank)
    reference = seeded(Branches, 3)
    replicate(model)
    # 1. a forward with grad enabled whose result is dropped
    model(data(rank, 0))
    # 2. a backward that reaches no replicated parameter, on every rank
    x = data(rank, 1).requires_grad_()
    (x * 2).sum().backward()
    grads = [name for name, p in model.named_parameters() if p.grad is not None]
    assert not grads, f"rank {rank}: a backward that reached no parameter gave grads to {grads}"
    # 3. a forward whose output needs grad only through its input: every
    #    parameter is unused everywhere, so every .grad stays None
    frozen = {name: p.requires_grad for name, p in model.named_parameters()}
    out = model.trunk(x).detach().requires_grad_() * 3
    out.sum().backward()
    grads = [name for name, p in model.named_parameters() if p.grad is not None]
    assert not grads, f"rank {rank}: grads appeared for {grads}"
    changed = [name for name, p in model.named_parameters() if p.requires_grad != frozen[name]]
    assert not changed, f"rank {rank}: the backward changed requires_grad of {changed}"
    # 4. then a normal step still matches the reference
    model(data(rank, 2)).pow(2).mean().backward()
    (sum(reference(data(r, 2)).pow(2).mean() for r in range(world_size)) / world_size).backward()
    assert_grads_match(model, reference, f"rank {rank} after odd steps")


@pytest.mark.parametrize("world_size", [2, 3])
def test_odd_steps_do_not_break_the_next(pools, world_size):
    pools.run(world_size, odd_steps)
