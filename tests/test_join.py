"""Uneven inputs with torch's Join: ranks with fewer batches shadow the others; DDP's semantics."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from parity import seeded
from torchreplicate import replicate

DIM = 8


def data(rank: int, step: int) -> torch.Tensor:
    return torch.randn(4, DIM, generator=torch.Generator().manual_seed(100 * step + rank))


def _net() -> nn.Module:
    net = nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh(), nn.Linear(DIM, 2))
    net.register_buffer("seen", torch.zeros(1))  # changes in forward: broadcast from a rank still training
    return net


def _forward(run: nn.Module, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    model.seen += 1  # a buffer that changes on every rank that still trains
    return run(x)


def expected(counts: list[int], divide_by_initial: bool) -> list[torch.Tensor]:
    """One process, DDP's semantics: step s averages the ranks that still have a batch s."""
    reference = seeded(_net, 3)
    world_size = len(counts)
    for step in range(max(counts)):
        training = [r for r in range(world_size) if step < counts[r]]
        divisor = world_size if divide_by_initial else len(training)
        reference.zero_grad()
        (sum(reference(data(r, step)).pow(2).mean() for r in training) / divisor).backward()
        with torch.no_grad():
            for p in reference.parameters():
                p -= 0.1 * p.grad
    return [p.detach() for p in reference.parameters()]


def uneven(rank: int, world_size: int, counts: list[int], divide_by_initial: bool, engine: str) -> list[float]:
    model = seeded(_net, 3 + rank)
    if engine == "ddp":
        model = seeded(_net, 3)  # DDP broadcasts too, but its buffer handling differs: start equal
        wrapped = DistributedDataParallel(model)
        context = wrapped.join(divide_by_initial_world_size=divide_by_initial)
        run = wrapped
    else:
        run = replicate(model)
        context = model.join(divide_by_initial_world_size=divide_by_initial)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with context:
        for step in range(counts[rank]):
            _forward(run, model, data(rank, step)).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    want = expected(counts, divide_by_initial)
    for (name, p), q in zip(model.named_parameters(), want):
        torch.testing.assert_close(
            p.detach(), q, rtol=1e-5, atol=1e-6, msg=lambda m: f"rank {rank} {engine} {name}: {m}"
        )
    seen = model.seen.clone()
    gathered = [torch.zeros(1) for _ in range(world_size)]
    dist.all_gather(gathered, seen)
    assert all(torch.equal(g, gathered[0]) for g in gathered), f"buffers differ after the join: {gathered}"
    return [p.sum().item() for p in model.parameters()]


@pytest.mark.parametrize("divide_by_initial", [True, False], ids=["initial-world-size", "ranks-training"])
@pytest.mark.parametrize("counts", [[3, 5], [0, 5]], ids=["3-vs-5", "0-vs-5"])
def test_uneven_inputs_two_ranks(pools, counts, divide_by_initial):
    ours = pools.run(2, uneven, counts, divide_by_initial, "ours", timeout_s=90)
    assert ours[0] == ours[1], "replicas differ after the join"


def test_uneven_inputs_three_ranks(pools):
    ours = pools.run(3, uneven, [0, 3, 5], False, "ours", timeout_s=90)
    assert len({tuple(r) for r in ours}) == 1


@pytest.mark.parametrize("divide_by_initial", [True, False])
def test_ddp_reaches_the_same_weights(pools, divide_by_initial):
    """The reference above is DDP's semantics: DDP's own run lands on it too."""
    ddp = pools.run(2, uneven, [3, 5], divide_by_initial, "ddp", timeout_s=90)
    ours = pools.run(2, uneven, [3, 5], divide_by_initial, "ours", timeout_s=90)
    for a, b in zip(ddp[0], ours[0]):
        assert abs(a - b) <= 1e-4 * max(1.0, abs(a)), (ddp[0], ours[0])
