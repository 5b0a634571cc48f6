"""On a CUDA GPU: NCCL at world size 1, and 2 gloo ranks sharing the GPU with CUDA tensors.

Marked ``cuda`` (``pytest -m cuda`` runs them; scripts/gpu_check.sh does). On
a machine without a GPU they skip, saying so; the CPU suite covers the same
reducer on gloo.
"""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist
from torch import nn

from local_ranks import launch
from parity import assert_grads_match, assert_replicas_identical, seeded, sgd_step
from torchreplicate import replicate

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; this machine has none"),
]


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(16, 64, generator=torch.Generator().manual_seed(100 * step + rank))


class Trained(NamedTuple):
    rank: int
    steps: int


def train_against_reference(backend: str) -> Trained:
    """Every rank trains on its own batches; the reference sees them all; grads and replicas compared."""
    dist.init_process_group(backend)  # launch() set the rank, world size and address
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    model = replicate(seeded(Mlp, 1 + rank).to(device))  # rank 0's values are broadcast
    reference = seeded(Mlp, 1).to(device)
    for step in range(4):
        xs = [batch(r, step).to(device) for r in range(world_size)]
        model(xs[rank]).pow(2).mean().backward()
        torch.stack([reference(x).pow(2).mean() for x in xs]).mean().backward()
        assert_grads_match(model, reference, f"rank {rank} step {step}")
        sgd_step(model, reference, lr=0.1)
        assert_replicas_identical(model, f"rank {rank} after step {step}")
    dist.destroy_process_group()
    return Trained(rank, 4)


def test_nccl_world_size_one_trains_like_local():
    assert launch(train_against_reference, 1, ("nccl",), timeout_s=180) == [Trained(0, 4)]


def test_two_gloo_ranks_share_the_gpu_with_cuda_tensors():
    results = launch(train_against_reference, 2, ("gloo",), timeout_s=180)
    assert results == [Trained(0, 4), Trained(1, 4)]
