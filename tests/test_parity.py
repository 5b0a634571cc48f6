"""Gradient and parameter parity against one process that sees the whole batch."""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import pytest
import torch

from models import MODELS, TINY_BUCKETS
from parity import PER_RANK, assert_grads_match, assert_replicas_identical, local_shard, seeded
from torchreplicate import replicate
from torchreplicate.reducer.layout.plan import MIN_CAP

MODEL_NAMES = ["mlp", "conv", "tied", "encoder", "wide"]


class ParityRun(NamedTuple):
    num_buckets: int  # 0 when there is no reducer (world size 1)
    grads_are_views: Optional[bool]  # after the last backward; None when there is no reducer


def train_against_reference(
    rank: int,
    world_size: int,
    model_name: str,
    *,
    steps: int = 3,
    options: Optional[dict[str, Any]] = None,
    set_to_none: bool = True,
) -> ParityRun:
    """Trains a replica and a single-process reference; checks grads every step.

    The replica starts from a rank-dependent seed, so this also checks that
    replicate() broadcasts rank 0's parameters.
    """
    build, make_batch, loss_of = MODELS[model_name]
    model = seeded(build, 100 + rank)
    reference = seeded(build, 100)
    replicate(model, **(options or {}))
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(
            p, q, rtol=0, atol=0, msg=lambda m: f"rank {rank}: replicate() did not broadcast rank 0's {name}: {m}"
        )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    grads_are_views = None
    for step in range(steps):
        batch = make_batch(torch.Generator().manual_seed(step), PER_RANK * world_size)
        local = local_shard(batch, rank)
        loss_of(model(local), local).backward()
        loss_of(reference(batch), batch).backward()
        assert_grads_match(model, reference, f"rank {rank} step {step}")
        grads_are_views = _grads_are_views(model)
        optimizer.step()
        ref_optimizer.step()
        optimizer.zero_grad(set_to_none=set_to_none)
        ref_optimizer.zero_grad(set_to_none=set_to_none)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=lambda m: f"rank {rank} after training: {name}: {m}")
    assert_replicas_identical(model, f"after {steps} steps")
    reducer = replicate.state(model).reducer
    return ParityRun(0 if reducer is None else len(reducer.buckets), grads_are_views)


def _grads_are_views(model) -> Optional[bool]:
    """Whether every .grad is its parameter's view into the bucket (None: no reducer)."""
    reducer = replicate.state(model).reducer
    if reducer is None:
        return None
    for slot in reducer.slots:
        assert slot.param.grad is not None, f"{slot.name}: every parameter of these models gets a gradient"
        if slot.param.grad.data_ptr() != slot.view.data_ptr():
            return False
    return True


@pytest.mark.parametrize("model_name", MODEL_NAMES)
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_parity_default_options(pools, model_name, world_size):
    first = pools.run(world_size, train_against_reference, model_name)[0]
    if world_size > 1:
        assert first.grads_are_views is True


@pytest.mark.parametrize("model_name", MODEL_NAMES)
@pytest.mark.parametrize("as_view", [True, False])
@pytest.mark.parametrize("set_to_none", [True, False])
def test_parity_tiny_buckets(pools, model_name, as_view, set_to_none):
    options = dict(TINY_BUCKETS, gradient_as_bucket_view=as_view)
    first = pools.run(2, train_against_reference, model_name, options=options, set_to_none=set_to_none)[0]
    assert first.num_buckets >= 2, "tiny caps should give several buckets"
    assert first.grads_are_views is as_view


def wide_layouts(rank: int, world_size: int) -> tuple[int, list[int], int]:
    build, make_batch, loss_of = MODELS["wide"]
    model = replicate(seeded(build, 1), bucket_layout="tuned")
    reducer = replicate.state(model).reducer
    before = len(reducer.buckets)
    for step in range(2):
        batch = local_shard(make_batch(torch.Generator().manual_seed(step), PER_RANK * world_size), rank)
        loss_of(model(batch), batch).backward()
    sizes = [bucket.grads.numel() * bucket.grads.element_size() for bucket in reducer.buckets]
    return before, sizes, reducer.layout_policy.cap_bytes


def test_wide_model_buckets_default_then_tuned(pools):
    before, sizes, cap = pools.run(2, wide_layouts)[0]
    # 16 x 256 KiB weights: a 1 MiB first bucket, then 25 MiB caps -> more than one bucket
    assert before >= 2
    # after the first step, tuned: no bucket between the first and the last under half the
    # smallest cap either plan uses (the cap's plan closes a bucket once half full)
    assert all(size >= min(cap, MIN_CAP) // 2 for size in sizes[1:-1]), (sizes, cap)


def test_parity_three_ranks_tiny_buckets(pools):
    pools.run(3, train_against_reference, "tied", options=TINY_BUCKETS)
