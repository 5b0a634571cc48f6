"""Compiled autograd: the gradient hooks are traced into the compiled backward and still average.

torch._dynamo.config.compiled_autograd turns it on for backwards that run
inside a compiled function. The reducer's traced path ([Note: compiled
autograd] in reducer.py) all-reduces each gradient in the graph. The
gradients must equal one process on the global batch, and differ from the
local ones (proof that they were averaged). aot_eager here; inductor's CPU
compile takes minutes on this machine (README says what was run by hand).
"""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist
from torch import nn

from parity import seeded
from torchreplicate import replicate


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 6), nn.ReLU(), nn.Linear(6, 2))


def data(rank: int, step: int) -> torch.Tensor:
    return torch.randn(3, 6, generator=torch.Generator().manual_seed(10 * step + rank))


class Compiled(NamedTuple):
    differs_from_local: bool  # the averaged gradients are not this rank's own


def compiled_autograd(rank: int, world_size: int, fullgraph: bool) -> Compiled:
    import torch._dynamo

    torch._dynamo.reset()
    config = torch._dynamo.config
    saved = (config.compiled_autograd, config.compiled_autograd_kwargs_override)
    config.compiled_autograd = True
    config.compiled_autograd_kwargs_override = {"fullgraph": True} if fullgraph else {}
    try:
        model = replicate(seeded(_net, 3))
        reference = seeded(_net, 3)
        local = seeded(_net, 3)

        @torch.compile(backend="aot_eager")
        def step(x: torch.Tensor) -> None:
            model(x).pow(2).mean().backward()

        differs = False
        for s in range(2):
            model.zero_grad()
            reference.zero_grad()
            local.zero_grad()
            step(data(rank, s))
            torch.stack([reference(data(r, s)).pow(2).mean() for r in range(world_size)]).mean().backward()
            local(data(rank, s)).pow(2).mean().backward()
            for (name, p), q, own in zip(model.named_parameters(), reference.parameters(), local.parameters()):
                torch.testing.assert_close(
                    p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=lambda m: f"rank {rank} {name}: {m}"
                )
                differs = differs or not torch.allclose(p.grad, own.grad)
        dist.barrier()
        return Compiled(differs)
    finally:
        config.compiled_autograd, config.compiled_autograd_kwargs_override = saved
        torch._dynamo.reset()


@pytest.mark.parametrize("fullgraph", [False, True], ids=["graph-breaks-allowed", "fullgraph"])
def test_compiled_autograd_averages(pools, fullgraph):
    for r in pools.run(2, compiled_autograd, fullgraph, timeout_s=240):
        assert r.differs_from_local, "the gradients are the local ones: nothing was averaged"
