"""Per-module state of a replicated module: set-up and re-planning.

``ReplicateState`` decides what is replicated (plan.py), checks it across
ranks, broadcasts rank 0's values, builds the reducer, installs the forward
hooks, and re-plans when what is replicated changes ([Note: re-planning] in
plan.py). The forward hooks themselves are in forward_hooks.py, gradient
reduction in reducer.py.
"""

from __future__ import annotations

import weakref
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from torchreplicate.config import ReplicateConfig
from torchreplicate.core import forward_hooks, lazy, nested
from torchreplicate.core.buffers import BufferSync
from torchreplicate.core.join import ReplicateJoinHook
from torchreplicate.core.mixed_precision import MixedPrecision
from torchreplicate.core.nested import class_name, is_fully_sharded
from torchreplicate.core.plan import EMPTY_PLAN, Plan, describe_change, ignored_names, make_plan, new_tensors
from torchreplicate.core.registry import registration_count
from torchreplicate.core.tied import TiedUses, to_split
from torchreplicate.reducer.bucket import grad_layout
from torchreplicate.reducer.collectives import (
    broadcast_coalesced,
    is_transport_error,
    verify_params_across_ranks,
)
from torchreplicate.reducer.comm_hooks import check_hook_options
from torchreplicate.reducer.dtensors import check_mesh_apart, local
from torchreplicate.reducer.flags import TrainingClock
from torchreplicate.reducer.probe import Probe, StepEvents
from torchreplicate.reducer.reducer import Reducer
from torchreplicate.reducer.reduction import AllReduce, HookReduction, Reduction, WeakGroup
from torchreplicate.reducer.switches import Learned, Lifecycle, SyncSwitch, TrainingState
from torchreplicate.reducer.watchdog import StallWatch
from torchreplicate.torch_internals import join_enabled, num_composable_states, num_in_backward_optimizer_params

MiB = 1024 * 1024


