"""DeviceMesh and tensor parallel: replicate(mesh=...) averages over the data-parallel dimension only."""

from __future__ import annotations

import hashlib
from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from parity import assert_replicas_identical, digest, seeded, sgd_step
from torchreplicate import replicate

DIM = 8


def data(dp_rank: int, step: int) -> torch.Tensor:
    return torch.randn(4, DIM, generator=torch.Generator().manual_seed(100 * step + dp_rank))


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.Tanh(), nn.Linear(2 * DIM, DIM), nn.LayerNorm(DIM))


def one_dimensional(rank: int, world_size: int, option: str) -> str:
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    model = replicate(seeded(_mlp, 10 + rank), **{option: mesh})
    reference = seeded(_mlp, 10)
    for step in range(3):
        model(data(rank, step)).pow(2).mean().backward()
        torch.stack([reference(data(r, step)).pow(2).mean() for r in range(world_size)]).mean().backward()
        for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=lambda m: f"rank {rank} {name}: {m}")
        sgd_step(model, reference)
        assert_replicas_identical(model, f"rank {rank} after step {step}")
    return digest(model)


@pytest.mark.parametrize("option", ["mesh", "device_mesh"])
def test_one_dimensional_mesh(pools, option):
    digests = pools.run(2, one_dimensional, option)
    assert len(set(digests)) == 1, f"the replicas differ bitwise: {digests}"


class TensorParallel(NamedTuple):
    param_types: set[str]  # type names of the parameters after training
    grad_types: set[str]  # and of their gradients
    state_dict_types: set[str]  # and of the state_dict values
    restored: bool  # a torch.distributed.checkpoint round trip restored every parameter


def local_digests(tensors: list[torch.Tensor]) -> list[str]:
    """Bitwise fingerprint of each tensor's local part (a DTensor's shard on this rank)."""
    from torch.distributed.tensor import DTensor

    return [
        hashlib.sha256(
            (t.to_local() if isinstance(t, DTensor) else t).detach().contiguous().numpy().tobytes()
        ).hexdigest()
        for t in tensors
    ]


def assert_same_across_group(tensors: list[torch.Tensor], group: dist.ProcessGroup, what: str) -> None:
    """Each tensor's local part bitwise equal on every rank of ``group`` (a rank's data-parallel peers)."""
    mine = local_digests(tensors)
    everyone: list[list[str]] = [[] for _ in range(dist.get_world_size(group))]
    dist.all_gather_object(everyone, mine, group=group)
    peers = dist.get_process_group_ranks(group)
    differing = [peers[i] for i, theirs in enumerate(everyone) if theirs != mine]
    assert not differing, f"rank {dist.get_rank()}: {what}: the local shards differ from those of ranks {differing}"


