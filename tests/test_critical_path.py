"""What a steady step puts on its critical path: DDP's collectives, and nothing the step waits for beside them.

At default options a step sums DDP's buckets (their sizes: tests/test_ddp_bits.py) and the flags in a
small all-reduce of their own ([Note: the flags' own all-reduce] in reducer/flags.py), which nothing in
the step waits for. Where the layout is not DDP's, the flags ride in the last bucket: the step launches
exactly its buckets' all-reduces ([Note: the flags carried]). Counted with torch.profiler's
``gloo:all_reduce`` and ``gloo:all_gather`` events (DDP's reducer issues its own from C++; the flags' sums
on the host are an all-gather and a local sum), on a model of several buckets, with
rank-different batches whose averaged gradients are checked against the replicas' agreement.
"""

from __future__ import annotations

import math
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from torchreplicate.reducer.flags import num_flags

CAP_MB = 0.04  # 8 x Linear(64, 64) (16.6 kB each): several buckets at DDP's rebuild and at a fixed layout


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(8)])


def engine(kind: str) -> nn.Module:
    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        return DDP(model(), bucket_cap_mb=CAP_MB)
    from torchreplicate import replicate

    if kind == "ours":
        return replicate(model(), bucket_cap_mb=CAP_MB)
    return replicate(model(), bucket_cap_mb=CAP_MB, first_bucket_cap_mb=CAP_MB, bucket_layout="fixed")


def steady_step_all_reduces(rank: int, world_size: int, kind: str) -> dict[str, Any]:
    """The sizes of one steady step's all-reduces (in elements), and what ours laid out."""
    from torch.profiler import ProfilerActivity, profile

    from torchreplicate import replicate

    wrapped = engine(kind)
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.1)

    def step(i: int) -> None:
        x = torch.randn(16, 64, generator=torch.Generator().manual_seed(100 * i + rank))
        wrapped(x).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()

    for i in range(3):  # past the first step and DDP's rebuild
        step(i)
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        step(3)
        dist.barrier()  # gloo's threads close their events once the work completes
        time.sleep(0.2)
    # the flags' sums on the host: an all-gather and a local sum (faults/wire.py's SummedGather)
    names = ("gloo:all_reduce", "gloo:all_gather")
    sizes = [math.prod((e.input_shapes or [[]])[0] or [0]) for e in prof.events() if e.name in names]
    out: dict[str, Any] = {"sizes": sorted(sizes)}
    if kind != "ddp":
        reducer = replicate.state(wrapped).reducer
        out["buckets"] = sorted(b.buffer.numel() for b in reducer.buckets)
        out["grads"] = sorted(b.numel for b in reducer.buckets)
        out["carried"] = reducer.flags.carrier is not None
    out["weights"] = torch.cat([p.detach().reshape(-1) for p in wrapped.parameters()]).tolist()[:8]
    return out


@pytest.fixture(scope="module")
def counted(pools) -> dict[str, list[dict[str, Any]]]:
    return {kind: pools.run(2, steady_step_all_reduces, kind) for kind in ("ddp", "ours", "ours_fixed")}


def test_the_default_sums_ddps_buckets_and_one_flags_all_reduce(counted):
    flags = num_flags(16)
    for rank, (theirs, mine) in enumerate(zip(counted["ddp"], counted["ours"])):
        assert len(theirs["sizes"]) >= 3, f"rank {rank}: DDP summed {theirs['sizes']}: not several buckets"
        assert not mine["carried"], "DDP's layout: its buckets carry DDP's bytes and nothing else"
        assert sorted(mine["sizes"]) == sorted([*theirs["sizes"], flags]), (rank, mine["sizes"], theirs["sizes"])
    assert counted["ours"][0]["weights"] == counted["ours"][1]["weights"], "the replicas differ"


def test_a_layout_not_ddps_carries_the_flags_in_its_last_bucket(counted):
    flags = num_flags(16)
    for rank, mine in enumerate(counted["ours_fixed"]):
        assert mine["carried"], f"rank {rank}: the flags travel apart at a fixed layout"
        assert len(mine["buckets"]) >= 3, f"rank {rank}: {mine['grads']}: not several buckets"
        assert mine["sizes"] == mine["buckets"], f"rank {rank}: {mine['sizes']} beside the buckets {mine['buckets']}"
        assert sum(mine["buckets"]) - sum(mine["grads"]) == flags, "one room of flags, in one bucket"
    assert counted["ours_fixed"][0]["weights"] == counted["ours_fixed"][1]["weights"], "the replicas differ"


class _SlowFlags:
    """A flags' work that reads as still running until the next step's forward starts (as on a slow link),
    and records every wait: whether it would have blocked, and where."""

    def __init__(self, work: dist.Work, log: dict[str, Any]) -> None:
        self.work, self.log, self.step = work, log, log["step"]

    def is_completed(self) -> bool:
        return self.log["step"] > self.step and bool(self.work.is_completed())

    def wait(self, *args: Any) -> bool:
        self.log["waits"].append((self.step, self.log["step"], self.log["phase"], self.is_completed()))
        return self.work.wait(*args)


def never_waits_for_its_flags(rank: int, world_size: int, layout: str) -> list[tuple[int, int, str, bool]]:
    from torchreplicate import replicate

    wrapped = replicate(model(), bucket_cap_mb=CAP_MB, first_bucket_cap_mb=CAP_MB, bucket_layout=layout)
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    reducer = replicate.state(wrapped).reducer
    log: dict[str, Any] = {"step": 0, "phase": "", "waits": []}
    reference = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(8)])
    reference.load_state_dict(model().state_dict())
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(6):
        if step == 2:  # the layout learned (DDP's rebuild): slow flags from now on
            travel = reducer.flags._travel

            def slow(tail: torch.Tensor, group: dist.ProcessGroup) -> Any:
                work = travel(tail, group)
                return None if work is None else _SlowFlags(work, log)

            reducer.flags._travel = slow  # type: ignore[method-assign]
        log["step"], log["phase"] = step, "forward"
        batches = [torch.randn(16, 64, generator=torch.Generator().manual_seed(100 * step + r)) for r in range(2)]
        loss = wrapped(batches[rank]).pow(2).mean()
        log["phase"] = "backward"
        loss.backward()
        log["phase"] = "optimizer"
        optimizer.step()
        optimizer.zero_grad()
        # the one-process reference on the global batch: the same gradients, averaged
        sum(reference(b).pow(2).mean() for b in batches).div(2).backward()
        ref_optimizer.step()
        ref_optimizer.zero_grad()
    for p, q in zip(wrapped.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    return log["waits"]


@pytest.mark.parametrize("layout", ["learned", "fixed"])
def test_the_step_never_waits_for_its_own_flags(pools, layout):
    """The flags' all-reduce reads as running until the next step: nothing in the forward or the backward
    waits for it. The optimizer step that follows lets go of its work, waiting if it must: a gloo work kept
    past its step aborts processes at exit ([Note: flags read a step late]); it left right after the last
    bucket, so it is done by then but where the machine is oversubscribed."""
    for rank, waits in enumerate(pools.run(2, never_waits_for_its_flags, layout)):
        blocked = [w for w in waits if not w[3] and w[2] != "optimizer"]
        assert not blocked, f"rank {rank}: waited for the flags of step {blocked[0][0]} in its {blocked[0][2]}"
        if layout == "learned":
            assert {w[0] for w in waits} >= {2, 3, 4}, f"rank {rank}: the flags of steps 2-4 never read: {waits}"
        else:
            assert not waits, f"rank {rank}: carried flags have no work of their own: {waits}"
