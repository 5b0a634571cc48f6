"""Tensor-parallel (DTensor) parameters: the reducer averages their local shards.

A parameter made a DTensor by ``parallelize_module`` on another mesh
dimension (tensor parallel) holds one shard per rank of that dimension; the
ranks of the data-parallel group hold the same shard. So the reducer lays
out, checks, broadcasts and averages the *local* tensors, over the
data-parallel group only, and ``.grad`` stays a DTensor: one wrapper per
parameter, built once around its slot, so autograd accumulates straight
into the bucket as it does for plain parameters. ``state_dict`` keeps the
DTensors, so ``torch.distributed.checkpoint`` saves and loads them.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - torch without DTensor
    DTensor = None  # type: ignore[assignment,misc]


def is_dtensor(tensor: Any) -> bool:
    """Whether ``tensor`` is a DTensor."""
    return DTensor is not None and isinstance(tensor, DTensor)


def local(tensor: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (sharing its storage), or the tensor itself."""
    if not is_dtensor(tensor):
        return tensor
    distributed: Any = tensor
    with torch.no_grad():  # to_local() without grad mode is the local tensor itself, no autograd node
        shard: torch.Tensor = distributed.to_local()
    return shard


def local_grad(grad: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """A gradient of ``param`` as a plain local tensor, in the parameter's placements.

    A gradient may arrive with other placements than its parameter (with
    sequence parallel, a LayerNorm weight's gradient is still Partial, to be
    summed over the tensor-parallel group): redistributing it runs that
    collective on the tensor-parallel group, never on the data-parallel one.
    """
    if not is_dtensor(grad):
        return grad
    distributed: Any = grad  # DTensor attributes, untyped for mypy
    spec: Any = param
    if distributed.placements != spec.placements:
        distributed = distributed.redistribute(spec.device_mesh, spec.placements)
    shard = local(distributed)
    wait = getattr(shard, "wait", None)  # an AsyncCollectiveTensor: wait for its collective
    return wait() if callable(wait) else shard


def grad_wrapper(view: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """What ``param.grad`` is set to: ``view`` itself, or a DTensor around it (sharing its storage)."""
    if not is_dtensor(param):
        return view
    spec: Any = param
    with torch.no_grad():
        wrapper: torch.Tensor = DTensor.from_local(
            view, spec.device_mesh, spec.placements, run_check=False, shape=spec.shape, stride=spec.stride()
        )
    return wrapper


def describe_placement(param: torch.Tensor) -> str:
    """For the cross-rank check: a DTensor's placements and local shape ('' for a plain tensor)."""
    if not is_dtensor(param):
        return ""
    spec: Any = param
    return f" {tuple(spec.placements)} local {list(local(param).shape)}"


def check_mesh_apart(name: str, param: torch.Tensor, group: dist.ProcessGroup) -> None:
    """Refuses a DTensor parameter whose mesh includes other ranks of the data-parallel group.

    Such a parameter is already sharded or replicated over the ranks
    ``replicate()`` averages over (``fully_shard``, or a mesh dimension
    that is the data-parallel one): averaging it again would be wrong.

    Raises:
        ValueError: naming the parameter and the fix.
    """
    if not is_dtensor(param):
        return
    spec: Any = param
    mesh_ranks = set(spec.device_mesh.mesh.flatten().tolist())
    group_ranks = set(dist.get_process_group_ranks(group))
    if len(mesh_ranks & group_ranks) > 1:
        raise ValueError(
            f"replicate(): parameter {name!r} is a DTensor on a mesh that includes ranks "
            f"{sorted(mesh_ranks & group_ranks)} of the group replicate() averages over; its "
            "shards or replicas there are not data parallel. Put tensor parallelism on its own mesh "
            "dimension and pass the data-parallel one: replicate(model, mesh=mesh['dp'])"
        )
