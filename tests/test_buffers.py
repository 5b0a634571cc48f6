"""Buffers: rank 0's broadcast before every forward (or not, when asked); SyncBatchNorm."""

import pytest
import torch
from torch import nn

from models import data
from parity import assert_replicas_identical, same_on_every_rank, seeded
from torchreplicate import replicate


class Norms(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.bn = nn.BatchNorm1d(8)
        self.out = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.bn(self.lin(x))))


def train_batchnorm(rank, world_size, *, broadcast_buffers):
    """Three steps of two forwards each on rank-dependent data, then an eval forward."""
    model = seeded(Norms, 0)
    replicate(model, broadcast_buffers=broadcast_buffers)
    for step in range(3):
        # two forwards through BatchNorm before one backward (DDP's in-place failure)
        first = model(data(rank, step) + rank)
        second = model(data(rank, step + 50) + rank)
        (first.pow(2).mean() + second.pow(2).mean()).backward()
        model.zero_grad()
    # the last forward ran on rank-dependent data: statistics differ unless re-broadcast
    equal_before_forward = same_on_every_rank(model.bn.running_mean)
    model.eval()
    model(data(rank, 99))  # grad enabled: buffers are broadcast (a no_grad forward runs no collective)
    equal_after_forward = same_on_every_rank(model.bn.running_mean)
    counters_equal = same_on_every_rank(model.bn.num_batches_tracked.reshape(1))
    where = f"rank {rank}, broadcast_buffers={broadcast_buffers}"
    if broadcast_buffers:
        assert not equal_before_forward, (
            f"{where}: ranks saw different data, so their statistics should differ before the broadcast"
        )
        assert equal_after_forward, f"{where}: bn.running_mean differs across ranks after a forward"
        assert counters_equal, f"{where}: bn.num_batches_tracked differs across ranks after a forward"
        # 6 training forwards; the eval forward does not count
        assert int(model.bn.num_batches_tracked) == 6, f"{where}: {int(model.bn.num_batches_tracked)} batches"
    else:
        assert not equal_after_forward, f"{where}: bn.running_mean was synchronised anyway"


def test_buffers_broadcast_before_every_forward(pools):
    pools.run(2, train_batchnorm, broadcast_buffers=True)


def test_buffers_left_alone_when_asked(pools):
    pools.run(2, train_batchnorm, broadcast_buffers=False)


def set_up_buffers(rank, world_size, *, broadcast_buffers):
    """At set-up, as DDP: rank 0's buffers everywhere, or each rank's own when broadcast_buffers=False."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    ours, theirs = seeded(Norms, 0), seeded(Norms, 0)
    for model in (ours, theirs):
        model.bn.running_mean.fill_(float(rank))  # per-rank statistics, as after local warm-up
    replicate(ours, broadcast_buffers=broadcast_buffers)
    DDP(theirs, broadcast_buffers=broadcast_buffers)
    expected = 0.0 if broadcast_buffers else float(rank)
    assert ours.bn.running_mean.eq(expected).all(), f"rank {rank}: {ours.bn.running_mean}"
    assert torch.equal(ours.bn.running_mean, theirs.bn.running_mean), f"rank {rank}: ours differs from DDP's"


@pytest.mark.parametrize("broadcast_buffers", [True, False])
def test_set_up_syncs_buffers_as_ddp(pools, broadcast_buffers):
    pools.run(2, set_up_buffers, broadcast_buffers=broadcast_buffers)


def sync_batchnorm_trains(rank, world_size):
    # On the GPU (the test pool's gloo group carries CUDA tensors for SyncBatchNorm's all-gather)
    device = torch.device("cuda", rank % torch.cuda.device_count())
    model = nn.SyncBatchNorm.convert_sync_batchnorm(seeded(Norms, 0)).to(device)
    replicate(model)
    for step in range(3):
        model((data(rank, step) + rank).to(device)).pow(2).mean().backward()
        model.zero_grad()
    model.cpu()
    assert_replicas_identical(model, "after 3 steps")


@pytest.mark.cuda
@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="torch.nn.SyncBatchNorm raises 'SyncBatchNorm expected input tensor to be on GPU' in training "
    "on CPU tensors (torch 2.13 batchnorm.py); this machine has no GPU",
)
def test_sync_batchnorm_model_trains_identically(pools):
    pools.run(2, sync_batchnorm_trains)
