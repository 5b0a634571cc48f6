"""Plan-time work of a replicated module: set-up, re-planning, and every mode decided once per plan.

``ReplicateState`` (state.py) owns the module's hooks and runs its step;
what happens only when what is replicated is decided lives here, as plain
functions over explicit arguments that return what they decide, and the
state assigns it in one place (``ReplicateState.install``): ``plan_tree``
walks the module tree, ``agree`` checks a plan across ranks and broadcasts
what is new to it from rank 0, ``start_watch`` starts the stall watchdog,
``build_reducer`` builds the plan's reducer and ``tied_uses`` the tied
holders' hooks.

Each mode a forward or a backward follows is decided there, once per plan,
into the objects it changes, so the step never asks again: mixed precision's
casts are installed on the plan's parameters (mixed_precision.py); the tied
parameters' split (``to_split``) gives the reducer its tied slots and the
state a ``TiedUses`` that hooks their holders, or neither (``state.tied``
None); ``state.buffer_sync`` gets the plan's buffers to broadcast before
forwards (none without other ranks to give them to); the reduction
(all-reduce, or a registered comm hook) is the reducer's. A plan with no
tied parameters and no buffers runs no code of tied.py, buffers.py, plan.py
or registry.py in its forwards.
"""

from __future__ import annotations

import secrets
from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from torchreplicate.config import ReplicateConfig, backend_of
from torchreplicate.core.buffers import broadcast_coalesced
from torchreplicate.core.checks import verify_params_across_ranks
from torchreplicate.core.nested import is_fully_sharded
from torchreplicate.core.plan import Plan, ignored_names, make_plan
from torchreplicate.core.tied import TiedUses, tied_params
from torchreplicate.faults.watchdog import StallWatch
from torchreplicate.faults.wire import Watch, WeakGroup
from torchreplicate.lifecycle import Learned, Lifecycle, SyncSwitch
from torchreplicate.reducer.bucket import bucket_kind, make_slots
from torchreplicate.reducer.dtensors import check_mesh_apart, is_dtensor, local
from torchreplicate.reducer.flags import TrainingClock
from torchreplicate.reducer.layout.policy import LayoutPolicy
from torchreplicate.reducer.probe import Probe
from torchreplicate.reducer.reducer import Reducer
from torchreplicate.reducer.reduction import AllReduce, Reduction
from torchreplicate.reducer.sparse import SparseGrads
from torchreplicate.reducer.tied_rows import TiedRows


