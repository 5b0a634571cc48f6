"""SyncBatchNorm: the conversion path (CPU), and its training path where a GPU is lent.

torch 2.13's SyncBatchNorm refuses CPU tensors in training ("SyncBatchNorm
expected input tensor to be on GPU ..."), so on this CPU machine the tests
check the conversion, before and after replicate(), and pin that message;
test_buffers.py trains one on a GPU.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from parity import seeded
from torchreplicate import replicate


class Normed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.bn = nn.BatchNorm1d(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.lin(x))


class Converted(NamedTuple):
    same_objects: bool  # the converted module kept the parameter and buffer objects
    keys_kept: bool  # and its state_dict keys
    eval_matches: bool  # eval-mode output equals plain BatchNorm's
    training_error: str  # what training on CPU raises


def convert(rank: int, world_size: int, when: str) -> Converted:
    model = seeded(Normed, rank)  # different per rank: replicate() broadcasts rank 0's
    plain = seeded(Normed, 0)
    with torch.no_grad():
        plain.bn.running_mean.uniform_()
        model.bn.running_mean.copy_(plain.bn.running_mean) if rank == 0 else model.bn.running_mean.zero_()
    before = [id(t) for t in list(model.parameters()) + list(model.buffers())]
    keys = list(model.state_dict())
    if when == "before":
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        replicate(model)
    else:
        replicate(model)
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)  # the next forward re-plans
    assert isinstance(model.bn, nn.SyncBatchNorm), type(model.bn)
    same = [id(t) for t in list(model.parameters())] == before[: len(list(model.parameters()))]
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    model.eval()
    out = model(x)  # grad enabled: parameters and buffers come from rank 0
    plain.eval()
    matches = torch.allclose(out, plain(x), atol=1e-6)
    model.train()
    try:
        model(x)
        error = "no error"
    except ValueError as exc:
        error = str(exc)
    return Converted(same, list(model.state_dict()) == keys, matches, error)


def test_sync_batchnorm_conversion_before_and_after_replicate(pools):
    for when in ("before", "after"):
        for rank, r in enumerate(pools.run(2, convert, when)):
            assert r.same_objects and r.keys_kept, f"{when}: rank {rank}: {r}"
            assert r.eval_matches, f"{when}: rank {rank}: eval output differs from BatchNorm with rank 0's weights"
            assert "SyncBatchNorm expected input tensor to be on GPU" in r.training_error, r.training_error
