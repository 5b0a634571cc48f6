"""Memory and layout as DDP's: gradient views keep the parameter's strides (channels_last); the set-up
broadcast packs at most DDP's 250 MiB at a time, not the whole model."""

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from parity import same_on_every_rank
from torchreplicate import replicate


class Convs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.conv2 = nn.Conv2d(8, 4, 1)
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.conv2(torch.relu(self.conv(x))).mean((2, 3)))


def convs() -> Convs:
    torch.manual_seed(0)
    return Convs().to(memory_format=torch.channels_last)


def batch(rank: int) -> torch.Tensor:
    x = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(rank))
    return x.to(memory_format=torch.channels_last)


def strides_as_ddp(rank, world_size):
    ours, theirs, reference = convs(), convs(), convs()
    replicate(ours)
    wrapped = DDP(theirs, gradient_as_bucket_view=True)
    for step in range(2):
        ours(batch(rank + 10 * step)).square().mean().backward()
        wrapped(batch(rank + 10 * step)).square().mean().backward()
        total = sum(reference(batch(r + 10 * step)).square().mean() for r in range(world_size)) / world_size
        total.backward()
        for (name, p), q, r in zip(ours.named_parameters(), theirs.parameters(), reference.parameters(), strict=True):
            assert p.grad.stride() == p.stride() == q.grad.stride(), f"{name}: {p.grad.stride()} {q.grad.stride()}"
            bucket = replicate.state(ours).reducer.buckets[0].buffer
            start = bucket.data_ptr()
            assert start <= p.grad.data_ptr() < start + bucket.numel() * bucket.element_size(), f"{name}: not a view"
            assert torch.equal(p.grad, q.grad), f"rank {rank} step {step}: {name} differs from DDP's"
            torch.testing.assert_close(p.grad, r.grad, rtol=1e-5, atol=1e-6)
            assert same_on_every_rank(p.grad)
        for model in (ours, theirs, reference):
            for p in model.parameters():
                p.grad = None if model is reference else p.grad.zero_()
    assert ours.conv.weight.is_contiguous(memory_format=torch.channels_last)
    assert not ours.conv.weight.grad.is_contiguous(), "a row-major view"


def test_channels_last_gradients_keep_their_strides_as_ddp(pools):
    pools.run(2, strides_as_ddp)


def test_the_broadcast_packs_runs_of_at_most_the_chunk_in_order():
    from torchreplicate.core.buffers import CHUNK_BYTES, _chunks

    assert CHUNK_BYTES == 250 * 1024 * 1024
    sizes = [torch.empty(n) for n in (10, 20_000_000, 50_000_000, 3, 70_000_000, 1)]  # float32: 4 bytes each
    chunks = _chunks(sizes)
    assert [t for chunk in chunks for t in chunk] == sizes, "every tensor once, in order"
    assert [len(c) for c in chunks] == [2, 2, 1, 1], [len(c) for c in chunks]  # 70M floats: over alone
    assert all(sum(t.numel() * 4 for t in c) <= CHUNK_BYTES for c in chunks if len(c) > 1)
    assert [len(c) for c in _chunks([torch.empty(100_000_000), torch.empty(1)])] == [1, 1], "a larger one alone"


def set_up_in_chunks(rank, world_size):
    import torch.distributed as dist

    from torchreplicate.core import buffers

    buffers.CHUNK_BYTES = 1024  # a model of many chunks
    sent = []
    broadcast = dist.broadcast

    def counting(tensor, *args, **kwargs):
        sent.append(tensor.numel() * tensor.element_size())
        return broadcast(tensor, *args, **kwargs)

    dist.broadcast = counting
    try:
        torch.manual_seed(rank)  # rank-different weights: the set-up must give every rank rank 0's
        model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 16), nn.BatchNorm1d(16), nn.Linear(16, 4))
        replicate(model)
    finally:
        dist.broadcast = broadcast
    torch.manual_seed(0)
    expected = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 16), nn.BatchNorm1d(16), nn.Linear(16, 4))
    for (name, value), want in zip(model.state_dict().items(), expected.state_dict().values(), strict=True):
        assert torch.equal(value, want), f"rank {rank}: {name} is not rank 0's"
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    assert len(sent) > 3 and max(sent) <= max(1024, largest), sent
    return len(sent)


def test_the_set_up_broadcast_goes_in_chunks(pools):
    counts = pools.run(2, set_up_in_chunks)
    assert counts[0] == counts[1]
