"""Compiled autograd: the gradient hooks are traced into the compiled backward and still average.

torch._dynamo.config.compiled_autograd turns it on for backwards that run
inside a compiled function. The reducer's traced path ([Note: compiled
autograd] in reduction.py) all-reduces each gradient in the graph. The
gradients must equal one process on the global batch, and differ from the
local ones (proof that they were averaged). aot_eager here (its graphs run
eager's kernels); inductor's CPU compile takes minutes on this machine
(docs/modern-stack.md says what was run by hand). The one inductor test
compares with DDP's python reducer on the same job, bitwise: inductor's
kernels round otherwise than eager's, by how much depends on the machine.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, NamedTuple

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from parity import assert_replicas_identical, assert_same_on_every_rank, seeded
from torchreplicate import replicate


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 6), nn.ReLU(), nn.Linear(6, 2))


def data(rank: int, step: int) -> torch.Tensor:
    return torch.randn(3, 6, generator=torch.Generator().manual_seed(10 * step + rank))


class Compiled(NamedTuple):
    differs_from_local: bool  # the averaged gradients are not this rank's own


class _CompiledAutograd:
    # compiled autograd on, for the length of a with-block (and dynamo reset around it)
    def __init__(self, fullgraph: bool) -> None:
        self.fullgraph = fullgraph

    def __enter__(self) -> None:
        import torch._dynamo

        torch._dynamo.reset()
        config = torch._dynamo.config
        self.saved = (config.compiled_autograd, config.compiled_autograd_kwargs_override)
        config.compiled_autograd = True
        config.compiled_autograd_kwargs_override = {"fullgraph": True} if self.fullgraph else {}

    def __exit__(self, *exc: object) -> None:
        import torch._dynamo

        config = torch._dynamo.config
        config.compiled_autograd, config.compiled_autograd_kwargs_override = self.saved
        torch._dynamo.reset()


def compiled_autograd(rank: int, world_size: int, fullgraph: bool, options: dict) -> Compiled:
    with _CompiledAutograd(fullgraph):
        # a different initial model on every rank: replicate() broadcasts rank 0's
        model = replicate(seeded(_net, 3 + rank), **options)
        reference = seeded(_net, 3)
        local = seeded(_net, 3)

        @torch.compile(backend="aot_eager")
        def step(x: torch.Tensor) -> None:
            model(x).pow(2).mean().backward()

        wire = options.get("reduce_dtype")
        tolerance = {"rtol": 1e-5, "atol": 1e-6} if wire is None else {"rtol": 2**-7, "atol": 1e-4}
        differs = False
        for s in range(2):
            model.zero_grad()
            reference.zero_grad()
            local.zero_grad()
            step(data(rank, s))
            torch.stack([reference(data(r, s)).pow(2).mean() for r in range(world_size)]).mean().backward()
            local(data(rank, s)).pow(2).mean().backward()
            for (name, p), q, own in zip(
                model.named_parameters(), reference.parameters(), local.parameters(), strict=True
            ):
                torch.testing.assert_close(p.grad, q.grad, **tolerance, msg=lambda m: f"rank {rank} {name}: {m}")
                assert_same_on_every_rank(p.grad, f"step {s} {name}.grad")
                if wire is not None:  # the mean travelled in the wire dtype: every value is one of its
                    assert torch.equal(p.grad, p.grad.to(wire).to(p.grad.dtype)), f"rank {rank} {name}: not {wire}"
                differs = differs or not torch.allclose(p.grad, own.grad)
            with torch.no_grad():
                for p, q in zip(model.parameters(), reference.parameters(), strict=True):
                    q.copy_(p)  # the next step starts from the replica's weights (bf16 wire: rounding differs)
                    p -= 0.1 * p.grad
                    q -= 0.1 * p.grad
        assert_replicas_identical(model, f"rank {rank} after the steps")
        dist.barrier()
        return Compiled(differs)


@pytest.mark.parametrize("fullgraph", [False, True], ids=["graph-breaks-allowed", "fullgraph"])
def test_compiled_autograd_averages(pools, fullgraph):
    for r in pools.run(2, compiled_autograd, fullgraph, {}, timeout_s=240):
        assert r.differs_from_local, "the gradients are the local ones: nothing was averaged"


def test_compiled_autograd_keeps_the_wire_dtype(pools):
    for r in pools.run(2, compiled_autograd, False, {"reduce_dtype": torch.bfloat16}, timeout_s=240):
        assert r.differs_from_local, "the gradients are the local ones: nothing was averaged"


def hook_under_compiled_autograd(rank: int, world_size: int) -> str:
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    with _CompiledAutograd(fullgraph=False):
        model = replicate(seeded(_net, 3))
        model.register_comm_hook(None, allreduce_hook)

        @torch.compile(backend="aot_eager")
        def step(x: torch.Tensor) -> None:
            model(x).pow(2).mean().backward()

        with pytest.raises(RuntimeError) as info:
            step(data(rank, 0))
        message = str(info.value)
        for words in ("comm hook cannot run under compiled autograd", "compiled_autograd off"):
            assert words in message, f"rank {rank}: {words!r} not in: {message}"
        return message.split("replicate():")[1].splitlines()[0]


def test_comm_hook_refused_under_compiled_autograd_on_every_rank(pools):
    messages = pools.run(2, hook_under_compiled_autograd, timeout_s=240)
    assert len(set(messages)) == 1, messages


class Fused(NamedTuple):
    ddp_buckets: object  # inductor's count of fused all-reduce buckets (None: no fusion ran)
    ddps_buckets: object  # the same for DDP's python reducer on the same job
    fusion_while_on: bool  # inductor's _fuse_ddp_communication during the compiled step
    fusion_after: bool  # ... after a forward with compiled autograd off


@contextlib.contextmanager
def ddp_python_reducer() -> Iterator[None]:
    """DDP built in this block is DDP's python reducer (``optimize_ddp="python_reducer"``), whose
    construction turns inductor's fusion on and makes dynamo inline DDP's forward, for good
    (DistributedDataParallel.__init__, torch 2.13): all as they were after the block."""
    import torch._dynamo
    from torch._dynamo import trace_rules
    from torch._inductor import config

    saved = (torch._dynamo.config.optimize_ddp, config._fuse_ddp_communication, config._fuse_ddp_bucket_size)
    inlined = "torch.nn.parallel.distributed" in trace_rules.LEGACY_MOD_INLINELIST
    torch._dynamo.config.optimize_ddp = "python_reducer"
    try:
        yield
    finally:
        torch._dynamo.config.optimize_ddp, config._fuse_ddp_communication, config._fuse_ddp_bucket_size = saved
        if not inlined:
            trace_rules.LEGACY_MOD_INLINELIST.discard("torch.nn.parallel.distributed")
            trace_rules.get_legacy_mod_inlinelist.cache_clear()


def fused_under_compiled_autograd(rank: int, world_size: int) -> Fused:
    # inductor (not aot_eager): its post-grad passes fuse the traced all-reduces into buckets, as DDP's.
    # Against DDP's python reducer on the same job, compiled the same way: the same graph, so the same
    # kernels and bitwise equal gradients whichever kernels inductor picks on this machine (against an
    # eager reference, inductor's kernels would round differently, by how much depends on the machine).
    import gc

    from torch._dynamo.utils import counters
    from torch._inductor import config

    gc.collect()  # the earlier tests' models, compiled-autograd trained in this process, let go of the fusion
    assert not config._fuse_ddp_communication, "inductor's fusion left on by a collected model"
    counters.clear()
    with _CompiledAutograd(fullgraph=False):
        model = replicate(seeded(_net, 3 + rank))

        @torch.compile
        def step(x: torch.Tensor) -> None:
            model(x).pow(2).mean().backward()

        step(data(rank, 0))
        fused, on = counters["inductor"].get("ddp_buckets"), bool(config._fuse_ddp_communication)
        counters.clear()
        with ddp_python_reducer():
            theirs = DistributedDataParallel(seeded(_net, 3 + rank))

            @torch.compile
            def ddp_step(x: torch.Tensor) -> None:
                theirs(x).pow(2).mean().backward()

            ddp_step(data(rank, 0))
        ddps = counters["inductor"].get("ddp_buckets")
        own = seeded(_net, 3 + rank)
        own(data(rank, 0)).pow(2).mean().backward()
        named = zip(model.named_parameters(), theirs.module.parameters(), own.parameters(), strict=True)
        for (name, p), q, _ in named:
            assert torch.equal(p.grad, q.grad), f"rank {rank} {name}: not bitwise DDP's python reducer's"
            assert_same_on_every_rank(p.grad, f"fused {name}.grad")
        local = zip(model.parameters(), own.parameters(), strict=True)
        assert not all(torch.allclose(p.grad, q.grad) for p, q in local), f"rank {rank}: its own gradients"
    model.zero_grad()
    model(data(rank, 1)).pow(2).mean().backward()  # compiled autograd off: inductor's config as it was
    dist.barrier()
    return Fused(fused, ddps, on, bool(config._fuse_ddp_communication))


def test_compiled_autograd_all_reduces_are_fused_into_buckets_as_ddps(pools):
    for r in pools.run(2, fused_under_compiled_autograd, timeout_s=300):
        assert r.ddp_buckets == r.ddps_buckets == 1, f"inductor fused ours into {r.ddp_buckets} buckets, DDP's {r}"
        assert r.fusion_while_on and not r.fusion_after, r
