"""Faults and desync: a clear error on every rank, naming who and where, in bounded time."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from parity import seeded
from torchreplicate import replicate
from torchreplicate.diagnostics import DesyncReport, format_desync

DIM = 8


def data(rank: int, step: int) -> torch.Tensor:
    return torch.randn(4, DIM, generator=torch.Generator().manual_seed(1000 * step + rank))


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh(), nn.Linear(DIM, 2))


# -- desync: a rank that ran an extra backward, or skipped one -------------------------


def desynced(rank: int, world_size: int, fault: str) -> str:
    """Trains with SGD; at step 3 rank 1 runs an extra micro-step, or skips its backward."""
    model = replicate(seeded(_net, 0))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        for step in range(8):
            backwards = 1
            if rank == 1 and step == 3:
                backwards = 2 if fault == "extra" else 0
            for micro in range(backwards):
                model(data(rank, 10 * step + micro)).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    except RuntimeError as error:
        return f"step {step}: {error}"
    return "no error"


@pytest.mark.parametrize("fault", ["extra", "skipped"])
def test_desync_raises_on_every_rank_naming_the_ranks(pools, fault):
    messages = pools.run(2, desynced, fault, timeout_s=60)
    for rank, message in enumerate(messages):
        assert f"replicate(): rank {rank}: synchronised backward" in message, message
        assert "the ranks are at different training steps" in message, message
        assert "a rank ran an extra backward or skipped one" in message, message
        # the step after the fault: one rank is one optimizer step ahead
        assert "rank 0 at step 4" in message or "rank 0 at step 3" in message, message
    backward = [m.split("synchronised backward ")[1].split(":")[0] for m in messages]
    assert backward[0] == backward[1], f"the ranks raised at different collectives: {backward}"


def healthy_with_two_optimizers(rank: int, world_size: int) -> int:
    """Gradient accumulation, an optimizer over other parameters, a no-grad evaluation on one rank."""
    model = replicate(seeded(_net, 0))
    other = nn.Linear(DIM, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    other_optimizer = torch.optim.SGD(other.parameters(), lr=0.1)
    for step in range(6):
        with model.no_sync():
            model(data(rank, step)).pow(2).mean().backward()
        model(data(rank, step + 50)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        if rank == 0:  # a probe trained on rank 0 alone: not this module's clock
            other(data(0, step)).sum().backward()
            other_optimizer.step()
            with torch.no_grad():
                model(data(0, 99))
    return replicate.state(model).clock.steps


def test_healthy_runs_never_report_a_desync(pools):
    assert pools.run(2, healthy_with_two_optimizers) == [6, 6]


def test_desync_message_names_each_group_of_ranks():
    reports = [DesyncReport(0, 6, 1), DesyncReport(1, 7, 1), DesyncReport(2, 6, 1)]
    message = format_desync(reports, 2, 6, clocks_agree=False)
    assert message.startswith("replicate(): rank 2: synchronised backward 6: the ranks are at different training steps")
    assert "(rank 1 at step 7, ranks 0, 2 at step 6;" in message
    layouts = format_desync([DesyncReport(0, 1, 5), DesyncReport(1, 1, 9)], 0, 3, clocks_agree=True)
    assert "bucket layouts differ (same layout within: rank 0; rank 1)" in layouts


def mismatched_options(rank: int, world_size: int) -> str:
    try:
        replicate(seeded(_net, 0), bucket_cap_mb=25 if rank == 0 else 10)
    except RuntimeError as error:
        return str(error)
    return "no error"


def test_different_options_are_refused_before_any_bucket_travels(pools):
    # gloo aborts the whole process when buckets of different sizes meet
    for rank, message in enumerate(pools.run(2, mismatched_options)):
        assert f"replicate(): rank {rank}: the ranks called replicate() with different bucket_cap_mb" in message
        assert "rank 0: 25, rank 1: 10" in message, message
