"""Under torch.compile, graphs are split at bucket boundaries as DDP's are ([Note: compiled backward split
at bucket boundaries] in core/compile_split.py): each piece has its own backward node, so buckets leave
while the compiled backward runs. Gradients still equal one process on the global batch."""

from __future__ import annotations

from typing import Any, NamedTuple

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from parity import assert_same_on_every_rank, seeded
from torchreplicate import replicate


def _net() -> nn.Module:
    return nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(512, 512), nn.ReLU())], nn.Linear(512, 4))


def data(rank: int, step: int) -> torch.Tensor:
    return torch.randn(4, 512, generator=torch.Generator().manual_seed(10 * step + rank))


class Split(NamedTuple):
    graphs: int  # graphs the backend compiled for the model
    active_after: Any  # DDP's _active_ddp_module after the steps


def compiled_steps(rank: int, world_size: int, optimize_ddp: bool, cap_mb: float) -> Split:
    import torch._dynamo

    graphs = 0

    def counting_backend(gm: torch.fx.GraphModule, inputs: Any) -> Any:
        nonlocal graphs
        graphs += 1
        return gm.forward

    torch._dynamo.reset()
    saved = torch._dynamo.config.optimize_ddp
    torch._dynamo.config.optimize_ddp = optimize_ddp
    try:
        # each Linear(512) holds 1 MiB: a bucket per layer at a 1 MiB cap; below 1 MiB, dynamo's split
        # is at 1 MiB (DDPOptimizer refuses less)
        model = replicate(seeded(_net, 1), bucket_cap_mb=cap_mb, first_bucket_cap_mb=cap_mb)
        reference = seeded(_net, 1)
        compiled = torch.compile(model, backend=counting_backend)
        for step in range(3):
            compiled(data(rank, step)).pow(2).mean().backward()
            torch.stack([reference(data(r, step)).pow(2).mean() for r in range(world_size)]).mean().backward()
            for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
            model.zero_grad()
            reference.zero_grad()
        with pytest.raises(RuntimeError):
            model(torch.randn(4, 3))  # a forward that raises (the wrong width) gives the attribute back too
        dist.barrier()
        return Split(graphs, DistributedDataParallel._active_ddp_module)
    finally:
        torch._dynamo.config.optimize_ddp = saved
        torch._dynamo.reset()


# (each block compiled alone with fullgraph=True, as torchtitan does: tests/test_torchtitan_call.py)
@pytest.mark.parametrize("cap_mb", [1, 0.25])
def test_compiled_graphs_are_split_at_bucket_boundaries_and_average(pools, cap_mb):
    for split in pools.run(2, compiled_steps, True, cap_mb, timeout_s=240):
        assert split.graphs >= 4, f"{split.graphs} graphs: the compiled forward was not split at the buckets"
        assert split.active_after is None, split.active_after  # given back after every forward, one that raised too


def test_optimize_ddp_false_turns_the_split_off_as_for_ddp(pools):
    for split in pools.run(2, compiled_steps, False, 1, timeout_s=240):
        assert split.graphs == 1, split.graphs


class OwnForward(nn.Module):
    # _net behind a forward of its own: dynamo does not compile the frames of torch.nn's own modules that
    # DDP's forward calls, so torch.compile of DDP around a bare nn.Sequential runs it eagerly, no graph
    def __init__(self) -> None:
        super().__init__()
        self.net = _net()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def against_ddp_compiled(rank: int, world_size: int) -> tuple[int, int]:
    # The same compiled job under DDP (its own DDPOptimizer split at the same 1 MiB cap) and under ours,
    # with rank-different batches and SGD: bitwise equal gradients and parameters at every step, and the
    # same on every rank; both split into the same number of graphs. aot_eager: the split graphs run as
    # their ATen ops, the same for both.
    import torch._dynamo
    from torch._dynamo.backends.registry import lookup_backend

    torch._dynamo.reset()
    ours = replicate(seeded(OwnForward, 1 + rank), bucket_cap_mb=1)  # rank 0's values are broadcast, as DDP's
    theirs = DistributedDataParallel(seeded(OwnForward, 1 + rank), bucket_cap_mb=1)
    aot_eager, graphs = lookup_backend("aot_eager"), [0, 0]

    def counting(engine: int) -> Any:
        def backend(gm: torch.fx.GraphModule, inputs: Any) -> Any:
            graphs[engine] += 1
            return aot_eager(gm, inputs)

        return backend

    engines = [
        (torch.compile(m, backend=counting(i)), m, torch.optim.SGD(m.parameters(), lr=0.1))
        for i, m in enumerate((ours, theirs))
    ]
    for step in range(3):
        for compiled, _, _ in engines:
            compiled(data(rank, step)).pow(2).mean().backward()
        for (name, p), q in zip(ours.named_parameters(), theirs.module.parameters(), strict=True):
            assert p.grad is not None and torch.equal(p.grad, q.grad), f"rank {rank} step {step} {name}.grad"
            assert_same_on_every_rank(p.grad, f"step {step} {name}.grad")
        for _, _, optimizer in engines:
            optimizer.step()
            optimizer.zero_grad()
    for (name, p), q in zip(ours.named_parameters(), theirs.module.parameters(), strict=True):
        assert torch.equal(p, q), f"rank {rank} {name} after 3 steps"
    torch._dynamo.reset()
    return graphs[0], graphs[1]


def test_compiled_steps_equal_ddps_compiled_steps_bitwise(pools):
    for ours, theirs in pools.run(2, against_ddp_compiled, timeout_s=300):
        assert ours == theirs >= 4, f"ours compiled {ours} graphs, DDP {theirs}: not both split at the buckets"
