"""Lazy modules (nn.LazyLinear): materialised at the first forward, broadcast from rank 0 before use;
exact against one process, bitwise across ranks that seeded differently; refused where unsafe."""

from __future__ import annotations

from typing import Callable

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from models import DIM, data
from parity import assert_grads_match, assert_replicas_identical, digest, seeded, sgd_step
from torchreplicate import replicate


def lazy_middle() -> nn.Module:
    return nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh(), nn.LazyLinear(6), nn.Tanh(), nn.Linear(6, 2))


def all_lazy() -> nn.Module:
    return nn.Sequential(nn.LazyLinear(6), nn.Tanh(), nn.LazyLinear(2))


BUILDS: dict[str, Callable[[], nn.Module]] = {"lazy-middle": lazy_middle, "all-lazy": all_lazy}


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).pow(2).mean()


def lazy_training(rank: int, world_size: int, build: str, options: dict, eval_first: bool) -> str:
    """Three steps; the reference materialises by a dry run and takes the replica's first values."""
    model = seeded(BUILDS[build], 100 + rank)  # every rank seeds differently
    replicate(model, **options)
    if eval_first and rank == 0:
        with torch.no_grad():  # materialises here only, runs no collective
            model(data(rank, 50))
    _loss(model, data(rank, 0)).backward()
    assert_replicas_identical(model, f"rank {rank} after the first backward")  # rank 0's values everywhere
    reference = seeded(BUILDS[build], 0)
    with torch.no_grad():
        reference(data(0, 0))  # materialise, then take the replica's values (before its first update)
        for p, q in zip(model.parameters(), reference.parameters(), strict=True):
            q.copy_(p)
    for step in range(3):
        if step > 0:
            _loss(model, data(rank, step)).backward()
        _loss(reference, torch.cat([data(r, step) for r in range(world_size)])).backward()
        assert_grads_match(model, reference, f"rank {rank} step {step} {build} {options}")
        sgd_step(model, reference)
    assert_replicas_identical(model, f"rank {rank} {build} {options}")
    return digest(model)


@pytest.mark.parametrize("eval_first", [False, True], ids=["train", "eval-on-rank-0-first"])
@pytest.mark.parametrize("options", [{}, {"gradient_as_bucket_view": False}], ids=["view", "copy"])
@pytest.mark.parametrize("build", sorted(BUILDS))
def test_lazy_modules_materialise_and_broadcast_at_the_first_forward(pools, build, options, eval_first):
    digests = pools.run(2, lazy_training, build, options, eval_first, timeout_s=180)
    assert digests[0] == digests[1], digests


def lazy_refused(rank: int, world_size: int, case: str) -> str:
    torch.manual_seed(rank)
    try:
        if case == "root":
            replicate(nn.LazyLinear(2))
        else:
            replicate(lazy_middle(), mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    except ValueError as error:
        dist.barrier()  # no rank is left in a collective
        return str(error)
    return "no error"


@pytest.mark.parametrize(
    "case, wanted",
    [
        ("root", "replicate(): the root LazyLinear is a lazy module that is not materialised yet, and torch "),
        ("mp-policy", "replicate(): 2 (LazyLinear) is a lazy module that is not materialised yet, and mp_policy "),
    ],
)
def test_an_unsafe_lazy_module_is_refused_naming_the_fix(pools, case, wanted):
    for rank, message in enumerate(pools.run(2, lazy_refused, case, timeout_s=180)):
        assert message.startswith(wanted) and "run one forward first" in message, f"rank {rank}: {message}"


def copied(model: torch.nn.Module, how: str) -> torch.nn.Module:
    """``model`` copied by deepcopy, torch.save + torch.load, or pickle."""
    import copy
    import io
    import pickle

    if how == "deepcopy":
        return copy.deepcopy(model)
    if how == "pickle":
        return pickle.loads(pickle.dumps(model))
    buffer = io.BytesIO()
    torch.save(model, buffer)  # raised TypeError: cannot pickle 'weakref.ReferenceType' (the lazy child's hook)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def lazy_copied(rank: int, world_size: int, how: str) -> str:
    """A copy taken before the first forward is a plain module: it materialises alone, no collective."""
    model = seeded(lazy_middle, 100 + rank)
    replicate(model)
    twin = copied(model, how)
    assert type(twin).__name__ == type(model).__name__ and not hasattr(twin, "register_comm_hook"), how
    if rank == 0:
        _loss(twin, data(rank, 0)).backward()  # one rank only: a collective here would hang
    _loss(model, data(rank, 0)).backward()
    assert_replicas_identical(model, f"rank {rank} after the {how} copy trained alone")
    return digest(model)


@pytest.mark.parametrize("how", ["deepcopy", "torch.save", "pickle"])
def test_a_copy_of_an_unmaterialised_replica_is_a_plain_module_and_runs_no_collective(pools, how):
    digests = pools.run(2, lazy_copied, how, timeout_s=180)
    assert digests[0] == digests[1], digests
