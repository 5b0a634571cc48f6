"""Per-module state of a replicated module: what ``replicate()`` keeps for it, and its forward hooks.

``ReplicateState`` holds the module's options, its plan (plan.py), its reducer and its one
``TrainingState``. As FSDP2's ``FSDPState`` does, it owns the root's hooks (before and after each
forward, and on the outputs) and holds the handles of the others ``replicate()`` installs on modules
(lazy modules'; tied holders' through its ``TiedUses``); the parameters' gradient hooks are its reducer's.
The plan-time work (set-up, the cross-rank checks and broadcasts, building the reducer, re-planning:
[Note: re-planning] in plan.py) is setup.py's, whose functions return what they decide; the state
assigns it in one place (``install``). Gradient reduction is reducer.py's.

Before each forward with gradients enabled: the join round (inside a Join),
the watchdog's mark, the re-plan check and the buffer broadcast ([Note:
buffer sync] in buffers.py); inputs cast (mp_policy). After it: whether the
next forward broadcasts buffers, outputs cast, and a hook on each output
that queues the reducer's end-of-backward work. They move the module's
``TrainingState`` from ``IDLE`` to ``FORWARD`` and back (a forward
recomputed inside a backward stays ``BACKWARD``; the first forward outside
one after a backward that raised ends that step, ``Reducer.finalize_raised_backward``). Both
hooks run at every forward, so they stay flat: the state's bound methods,
registered directly, with no wrapper layers between.
"""

from __future__ import annotations

import sys
import weakref
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.hooks import RemovableHandle

from torchreplicate.config import ReplicateConfig
from torchreplicate.core import lazy, nested, setup
from torchreplicate.core.buffers import BufferSync
from torchreplicate.core.compile_split import BucketCap
from torchreplicate.core.mixed_precision import MixedPrecision
from torchreplicate.core.nested import class_name
from torchreplicate.core.plan import EMPTY_PLAN, Plan, describe_change, new_tensors
from torchreplicate.core.registry import find_state, registrations
from torchreplicate.core.tied import TiedUses
from torchreplicate.errors import compiled_hook_error, ddp_on_top_error, describe_error, graph_capture_error
from torchreplicate.faults.place import Collective, Place
from torchreplicate.faults.wire import Watch, WeakGroup
from torchreplicate.lifecycle import Learned, Lifecycle, SyncSwitch, TrainingState
from torchreplicate.reducer.comm_hooks import check_hook_options
from torchreplicate.reducer.dtensors import local
from torchreplicate.reducer.flags import TrainingClock
from torchreplicate.reducer.probe import Probe, StepEvent, StepObserver
from torchreplicate.reducer.reducer import Reducer
from torchreplicate.reducer.reduction import AllReduce, HookReduction, Reduction
from torchreplicate.torch_internals import (
    claimed_elsewhere,
    ddp_reduces_any,
    join_enabled,
    moved_to,
    swap_active_ddp_module,
    tensors_in,
)


