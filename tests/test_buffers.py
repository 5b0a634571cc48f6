"""Buffers: rank 0's broadcast before every forward (or not, when asked); SyncBatchNorm."""

from functools import partial

import pytest
import torch
from torch import nn

from ddp_versions import ddp_213, run_as_ddp_213
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
        # two forwards through BatchNorm before one backward: the in-place broadcast keeps the version counter
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
    ours, theirs = seeded(Norms, 0), seeded(Norms, 0)
    for model in (ours, theirs):
        model.bn.running_mean.fill_(float(rank))  # per-rank statistics, as after local warm-up
    replicate(ours, broadcast_buffers=broadcast_buffers)
    ddp_213(theirs, broadcast_buffers=broadcast_buffers)
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


BUFFER_OPTIONS = [
    {},
    {"broadcast_buffers": False},
    {"broadcast_buffers": True},
    {"forward_sync_buffers": False},
    {"forward_sync_buffers": True},
    {"broadcast_buffers": False, "forward_sync_buffers": True},
    {"broadcast_buffers": True, "forward_sync_buffers": False},
]


def norms_on(rank: int) -> Norms:
    """The same weights everywhere; rank-different BatchNorm statistics, as after a local warm-up."""
    model = seeded(Norms, 0)
    with torch.no_grad():
        model.bn.running_mean.add_(rank)
        model.bn.running_var.mul_(rank + 1)
        model.bn.num_batches_tracked.add_(rank)
    return model


def assert_buffers_as_ddp(ours: nn.Module, theirs: nn.Module, where: str) -> None:
    """Parameters, gradients and buffers equal to DDP's on this rank, bit for bit (DDP's arithmetic)."""
    mine = {**dict(ours.named_parameters()), **dict(ours.named_buffers())}
    ddp = {**dict(theirs.named_parameters()), **dict(theirs.named_buffers())}
    for name, tensor in mine.items():
        pairs = [(tensor, ddp[name], name)]
        if tensor.grad is not None or ddp[name].grad is not None:
            assert tensor.grad is not None and ddp[name].grad is not None, f"{where}: {name}.grad missing on one side"
            pairs.append((tensor.grad, ddp[name].grad, f"{name}.grad"))
        for a, b, what in pairs:
            assert torch.equal(a, b), f"{where}: {what} differs from DDP's by {float((a - b).abs().max()):.3g}"


def buffers_as_ddp(rank, world_size, *, options):
    """Set-up, no_sync accumulation, two forwards per backward and an eval forward: buffers as DDP's."""
    import warnings

    ours, theirs = norms_on(rank), norms_on(rank)
    held, held_ddp = ours.bn.running_mean, theirs.bn.running_mean  # references a user keeps
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # both spellings given: each warns, as it should
        replicate(ours, **options)
        wrapped = ddp_213(theirs, **options)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ours, theirs)]

    def check(where):
        assert_buffers_as_ddp(ours, theirs, f"rank {rank}, {options}, {where}")
        assert held is ours.bn.running_mean, f"rank {rank}: {where}: bn.running_mean was replaced, not updated"
        assert held_ddp is theirs.bn.running_mean

    def micro_batch(step, sync=None, *, forwards=1):
        for runner in (ours, wrapped):
            if sync is not None:
                runner.require_backward_grad_sync = sync
            run = runner if runner is ours else partial(run_as_ddp_213, wrapped)
            loss = sum(run(data(rank, 10 * step + k) + rank).pow(2).mean() for k in range(forwards))
            loss.backward()
            if sync is not None:
                runner.require_backward_grad_sync = True

    check("after set-up")
    for step in range(2):
        with ours.no_sync(), wrapped.no_sync():  # accumulation: only the first forward broadcasts
            micro_batch(step)
            check(f"step {step}, first micro-batch (no_sync)")
            micro_batch(step + 100, forwards=2)  # two forwards before one backward
            check(f"step {step}, second micro-batch (no_sync)")
        micro_batch(step + 200)
        check(f"step {step}, synced micro-batch")
        micro_batch(step + 300, False)  # DDP's switch: the next forward does not broadcast
        micro_batch(step + 400, True, forwards=2)
        check(f"step {step}, after the switch")
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    ours.eval(), theirs.eval()
    (
        ours(data(rank, 999)).sum().backward(),
        run_as_ddp_213(wrapped, data(rank, 999)).sum().backward(),
    )  # eval with grad: as DDP
    check("an eval forward with gradients")
    if options.get("forward_sync_buffers", options.get("broadcast_buffers", True)):
        assert same_on_every_rank(ours.bn.running_mean), "buffers differ after a broadcasting forward"


@pytest.mark.parametrize(
    "options", BUFFER_OPTIONS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "defaults"
)
def test_buffers_as_ddp(pools, options):
    pools.run(2, buffers_as_ddp, options=options)


def test_buffers_as_ddp_on_3_ranks(pools):
    pools.run(3, buffers_as_ddp, options={})
    pools.run(3, buffers_as_ddp, options={"forward_sync_buffers": False})


def join_with_accumulation(rank, world_size):
    """Uneven inputs with no_sync micro-batches: joined ranks follow the buffer decision of those still training."""
    model = replicate(norms_on(rank))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with model.join():
        for step in range(2 + 2 * rank):  # rank 1 trains two steps longer
            with model.no_sync():  # its forward broadcasts; the next one does not (DDP's rule)
                model(data(rank, 10 * step) + rank).pow(2).mean().backward()
            model(data(rank, 10 * step + 1) + rank).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    assert_replicas_identical(model, "after the join")
    for name, buffer in model.named_buffers():  # the final sync takes the last joiner's buffers
        assert same_on_every_rank(buffer.reshape(-1)), f"rank {rank}: {name} differs after the join"


def test_buffers_under_join_with_accumulation(pools):
    pools.run(2, join_with_accumulation, timeout_s=90)