def process_group(given: Optional[WeakGroup]) -> WeakGroup:
    """The group gradients are averaged over: the one given to ``replicate()``, else the world group.

    Raises:
        RuntimeError: torch.distributed is not initialised.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "replicate(): torch.distributed is not initialized; call "
            "torch.distributed.init_process_group() first (torchrun or "
            "torch's elastic_launch set up its environment)"
        )
    world = dist.group.WORLD
    assert world is not None, "initialised above"
    return given or WeakGroup(world)


def collective_device(group: dist.ProcessGroup, plan: Plan, device_id: Optional[torch.device]) -> torch.device:
    """Where a module's own small collectives run (the cross-rank check, the token, Join's rounds).

    A group that runs CPU tensors (gloo, or gloo beside NCCL): the device of
    the module's tensors. NCCL alone: the module's GPU, ``device_id``, else
    the GPU of a parameter or buffer, and only where the module has none, the
    current device (without ``torch.cuda.set_device`` every rank's current
    device is cuda:0).
    """
    tensors = [local(tensor) for tensor in (*plan.candidates, *plan.buffer_values())]
    if not backend_of(group, "cpu"):
        if device_id is not None and device_id.type == "cuda":
            return device_id if device_id.index is not None else torch.device("cuda", torch.cuda.current_device())
        on_gpu = [tensor.device for tensor in tensors if tensor.is_cuda]
        return on_gpu[0] if on_gpu else torch.device("cuda", torch.cuda.current_device())
    return tensors[0].device if tensors else torch.device("cpu")


def refuse_unreducible(plan: Plan, group: dist.ProcessGroup, reduces: bool) -> None:
    """Refuses a plan the group cannot reduce: a DTensor on the group's own mesh dimension, and (where a
    reducer will run: ``reduces``) sparse gradients on NCCL. Runs before the state changes anything.

    Raises:
        ValueError: on every rank (every plan alike), naming the parameter and the fix.
    """
    for name, param in zip(plan.candidate_names, plan.candidates, strict=True):
        check_mesh_apart(name, param, group)
    if reduces:
        refuse_sparse_on(sparse_backend(group, plan), plan)


def sparse_backend(group: dist.ProcessGroup, plan: Plan) -> str:
    """The backend ``group`` runs the plan's sparse gradients on (their device's; "" without any)."""
    device = next((p.device for p in plan.params if id(p) in plan.sparse), None)
    return "" if device is None else backend_of(group, device.type)


def refuse_sparse_on(backend: str, plan: Plan) -> None:
    """Refuses parameters with sparse gradients where ``backend`` cannot all-reduce them (NCCL).

    Raises:
        ValueError: on every rank (all plan alike), naming the parameters and the fix.
    """
    if backend != "nccl" or not plan.sparse:
        return
    names = [name for name, param in zip(plan.names, plan.params, strict=True) if id(param) in plan.sparse]
    raise ValueError(
        f"replicate(): {', '.join(repr(n) for n in names)} get sparse gradients (nn.Embedding(sparse=True)), "
        "which NCCL cannot all-reduce; construct the embedding with sparse=False (its gradient then travels "
        "dense, in the buckets), or replicate over a gloo process group"
    )


def run_token(device: torch.device) -> torch.Tensor:
    """Rank 0's random token, broadcast with everything at set-up: the watchdog's keys are fresh in
    every run (torchrun's store outlives restarts).

    From the operating system (``secrets``), never a generator the user's
    program draws from: one draw there moves every later random number of the job.
    """
    return torch.tensor([secrets.randbits(62)], dtype=torch.int64, device=device)


def plan_tree(
    module: nn.Module, ignored: Sequence[nn.Module], lazy: Sequence[nn.Module], inner: Sequence[nn.Module]
) -> Plan:
    """What ``module``'s tree replicates now: all but the ``ignored``, the ``lazy`` modules still pending and
    the children ``fully_shard`` manages; ``inner``: the replicated modules inside it (nested.py).
    """
    skipped = [*ignored, *lazy, *(m for m in module.modules() if m is not module and is_fully_sharded(m))]
    return make_plan(module, skipped, list(inner), ignored_names(module))


def agree(
    plan: Plan,
    group: dist.ProcessGroup,
    device: torch.device,
    options: dict[str, str],
    watch: Watch,
    to_broadcast: Sequence[torch.Tensor],
) -> None:
    """Checks ``plan`` across ranks (and the ``options`` that decide the collectives), then broadcasts
    ``to_broadcast`` from rank 0; each rank runs the same collectives.

    Raises:
        RuntimeError: on every rank, where ranks differ (naming the parameter or option).
    """
    verify_params_across_ranks(plan.candidate_names, plan.candidates, group, device, options, watch)
    if dist.get_world_size(group) > 1 and to_broadcast:
        broadcast_coalesced(to_broadcast, group, watch)


def start_watch(group: dist.ProcessGroup, stall_timeout_s: Optional[float], token: torch.Tensor) -> Watch:
    """The stall watchdog, keyed by the broadcast ``token``; a plain watch at world size 1 or with
    ``stall_timeout=None``."""
    if dist.get_world_size(group) == 1 or stall_timeout_s is None:
        return Watch()
    return StallWatch(group, stall_timeout_s, key=f"{group.group_name}/{int(token)}", device_type=token.device.type)


def tied_uses(root: nn.Module, reducer: Optional[Reducer], lifecycle: Lifecycle) -> Optional[TiedUses]:
    """The holder hooks of the tied parameters ``reducer`` splits, installed on ``root``'s tree.

    None where it splits none.
    """
    if reducer is None or not reducer.tied_rows.slots:
        return None
    tied = TiedUses(lifecycle)
    tied.install(root, reducer)
    return tied


def build_reducer(
    root: nn.Module,
    plan: Plan,
    config: ReplicateConfig,
    reduction: Reduction,
    group: dist.ProcessGroup,
    *,
    mixed: bool,
    lifecycle: Lifecycle,
    sync: SyncSwitch,
    clock: TrainingClock,
    probe: Probe,
    learned: Optional[Learned],
) -> Reducer:
    """A reducer for ``plan`` and the options, handed what the previous one ``learned`` (or None).

    Every option that decides how the backward reduces is read here, into
    the part it changes: the bucket caps and a fixed layout into the layout
    policy, ``gradient_as_bucket_view`` into the kind of bucket, the tied
    split into the tied rows' slots, sparse parameters into their round.

    Raises:
        ValueError: a parameter carries a post-accumulate-grad hook of its own.
    """
    refuse_sparse_on(sparse_backend(group, plan), plan)  # also where a comm hook asks for a reducer at world size 1
    learned = learned or Learned({}, 0)
    slots = make_slots(plan.params, plan.names, learned.expected)
    dense = [slot for slot in slots if id(slot.param) not in plan.sparse]
    split = config.tied_split if config.tied_split is not None else config.bucket_layout == "tuned"
    tied = to_split(root, plan, reduction, mixed) if split else frozenset()
    return Reducer(
        slots,
        group,
        policy=LayoutPolicy(
            dense,
            plan.param_groups,
            config.cap_bytes,
            config.first_cap_bytes,
            layout=config.bucket_layout,
            find_unused=config.find_unused_parameters,
            static_graph=config.static_graph,
        ),
        sparse=SparseGrads([slot for slot in slots if id(slot.param) in plan.sparse]),
        tied_rows=TiedRows([slot for slot in dense if id(slot.param) in tied], sync, priced=config.tied_split is None),
        bucket_kind=bucket_kind(config.gradient_as_bucket_view),
        reduction=reduction,
        lifecycle=lifecycle,
        sync=sync,
        clock=clock,
        probe=probe,
        num_steps=learned.num_steps,
        read_every_step=config.graph == "dynamic",
    )


def to_split(root: nn.Module, plan: Plan, reduction: Reduction, mixed: bool) -> frozenset[int]:
    """The tied parameters whose detached uses are reduced by rows, by identity ([Note: tied parameters]).

    None under mixed precision (its casts own ``_parameters`` in the forward),
    a comm hook or a wire dtype (the hook or the cast sees each gradient whole,
    in its bucket); never a sparse, DTensor or nested module's parameter.
    """
    if mixed or not isinstance(reduction, AllReduce) or reduction.reduce_dtype is not None:
        return frozenset()
    params = tuple(
        p
        for p, group in zip(plan.params, plan.param_groups or (0,) * len(plan.params), strict=True)
        if group == 0 and id(p) not in plan.sparse and not is_dtensor(p)
    )
    return frozenset(tied_params(root, params))
