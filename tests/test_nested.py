"""Nested replicate: per block, then the root (as torchtitan applies it); each parameter reduced once."""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist
from torch import nn

from parity import assert_grads_match, assert_replicas_identical, seeded, sgd_step
from torchreplicate import replicate

DIM = 8


def data(rank: int, step: int) -> torch.Tensor:
    return torch.randn(4, DIM, generator=torch.Generator().manual_seed(100 * step + rank))


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(DIM, DIM)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh(), nn.Linear(DIM, DIM)) for _ in range(3)
        )
        self.head = nn.Linear(DIM, 2)

    def forward(self, x: torch.Tensor, skip: int = -1) -> torch.Tensor:
        h = self.embed(x)
        for index, block in enumerate(self.blocks):
            if index != skip:  # a block skipped on one rank: the graph differs by rank
                h = h + block(h)
        return self.head(h)


class Nested(NamedTuple):
    bucket_groups: list[list[str]]  # per bucket, the prefixes of its parameters
    inner_reducers: int  # reducers the blocks kept (must be 0)
    nested: list[bool]


def nested(rank: int, world_size: int, skip_on_rank_1: bool) -> Nested:
    model = seeded(Stack, 40 + rank)
    reference = seeded(Stack, 40)
    for block in model.blocks:
        replicate(block)
    replicate(model, bucket_cap_mb=10)  # large caps: the blocks still get buckets of their own
    for step in range(4):
        skip = 1 if skip_on_rank_1 and step % 2 == 0 else -1
        model(data(rank, step), skip if rank == 1 else -1).pow(2).mean().backward()
        total = sum(reference(data(r, step), skip if r == 1 else -1).pow(2).mean() for r in range(world_size))
        (total / world_size).backward()
        assert_grads_match(model, reference, f"rank {rank} step {step}")
        sgd_step(model, reference)
        assert_replicas_identical(model, f"rank {rank} after step {step}")
    states = [replicate.state(block) for block in model.blocks]
    buckets = replicate.state(model).reducer.buckets
    groups = [sorted({".".join(slot.name.split(".")[:2]) for slot in bucket.slots}) for bucket in buckets]
    return Nested(groups, sum(s.reducer is not None for s in states), [s.nested for s in states])


@pytest.mark.parametrize("skip_on_rank_1", [False, True], ids=["static", "block-skipped-on-one-rank"])
def test_per_block_then_root(pools, skip_on_rank_1):
    for r in pools.run(2, nested, skip_on_rank_1):
        assert r.inner_reducers == 0 and r.nested == [True, True, True], r
        for prefixes in r.bucket_groups:
            blocks = [p for p in prefixes if p.startswith("blocks.")]
            assert len(blocks) <= 1 and (not blocks or len(prefixes) == 1), f"a bucket mixes blocks: {prefixes}"


def refusals(rank: int, world_size: int) -> list[str]:
    """The three refused nestings, in order; "no error: ..." where one was accepted."""
    messages = []
    model = Stack()
    replicate(model.blocks[0], gradient_as_bucket_view=False)
    try:
        replicate(model)
        messages.append("no error: options that disagree")
    except ValueError as error:
        messages.append(str(error))
    outer = replicate(Stack())
    try:
        replicate(outer.blocks[0])
        messages.append("no error: inner after outer")
    except RuntimeError as error:
        messages.append(str(error))
    try:
        replicate([Stack(), Stack()])  # type: ignore[arg-type]
        messages.append("no error: a list")
    except TypeError as error:
        messages.append(str(error))
    return messages


def test_nested_refusals_name_the_fix(pools):
    for rank, (options, order, listed) in enumerate(pools.run(2, refusals)):
        assert "nested replicate() calls disagree on gradient_as_bucket_view (Sequential: False" in options, (
            f"rank {rank}: {options}"
        )
        assert "apply replicate() to the blocks first, then to the enclosing module" in order, f"rank {rank}: {order}"
        assert "replicate each block and then their common parent" in listed, f"rank {rank}: {listed}"


def different_groups(rank: int, world_size: int) -> str:
    """A block replicated over a group of every rank, its parent over the world group: refused.

    ``dist.new_group`` of all ranks is a distinct group object from the world
    group, so the outermost module cannot reduce the block's parameters in
    its one collective sequence. Then the fix the message names, the same
    group for both, is applied and trains in parity with the reference.
    """
    every = dist.new_group(list(range(world_size)))
    model = seeded(Stack, 60 + rank)
    reference = seeded(Stack, 60)
    replicate(model.blocks[0], process_group=every)
    try:
        replicate(model)
        message = "no error"
    except ValueError as error:
        message = str(error)
    replicate(model, process_group=every)
    assert replicate.state(model.blocks[0]).nested, f"rank {rank}: the block was not nested with the same group"
    for step in range(2):
        model(data(rank, step)).pow(2).mean().backward()
        total = sum(reference(data(r, step)).pow(2).mean() for r in range(world_size))
        (total / world_size).backward()
        assert_grads_match(model, reference, f"rank {rank} step {step} (same group)")
        sgd_step(model, reference)
        assert_replicas_identical(model, f"rank {rank} after step {step} (same group)")
    return message


