"""Mixed precision with torch's MixedPrecisionPolicy: bf16 compute, fp32 master weights and gradients.

Tolerance. The reference runs the same computation in one process on the
global batch: parameters cast to bf16 by a differentiable ``to``, inputs
cast, no autocast. Each bf16 operation rounds its result once (unit roundoff
u = 2^-8); a gradient here passes through at most 8 such roundings (3 linear
layers forward and backward, the loss), and the replica adds one more when
the two ranks' halves are summed in bf16 on the wire. So each gradient
tensor must agree with the reference to 9u of its largest magnitude, and it
must differ from the fp32 gradient (proof that bf16 really computed it).
"""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.func import functional_call
from torch.utils.checkpoint import checkpoint

from parity import assert_replicas_identical, assert_same_on_every_rank, seeded
from torchreplicate import replicate

DIM = 16
U = 2.0**-8  # bf16 unit roundoff
ROUNDINGS = 9


def data(rank: int, step: int) -> torch.Tensor:
    return torch.randn(4, DIM, generator=torch.Generator().manual_seed(100 * step + rank))


class Blocks(nn.Module):
    def __init__(self, checkpointed: bool = False) -> None:
        super().__init__()
        self.checkpointed = checkpointed
        self.a = nn.Linear(DIM, DIM)
        self.b = nn.Linear(DIM, DIM)
        self.out = nn.Linear(DIM, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        h = checkpoint(self.b, h, use_reentrant=False) if self.checkpointed else self.b(h)
        return self.out(torch.tanh(h))


def reference_grads(reference: nn.Module, rows: torch.Tensor, dtype: torch.dtype) -> list[torch.Tensor]:
    reference.zero_grad()
    params = {name: p.to(dtype) for name, p in reference.named_parameters()}
    out = functional_call(reference, params, (rows.to(dtype),))
    out.float().pow(2).mean().backward()
    return [p.grad.clone() for p in reference.parameters()]


class Result(NamedTuple):
    worst: float  # largest |g - ref| / max|ref| over tensors and steps
    param_dtypes: set[str]
    grad_dtypes: set[str]
    output_dtype: str
    wire_dtypes: set[str]


def bf16_training(rank: int, world_size: int, reduce_dtype: str, checkpointed: bool, output: str) -> Result:
    policy = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16,
        reduce_dtype=getattr(torch, reduce_dtype) if reduce_dtype else None,
        output_dtype=getattr(torch, output) if output else None,
    )
    model = replicate(seeded(lambda: Blocks(checkpointed), 5 + rank), mp_policy=policy)
    reference = seeded(Blocks, 5)  # checkpointing changes no arithmetic
    worst = 0.0
    out = model(data(rank, 0))
    for step in range(3):
        model.zero_grad()
        out = model(data(rank, step))
        out.float().pow(2).mean().backward()
        rows = torch.cat([data(r, step) for r in range(world_size)])
        low = reference_grads(reference, rows, torch.bfloat16)
        full = reference_grads(reference, rows, torch.float32)
        for (name, p), ref, exact in zip(model.named_parameters(), low, full, strict=True):
            assert_same_on_every_rank(p.grad, f"step {step} {name}.grad")
            scale = ref.abs().max().item()
            error = (p.grad - ref).abs().max().item()
            assert error <= ROUNDINGS * U * scale, (
                f"rank {rank} step {step} {name}: {error:.3g} > {ROUNDINGS}u x {scale:.3g}"
            )
            assert not torch.equal(p.grad, exact), f"rank {rank} {name}: the gradient is the fp32 one: no bf16 compute"
            worst = max(worst, error / scale)
        with torch.no_grad():
            for p, q in zip(model.parameters(), reference.parameters(), strict=True):
                p -= 0.1 * p.grad
                q -= 0.1 * p.grad  # continue from the same point: errors do not compound
        assert_replicas_identical(model, f"rank {rank} after step {step}")
    return Result(
        worst,
        {str(p.dtype) for p in model.parameters()},
        {str(p.grad.dtype) for p in model.parameters()},
        str(out.dtype),
        {str(w.dtype) for w in replicate.state(model).reducer.reduction.wires},
    )


@pytest.mark.parametrize(
    "reduce_dtype, checkpointed, output",
    [("", False, ""), ("float32", False, "float32"), ("", True, "")],
    ids=["default", "reduce-fp32-output-fp32", "checkpointed"],
)
def test_bf16_compute_fp32_master_weights(pools, reduce_dtype, checkpointed, output):
    results = pools.run(2, bf16_training, reduce_dtype, checkpointed, output)
    for r in results:
        assert r.param_dtypes == {"torch.float32"} and r.grad_dtypes == {"torch.float32"}, r
        assert r.output_dtype == ("torch.float32" if output else "torch.bfloat16"), r
        assert r.wire_dtypes == {"torch.float32" if reduce_dtype else "torch.bfloat16"}, r


def test_policy_errors():
    with pytest.raises(TypeError, match="mp_policy must be a torch.distributed.fsdp.MixedPrecisionPolicy, got dict"):
        replicate(nn.Linear(2, 2), mp_policy={"param_dtype": torch.bfloat16})
    with pytest.raises(ValueError, match="reduce_dtype=torch.float16 and mp_policy .* disagree"):
        replicate(
            nn.Linear(2, 2), reduce_dtype=torch.float16, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16)
        )
