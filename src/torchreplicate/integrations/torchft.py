"""torchreplicate on torchft: a replica group that survives the loss of another, without a restart.

``replicate_ft(model, manager)`` replicates ``model`` with every bucket
reduced across replica groups by torchft's ``Manager.allreduce`` (a comm
hook, as ``torchft.ddp.DistributedDataParallel`` does), so a step that lost a
peer is dropped by ``manager.should_commit()`` instead of raising, and a new
or restarted replica group heals from a live peer through the Manager.
Needs the ``torchft`` package (``pip install ".[torchft]" in a clone``);
checked with torchft 0.2.0 and torch 2.13 (gloo, CPU).

[Note: torchft]
torchft owns everything that crosses replica groups: the per-step quorum
(``manager.start_quorum()``, or ``torchft.optim.OptimizerWrapper.zero_grad``),
the reconfigurable process group, the all-reduce of each bucket
(``manager.allreduce``: an average over the step's participants; an error is
recorded, never raised, and the step is not committed), healing a replica
from a peer's ``state_dict`` (the Manager's ``load_state_dict`` /
``state_dict`` functions), and the step-0 sync (``Manager(init_sync=True)``).
Our reducer therefore runs on a process group of this process alone (one
process per replica group): its own collectives (set-up checks and
broadcast, the flags, late rounds, tuning) never leave the process, so they
cannot disagree with a peer, hang on a dead one or raise on the survivor;
there is no stall watchdog (``stall_timeout=None``; the Manager's timeout
bounds every collective) and no set-up broadcast (``init_sync=False``; the
Manager syncs step 0 and heals). The bucket layout is fixed
(``bucket_layout="fixed"``, [Note: fixed layout] in layout/policy.py): a pure
function of the parameters and the caps, so a replica that joins later
builds the same buckets as its peers without agreeing on anything.

Limits (docs/torchft.md): one process per replica group; the same graph on
every replica (a parameter unused on one replica only gets that replica's
zeros averaged in, as with torchft's DDP; a gradient that arrives after its
bucket left, more often than in the first step, raises at the next step, as
at ``replicate()``'s default ``graph="learned"``); no other comm hook, no
``Join``, no compiled autograd; buffers (BatchNorm statistics) are not
averaged across replica groups, only healed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Optional

import torch
import torch.distributed as dist
from torch import nn
from torchft.manager import Manager  # type: ignore[import-untyped]  # torchft 0.2.0 ships no py.typed

from torchreplicate.api import replicate
from torchreplicate.core.registry import get_state

__all__ = ["ManagerFuture", "ManagerHookState", "manager_allreduce_hook", "replicate_ft"]


def replicate_ft(
    module: nn.Module,
    manager: Manager,
    *,
    process_group: Optional[dist.ProcessGroup] = None,
    bucket_cap_mb: float = 25.0,
    first_bucket_cap_mb: float = 1.0,
    gradient_as_bucket_view: bool = True,
    reduce_dtype: Optional[torch.dtype] = None,
    ignored_modules: Optional[Iterable[nn.Module]] = None,
) -> nn.Module:
    """Replicates ``module`` across torchft replica groups, in place; returns it.

    Every bucket is averaged over the step's participants by
    ``manager.allreduce`` ([Note: torchft]); gate the optimizer on
    ``manager.should_commit()`` (``torchft.optim.OptimizerWrapper`` does) and
    start each step's quorum before the forward. Call once per replica
    group, after ``dist.init_process_group`` for this process alone (e.g.
    ``dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)``).

    Example::

        manager = Manager(pg=ProcessGroupGloo(), min_replica_size=1, load_state_dict=..., state_dict=..., ...)
        model = replicate_ft(model, manager)
        optimizer = OptimizerWrapper(manager, torch.optim.SGD(model.parameters(), lr=0.1))
        for x, y in batches:
            optimizer.zero_grad()            # the step's quorum; a new replica heals here
            loss_fn(model(x), y).backward()  # buckets averaged by manager.allreduce
            optimizer.step()                 # only if every participant committed

    Args:
        module: the model.
        manager: the replica group's ``torchft.manager.Manager``.
        process_group: the group of this replica group's processes; it must
            hold this process alone. Default: the world group.
        bucket_cap_mb: bucket cap in MiB, fixed (the same on every replica,
            whenever it joins). Default 25.
        first_bucket_cap_mb: cap of the first bucket. Default 1.
        gradient_as_bucket_view: ``.grad`` as views into the buckets. Default True.
        reduce_dtype: dtype the buckets travel in across replica groups (the
            average is cast back to the parameters' dtype). Default None: the
            parameters' own.
        ignored_modules: modules left alone. Default none.

    Returns:
        ``module`` itself.

    Raises:
        TypeError: ``manager`` is not a torchft ``Manager``, or ``reduce_dtype``
            is not a floating dtype.
        ValueError: the process group holds more than this process, or another
            option has a bad value (named, with the fix).
        RuntimeError: torch.distributed is not initialised.
    """
    if not isinstance(manager, Manager):
        raise TypeError(
            f"replicate_ft(): manager must be a torchft.manager.Manager, got {type(manager).__name__}; "
            "create one per replica group: Manager(pg=ProcessGroupGloo(), min_replica_size=..., "
            "load_state_dict=..., state_dict=...)"
        )
    if reduce_dtype is not None and (not isinstance(reduce_dtype, torch.dtype) or not reduce_dtype.is_floating_point):
        raise TypeError(
            f"replicate_ft(): reduce_dtype must be a floating torch.dtype such as torch.bfloat16, got {reduce_dtype!r}"
        )
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "replicate_ft(): torch.distributed is not initialized; this process is its replica group: "
            'dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)'
        )
    if (size := dist.get_world_size(process_group)) != 1:
        raise ValueError(
            f"replicate_ft(): process_group has {size} ranks; a replica group must be one process "
            "(torchft connects the replica groups, each through its own Manager): start one process per "
            "replica group, or pass process_group= a group of this process alone"
        )
    replicate(
        module,
        process_group=process_group,
        bucket_cap_mb=bucket_cap_mb,
        first_bucket_cap_mb=first_bucket_cap_mb,
        bucket_layout="fixed",
        gradient_as_bucket_view=gradient_as_bucket_view,
        broadcast_buffers=False,
        stall_timeout=None,
        ignored_modules=ignored_modules,
        init_sync=False,
    )
    module.register_comm_hook(ManagerHookState(manager, reduce_dtype), manager_allreduce_hook)  # type: ignore[operator]
    get_state(module).refuse_join(
        "replicate_ft(): torch's Join does not apply across torchft replica groups (this module's process "
        "group is this process alone); a replica group that runs out of data stops calling start_quorum() "
        "and the others go on without it: drop the Join context"
    )
    return module


@dataclass(frozen=True)
class ManagerHookState:
    """The state of ``manager_allreduce_hook``.

    Attributes:
        manager: the replica group's torchft ``Manager``.
        reduce_dtype: the dtype buckets travel in; None: their own.
    """

    manager: Manager
    reduce_dtype: Optional[torch.dtype] = None


class ManagerFuture:
    """What ``manager_allreduce_hook`` returns: waits for torchft's all-reduce, never raises for it.

    torchft's managed work builds its callback chain (the division by the
    number of participants) when waited on, and records an error with the
    Manager instead of raising it; so ``wait`` waits on the work, and on
    an error (this step, or an earlier bucket of it) returns zeros: the step
    is not committed, and no half-reduced gradient is left in ``.grad``.

    Args:
        manager: the Manager that launched the work.
        work: what ``manager.allreduce`` returned.
        wire: the tensor it reduces in place.
        out_dtype: the dtype to hand back (the bucket's).
    """

    def __init__(self, manager: Manager, work: Any, wire: torch.Tensor, out_dtype: torch.dtype) -> None:
        self.manager = manager
        self.work = work
        self.wire = wire
        self.out_dtype = out_dtype

    def wait(self) -> torch.Tensor:
        """Waits for the all-reduce; the average, or zeros if the step errored."""
        self.work.wait()  # torchft: errors are reported to the Manager, not raised
        if self.manager.errored() is not None:
            self.wire.zero_()
        return self.wire.to(self.out_dtype)


def manager_allreduce_hook(state: ManagerHookState, bucket: Any) -> ManagerFuture:
    """A comm hook: the bucket's average over the step's participants, through ``manager.allreduce``.

    The all-reduce starts here and is waited for by the reducer (overlapping
    the rest of backward), unlike torchft's own DDP hook, which waits at once.

    Args:
        state: the Manager and the wire dtype.
        bucket: the reducer's ``GradBucket``.

    Returns:
        A future-like object whose ``wait()`` gives the averaged bucket.
    """
    buffer = bucket.buffer()
    wire = buffer if state.reduce_dtype in (None, buffer.dtype) else buffer.to(state.reduce_dtype)
    return ManagerFuture(state.manager, state.manager.allreduce(wire), wire, buffer.dtype)
