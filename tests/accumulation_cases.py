"""Gradient accumulation, buffers and odd steps: functions run on every rank."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from dynamic_cases import Branches, data
from parity import assert_grads_match, digest, seeded
from torchreplicate import replicate


def _gathered_equal(tensor: torch.Tensor) -> bool:
    copies = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(copies, tensor.contiguous())
    return all(torch.equal(c, copies[0]) for c in copies)


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
            trunk = model.trunk.weight.grad
            assert not _gathered_equal(trunk), "no_sync backward averaged the gradients"
        loss_of(model, rank, micro_batches).backward()
        total = sum(loss_of(reference, r, k) for r in range(world_size) for k in range(micro_batches + 1))
        (total / world_size).backward()
        assert_grads_match(model, reference, f"rank {rank} step {step}")
        for module in (model, reference):
            with torch.no_grad():
                for p in module.parameters():
                    if p.grad is not None:
                        p -= 0.05 * p.grad
            module.zero_grad()
    return digest(model)


def sync_setting_read_at_backward(rank, world_size):
    model = seeded(Branches, 3 + rank)
    replicate(model)
    # forward with sync on, backward with it off: local only
    loss = model(data(rank, 0)).pow(2).mean()
    model.set_requires_gradient_sync(False)
    loss.backward()
    local_only = not _gathered_equal(model.trunk.weight.grad)
    model.set_requires_gradient_sync(True)
    model.zero_grad()
    # forward inside no_sync, backward after it: averaged
    with model.no_sync():
        loss = model(data(rank, 1)).pow(2).mean()
    loss.backward()
    averaged = _gathered_equal(model.trunk.weight.grad)
    return local_only, averaged


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
    assert all(p.grad is None for p in model.parameters())
    # 3. a forward whose output needs grad only through its input: every
    #    parameter is unused everywhere, so every .grad stays None
    frozen = {name: p.requires_grad for name, p in model.named_parameters()}
    out = model.trunk(x).detach().requires_grad_() * 3
    out.sum().backward()
    assert all(p.grad is None for p in model.parameters()), "grads appeared"
    assert frozen == {name: p.requires_grad for name, p in model.named_parameters()}
    # 4. then a normal step still matches the reference
    model(data(rank, 2)).pow(2).mean().backward()
    (sum(reference(data(r, 2)).pow(2).mean() for r in range(world_size)) / world_size).backward()
    assert_grads_match(model, reference, f"rank {rank} after odd steps")
    return True


class Norms(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.bn = nn.BatchNorm1d(8)
        self.out = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.bn(self.lin(x))))


def buffers_broadcast(rank, world_size, *, broadcast_buffers):
    model = seeded(Norms, 0)
    replicate(model, broadcast_buffers=broadcast_buffers)
    for step in range(3):
        # two forwards through BatchNorm before one backward (DDP's in-place failure)
        first = model(data(rank, step) + rank)
        second = model(data(rank, step + 50) + rank)
        (first.pow(2).mean() + second.pow(2).mean()).backward()
        model.zero_grad()
    # the last forward ran on rank-dependent data: statistics differ unless re-broadcast
    before_forward_equal = _gathered_equal(model.bn.running_mean)
    model.eval()
    model(data(rank, 99))  # grad enabled: buffers are broadcast (a no_grad forward runs no collective)
    after_forward_equal = _gathered_equal(model.bn.running_mean)
    counter_equal = _gathered_equal(model.bn.num_batches_tracked.reshape(1))
    return before_forward_equal, after_forward_equal, counter_equal, int(model.bn.num_batches_tracked)


def sync_batchnorm_trains(rank, world_size):
    model = nn.SyncBatchNorm.convert_sync_batchnorm(seeded(Norms, 0))
    replicate(model)
    for step in range(3):
        model(data(rank, step) + rank).pow(2).mean().backward()
        model.zero_grad()
    return digest(model)
