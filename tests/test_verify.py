"""verify_replicas(): one collective of digests on healthy replicas; names what differs, on every rank."""

from __future__ import annotations

from typing import NamedTuple, Optional

import pytest
import torch
from torch import nn

from models import DIM, data
from parity import seeded
from torchreplicate import ReplicaMismatchError, replicate, verify_replicas
from torchreplicate.observe.verify import tensor_digest


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(DIM, DIM)
        self.register_buffer("offset", torch.randn(DIM))
        self.head = nn.Linear(DIM, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(x) + self.offset))


def test_digest_sees_one_bit_and_nothing_else():
    x = torch.randn(5, 3)
    assert tensor_digest(x) == tensor_digest(x.clone())
    flipped = x.clone()
    flipped.view(torch.int32)[2, 1] ^= 1
    assert tensor_digest(flipped) != tensor_digest(x)
    assert tensor_digest(x.t()) == tensor_digest(x.t().contiguous()), "the values, not the strides"
    for tensor in (
        torch.zeros(0),
        torch.tensor(3.0),
        torch.ones(3, dtype=torch.bfloat16),
        torch.ones(2, dtype=torch.bool),
    ):
        assert tensor_digest(tensor) == tensor_digest(tensor.clone())
    assert tensor_digest(None) != tensor_digest(torch.zeros(0))
    sparse = torch.sparse_coo_tensor(torch.tensor([[0, 2]]), torch.tensor([1.0, 2.0]), (3,), check_invariants=True)
    assert tensor_digest(sparse) == tensor_digest(torch.tensor([1.0, 0.0, 2.0]))


class VerifyResult(NamedTuple):
    error: str  # the message of ReplicaMismatchError on this rank ("" if none)
    kinds: list[str]  # of the mismatches
    names: list[str]
    ranks: list[tuple[int, ...]]
    max_difference: list[float]
    expected_difference: float  # what the fault changed, on the faulty rank (0 elsewhere)


