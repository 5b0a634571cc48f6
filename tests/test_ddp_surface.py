"""DDP's attributes and methods on a replicated module, against torch DDP on the same job.

Every multi-rank check runs DDP and replicate() side by side on rank-different
inputs (and rank-different initial values where set-up matters), so a missing
or extra average or broadcast shows.
"""

import copy

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from parity import gather, same_on_every_rank
from torchreplicate import replicate

IGNORED = ["tables.weight", "tables.bias", "norm.running_mean"]  # DDP's ignore list, by fully qualified name


class Ranker(nn.Module):
    """A shared body, a "sharded table" (torchrec keeps it out of DDP) and a BatchNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.tables = nn.Linear(6, 6)
        self.body = nn.Linear(6, 6)
        self.norm = nn.BatchNorm1d(6)
        self.head = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.body(x) + self.tables(x)))


def rank_model(rank: int) -> Ranker:
    """The same weights on every rank, except the ignored table and statistics: rank-different."""
    torch.manual_seed(0)
    model = Ranker()
    with torch.no_grad():
        model.tables.weight.add_(rank)
        model.tables.bias.add_(rank)
        model.norm.running_mean.add_(rank)
        model.norm.running_var.add_(rank)  # not ignored: broadcast at set-up by both
    return model


def batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(4, 6, generator=torch.Generator().manual_seed(1000 * rank + step)) + rank


def state_of(model: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters, their gradients and buffers, by name (names without DDP's ``module.``)."""
    tensors = {f"param {n}": p.detach().clone() for n, p in model.named_parameters()}
    tensors |= {f"grad {n}": p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    tensors |= {f"buffer {n}": b.clone() for n, b in model.named_buffers()}
    return {name.replace("module.", "", 1): t for name, t in tensors.items()}


def assert_as_ddp(ours: nn.Module, theirs: nn.Module, where: str) -> None:
    """Bitwise equal parameters, gradients and buffers (2 ranks: the same sums in the same order)."""
    mine, ddp = state_of(ours), state_of(theirs)
    assert mine.keys() == ddp.keys(), f"{where}: {sorted(mine.keys() ^ ddp.keys())}"
    for name, tensor in mine.items():
        assert torch.equal(tensor, ddp[name]), f"{where}: {name} differs from DDP's: {tensor} vs {ddp[name]}"


def train(model: nn.Module, rank: int, steps: range) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in steps:
        optimizer.zero_grad()
        model(batch(rank, step)).square().mean().backward()
        optimizer.step()


def ignored_before_replicate(rank, world_size):
    """Set before wrapping (torchrec's way): not broadcast at set-up, not averaged, as DDP."""
    ours, theirs = rank_model(rank), rank_model(rank)
    for model in (ours, theirs):
        DDP._set_params_and_buffers_to_ignore_for_model(model, IGNORED)
    replicate(ours)
    wrapped = DDP(theirs)
    assert_as_ddp(ours, wrapped, f"rank {rank}, after set-up")
    assert not same_on_every_rank(ours.tables.weight), "the ignored table was broadcast at set-up"
    assert same_on_every_rank(ours.norm.running_var), "a buffer not ignored was not broadcast at set-up"
    for step in range(3):
        train(ours, rank, range(step, step + 1))
        train(wrapped, rank, range(step, step + 1))
        assert_as_ddp(ours, wrapped, f"rank {rank}, step {step}")
    assert not same_on_every_rank(ours.tables.weight.grad), "the ignored table's gradient was averaged"
    assert same_on_every_rank(ours.body.weight.grad), "a replicated gradient was not averaged"
    assert "tables.weight" not in replicate.state(ours).param_names


def test_ignored_parameters_and_buffers_as_ddp(pools):
    pools.run(2, ignored_before_replicate)


def ignored_after_replicate(rank, world_size):
    """Set after replicate(): the next forward re-plans without them; then the steps equal DDP's."""
    ours, theirs = rank_model(0), rank_model(0)  # equal everywhere: set-up broadcasts do not tell
    DDP._set_params_and_buffers_to_ignore_for_model(theirs, IGNORED)
    wrapped = DDP(theirs)
    replicate(ours)
    assert "tables.weight" in replicate.state(ours).param_names
    DDP._set_params_and_buffers_to_ignore_for_model(ours, IGNORED)  # sets ours._ddp_params_and_buffers_to_ignore
    assert ours._ddp_params_and_buffers_to_ignore == IGNORED
    for step in range(3):
        train(ours, rank, range(step, step + 1))
        train(wrapped, rank, range(step, step + 1))
        assert_as_ddp(ours, wrapped, f"rank {rank}, step {step}")
    assert "tables.weight" not in replicate.state(ours).param_names
    assert not same_on_every_rank(ours.tables.weight), "the ignored table was averaged after all"
    del ours._ddp_params_and_buffers_to_ignore  # back to averaging everything at the next forward
    train(ours, rank, range(9, 10))
    assert "tables.weight" in replicate.state(ours).param_names
    assert same_on_every_rank(ours.tables.weight.grad), "no longer ignored, yet not averaged"


def test_ignore_list_set_after_replicate_re_plans(pools):
    pools.run(2, ignored_after_replicate)


def ignore_list_checked(rank, world_size):
    model = rank_model(0)
    model._ddp_params_and_buffers_to_ignore = "tables.weight"
    with pytest.raises(TypeError, match="single string 'tables.weight'.*write a list"):
        replicate(model)
    del model._ddp_params_and_buffers_to_ignore
    model._ddp_params_and_buffers_to_ignore = ["tables.wieght"]
    with pytest.warns(UserWarning, match=r"\['tables.wieght'\].*match no parameter or buffer"):
        replicate(model)
    assert "tables.weight" in replicate.state(model).param_names
    with pytest.raises(TypeError, match="fully qualified names .str., got 3"):
        model._ddp_params_and_buffers_to_ignore = [3]
    plain = copy.deepcopy(model)  # a copy is a plain module and keeps the list, as a plain module would
    assert type(plain) is Ranker and plain._ddp_params_and_buffers_to_ignore == ["tables.wieght"]
    assert gather(torch.ones(1))  # every rank got here


def test_ignore_list_is_checked(pools):
    pools.run(2, ignore_list_checked)