class ReplicateState:
    """What ``replicate()`` keeps for one module; ``replicate.state(module)``.

    For users, read-only: ``module``, ``config``, ``params``, ``param_names``,
    ``group``, ``world_size``, ``requires_gradient_sync``, ``training_state``,
    ``device`` (where its small collectives run) and ``reducer`` (``None`` at
    world size 1). The rest is the library's own.

    Args:
        module: the root module ``replicate()`` was applied to.
        config: its validated options.
        process_group: the group to average over; None: the world group.
    """

    def __init__(
        self, module: nn.Module, config: ReplicateConfig, process_group: Optional[dist.ProcessGroup] = None
    ) -> None:
        # - Identity. The registry maps module -> state weakly (a strong reference back: alive until exit)
        self._module_ref = weakref.ref(module)  # the replicated root
        self.config = config  # options, frozen
        self._given_group = None if process_group is None else WeakGroup(process_group)
        self._group: Optional[WeakGroup] = None  # resolved at init, held weakly
        self.device = torch.device("cpu")  # where the module's own small collectives run (setup.py, per plan)
        # replicate(device_id=) an accelerator: inputs are moved there before each forward, as DDP's
        # device_ids moves them; None: inputs stay where the caller put them
        self.input_device = (
            config.device_id if config.device_id is not None and config.device_id.type != "cpu" else None
        )
        # - Lifecycle: the module's one TrainingState, shared with every reducer
        #   it builds (they move it through a synchronised backward); this
        #   state's forward hooks, the tied holders and Join read it. Two
        #   conditions are torch's to decide and are read from torch: an
        #   enabled Join (`joining`) and compiled autograd ([Note: compiled autograd]).
        self.lifecycle = Lifecycle()
        # - What is replicated, and the stamp it was planned at ([Note: re-planning])
        self.plan: Plan = EMPTY_PLAN
        self.planned_stamp: tuple[int, ...] = ()  # stamp() when planned; each forward compares
        self.lazy = lazy.LazyModules()  # lazy modules left out of the plan until they materialise
        self._num_noted_changes = 0  # note_change() calls: .to(), .double(), a new ignore list, ...
        # - Reduction. How gradients are reduced (from the options, or a registered comm hook) and whether
        #   they are: kept here, so every reducer built for the module (also after a re-plan) shares them.
        self.reduction: Reduction = AllReduce(config.wire_dtype, config.gradient_divide_factor)
        # mp_policy: casts around every forward, re-installed at each plan (mixed_precision.py)
        self.mixed = None if config.mp_policy is None else MixedPrecision(config.mp_policy)
        # tied parameters' first use detached ([Note: tied parameters]); None where none is split or with a comm hook
        self.tied: Optional[TiedUses] = None
        self.bucket_cap = BucketCap(config)  # dynamo splits graphs compiled in the forward at it (compile_split.py)
        self.sync = SyncSwitch()  # set_requires_gradient_sync(), read by the reducer at backward
        self.buffer_sync = BufferSync(config)  # when and which buffers are broadcast ([Note: buffer sync])
        self.clock = TrainingClock()  # optimizer steps over the replicated parameters ([Note: desync detection])
        self.reducer: Optional[Reducer] = None  # None when there is nothing to reduce
        # the watchdog, an observer of the steps and profiler labels, shared with every reducer (probe.py)
        self.probe = Probe()
        self.num_forwards = 0  # forwards of the root with gradients enabled (counted by _sync_before_forward)
        self._outer: Optional[weakref.ref[ReplicateState]] = None  # the enclosing module's state, once NESTED
        # the hook torch's Join took from model.join_hook() (it holds the
        # divisor rule), until every rank joined; None outside a Join ([Note: join])
        self.join_hook: Any = None  # a ReplicateJoinHook (core/join.py, which imports this file)
        self.join_refusal: Optional[str] = None  # why torch's Join is refused for this module (replicate_ft)
        # - Hooks. The module's hook dicts hold this state's bound methods; the
        #   state holds the module weakly and only the handles, so no
        #   reference cycle keeps a discarded model's state (and its watchdog) alive.
        self._handles: list[RemovableHandle] = [
            module.register_forward_pre_hook(self._pre_forward, prepend=True, with_kwargs=True),  # first of all
            module.register_forward_hook(self._post_forward),
            module.register_forward_hook(self._leave_forward, always_call=True),  # also when the forward raised
        ]

    # -- public --------------------------------------------------------------

    @property
    def module(self) -> nn.Module:
        """The root module ``replicate()`` was applied to."""
        if (module := self._module_ref()) is None:
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
        return self.weak_group.get()

    @property
    def weak_group(self) -> WeakGroup:
        """The process group, held weakly (what the module's own objects keep)."""
        if self._group is None:
            raise RuntimeError("replicate.state(): the module was not initialised")
        return self._group

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
            # World size 1 runs no reducer until a hook asks for one; forwards stand in for its backwards.
            if self.num_forwards:
                raise RuntimeError(
                    f"register_comm_hook(): training already ran {self.num_forwards} forward(s); "
                    "register the hook before the first backward (at world size 1: before the "
                    "first forward)"
                )
            self.reduction = reduction
            self.make_reducer(None)
        else:
            self.reducer.use_reduction(reduction)
            self.reduction = reduction
        self.drop_tied()  # the hook sees each parameter's whole gradient in its bucket (setup.to_split)

    def drop_tied(self) -> None:
        """Removes the tied holders' hooks: the plan changes, or a comm hook now sees every gradient whole."""
        if self.tied is not None:
            self.tied.remove()
            self.tied = None

    @property
    def events(self) -> Optional[StepObserver]:
        """The observer of every step's timeline (``set_events``), or None."""
        return self.probe.events

    def set_events(self, events: Optional[StepObserver]) -> None:
        """Attaches an observer of every step's timeline, or detaches it (None): ``events(event, a, b)`` is
        called with probe.py's ``StepEvent`` and the two ints it says, at every point of every step.

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
        self.drop_tied()
        self._let_go_of_reducer()

    @property
    def hook_handles(self) -> tuple[RemovableHandle, ...]:
        """The handles of the hooks ``replicate()`` installed on modules (the root's forward, lazy modules)."""
        return tuple(self._handles)

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
        nested.check_same_reduction(self.config, outer.config, class_name(self.module), class_name(outer.module))
        if self._group is not None and outer._group is not None and self.group is not outer.group:
            raise ValueError(
                f"replicate(): nested replicate() calls use different process groups ({class_name(self.module)} "
                f"and the enclosing {class_name(outer.module)}); pass the same group or mesh to both"
            )
        self._outer = weakref.ref(outer)
        self.lifecycle.now = TrainingState.NESTED
        self._let_go_of_reducer()
        if self.mixed is not None:
            self.mixed.remove()
        self.probe.watch.stop()
        self.probe.watch = Watch()

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

    # -- set-up and re-planning (setup.py decides, install assigns) ------------

    def init(self) -> None:
        """At ``replicate()``: plans, checks across ranks, broadcasts everything, builds the reducer."""
        self._group = setup.process_group(self._given_group)
        if self.config.device_id is not None:
            self.module.to(self.config.device_id)
        # planned as they materialise ([Note: lazy modules])
        self._handles += self.lazy.watch(self.module, self.mixed is not None, self._lazy_materialised)
        plan = self._plan_now()
        self.device = setup.collective_device(self.group, plan, self.config.device_id)
        token = setup.run_token(self.device)
        buffers = plan.buffer_values() if self.buffer_sync.at_set_up else []  # as DDP's _sync_module_states
        self.install(plan, [local(p).detach() for p in plan.candidates] + buffers + [token], token)

    def replan_if_changed(self) -> None:
        """Walks the module tree (the stamp moved, or a lazy module materialised); re-plans if the plan changed.

        A re-plan runs collectives that every rank must run at the same
        forward. If one rank's change is its own (a layer frozen on one rank
        only), the others are elsewhere: the watchdog's note says what changed
        here, so every rank's error names the parameters.
        """
        plan = self._plan_now()
        if plan.same_as(self.plan):
            return
        change = describe_change(self.plan, plan)
        step = 0 if self.reducer is None else self.reducer.num_steps
        self.probe.at(Place(TrainingState.FORWARD, step, collective=Collective.REPLAN), change)
        with self.probe.watch.diagnosing():
            self.install(plan, new_tensors(self.plan, plan, self.buffer_sync.at_set_up))
        self.probe.emit(StepEvent.REPLAN, step)  # back at the forward's place

    def _lazy_materialised(self, module: nn.Module) -> None:
        # A lazy module materialised in a forward with gradients: planned from now on.
        self.lazy.release(module)
        if not self.nested:  # else the enclosing replicated module re-plans
            self.replan_if_changed()

    def _plan_now(self) -> Plan:
        # What the tree replicates now; notes the stamp it was planned at.
        self.planned_stamp = self.stamp()
        inner = nested.replicated_inside(self.module)
        for module in inner:  # the outermost reduces ([Note: nested replicate])
            inner_state = find_state(module)
            assert inner_state is not None, "replicated_inside found it"
            inner_state.nest_into(self)
        return setup.plan_tree(self.module, self.config.ignored_modules, self.lazy.modules(), inner)

    def install(self, plan: Plan, to_broadcast: list[torch.Tensor], token: Optional[torch.Tensor] = None) -> None:
        """Makes ``plan`` the state's: checks it across ranks, broadcasts ``to_broadcast`` from rank 0, builds its
        reducer, handed what the previous one learned. At ``replicate()``, ``token`` (broadcast too) keys the
        watchdog. The one place where what setup.py decides is assigned."""
        group = self.group
        reduces = bool(plan.params) and (dist.get_world_size(group) > 1 or isinstance(self.reduction, HookReduction))
        setup.refuse_unreducible(plan, group, reduces)  # before anything changes: a refused plan leaves the old
        self.drop_tied()
        learned = self._let_go_of_reducer()
        if self.lifecycle.now in (TrainingState.BACKWARD, TrainingState.FINALIZING):
            self.lifecycle.now = TrainingState.IDLE  # a step the old reducer never ended (its backward raised)
        self.plan = plan
        if self.mixed is not None:
            self.mixed.install(self.module, plan)
        self.clock.param_ids = frozenset(id(p) for p in plan.params)
        watch = self.probe.watch
        self.device = setup.collective_device(group, plan, self.config.device_id)
        setup.agree(plan, group, self.device, self.config.wire_options, watch, to_broadcast)
        if token is not None:
            watch = self.probe.watch = setup.start_watch(group, self.config.stall_timeout_s, token)
            # released: a last note (the stall watchdog's); at interpreter exit its own hook says "exited"
            weakref.finalize(self, watch.leave, "released its replica").atexit = False
        self.clock.held.watch = watch
        if reduces:
            self.make_reducer(learned)
        self.tied = setup.tied_uses(self.module, self.reducer, self.lifecycle)
        buffers = plan.buffers if self.world_size > 1 else ()
        self.buffer_sync.install(buffers, self.weak_group, self.probe, self.clock.held)

    def _let_go_of_reducer(self) -> Optional[Learned]:
        # Detaches the reducer (its gradient hooks removed); returns what it learned, for its successor.
        reducer, self.reducer = self.reducer, None
        if reducer is None:
            return None
        reducer.remove_hooks()
        return reducer.learned

    def make_reducer(self, learned: Optional[Learned] = None) -> None:
        """Makes the module's reducer (the one place it is made) for the current plan and options
        (setup.py's ``build_reducer``), handed what a previous one ``learned``; at world size 1, where
        none is made unless a comm hook asks, a test may ask for one."""
        self.reducer = setup.build_reducer(
            self.module,
            self.plan,
            self.config,
            self.reduction,
            self.group,
            mixed=self.mixed is not None,
            lifecycle=self.lifecycle,
            sync=self.sync,
            clock=self.clock,
            probe=self.probe,
            learned=learned,
        )

    def stamp(self) -> tuple[int, ...]:
        """What moves when the plan may have changed ([Note: re-planning])."""
        return (registrations.count, self._num_noted_changes, *claimed_elsewhere())

    # -- the forward hooks ----------------------------------------------------

    @torch.compiler.disable  # eager under torch.compile, as FSDP2's hooks: collectives, Python state
    def _pre_forward(self, module: nn.Module, args: Any, kwargs: dict[str, Any]) -> Optional[tuple[Any, Any]]:
        # Before every forward of the root; returns moved or cast inputs, or None to keep them.
        # the DDP whose forward runs around this one; dynamo splits at our buckets ([Note: compiled backward ...])
        with self.probe.span("pre_forward"):  # a profiler's label, while one records
            held, ddp, traced = swap_active_ddp_module(self.bucket_cap)
            self.bucket_cap.outer = self.bucket_cap.outer if held is self.bucket_cap else held  # (re-entered)
            if ddp is not None and ddp_reduces_any(ddp, self.params):  # every rank runs DDP: every rank raises
                raise ddp_on_top_error(class_name(self.module), class_name(ddp.module), dist.get_rank())
            if self.nested:
                pass  # the enclosing replicated module does this work
            elif torch.is_grad_enabled():
                self._sync_before_forward(traced)
            else:
                self.buffer_sync.before(False)  # no collective: rank 0's buffers sent ahead, where due
            moved = None
            if self.input_device is not None:  # as DDP with device_ids: the inputs go to the module's device
                moved = args, kwargs = moved_to(self.input_device, (args, kwargs))
            if self.mixed is None or self.nested:
                return moved
            cast = self.mixed.cast_inputs_of((args, kwargs))
            return moved if cast is None else (cast[0], cast[1])

    def _sync_before_forward(self, traced: bool) -> None:
        # What every rank does together before a forward with gradients
        # enabled: the join round, the watchdog's mark, the re-plan check and
        # the buffer broadcast. Without gradients (or nested): nothing, no
        # collective, so one rank may evaluate alone ([Note: re-planning]).
        if isinstance(self.reduction, HookReduction) and traced:  # traced: compiled autograd is on
            raise compiled_hook_error()  # every rank, before any collective ([Note: compiled autograd])
        if traced is not self.bucket_cap.fusing:  # inductor's fusion, on a change (compile_split.py)
            self.bucket_cap.follow(traced)
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise graph_capture_error(class_name(self.module))  # before any collective, never half captured
        lifecycle = self.lifecycle
        if lifecycle.now is TrainingState.BACKWARD and self.reducer is not None:
            self.reducer.finalize_raised_backward()  # outside a backward: the last one raised before its end ran
        buffer_source = None  # rank 0, as its last forward left them; inside a Join: a rank still training, now
        if self.joining:  # inside a Join context ([Note: join] in join.py)
            buffer_source = self.join_hook.training_round().source
        self.num_forwards += 1
        self.probe.at(Place(TrainingState.FORWARD, 0 if self.reducer is None else self.reducer.num_steps))
        plan = self.plan
        if self.stamp() != self.planned_stamp or [p.requires_grad for p in plan.candidates] != plan.trainable:
            self.replan_if_changed()
        self.buffer_sync.before(True, buffer_source)  # [Note: buffer sync] in buffers.py
        now = lifecycle.now
        if now is TrainingState.IDLE or now is TrainingState.FORWARD:  # not a forward recomputed in a backward
            lifecycle.now = TrainingState.FORWARD
            if self.tied is not None:
                self.tied.begin(self.reducer, self.sync.on)

    @torch.compiler.disable
    def _leave_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        # After every forward of the root, one that raised too: DDP's attribute as it was ([Note: compiled ...]).
        swap_active_ddp_module(self.bucket_cap.outer)
        self.bucket_cap.outer = None
        if self.lifecycle.now is TrainingState.FORWARD:  # the forward raised: _post_forward never ran
            self._end_raised_forward(sys.exc_info()[1])

    def _end_raised_forward(self, error: Optional[BaseException]) -> None:
        # A forward that raised here, after the forward's own collectives ([Note: a backward that raised]
        # in reducer.py): the collectives the other ranks run after theirs run here too, so every rank's
        # sequence stays paired whether this rank's loop retries the batch or skips it: the buffers for
        # the next forward, then the backward's, with flags that say this rank raised (and what).
        self.lifecycle.now = TrainingState.IDLE
        grad_enabled = torch.is_grad_enabled()
        self.buffer_sync.after(grad_enabled, self.sync.on, self.joining)
        if grad_enabled and self.sync.on and self.reducer is not None:
            self.reducer.end_raised_forward(describe_error(error) if error is not None else "an exception")

    @torch.compiler.disable  # the outputs get real (eager) hooks
    def _post_forward(self, module: nn.Module, args: Any, output: Any) -> Any:
        # After every forward of the root; returns the (cast) output.
        with self.probe.span("post_forward"):  # a profiler's label, while one records
            lifecycle = self.lifecycle
            if lifecycle.now is TrainingState.FORWARD:
                lifecycle.now = TrainingState.IDLE
            elif lifecycle.now is TrainingState.NESTED:
                return output  # nested replicate: the enclosing module does this work
            self.buffer_sync.after(torch.is_grad_enabled(), self.sync.on, self.joining)  # [Note: buffer sync]
            if self.mixed is not None:
                output = self.mixed.cast_output(output)
            reducer = self.reducer
            if reducer is None or not torch.is_grad_enabled():
                return output
            for tensor in tensors_in(output):
                if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                    tensor.register_hook(_OutputGradHook(reducer))
            return output


class _OutputGradHook:
    # Queues the reducer's end-of-backward work (Reducer._finalize) from the outermost backward pass.
    #
    # [Note: end of backward]
    # The callback is queued from a hook on the forward outputs (the outermost backward pass reaches them
    # first), or, when no forward hook ran (a method other than ``forward``), from the first parameter hook
    # of the backward. If that first hook fires inside a nested pass (reentrant checkpointing around the
    # last layers, called through such a method), the callback runs when the nested pass ends, and the rest
    # of the backward queues another: the step is reduced in two rounds, each agreed, and the second adds
    # the mean of what the outer pass accumulated. Still exact, as long as every rank's graph has the same
    # nesting (tests/test_dynamic_graphs.py: other_method_checkpointed).
    __slots__ = ("reducer",)

    def __init__(self, reducer: Reducer) -> None:
        self.reducer = reducer

    def __call__(self, grad: torch.Tensor) -> torch.Tensor:
        if not torch.compiler.is_compiling():  # traced by compiled autograd: no callback ([Note: compiled autograd])
            self.reducer.queue_finalize()
        return grad  # not None: traced under compiled autograd, the return value is the gradient
