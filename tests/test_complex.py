"""Complex parameters: averaged exactly, as DDP does, in every layout and hook path; a real wire
dtype (reduce_dtype, mp_policy) is refused on every rank, naming the parameter and the fix."""

from __future__ import annotations

from typing import Optional

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.fsdp import MixedPrecisionPolicy

from models import DIM, data
from parity import assert_grads_match, assert_replicas_identical, digest, seeded, sgd_step
from torchreplicate import replicate


class Rotor(nn.Module):
    """A real layer, then a complex matrix: its gradient is complex; the loss is real."""

    def __init__(self, dtype: torch.dtype = torch.complex64) -> None:
        super().__init__()
        self.rotor = nn.Parameter(torch.randn(DIM, 4, dtype=dtype))  # registered first: the last bucket's
        self.trunk = nn.Linear(DIM, DIM, dtype=dtype.to_real())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (torch.tanh(self.trunk(x.to(self.trunk.weight.dtype))).to(self.rotor.dtype) @ self.rotor).abs()


def _build(dtype: torch.dtype) -> nn.Module:
    return Rotor(dtype)


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).pow(2).mean()


def complex_training(rank: int, world_size: int, options: dict, hook: Optional[str], dtype: torch.dtype) -> str:
    """Three steps against one process on the global batch; ranks start (and see data) differently."""
    model = seeded(lambda: _build(dtype), 100 + rank)
    reference = seeded(lambda: _build(dtype), 100)
    replicate(model, **options)
    if hook == "allreduce":
        model.register_comm_hook(None, default_hooks.allreduce_hook)
    for step in range(3):
        _loss(model, data(rank, step)).backward()
        _loss(reference, torch.cat([data(r, step) for r in range(world_size)])).backward()
        assert model.rotor.grad is not None and model.rotor.grad.dtype == dtype, f"rank {rank} step {step}"
        assert_grads_match(model, reference, f"rank {rank} step {step} {options} {hook}")
        sgd_step(model, reference)
    assert_replicas_identical(model, f"rank {rank} {options} {hook}")
    return digest(model)


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128], ids=["c64", "c128"])
@pytest.mark.parametrize("hook", [None, "allreduce"])
@pytest.mark.parametrize(
    "options",
    [{}, {"gradient_as_bucket_view": False}, {"bucket_cap_mb": 1e-4, "first_bucket_cap_mb": 1e-4}],
    ids=["view", "copy", "tiny-buckets"],
)
def test_complex_gradients_are_averaged_exactly(pools, options, hook, dtype):
    digests = pools.run(2, complex_training, options, hook, dtype, timeout_s=180)
    assert digests[0] == digests[1], digests


def compressed(rank: int, world_size: int) -> str:
    """fp16_compress_hook sees the complex bucket as real: both parts compressed, none dropped."""
    model = seeded(Rotor, 100 + rank)
    reference = seeded(Rotor, 100)
    replicate(model)
    model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    _loss(model, data(rank, 0)).backward()
    _loss(reference, torch.cat([data(r, 0) for r in range(world_size)])).backward()
    assert model.rotor.grad is not None and reference.rotor.grad is not None
    assert model.rotor.grad.imag.abs().max() > 0, f"rank {rank}: the imaginary part was dropped"
    torch.testing.assert_close(model.rotor.grad, reference.rotor.grad, rtol=2e-3, atol=1e-3)
    assert_replicas_identical(model, f"rank {rank} fp16_compress_hook")
    return digest(model)


def test_a_compression_hook_compresses_both_parts(pools):
    digests = pools.run(2, compressed, timeout_s=180)
    assert digests[0] == digests[1], digests


def complex_refused(rank: int, world_size: int, options: dict) -> str:
    model = seeded(Rotor, 100 + rank)
    try:
        replicate(model, **options)
        _loss(model, data(rank, 0)).backward()
    except ValueError as error:
        dist.barrier()  # the group is still usable: no rank is left in a collective
        return str(error)
    return "no error"


@pytest.mark.parametrize(
    "options, wire",
    [
        ({"reduce_dtype": torch.bfloat16}, "torch.bfloat16"),
        ({"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16)}, "torch.bfloat16"),
        ({"mp_policy": MixedPrecisionPolicy(reduce_dtype=torch.float32)}, "torch.float32"),
    ],
    ids=["reduce-dtype", "mp-policy-bf16", "mp-policy-fp32"],
)
def test_a_real_wire_dtype_is_refused_on_every_rank(pools, options, wire):
    for rank, message in enumerate(pools.run(2, complex_refused, options, timeout_s=180)):
        assert message == (
            f"replicate(): parameter 'rotor' is complex (torch.complex64), and its gradient cannot travel in "
            f"reduce_dtype={wire}: a real dtype drops the imaginary part. Drop reduce_dtype (or the "
            "mp_policy's reduce_dtype), or pass the module that holds the parameter in ignored_modules"
        ), f"rank {rank}: {message}"
