"""Plan-time work of a replicated module: set-up, re-planning, and every mode decided once per plan.

``ReplicateState`` (state.py) owns the module's hooks and runs its step;
what happens only when what is replicated is decided lives here, as plain
functions of the state: ``init`` at ``replicate()``, ``replan_if_changed``
when a forward's stamp moved ([Note: re-planning] in plan.py), and
``install_plan`` between them, which checks a plan across ranks, broadcasts
what is new to it from rank 0 and builds its reducer (``build_reducer``).

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
import weakref
from typing import TYPE_CHECKING, Optional

import torch
import torch.distributed as dist
from torch import nn

from torchreplicate.config import MiB
from torchreplicate.core import nested
from torchreplicate.core.nested import is_fully_sharded
from torchreplicate.core.plan import Plan, describe_change, ignored_names, make_plan, new_tensors
from torchreplicate.core.tied import TiedUses, tied_params
from torchreplicate.reducer.bucket import bucket_kind, make_slots
from torchreplicate.reducer.collectives import is_transport_error, verify_params_across_ranks
from torchreplicate.reducer.dtensors import check_mesh_apart, is_dtensor, local
from torchreplicate.reducer.reducer import Reducer
from torchreplicate.reducer.reduction import AllReduce, HookReduction, Reduction, WeakGroup, broadcast_coalesced
from torchreplicate.reducer.sparse import SparseGrads
from torchreplicate.reducer.switches import Learned, TrainingState
from torchreplicate.reducer.tied_rows import TiedRows
from torchreplicate.reducer.tuning import LayoutPolicy
from torchreplicate.reducer.watchdog import StallWatch

if TYPE_CHECKING:
    from torchreplicate.core.state import ReplicateState


def process_group(given: Optional[WeakGroup]) -> WeakGroup:
    """The group gradients are averaged over: the one given to ``replicate()``, else the world group.

    Raises:
        RuntimeError: torch.distributed is not initialised.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "replicate(): torch.distributed is not initialized; call "
            "torch.distributed.init_process_group() first (torchrun or "
            "torchreplicate.launch() set up its environment)"
        )
    world = dist.group.WORLD
    assert world is not None, "initialised above"
    return given or WeakGroup(world)


def init(state: ReplicateState) -> None:
    """At ``replicate()``, once the state has its group: plans, checks across ranks, broadcasts, builds the reducer."""
    plan = make_state_plan(state)
    # rank 0's random token, broadcast with everything: the watchdog's
    # keys are fresh in every run (torchrun's store outlives restarts). From
    # the operating system (secrets), never a generator the user's program
    # draws from: one draw there moves every later random number of the job
    token = torch.tensor([secrets.randbits(62)], dtype=torch.int64, device=state.collective_device())
    buffers = plan.buffer_values() if state.buffer_sync.at_set_up else []  # as DDP's _sync_module_states
    install_plan(state, plan, [local(p).detach() for p in plan.candidates] + buffers + [token], token)


def make_state_plan(state: ReplicateState) -> Plan:
    """Walks the state's module tree and returns what it replicates now; notes the stamp it planned at."""
    state.planned_stamp = state.stamp()
    module = state.module
    nested.refuse_inside_fully_shard(module)
    skipped = list(state.config.ignored_modules) + state.lazy.modules()
    skipped += [m for m in module.modules() if m is not module and is_fully_sharded(m)]
    return make_plan(module, skipped, nested.nest_inner(state), ignored_names(module))


def replan_if_changed(state: ReplicateState) -> None:
    """Walks the module tree (the stamp moved) and re-plans if it finds a different plan."""
    plan = make_state_plan(state)
    if not plan.same_as(state.plan):
        _install_agreed(state, plan)
        state.probe.replanned(0 if state.reducer is None else state.reducer.num_steps)


def _install_agreed(state: ReplicateState, plan: Plan) -> None:
    # A re-plan runs collectives that every rank must run at the same
    # forward. If one rank's change is its own (a layer frozen on one
    # rank only), the others are elsewhere: the watchdog's note says what
    # changed here, so every rank's error names the parameters.
    change = describe_change(state.plan, plan)
    step = 0 if state.reducer is None else state.reducer.num_steps
    state.probe.at(f"a re-plan ({change}: every rank must make the same change at the same step)", step)
    watch = state.probe.watch
    try:
        install_plan(state, plan, new_tensors(state.plan, plan, state.buffer_sync.at_set_up))
    except RuntimeError as error:
        if watch is None or not is_transport_error(error):
            raise
        raise watch.diagnose(f"the re-plan ({change}) before step {step}", error) from error