def faulty(rank: int, world_size: int, fault: Optional[str], bad_rank: int) -> VerifyResult:
    """Trains two steps; then, on ``bad_rank``, applies ``fault`` and checks the replicas."""
    model = replicate(seeded(Net, rank))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):
        model(data(rank, step)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    model(data(rank, 2)).pow(2).mean().backward()
    healthy = verify_replicas(model, grads=True)
    assert healthy.ok and healthy.num_tensors == 4 + 1 + 4, f"rank {rank}: {healthy}"
    expected = 0.0
    if rank == bad_rank:
        with torch.no_grad():
            if fault == "bit":  # the lowest mantissa bit of one weight
                before = model.head.weight[1, 3].item()
                model.head.weight.view(torch.int32)[1, 3] ^= 1
                expected = abs(model.head.weight[1, 3].item() - before)
            elif fault == "grad":
                model.body.bias.grad[5] += 0.25
                expected = 0.25
            elif fault == "no_grad":
                model.body.bias.grad = None
            elif fault == "buffer":
                model.offset[0] += 1.0
                expected = 1.0
    try:
        report = verify_replicas(model, grads=fault in ("grad", "no_grad"))
    except ReplicaMismatchError as error:
        report = error.report
        message = str(error)
    else:
        message = ""
    assert report == verify_replicas(model, grads=fault in ("grad", "no_grad"), raise_on_mismatch=False)
    mismatches = report.mismatches
    return VerifyResult(
        message,
        [m.kind for m in mismatches],
        [m.name for m in mismatches],
        [m.ranks for m in mismatches],
        [m.max_difference for m in mismatches],
        expected,
    )


@pytest.mark.parametrize("world_size", [2, 3])
def test_healthy_replicas_pass(pools, world_size):
    results = pools.run(world_size, faulty, None, -1)
    assert all(r.error == "" and r.kinds == [] for r in results), results


@pytest.mark.parametrize("world_size,bad_rank", [(2, 1), (3, 2), (3, 0)])
def test_a_flipped_bit_is_named_with_its_rank_on_every_rank(pools, world_size, bad_rank):
    results = pools.run(world_size, faulty, "bit", bad_rank)
    expected = results[bad_rank].expected_difference
    assert expected > 0
    # two ranks: rank 0's value is the reference, so a fault on rank 1 names rank 1
    for rank, result in enumerate(results):
        assert result.kinds == ["parameter"] and result.names == ["head.weight"], (rank, result)
        assert result.ranks == [(bad_rank,)], (rank, result)
        assert result.max_difference == [pytest.approx(expected, rel=1e-6)], (rank, result)
        assert f"parameter 'head.weight': rank {bad_rank} differs from rank" in result.error, result.error
        assert "1 of 16 elements" in result.error and "first at [1, 3]" in result.error, result.error
    assert len({r.error for r in results}) == 1, "the same report on every rank"


@pytest.mark.parametrize("fault", ["grad", "no_grad", "buffer"])
def test_gradients_and_buffers(pools, fault):
    results = pools.run(2, faulty, fault, 1)
    for result in results:
        assert result.ranks == [(1,)], result
        if fault == "grad":
            assert result.kinds == ["gradient"] and result.names == ["body.bias"], result
            assert result.max_difference == [pytest.approx(0.25)], result
        elif fault == "no_grad":
            assert result.kinds == ["gradient"] and result.max_difference == [float("inf")], result
            assert "no gradient on rank(s) 1, a gradient on rank(s) 0" in result.error, result.error
        else:
            assert result.kinds == ["buffer"] and result.names == ["offset"], result
            assert result.max_difference == [pytest.approx(1.0)], result
            assert "before a forward, or pass buffers=False" in result.error, result.error


def optimizer_state(rank: int, world_size: int) -> list[tuple[bool, str]]:
    """A resume that loads the optimizer's state on rank 0 only (the model's weights replicate() broadcasts),
    then on every rank, then one rank's state changed by hand: what verify_replicas(optimizer=) says."""
    torch.manual_seed(0)
    model = replicate(nn.Sequential(nn.Linear(DIM, 8), nn.ReLU(), nn.Linear(8, 1)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    saved_model = seeded(lambda: nn.Sequential(nn.Linear(DIM, 8), nn.ReLU(), nn.Linear(8, 1)), 5)
    saved = torch.optim.AdamW(saved_model.parameters(), lr=0.01)  # a checkpoint's optimizer: two steps taken
    for step in range(2):
        saved_model(data(0, step)).square().mean().backward()
        saved.step()
    checkpoint = saved.state_dict()
    seen = []
    if rank == 0:  # "load on rank 0 before replicate()" applied to the optimizer too
        optimizer.load_state_dict(checkpoint)
    report = verify_replicas(model, optimizer=optimizer, raise_on_mismatch=False)
    seen.append((report.ok, report.message()))
    optimizer.load_state_dict(checkpoint)  # on every rank, as DDP's tutorial loads it
    report = verify_replicas(model, optimizer=optimizer, raise_on_mismatch=False)
    seen.append((report.ok, report.message()))
    if rank == 1:
        next(iter(optimizer.state.values()))["exp_avg"].view(-1)[0] += 1.0
    try:
        verify_replicas(model, optimizer=optimizer)
        seen.append((True, ""))
    except ReplicaMismatchError as error:
        seen.append((False, str(error)))
    return seen


def test_the_optimizers_state_is_compared_when_given(pools):
    for rank, (rank0_only, everywhere, changed) in enumerate(pools.run(2, optimizer_state)):
        assert not rank0_only[0], f"rank {rank}: a state loaded on rank 0 alone passed: {rank0_only[1]}"
        assert "optimizer state" in rank0_only[1] and "load it on every rank" in rank0_only[1], rank0_only[1]
        assert everywhere[0], f"rank {rank}: the state loaded on every rank differs: {everywhere[1]}"
        assert not changed[0], f"rank {rank}: one changed exp_avg element passed"
        assert "optimizer state '0.weight.exp_avg': rank 1 differs from rank 0: 1 of" in changed[1], changed[1]