def test_nested_calls_on_different_groups_are_refused_on_every_rank(pools):
    for rank, message in enumerate(pools.run(2, different_groups)):
        assert message.startswith("replicate(): nested replicate() calls use different process groups"), (
            f"rank {rank}: {message}"
        )
        assert "(Sequential and the enclosing Stack)" in message, f"rank {rank}: {message}"
        assert "pass the same group or mesh to both" in message, f"rank {rank}: {message}"


# -- replicate a child, then fully_shard the root ([Note: replicate under fully_shard]) --


def full(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor as one process holds it: ``fully_shard``'s DTensors gathered, plain tensors as they are."""
    gathered = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
    return gathered.detach().clone()


def under_fully_shard(rank: int, world_size: int, api_name: str) -> list[list[torch.Tensor]]:
    """``api(model.blocks[1])``, then ``fully_shard(model)``: 3 SGD steps against the reference.

    ``api`` is ours or torch's own composable ``replicate`` (the seed). Every
    gradient and, after each step, every weight is compared with a
    one-process reference on the global batch; returns the weights after
    each step (full tensors), to compare the two APIs.
    """
    from torch.distributed._composable.replicate import replicate as seed
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    api = {"ours": replicate, "seed": seed}[api_name]
    model = seeded(Stack, 70 + rank)  # different on each rank: the set-up broadcasts must make them equal
    reference = seeded(Stack, 70)
    if rank != 0:
        with torch.no_grad():  # fully_shard shards rank-local values: give it rank 0's outside the block
            for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
                if not name.startswith("blocks.1."):
                    p.copy_(q)
    api(model.blocks[1])
    fully_shard(model, mesh=init_device_mesh("cpu", (world_size,)))
    block = {name for name, _ in model.blocks[1].named_parameters(prefix="blocks.1")}
    sharded = {name for name, p in model.named_parameters() if hasattr(p, "full_tensor")}
    assert sharded and not sharded & block, f"rank {rank} {api_name}: fully_shard took {sorted(sharded & block)}"
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    after_steps = []
    for step in range(3):
        model(data(rank, step)).pow(2).mean().backward()
        (sum(reference(data(r, step)).pow(2).mean() for r in range(world_size)) / world_size).backward()
        for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
            assert p.grad is not None, f"rank {rank} {api_name} step {step}: {name} has no gradient"
            torch.testing.assert_close(
                full(p.grad), q.grad, rtol=1e-5, atol=1e-6, msg=lambda m: f"rank {rank} {api_name} {name}: {m}"
            )
        optimizer.step()
        optimizer.zero_grad()
        sgd_step(reference)
        weights = [full(p) for p in model.parameters()]
        for (name, _), weight, q in zip(model.named_parameters(), weights, reference.parameters(), strict=True):
            torch.testing.assert_close(weight, q.detach(), rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
        after_steps.append(weights)
    dist.barrier()  # the seed's DDP: gloo occasionally hangs in teardown otherwise
    return after_steps


def test_replicate_a_child_then_fully_shard_the_root_as_the_seed_does(pools):
    # Refused before the registry was torch's: fully_shard now skips the replicated block.
    ours, seed = pools.run(2, under_fully_shard, "ours"), pools.run(2, under_fully_shard, "seed")
    for rank in range(2):
        for step, (mine, theirs) in enumerate(zip(ours[rank], seed[rank], strict=True)):
            for a, b in zip(mine, theirs, strict=True):
                torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=lambda m: f"rank {rank} step {step}: {m}")


def fully_shard_then_replicate(rank: int, world_size: int) -> str:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = Stack()
    fully_shard(model, mesh=init_device_mesh("cpu", (world_size,)))
    try:
        replicate(model.blocks[1])
    except RuntimeError as error:
        retried = "no retry"
        try:
            replicate(model.blocks[1])  # refused again, by the same check: the failed call left no entry
        except RuntimeError as again:
            retried = str(again)
        return f"{error}\n{retried}"
    return "no error"


def test_replicate_inside_a_fully_shard_module_is_refused_on_every_rank(pools):
    # fully_shard already reduces the block's gradients: replicate() would average them twice.
    for message in pools.run(2, fully_shard_then_replicate):
        first, again = message.split("\n", 1) if "\n" in message else (message, "")
        for text in (first, again):
            assert "inside a FSDPStack managed by fully_shard" in text, message
            assert "average them a second time" in text, message
