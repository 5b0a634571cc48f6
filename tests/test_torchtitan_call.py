"""torchtitan's call, with ours swapped in by the import alone.

torchtitan's ``apply_ddp`` (and the codebases that copy it) sets
``torch._dynamo.config.optimize_ddp``, then calls
``replicate(model, device_mesh=dp_mesh, bucket_cap_mb=100)`` on a model whose
blocks were compiled one by one; some then register their own forward
pre-hooks with ``prepend=True`` (OLMo-core hides CPU inputs that way). Here
that call runs with ``from torchreplicate import replicate`` in place of
``from torch.distributed._composable.replicate import replicate``, one test
per setting: the gradients must be those of one process on the global batch,
and the replicas bitwise equal. Blocks compile with aot_eager: inductor's CPU
compile takes minutes on this machine.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from parity import assert_replicas_identical, digest, seeded
from torchreplicate import replicate  # the swap: torchtitan imports torch.distributed._composable.replicate

DIM = 8
NUM_STEPS = 2


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, 2 * DIM)
        self.down = nn.Linear(2 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


class Transformerish(nn.Module):
    """torchtitan's shape: ``layers`` a ModuleDict of blocks, then a norm and an output projection."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleDict({str(i): Block() for i in range(2)})
        self.norm = nn.LayerNorm(DIM)
        self.output = nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor, *, scale: torch.Tensor) -> torch.Tensor:
        for block in self.layers.values():
            x = block(x)
        return self.output(self.norm(x)) * scale


def apply_compile(model: Transformerish) -> None:
    # torchtitan's apply_compile: each block compiled on its own, fullgraph, before data parallelism
    for layer_id, block in model.layers.named_children():
        model.layers.register_module(layer_id, torch.compile(block, backend="aot_eager", fullgraph=True))


def hide_scale(module: nn.Module, args: Any, kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    # runs before replicate()'s own pre-hook (prepend=True), as OLMo-core's _hide_cpu_inputs_from_torch
    return args, {**kwargs, "scale": ("hidden", kwargs["scale"])}


def unhide_scale(module: nn.Module, args: Any, kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    return args, {**kwargs, "scale": kwargs["scale"][1] * 0.5}


def build(compiled: bool) -> Transformerish:
    model = Transformerish()
    if compiled:
        apply_compile(model)
    return model


def data(rank: int, step: int) -> torch.Tensor:
    return torch.randn(3, DIM, generator=torch.Generator().manual_seed(100 * step + rank))


@contextlib.contextmanager
def dynamo_settings(optimize_ddp: str, compiled_autograd: bool) -> Iterator[None]:
    """``optimize_ddp`` set as torchtitan sets it, and compiled autograd on if asked; both restored after."""
    import torch._dynamo

    torch._dynamo.reset()
    config = torch._dynamo.config
    saved = (config.optimize_ddp, config.compiled_autograd)
    config.optimize_ddp = optimize_ddp
    config.compiled_autograd = compiled_autograd
    try:
        yield
    finally:
        config.optimize_ddp, config.compiled_autograd = saved
        torch._dynamo.reset()


def train_torchtitan_style(rank: int, world_size: int, optimize_ddp: str, compiled_autograd: bool) -> str:
    with dynamo_settings(optimize_ddp, compiled_autograd):
        dp_mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
        # a different start on every rank: replicate() gives every rank rank 0's
        model = seeded(lambda: build(compiled=not compiled_autograd), 5 + rank)
        model = replicate(model, device_mesh=dp_mesh, bucket_cap_mb=100)  # torchtitan's apply_ddp, verbatim
        model.register_forward_pre_hook(hide_scale, prepend=True, with_kwargs=True)
        model.register_forward_pre_hook(unhide_scale, prepend=False, with_kwargs=True)
        reference = seeded(lambda: build(compiled=False), 5)
        reference.register_forward_pre_hook(hide_scale, prepend=True, with_kwargs=True)
        reference.register_forward_pre_hook(unhide_scale, prepend=False, with_kwargs=True)
        scale = torch.tensor(2.0)

        def backward(x: torch.Tensor) -> None:
            model(x, scale=scale).pow(2).mean().backward()

        # compiled autograd traces the backward of a compiled step (the model itself eager:
        # "python_reducer_without_compiled_forward")
        step = torch.compile(backward, backend="aot_eager") if compiled_autograd else backward
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
        reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=0.01)
        for s in range(NUM_STEPS):
            step(data(rank, s))
            torch.stack([reference(data(r, s), scale=scale).pow(2).mean() for r in range(world_size)]).mean().backward()
            for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
                assert p.grad is not None, f"rank {rank} step {s}: {name}.grad is None"
                torch.testing.assert_close(
                    p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=lambda m: f"rank {rank} step {s} {name}: {m}"
                )
            optimizer.step()
            optimizer.zero_grad()
            reference_optimizer.step()
            reference_optimizer.zero_grad()
            with torch.no_grad():  # the next step starts from the replica's weights
                for p, q in zip(model.parameters(), reference.parameters(), strict=True):
                    q.copy_(p)
            assert_replicas_identical(model, f"rank {rank} after step {s}")
        dist.barrier()
        return digest(model)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("optimize_ddp", "compiled_autograd"),
    [("ddp_optimizer", False), ("python_reducer_without_compiled_forward", True)],
    ids=["ddp_optimizer-compiled-blocks", "python_reducer_without_compiled_forward-compiled-autograd"],
)
def test_torchtitan_apply_ddp_trains_exactly(pools, optimize_ddp, compiled_autograd):
    digests = pools.run(2, train_torchtitan_style, optimize_ddp, compiled_autograd, timeout_s=280)
    assert len(set(digests)) == 1, f"the replicas differ bitwise: {digests}"