def install_plan(
    state: ReplicateState, plan: Plan, to_broadcast: list[torch.Tensor], token: Optional[torch.Tensor] = None
) -> None:
    """Makes ``plan`` the state's: checks it across ranks, broadcasts ``to_broadcast`` from rank 0, builds its reducer.

    The new reducer gets what the previous one learned. At ``replicate()``,
    ``token`` (broadcast too) names the watchdog's keys and starts it.
    """
    learned: Optional[Learned] = None
    state.drop_tied()
    if state.reducer is not None:
        learned = state.reducer.learned
        state.reducer.remove_hooks()
        state.reducer = None
    lifecycle = state.lifecycle
    if lifecycle.now is TrainingState.BACKWARD or lifecycle.now is TrainingState.FINALIZING:
        lifecycle.now = TrainingState.IDLE  # a step the old reducer never ended (its backward raised)
    group = state.group
    for name, param in zip(plan.candidate_names, plan.candidates, strict=True):
        check_mesh_apart(name, param, group)
    state.plan = plan
    if state.mixed is not None:
        state.mixed.install(state.module, plan)
    state.clock.param_ids = frozenset(id(p) for p in plan.params)
    verify_params_across_ranks(
        plan.candidate_names,
        plan.candidates,
        group,
        state.collective_device(),
        state.config.wire_options,
        state.probe.watch,
    )
    world_size = state.world_size
    if world_size > 1 and to_broadcast:
        broadcast_coalesced(to_broadcast, group, waiter=state.probe.watch)
    stall_timeout_s = state.config.stall_timeout_s
    if token is not None and world_size > 1 and stall_timeout_s is not None:
        watch = state.probe.watch = StallWatch(group, stall_timeout_s, key=f"{group.group_name}/{int(token)}")
        # released: a last note; at interpreter exit the watch's own hook says "exited" instead
        weakref.finalize(state, watch.leave, "released its replica").atexit = False
    if plan.params and (world_size > 1 or isinstance(state.reduction, HookReduction)):
        state.reducer = build_reducer(state, learned)
    state.tied = tied_uses(state)
    state.buffer_sync.install(plan.buffers if world_size > 1 else (), state.weak_group, state.probe)


def tied_uses(state: ReplicateState) -> Optional[TiedUses]:
    """The holder hooks of the tied parameters the state's reducer splits, installed; None where it splits none."""
    reducer = state.reducer
    if reducer is None or not reducer.tied_rows.slots:
        return None
    tied = TiedUses(state.lifecycle)
    tied.install(state.module, reducer)
    return tied


def build_reducer(state: ReplicateState, learned: Optional[Learned]) -> Reducer:
    """A reducer for the state's current plan and options, handed what the previous one ``learned`` (or None).

    Every option that decides how the backward reduces is read here, into
    the part it changes: the bucket caps and a fixed layout into the layout
    policy, ``gradient_as_bucket_view`` into the ``.grad`` layout, the tied
    split into the tied rows' slots, sparse parameters into their round.

    Raises:
        ValueError: a parameter carries a post-accumulate-grad hook of its own.
    """
    config, plan = state.config, state.plan
    learned = learned or Learned({}, 0)
    slots = make_slots(plan.params, plan.names, learned.expected)
    dense = [slot for slot in slots if id(slot.param) not in plan.sparse]
    tied = to_split(state.module, plan, state.reduction, state.mixed is not None)
    policy = LayoutPolicy(
        dense,
        plan.param_groups,
        config.cap_bytes,
        int(config.first_bucket_cap_mb * MiB),
        fixed=config.bucket_layout == "fixed",
    )
    return Reducer(
        slots,
        state.group,
        policy=policy,
        sparse=SparseGrads([slot for slot in slots if id(slot.param) in plan.sparse]),
        tied_rows=TiedRows([slot for slot in dense if id(slot.param) in tied], state.sync),
        bucket_kind=bucket_kind(config.gradient_as_bucket_view),
        reduction=state.reduction,
        lifecycle=state.lifecycle,
        sync=state.sync,
        clock=state.clock,
        probe=state.probe,
        num_steps=learned.num_steps,
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