def two_dimensional(rank: int, world_size: int, checkpoint_dir: str) -> TensorParallel:
    """4 ranks: 2 data-parallel replicas x 2 tensor-parallel shards; parity with one process."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh["dp"].get_local_rank()
    model = seeded(_mlp, 20 + dp_rank)  # differs across replicas: replicate() broadcasts dp rank 0's
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    replicate(model, mesh=mesh["dp"], bucket_cap_mb=0.0005, first_bucket_cap_mb=0.0002)
    reference = seeded(_mlp, 20)
    dp_group = mesh["dp"].get_group()  # this rank and its data-parallel peer (the same tensor-parallel shard)
    for step in range(3):
        model(data(dp_rank, step)).pow(2).mean().backward()
        torch.stack([reference(data(r, step)).pow(2).mean() for r in range(2)]).mean().backward()
        for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
            grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            torch.testing.assert_close(
                grad, q.grad, rtol=1e-5, atol=1e-6, msg=lambda m: f"rank {rank} step {step} {name}: {m}"
            )
        assert_same_across_group([p.grad for p in model.parameters()], dp_group, f"step {step} gradients")
        sgd_step(model, reference)
        assert_same_across_group(list(model.parameters()), dp_group, f"parameters after step {step}")
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        value = p.full_tensor() if isinstance(p, DTensor) else p
        torch.testing.assert_close(value, q, rtol=1e-5, atol=1e-6, msg=lambda m: f"rank {rank} {name}: {m}")
    model(data(dp_rank, 9)).sum().backward()  # grads present for the type check below
    kinds = TensorParallel(
        {type(p).__name__ for p in model.parameters()},
        {type(p.grad).__name__ for p in model.parameters()},
        {type(v).__name__ for v in model.state_dict().values()},
        False,
    )
    saved = {name: p.detach().clone() for name, p in model.state_dict().items()}
    dcp.save({"model": model.state_dict()}, checkpoint_id=checkpoint_dir)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=checkpoint_dir)
    model.load_state_dict(state["model"])
    restored = all(
        torch.equal(
            saved[name].full_tensor() if isinstance(saved[name], DTensor) else saved[name],
            v.full_tensor() if isinstance(v, DTensor) else v,
        )
        for name, v in model.state_dict().items()
    )
    return kinds._replace(restored=restored)


def test_tensor_parallel_on_a_two_dimensional_mesh(pools, tmp_path):
    results = pools.run(4, two_dimensional, str(tmp_path / "ckpt"), timeout_s=180)
    for r in results:
        assert r.param_types == {"DTensor", "Parameter"} or r.param_types == {"DTensor"}, r
        assert "DTensor" in r.grad_types and "DTensor" in r.state_dict_types, r
        assert r.restored, "torch.distributed.checkpoint did not restore the DTensor parameters"


def overlapping_mesh(rank: int, world_size: int) -> str:
    from torch.distributed.tensor import Replicate, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    model = _mlp()
    model[0].weight = nn.Parameter(distribute_tensor(model[0].weight.detach(), mesh, [Replicate()]))
    try:
        replicate(model, mesh=mesh)
    except ValueError as error:
        return str(error)
    return "no error"


def test_a_dtensor_already_spread_over_the_data_parallel_ranks_is_refused(pools):
    for message in pools.run(2, overlapping_mesh):
        assert "parameter '0.weight' is a DTensor on a mesh that includes ranks [0, 1]" in message, message
        assert "replicate(model, mesh=mesh['dp'])" in message, message


def mesh_errors(rank: int, world_size: int) -> list[str]:
    """Each refused mesh argument's error, in order; "no error: ..." where one was accepted."""
    mesh2d = init_device_mesh("cpu", (1, world_size), mesh_dim_names=("dp", "tp"))
    messages = []
    for kwargs in (
        {"mesh": mesh2d},
        {"mesh": mesh2d["dp"], "process_group": dist.group.WORLD},
        {"mesh": "dp"},
        {"mesh": mesh2d["dp"], "device_mesh": mesh2d["dp"]},
    ):
        try:
            replicate(_mlp(), **kwargs)
            messages.append(f"no error: {sorted(kwargs)}")
        except (TypeError, ValueError) as error:  # some are also the seed's RuntimeError (errors.py)
            kind = "TypeError" if isinstance(error, TypeError) else "ValueError"
            messages.append(f"{kind}: {error}")
    return messages


def test_mesh_errors_name_the_fix(pools):
    for rank, (two_d, both, wrong_type, both_names) in enumerate(pools.run(2, mesh_errors)):
        assert two_d.startswith("ValueError: "), f"rank {rank}: {two_d}"
        assert "mesh must be 1-D, the data-parallel dimension; got a 2-D mesh ('dp', 'tp')" in two_d, (
            f"rank {rank}: {two_d}"
        )
        assert "e.g. mesh=mesh['dp']" in two_d, f"rank {rank}: {two_d}"
        assert both.startswith("ValueError: "), f"rank {rank}: {both}"
        assert "pass either process_group= or mesh=, not both" in both, f"rank {rank}: {both}"
        assert wrong_type.startswith("TypeError: "), f"rank {rank}: {wrong_type}"
        assert "mesh must be a DeviceMesh, got str" in wrong_type, f"rank {rank}: {wrong_type}"
        assert both_names == "ValueError: replicate(): pass mesh= or device_mesh= (DDP's name for it), not both", (
            f"rank {rank}: {both_names}"
        )
