"""Models whose graph changes by rank or step, and the parity driver for them.

Each case is ``(build, loss_of)``: ``loss_of(model, rank, world_size, step)``
is what one rank computes in one step. The reference is one process that
computes ``mean over ranks of loss_of(reference, r, ...)`` and backwards once:
exactly the gradient replicate() must produce on every rank.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.utils.checkpoint as cp
from torch import nn

from models import DIM, Branches, data
from parity import assert_grads_match, digest, seeded
from torchreplicate import replicate


def rank_branch(model, rank, world_size, step):
    return model(data(rank, step), branch="a" if rank == 0 else "b").pow(2).mean()


def alternating_head(model, rank, world_size, step):
    out = model(data(rank, step))
    loss = out.pow(2).mean()
    if step % 2 == 0:
        loss = loss + model.aux_head(out).mean()
    return loss


def moe(model, rank, world_size, step):
    # expert 3 is never chosen; which of 0-2 a rank uses changes every step
    return model(data(rank, step), expert=(rank + step) % 3).pow(2).mean()


def unused_on_one_rank_only(model, rank, world_size, step):
    out = model(data(rank, step))
    if rank != world_size - 1:
        out = model.aux_head(out)
    return out.pow(2).mean()


def two_forwards(model, rank, world_size, step):
    first = model(data(rank, step), branch="a")
    second = model(data(rank, step + 100), branch="b")
    return first.pow(2).mean() + second.abs().mean()


def other_method(model, rank, world_size, step):
    return model.encode(data(rank, step)).pow(2).mean()


class Reused(nn.Module):
    """One layer applied several times, inside and outside checkpoints."""

    def __init__(self, reentrant: Optional[bool]) -> None:
        super().__init__()
        self.reentrant = reentrant  # None: no checkpointing
        self.inp = nn.Linear(DIM, DIM)
        self.shared = nn.Linear(DIM, DIM)
        self.block = nn.Linear(DIM, DIM)
        self.out = nn.Linear(DIM, 2)

    def segment(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.block(torch.tanh(self.shared(h))))

    def forward(self, x: torch.Tensor, uses: int = 2) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        for _ in range(uses):
            if self.reentrant is None:
                h = self.segment(h)
            else:
                h = cp.checkpoint(self.segment, h, use_reentrant=self.reentrant)
        return self.out(self.shared(h))


def other_method_checkpointed(model, rank, world_size, step):
    # no forward hook runs, and the first gradient hook fires inside a nested
    # (reentrant) backward: see [Note: end of backward] in reducer.py
    x = data(rank, step).requires_grad_()
    h = torch.tanh(model.inp(x))

    def head(t):
        return model.out(model.shared(model.segment(t)))

    return cp.checkpoint(head, h, use_reentrant=True).pow(2).mean()


def reused_static(model, rank, world_size, step):
    x = data(rank, step).requires_grad_(model.reentrant is True)  # reentrant needs an input that requires grad
    return model(x).pow(2).mean()


def reused_growing(model, rank, world_size, step):
    # 1, 2, 3, 1, 2, 3 uses: the shared layer's gradient arrives more often than learned
    x = data(rank, step).requires_grad_(model.reentrant is True)
    return model(x, uses=1 + step % 3).pow(2).mean()


def reused_rank_dependent(model, rank, world_size, step):
    x = data(rank, step).requires_grad_(model.reentrant is True)
    return model(x, uses=1 + (rank + step) % 2).pow(2).mean()


CASES: dict[str, tuple[Callable[[], nn.Module], Callable[..., torch.Tensor]]] = {
    "rank_branch": (Branches, rank_branch),
    "alternating_head": (Branches, alternating_head),
    "moe": (Branches, moe),
    "unused_on_one_rank": (Branches, unused_on_one_rank_only),
    "two_forwards": (Branches, two_forwards),
    "other_method": (Branches, other_method),
    "called_twice": (lambda: Reused(None), reused_static),
    "checkpoint_reentrant": (lambda: Reused(True), reused_static),
    "checkpoint_non_reentrant": (lambda: Reused(False), reused_static),
    "checkpoint_reentrant_growing": (lambda: Reused(True), reused_growing),
    "checkpoint_non_reentrant_growing": (lambda: Reused(False), reused_growing),
    "checkpoint_reentrant_by_rank": (lambda: Reused(True), reused_rank_dependent),
    "other_method_checkpointed": (lambda: Reused(True), other_method_checkpointed),
}


def run_case(
    rank: int,
    world_size: int,
    case: str,
    *,
    steps: int = 6,
    options: Optional[dict[str, Any]] = None,
) -> dict[str, Any]:
    """Trains ``case`` replicated and as the reference; checks grads every step."""
    build, loss_of = CASES[case]
    model = seeded(build, 7 + rank)
    reference = seeded(build, 7)
    replicate(model, **(options or {}))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.5)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.5)
    none_grads = []
    for step in range(steps):
        loss_of(model, rank, world_size, step).backward()
        total = sum(loss_of(reference, r, world_size, step) for r in range(world_size)) / world_size
        total.backward()
        assert_grads_match(model, reference, f"{case}: rank {rank} step {step}")
        none_grads.append(sorted(n for n, p in model.named_parameters() if p.grad is None))
        optimizer.step()
        ref_optimizer.step()
        optimizer.zero_grad()
        ref_optimizer.zero_grad()
    return {"digest": digest(model), "none_grads": none_grads}