class ReplicateState:
    """What ``replicate()`` keeps for one module; ``replicate.state(module)``.

    Args:
        module: the root module ``replicate()`` was applied to.
        config: its validated options.
        process_group: the group to average over; None: the world group.
    """

    def __init__(
        self, module: nn.Module, config: ReplicateConfig, process_group: Optional[dist.ProcessGroup] = None
    ) -> None:
        # - Identity. The registry maps module -> state weakly; a strong
        #   reference back would keep every replicated model (and its process
        #   group) alive until interpreter exit.
        self._module_ref = weakref.ref(module)  # the replicated root
        self.config = config  # options, frozen
        self._given_group = None if process_group is None else WeakGroup(process_group)
        self._group: Optional[WeakGroup] = None  # resolved at init, held weakly
        # - Lifecycle: the module's one TrainingState, shared with every reducer
        #   it builds (they move it through a synchronised backward); the
        #   forward hooks, the tied holders and Join read it. Two conditions are
        #   torch's to decide and are read from torch: an enabled Join
        #   (`joining`) and compiled autograd ([Note: compiled autograd]).
        self.lifecycle = Lifecycle()
        # - What is replicated, and the stamp it was planned at ([Note: re-planning])
        self.plan: Plan = EMPTY_PLAN
        self.planned_stamp: tuple[int, ...] = ()  # stamp() when planned; each forward compares
        self.lazy = lazy.LazyModules()  # lazy modules left out of the plan until they materialise
        self._num_noted_changes = 0  # note_change() calls: .to(), .double(), a new ignore list, ...
        # - Reduction. How gradients are reduced (from the options, or a
        #   registered comm hook) and whether they are: kept here, so every
        #   reducer built for the module (also after a re-plan) shares them.
        self.reduction: Reduction = AllReduce(config.wire_dtype, config.gradient_divide_factor)
        # mp_policy: casts around every forward, re-installed at each plan (mixed_precision.py)
        self.mixed = None if config.mp_policy is None else MixedPrecision(config.mp_policy)
        self.tied = TiedUses(self.lifecycle)  # tied parameters' first use detached ([Note: tied parameters]), per plan
        self.sync = SyncSwitch()  # set_requires_gradient_sync(), read by the reducer at backward
        self.buffer_sync = BufferSync(config)  # when buffers are broadcast ([Note: buffer sync])
        self.clock = TrainingClock()  # optimizer steps over the replicated parameters ([Note: desync detection])
        self.reducer: Optional[Reducer] = None  # None when there is nothing to reduce
        # the watchdog, an observer of the steps and profiler labels, shared with every reducer (probe.py)
        self.probe = Probe()
        self.num_forwards = 0  # forwards of the root with gradients enabled (counted by forward_hooks.py)
        self._outer: Optional[weakref.ref[ReplicateState]] = None  # the enclosing module's state, once NESTED
        # the hook torch's Join took from model.join_hook() (it holds the
        # divisor rule), until every rank joined; None outside a Join ([Note: join])
        self.join_hook: Optional[ReplicateJoinHook] = None
        self.join_refusal: Optional[str] = None  # why torch's Join is refused for this module (replicate_ft)
        # the forward hooks (forward_hooks.py); they hold this state, it holds their handles
        self._handles = forward_hooks.ForwardHooks(self).install(module)

    # -- public --------------------------------------------------------------

    @property
    def module(self) -> nn.Module:
        """The root module ``replicate()`` was applied to."""
        module = self._module_ref()
        if module is None:
            raise RuntimeError("replicate.state(): the replicated module was garbage-collected")
        return module

    @property
    def params(self) -> tuple[nn.Parameter, ...]:
        """The replicated parameters (those whose gradients are averaged), in registration order."""
        return self.plan.params

    @property
    def param_names(self) -> tuple[str, ...]:
        """Fully qualified names of the replicated parameters, as in ``named_parameters()``."""
        return self.plan.names

    @property
    def group(self) -> dist.ProcessGroup:
        """The process group gradients are averaged over."""
        if self._group is None:
            raise RuntimeError("replicate.state(): the module was not initialised")
        return self._group.get()

    @property
    def world_size(self) -> int:
        """Number of ranks in the process group."""
        return dist.get_world_size(self.group)

    @property
    def requires_gradient_sync(self) -> bool:
        """Whether backwards average gradients (``set_requires_gradient_sync``)."""
        return self.sync.on

    def set_requires_gradient_sync(self, requires_gradient_sync: bool) -> None:
        """See ``ReplicateModule.set_requires_gradient_sync``."""
        if not isinstance(requires_gradient_sync, bool):
            raise TypeError(
                f"set_requires_gradient_sync(): expected a bool, got {type(requires_gradient_sync).__name__}"
            )
        self.sync.on = requires_gradient_sync

    def register_comm_hook(self, state: Any, hook: Any) -> None:
        """See ``ReplicateModule.register_comm_hook``."""
        reduction = HookReduction(state, hook)  # checks the hook's signature
        check_hook_options(self.config)
        if isinstance(self.reduction, HookReduction):
            raise RuntimeError(
                "register_comm_hook(): a comm hook is already registered; it can be registered only once"
            )
        if not self.params:
            raise RuntimeError(
                "register_comm_hook(): this module has no replicated parameters "
                "(all ignored, frozen or managed by fully_shard)"
            )
        if self.reducer is None:
            # World size 1 runs no reducer until a hook asks for one; it cannot
            # have counted backwards, so forwards stand in for them.
            if self.num_forwards:
                raise RuntimeError(
                    f"register_comm_hook(): training already ran {self.num_forwards} forward(s); "
                    "register the hook before the first backward (at world size 1: before the "
                    "first forward)"
                )
            self.reduction = reduction
            self.reducer = self.build_reducer(None)
        else:
            self.reducer.use_reduction(reduction)
            self.reduction = reduction

    @property
    def events(self) -> Optional[StepEvents]:
        """The observer of every step's timeline (``set_events``), or None."""
        return self.probe.events

    def set_events(self, events: Optional[StepEvents]) -> None:
        """Attaches an observer of every step's timeline (probe.py's ``StepEvents``), or detaches it (None).

        It stays attached across re-plans.
        """
        self.probe.events = events

    def remove_hooks(self) -> None:
        """Removes every hook ``replicate()`` installed (forward and gradient)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self.mixed is not None:
            self.mixed.remove()
        self.tied.remove()
        if self.reducer is not None:
            self.reducer.remove_hooks()
            self.reducer = None

    def without_own_hooks(self, attributes: dict[str, Any]) -> dict[str, Any]:
        """A shallow copy of the module's ``__dict__`` without the hooks ``replicate()`` installed.

        What a deep copy or a pickle of the module holds (``ReplicateModule.__reduce_ex__``).
        """
        copied = forward_hooks.without_hooks(attributes, self._handles)
        copied.pop("_join_config", None)  # torch's Join protocol state, set by replicate()
        return copied

    @property
    def training_state(self) -> TrainingState:
        """Where the module is in its training step (``TrainingState``)."""
        return self.lifecycle.now

    @property
    def nested(self) -> bool:
        """Whether an enclosing replicated module reduces this module's parameters (``TrainingState.NESTED``)."""
        return self.lifecycle.now is TrainingState.NESTED

    def nest_into(self, outer: ReplicateState) -> None:
        """Hands this module's reduction to ``outer``, an enclosing replicated module.

        It gives up its reducer, its forward work and its watchdog; see
        [Note: nested replicate] in nested.py.

        Raises:
            ValueError: an option that decides the reduction differs, or the process group.
        """
        if self._outer is not None and self._outer() is outer:
            return
        nested.check_same_reduction(self, outer)
        if self._group is not None and outer._group is not None and self.group is not outer.group:
            raise ValueError(
                f"replicate(): nested replicate() calls use different process groups ({class_name(self.module)} "
                f"and the enclosing {class_name(outer.module)}); pass the same group or mesh to both"
            )
        self._outer = weakref.ref(outer)
        self.lifecycle.now = TrainingState.NESTED
        if self.reducer is not None:
            self.reducer.remove_hooks()
            self.reducer = None
        if self.mixed is not None:
            self.mixed.remove()
        if self.probe.watch is not None:
            self.probe.watch.stop()
            self.probe.watch = None

    # -- uneven inputs ([Note: join] in join.py) ------------------------------

    @property
    def joining(self) -> bool:
        """Whether the module is inside an enabled ``Join`` context (torch sets its join config)."""
        return join_enabled(self.module)

    def refuse_join(self, reason: str) -> None:
        """From now on, torch's ``Join`` raises ``RuntimeError(reason)`` for this module (``replicate_ft``)."""
        self.join_refusal = reason

    def note_change(self) -> None:
        """After ``.to()``, ``.double()``, ... or a new DDP ignore list: re-check at the next forward."""
        self._num_noted_changes += 1

    # -- set-up and re-planning ----------------------------------------------

    def init(self) -> None:
        """At ``replicate()``: plans, checks across ranks, broadcasts everything, builds the reducer."""
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "replicate(): torch.distributed is not initialized; call "
                "torch.distributed.init_process_group() first (torchrun or "
                "torchreplicate.launch() set up its environment)"
            )
        world = dist.group.WORLD
        assert world is not None, "initialised above"
        self._group = self._given_group or WeakGroup(world)
        if self.config.device_id is not None:
            self.module.to(self.config.device_id)
        self._handles += self.lazy.watch(self)  # planned as they materialise ([Note: lazy modules])
        plan = self._make_plan()
        # rank 0's random token, broadcast with everything: the watchdog's
        # keys are fresh in every run (torchrun's store outlives restarts)
        token = torch.randint(0, 2**62, (1,), dtype=torch.int64, device=self.collective_device())
        buffers = plan.buffer_values() if self.buffer_sync.at_set_up else []  # as DDP's _sync_module_states
        self._install_plan(plan, [local(p).detach() for p in plan.candidates] + buffers + [token], token)

    def stamp(self) -> tuple[int, ...]:
        """What moves when the plan may have changed ([Note: re-planning])."""
        return (
            registration_count(),
            self._num_noted_changes,
            num_in_backward_optimizer_params(),
            num_composable_states(),
        )

    def _make_plan(self) -> Plan:
        self.planned_stamp = self.stamp()
        module = self.module
        nested.refuse_inside_fully_shard(module)
        skipped = list(self.config.ignored_modules) + self.lazy.modules()
        skipped += [m for m in module.modules() if m is not module and is_fully_sharded(m)]
        return make_plan(module, skipped, nested.nest_inner(self), ignored_names(module))

    def replan_if_changed(self) -> None:
        """Walks the module tree (the stamp moved) and re-plans if it finds a different plan."""
        plan = self._make_plan()
        if not plan.same_as(self.plan):
            self._install_agreed(plan)
            self.probe.replanned(0 if self.reducer is None else self.reducer.num_steps)

    def _install_agreed(self, plan: Plan) -> None:
        # A re-plan runs collectives that every rank must run at the same
        # forward. If one rank's change is its own (a layer frozen on one
        # rank only), the others are elsewhere: the watchdog's note says what
        # changed here, so every rank's error names the parameters.
        change = describe_change(self.plan, plan)
        step = 0 if self.reducer is None else self.reducer.num_steps
        self.probe.at(f"a re-plan ({change}: every rank must make the same change at the same step)", step)
        watch = self.probe.watch
        try:
            self._install_plan(plan, new_tensors(self.plan, plan, self.buffer_sync.at_set_up))
        except RuntimeError as error:
            if watch is None or not is_transport_error(error):
                raise
            raise watch.diagnose(f"the re-plan ({change}) before step {step}", error) from error

    def _install_plan(self, plan: Plan, to_broadcast: list[torch.Tensor], token: Optional[torch.Tensor] = None) -> None:
        # Checks the plan across ranks, broadcasts what is new to it from rank 0
        # and builds its reducer, handing over what the previous one learned.
        # At replicate(), `token` (broadcast too) names the watchdog's keys.
        learned: Optional[Learned] = None
        if self.reducer is not None:
            learned = self.reducer.learned
            self.reducer.remove_hooks()
            self.reducer = None
        if self.lifecycle.now is TrainingState.BACKWARD or self.lifecycle.now is TrainingState.ENDING:
            self.lifecycle.now = TrainingState.IDLE  # a step the old reducer never ended (its backward raised)
        for name, param in zip(plan.candidate_names, plan.candidates, strict=True):
            check_mesh_apart(name, param, self.group)
        self.plan = plan
        if self.mixed is not None:
            self.mixed.install(self.module, plan)
        self.clock.param_ids = frozenset(id(p) for p in plan.params)
        verify_params_across_ranks(
            plan.candidate_names,
            plan.candidates,
            self.group,
            self.collective_device(),
            self.config.wire_options,
            self.probe.watch,
        )
        if self.world_size > 1 and to_broadcast:
            broadcast_coalesced(to_broadcast, self.group, waiter=self.probe.watch)
        stall_timeout_s = self.config.stall_timeout_s
        if token is not None and self.world_size > 1 and stall_timeout_s is not None:
            watch = self.probe.watch = StallWatch(
                self.group, stall_timeout_s, key=f"{self.group.group_name}/{int(token)}"
            )
            # released: a last note; at interpreter exit the watch's own hook says "exited" instead
            weakref.finalize(self, watch.leave, "released its replica").atexit = False
        if plan.params and (self.world_size > 1 or isinstance(self.reduction, HookReduction)):
            self.reducer = self.build_reducer(learned)
        self.tied.install(self.module, self.reducer)

    def build_reducer(self, learned: Optional[Learned]) -> Reducer:
        """A reducer for the current plan and options, handed what the previous one ``learned`` (or None).

        The state keeps the one it builds itself; the benchmark builds one at
        world size 1 (where ``replicate()`` builds none) to time its bookkeeping.
        """
        reducer = Reducer(
            self.plan.params,
            self.plan.names,
            self.group,
            bucket_cap_bytes=None if self.config.bucket_cap_mb is None else int(self.config.bucket_cap_mb * MiB),
            first_bucket_cap_bytes=int(self.config.first_bucket_cap_mb * MiB),
            layout=grad_layout(self.config.gradient_as_bucket_view),
            reduction=self.reduction,
            lifecycle=self.lifecycle,
            sync=self.sync,
            clock=self.clock,
            probe=self.probe,
            sparse=self.plan.sparse,
            tied=to_split(self.module, self.plan, self.reduction, self.mixed is not None),
            groups=self.plan.param_groups,
            learned=learned,
            fixed_layout=self.config.bucket_layout == "fixed",
        )
        return reducer

    def collective_device(self) -> torch.device:
        """Where this module's own small collectives run (the accelerator for NCCL)."""
        if dist.get_backend(self.group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        for tensor in list(self.plan.candidates) + self.plan.buffer_values():
            return local(tensor).device
        return torch.device("cpu")
