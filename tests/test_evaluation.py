"""Evaluation after training reads DDP's buffers: rank 0's, as its last forward left them ([Note: buffer sync]).

DDP's first forward after a synchronised step takes rank 0's buffers even under ``torch.no_grad()``, so
an evaluation whose metric is all-reduced across ranks sees rank 0's BatchNorm statistics on every rank.
Ours sends them at the end of the forward before, so a rank may also evaluate alone with no collective.
Each job trains 3 synchronised steps on rank-different batches, then evaluates under ``no_grad`` (in
train and in eval mode), after plain steps, after ``no_sync`` accumulation, and after a forward that had
no backward: each rank's outputs and buffers bitwise equal to DDP's in the same job, at 3 ranks.
"""

from __future__ import annotations

import hashlib
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from local_ranks import launch

VARIANTS = ("steps", "no_sync", "forward_without_backward", "grad_forward_eval")


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4), nn.BatchNorm1d(4))


def batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(6, 8, generator=torch.Generator().manual_seed(100 * step + rank)) * (1 + rank) + rank


def digest(tensors: Any) -> str:
    h = hashlib.sha256()
    for tensor in tensors:
        h.update(tensor.detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def evaluate(wrapped: nn.Module, raw: nn.Module, rank: int, mode: str) -> list[str]:
    """Two evaluation forwards under no_grad in ``mode``: each one's output and the buffers after it."""
    raw.train(mode == "train")
    seen = []
    with torch.no_grad():
        for k in range(2):
            out = wrapped(batch(rank, 1000 + k))
            seen += [digest([out]), digest(raw.buffers())]
    raw.train()
    return seen


def job(engine: str, variant: str, mode: str, evaluating: tuple[int, ...]) -> list[str]:
    """Trains, then evaluates on the ranks in ``evaluating``; what each evaluation saw (empty elsewhere)."""
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    raw = model()
    if engine == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        wrapped: nn.Module = DDP(raw)
    else:
        from torchreplicate import replicate

        wrapped = replicate(raw)
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.1, momentum=0.9)
    for step in range(3):
        wrapped(batch(rank, step)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    if variant == "no_sync":  # an accumulation's micro-batches, the last one synchronised
        with wrapped.no_sync():
            wrapped(batch(rank, 10)).pow(2).mean().backward()
        wrapped(batch(rank, 11)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    elif variant == "forward_without_backward":
        wrapped(batch(rank, 20))  # with gradients, dropped: the next forward takes rank 0's buffers again
    elif variant == "grad_forward_eval":  # an evaluation with gradients enabled first (every rank)
        wrapped(batch(rank, 30)).sum()
    seen = evaluate(wrapped, raw, rank, mode) if rank in evaluating else []
    dist.barrier()
    dist.destroy_process_group()
    return seen


@pytest.mark.parametrize("mode", ["eval", "train"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_every_rank_evaluates_with_ddps_buffers(variant, mode):
    every = (0, 1, 2)
    theirs = launch(job, nprocs=3, args=("ddp", variant, mode, every), timeout_s=120, threads_per_rank=1)
    ours = launch(job, nprocs=3, args=("ours", variant, mode, every), timeout_s=120, threads_per_rank=1)
    for rank in every:
        assert ours[rank] == theirs[rank], f"rank {rank}, {variant}, {mode} mode: outputs or buffers differ from DDP's"
    if mode == "eval":  # rank 0's statistics on every rank: every rank's evaluation of its batch differs
        assert len({seen[1] for seen in ours}) == 1, "the buffers differ across ranks in evaluation"


def test_rank_0_evaluates_alone_with_ddps_numbers():
    """Rank 0 alone evaluates (the others wait at a barrier): no hang, and its numbers are those rank 0
    sees under DDP when every rank evaluates (DDP's rank 0 alone would wait in its broadcast)."""
    theirs = launch(job, nprocs=3, args=("ddp", "steps", "eval", (0, 1, 2)), timeout_s=120, threads_per_rank=1)
    ours = launch(job, nprocs=3, args=("ours", "steps", "eval", (0,)), timeout_s=120, threads_per_rank=1)
    assert ours[0] == theirs[0], "rank 0's evaluation differs from DDP's"
    assert ours[1] == ours[2] == [], "only rank 0 evaluated"
