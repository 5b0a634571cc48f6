"""Gradient accumulation: no_sync() and set_requires_gradient_sync(), read at backward."""

import pytest

from models import Branches, data
from parity import assert_grads_match, assert_replicas_identical, same_on_every_rank, seeded, sgd_step
from torchreplicate import replicate


def accumulate(rank, world_size, *, micro_batches, use_context, vary_used_set):
    """K micro-batches without sync, then one with: equals the reference on all K+1."""
    model = seeded(Branches, 3 + rank)
    reference = seeded(Branches, 3)
    replicate(model)
    for step in range(3):

        def loss_of(module, r, k):
            branch = "a" if not vary_used_set or k % 2 == 0 else "b"
            return module(data(r, 10 * step + k), branch=branch).pow(2).mean()

        for k in range(micro_batches):
            if use_context:
                with model.no_sync():
                    loss_of(model, rank, k).backward()
            else:
                model.set_requires_gradient_sync(False)
                loss_of(model, rank, k).backward()
                model.set_requires_gradient_sync(True)
        if micro_batches:
            assert not same_on_every_rank(model.trunk.weight.grad), (
                f"rank {rank} step {step}: no_sync backward averaged trunk.weight's gradient"
            )
        loss_of(model, rank, micro_batches).backward()
        total = sum(loss_of(reference, r, k) for r in range(world_size) for k in range(micro_batches + 1))
        (total / world_size).backward()
        assert_grads_match(model, reference, f"rank {rank} step {step}")
        sgd_step(model, reference, lr=0.05, skip_none=True)
    assert_replicas_identical(model, "after 3 steps")


@pytest.mark.parametrize("use_context", [True, False])
@pytest.mark.parametrize("vary_used_set", [False, True])
@pytest.mark.parametrize("micro_batches", [0, 3])
@pytest.mark.parametrize("world_size", [2, 3])
def test_accumulation_matches_reference(pools, world_size, micro_batches, use_context, vary_used_set):
    pools.run(world_size, accumulate, micro_batches=micro_batches, use_context=use_context, vary_used_set=vary_used_set)


def sync_setting_read_at_backward(rank, world_size):
    model = seeded(Branches, 3 + rank)
    replicate(model)
    # forward with sync on, backward with it off: local only
    loss = model(data(rank, 0)).pow(2).mean()
    model.set_requires_gradient_sync(False)
    loss.backward()
    assert not same_on_every_rank(model.trunk.weight.grad), (
        f"rank {rank}: sync switched off before backward still averaged trunk.weight's gradient"
    )
    model.set_requires_gradient_sync(True)
    model.zero_grad()
    # forward inside no_sync, backward after it: averaged
    with model.no_sync():
        loss = model(data(rank, 1)).pow(2).mean()
    loss.backward()
    assert same_on_every_rank(model.trunk.weight.grad), (
        f"rank {rank}: sync back on before backward did not average trunk.weight's gradient"
    )


def test_sync_setting_takes_effect_at_backward(pools):
    pools.run(2, sync_setting_read_at_backward)
