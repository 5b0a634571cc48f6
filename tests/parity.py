"""The parity check: replicated training against one process on the global batch."""

from __future__ import annotations

import hashlib
from typing import Any, Callable, Optional

import torch
from torch import nn

from models import MODELS
from torchreplicate import replicate

PER_RANK = 4  # samples per rank per step


def seeded(build: Callable[[], nn.Module], seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return build()


def digest(module: nn.Module) -> str:
    """Bitwise fingerprint of the parameters (equal across ranks iff identical)."""
    h = hashlib.sha256()
    for p in module.parameters():
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def assert_grads_match(model: nn.Module, reference: nn.Module, where: str) -> None:
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        if q.grad is None:
            assert p.grad is None, f"{where}: {name}.grad should be None"
            continue
        assert p.grad is not None, f"{where}: {name}.grad is None, reference has one"
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=lambda m: f"{where}: {name}: {m}")


def run_parity(
    rank: int,
    world_size: int,
    model_name: str,
    *,
    steps: int = 3,
    replicate_kwargs: Optional[dict[str, Any]] = None,
    set_to_none: bool = True,
) -> dict[str, Any]:
    """Trains a replica and a single-process reference; checks grads every step.

    The replica starts from a rank-dependent seed, so the test also checks
    that replicate() broadcasts rank 0's parameters. Returns what the parent
    checks across ranks.
    """
    build, make_batch, loss_of = MODELS[model_name]
    model = seeded(build, 100 + rank)
    reference = seeded(build, 100)
    replicate(model, **(replicate_kwargs or {}))
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg="replicate() did not broadcast rank 0's parameters")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for step in range(steps):
        generator = torch.Generator().manual_seed(step)
        batch = make_batch(generator, PER_RANK * world_size)
        local = batch[rank * PER_RANK : (rank + 1) * PER_RANK]
        loss_of(model(local), local).backward()
        loss_of(reference(batch), batch).backward()
        assert_grads_match(model, reference, f"rank {rank} step {step}")
        grads_are_views = _grads_are_views(replicate.state(model))
        optimizer.step()
        ref_optimizer.step()
        optimizer.zero_grad(set_to_none=set_to_none)
        ref_optimizer.zero_grad(set_to_none=set_to_none)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    state = replicate.state(model)
    reducer = state.reducer
    return {
        "digest": digest(model),
        "num_buckets": 0 if reducer is None else len(reducer.buckets),
        "grads_are_views": grads_are_views,
    }


def _grads_are_views(state) -> Optional[bool]:
    """Whether every .grad lies in its bucket's memory (None: nothing to check)."""
    reducer = state.reducer
    if reducer is None:
        return None
    for slot in reducer.slots:
        p = slot.param
        assert p.grad is not None, "every parameter of these models gets a gradient"
        bucket = slot.bucket
        start = bucket.buffer.data_ptr()
        end = start + bucket.buffer.numel() * bucket.buffer.element_size()
        if not start <= p.grad.data_ptr() < end:
            return False
    return True
