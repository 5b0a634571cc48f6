"""Checks a rank function runs: against a single-process reference, and across ranks.

The reference is an unreplicated copy of the model that sees the global batch
(every rank's shard); replicate() must give each rank its gradients. The
cross-rank checks gather from every rank of the world group, so every rank
must call them at the same point.
"""

from __future__ import annotations

import hashlib
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

PER_RANK = 4  # samples per rank per step


def seeded(build: Callable[[], nn.Module], seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return build()


def local_shard(batch: torch.Tensor, rank: int) -> torch.Tensor:
    """This rank's ``PER_RANK`` rows of the global batch."""
    return batch[rank * PER_RANK : (rank + 1) * PER_RANK]


def digest(module: nn.Module) -> str:
    """Bitwise fingerprint of the parameters (equal across ranks iff identical)."""
    h = hashlib.sha256()
    for p in module.parameters():
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def _tensor_digest(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.detach().cpu().contiguous().numpy().tobytes()).hexdigest()


def assert_grads_match(model: nn.Module, reference: nn.Module, where: str) -> None:
    """Each ``.grad`` is the reference's (rtol 1e-5, atol 1e-6), and None where the reference's is.

    The two must have the same number of parameters: one lost or added fails.
    """
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        if q.grad is None:
            assert p.grad is None, f"{where}: {name}.grad should be None"
            continue
        assert p.grad is not None, f"{where}: {name}.grad is None, reference has one"
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=lambda m: f"{where}: {name}: {m}")


def assert_same_parameters(model: nn.Module, other: nn.Module, where: str) -> None:
    """Bitwise equal parameters, in the same process (the same number of them)."""
    for (name, p), q in zip(model.named_parameters(), other.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=lambda m: f"{where}: {name}: {m}")


def gather(tensor: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's copy of ``tensor`` (same shape everywhere), by rank."""
    copies = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(copies, tensor.detach().contiguous())
    return copies


def same_on_every_rank(tensor: torch.Tensor) -> bool:
    copies = gather(tensor)
    return all(torch.equal(c, copies[0]) for c in copies)


def assert_same_on_every_rank(tensor: torch.Tensor, what: str) -> None:
    """Bitwise equal on every rank; else names the ranks that differ from rank 0, and by how much."""
    copies = gather(tensor)
    gaps = [
        f"rank {r} differs from rank 0 by up to {float((c - copies[0]).abs().max()):.3g}"
        for r, c in enumerate(copies)
        if not torch.equal(c, copies[0])
    ]
    assert not gaps, f"rank {dist.get_rank()}: {what}: {'; '.join(gaps)}"


def assert_replicas_identical(model: nn.Module, where: str) -> None:
    """Every parameter bitwise equal on every rank; else names the parameters that differ.

    The ranks exchange a digest per parameter; every rank sees the same
    digests, so all of them go on together to gather the first differing
    parameter's values for the message.
    """
    named = list(model.named_parameters())
    everyone: list[list[str]] = [[] for _ in range(dist.get_world_size())]
    dist.all_gather_object(everyone, [_tensor_digest(p) for _, p in named])
    differing = [i for i in range(len(named)) if len({digests[i] for digests in everyone}) > 1]
    if differing:
        name, first = named[differing[0]]
        assert_same_on_every_rank(first, f"{where}: replicas differ in {[named[i][0] for i in differing]}; {name}")


def assert_group_usable(where: str) -> None:
    """An all-reduce on the world group still gives the right sum."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    probe = torch.full((3,), float(rank + 1))
    dist.all_reduce(probe)
    expected = world_size * (world_size + 1) / 2
    assert torch.equal(probe, torch.full((3,), expected)), f"{where}: the process group is unusable: {probe.tolist()}"


def sgd_step(*modules: nn.Module, lr: float = 0.1, skip_none: bool = False) -> None:
    """One plain SGD step on each module's parameters, then ``zero_grad()``.

    Args:
        modules: the replica and its reference (stepped alike).
        lr: the learning rate.
        skip_none: leave parameters without a gradient alone (frozen, unused);
            otherwise every parameter must have one.
    """
    with torch.no_grad():
        for module in modules:
            for name, p in module.named_parameters():
                if p.grad is None:
                    assert skip_none, f"sgd_step: {name} has no gradient"
                    continue
                p -= lr * p.grad
            module.zero_grad()
