"""The gradient reducer: the owner of every synchronised step.

One ``Reducer`` per replicated module (rebuilt on a re-plan). It owns the
buckets (bucket.py), the step's state (``StepState``, replaced at the end of
each step), a post-accumulate-grad hook per parameter, the step counter, and
what it learns between steps (firing counts, launch order, bucket cap:
tuning.py). How a slot is filled and a bucket reduced is the ``Reduction``'s
job (reduction.py); where ``.grad`` lives is the ``GradLayout``'s
(bucket.py); the collectives at the end of backward are step.py's,
which reads the reducer and changes only the step and ``.grad``. Every
point of a step is reported to one ``Probe`` (probe.py).

[Note: one collective sequence]
Every rank must launch the same collectives in the same order, whatever its
own graph did. So buckets are launched strictly by index, each exactly once
per synchronised backward, and the last bucket is always launched from the
end-of-backward callback. A rank may launch bucket ``k`` early (from a
gradient hook, overlapping backward) or late (from the callback); only the
timing differs, never the sequence. Anything a rank knows alone travels as
flags (flags.py) after the last bucket's gradients: which parameters this
rank holds a gradient for, and whether a gradient arrived after its bucket
was launched. After the last bucket is reduced, every rank reads the same
sums and takes the same decisions: a parameter with no gradient on any rank
keeps ``grad=None``; any late gradient anywhere triggers one more agreed
round ([Note: the late round] in step.py).

[Note: when is a parameter ready]
A post-accumulate-grad hook fires once per accumulation into ``.grad``, which
can be several times in one backward (reentrant checkpointing runs nested
backward passes). The reducer counts firings per parameter and learns the
count each parameter reached in earlier synchronised steps
(``ParamSlot.expected``, a running maximum). A bucket is launched from a hook
only when every one of its parameters has reached its expected count; until
a parameter has been seen, its expected count is 0 and its bucket waits for
the end of backward. The first step thus reduces everything at the end; later
static steps overlap. If a parameter fires again after its bucket was
launched (the graph changed), the gradient must not race with the collective
that reads the bucket: at launch, each parameter's ``.grad`` is detached from
the bucket (``GradLayout.detach``), so a late accumulation lands in a fresh
tensor, which the late round reduces.
"""

from __future__ import annotations

import functools
import time
from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.compiler import is_compiling

from torchreplicate.errors import changed_since_plan, foreign_hook_error, raise_with_place, warn_create_graph
from torchreplicate.reducer import tuning
from torchreplicate.reducer.bucket import (
    Bucket,
    GradLayout,
    ParamSlot,
    ReducerView,
    layout_digest,
    make_slots,
)
from torchreplicate.reducer.collectives import WeakGroup, is_transport_error
from torchreplicate.reducer.dtensors import local
from torchreplicate.reducer.flags import FlagSums, StepFlags, TrainingClock, num_flags, real_view
from torchreplicate.reducer.late_uses import LateUses
from torchreplicate.reducer.probe import Probe, labelled
from torchreplicate.reducer.reduction import Reduction
from torchreplicate.reducer.rounds import Round, StepEnd
from torchreplicate.reducer.schedule import settle_tied
from torchreplicate.reducer.sparse import SparseGrads
from torchreplicate.reducer.step import (
    LateRound,
    StepState,
    end_backward,
    step_in_backward_optimizers,
    take_over_in_backward_optimizers,
)
from torchreplicate.reducer.switches import Learned, Lifecycle, SyncSwitch, TrainingState
from torchreplicate.reducer.tuning import LayoutPolicy, build_buckets, learn_layout, retune_cap
from torchreplicate.torch_internals import PROFILER, queue_end_of_backward_callback


class Reducer:
    """Averages gradients across ranks after every synchronised backward.

    Args:
        params: the parameters to reduce, in registration order.
        names: their fully qualified names, for error messages.
        group: the process group to reduce over.
        bucket_cap_bytes: bucket size cap; None: tuned in the first step ([Note: tuning] in tuning.py).
        first_bucket_cap_bytes: cap of the first bucket.
        layout: where ``.grad`` lives (bucket.py).
        reduction: how buckets are reduced (reduction.py); bound here.
        lifecycle: where the module is in its step; the reducer moves it through a synchronised backward.
        sync: the module's gradient-sync switch.
        clock: the module's training clock (sent with the flags).
        probe: the module's probe (probe.py): watchdog, observer, profiler labels.
        sparse: identities of the parameters with sparse gradients (sparse.py).
        tied: identities of the tied parameters to split ([Note: tied parameters] in late_uses.py).
        groups: per parameter, a group its buckets keep to (nested replicate; bucket_plan.py).
        learned: what the previous reducer of the module learned (a re-plan).
        fixed_layout: never reorder or resize the buckets ([Note: fixed layout] in tuning.py).

    Raises:
        ValueError: a parameter carries a post-accumulate-grad hook of its own.
    """

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        names: Sequence[str],
        group: dist.ProcessGroup,
        *,
        bucket_cap_bytes: Optional[int],
        first_bucket_cap_bytes: int,
        layout: GradLayout,
        reduction: Reduction,
        lifecycle: Lifecycle,
        sync: SyncSwitch,
        clock: TrainingClock,
        probe: Probe,
        sparse: frozenset[int] = frozenset(),
        tied: frozenset[int] = frozenset(),
        groups: Optional[Sequence[int]] = None,
        learned: Optional[Learned] = None,
        fixed_layout: bool = False,
    ) -> None:
        learned = learned or Learned({}, 0)
        # - Configuration, fixed for the reducer's life
        self.layout = layout
        self.lifecycle = lifecycle  # the module's one TrainingState: BACKWARD and ENDING are set here
        self.sync = sync
        self.probe = probe
        self.slots = make_slots(params, names, learned.expected)
        self.sparse = SparseGrads([slot for slot in self.slots if id(slot.param) in sparse])
        dense = [slot for slot in self.slots if id(slot.param) not in sparse]
        self.late_uses = LateUses([slot for slot in dense if id(slot.param) in tied])
        self.late_round = LateRound()  # the first of the rounds after the buckets (step.py)
        # how buckets are laid out, and what the first step still has to learn ([Note: tuning])
        self.layout_policy = LayoutPolicy(dense, groups, bucket_cap_bytes, first_bucket_cap_bytes, fixed_layout)
        self.buckets = build_buckets(self.layout_policy, num_flags(len(self.slots)), self.slots[0].param.device)
        self.in_backward_optimizer_slots = take_over_in_backward_optimizers(self.slots)
        # - Reduction: how buckets travel; the flags ride with the last bucket
        #   ([Note: one collective sequence]) or on their own (comm hooks)
        self.reduction = reduction
        self.flags = self._bind(reduction, clock, WeakGroup(group))  # the group is held weakly: collectives.py
        # - Across steps
        self.num_steps = learned.num_steps  # synchronised backwards completed
        self._view: Optional[ReducerView] = None  # what observers read; rebuilt after the buckets change
        # - The step in progress: replaced at the end of each synchronised backward
        self.step = StepState(len(self.slots))  # each bucket's own per-step state: Bucket.pending, .work
        self._register_hooks()
        layout.take_over_grads(self.slots)

    # -- derived facts -------------------------------------------------------

    @property
    def group(self) -> dist.ProcessGroup:
        """The process group of the collectives."""
        return self._weak_group.get()

    @property
    def _weak_group(self) -> WeakGroup:
        weak_group = self.reduction.weak_group
        assert weak_group is not None, "bound at __init__"
        return weak_group

    @property
    def learned(self) -> Learned:
        """What this reducer learned, for its successor after a re-plan."""
        return Learned({id(slot.param): slot.expected for slot in self.slots}, self.num_steps)

    @property
    def view(self) -> ReducerView:
        """What observers read (trace(), log_summary()): the same object until the buckets change."""
        if self._view is None:
            self._view = ReducerView.of(self.buckets, self.probe.watch)
        return self._view

    @property
    def rounds(self) -> tuple[Round, ...]:
        """The rounds after the buckets, in order (rounds.py): the late round, then the sparse
        gradients and the tied parameters' rows where this reducer has such parameters."""
        rounds: tuple[Round, ...] = (self.late_round,)
        if self.sparse.slots:
            rounds += (self.sparse,)
        if self.late_uses.slots:
            rounds += (self.late_uses,)
        return rounds

    def step_end(self, sums: FlagSums, late_grads: dict[int, torch.Tensor]) -> StepEnd:
        """What the rounds of this step read, once the buckets are back and the flags summed."""
        divide_factor = self.reduction.divide_factor
        return StepEnd(self.buckets, self.group, divide_factor, self.probe, self.num_steps, sums, late_grads)

    def where(self, bucket: Bucket) -> str:
        """Rank, step and parameters, for errors a user must trace to a layer."""
        rank = dist.get_rank(self.group)
        return f"replicate(): rank {rank}, step {self.num_steps}, bucket {bucket.index} ({bucket.description})"

    def wire_bytes(self, late: bool = False) -> int:
        """Bytes one synchronised backward hands to the reducer's collectives (per rank)."""
        wire = self.reduction.wire_bytes(self.buckets)
        if late:
            wire += sum(b.grads.numel() * b.grads.element_size() for b in self.buckets)
        return wire + self.late_uses.mask_bytes()  # and the rows some rank touched

    # -- set-up ----------------------------------------------------------------

    def _register_hooks(self) -> None:
        sparse = {id(slot.param) for slot in self.sparse.slots}
        for slot in self.slots:
            hook = self._on_sparse_grad if id(slot.param) in sparse else self._on_grad_accumulated
            slot.hook = slot.param.register_post_accumulate_grad_hook(functools.partial(hook, slot))

    def use_reduction(self, reduction: Reduction) -> None:
        """Switches to another reduction (a comm hook registered); before the first step, else RuntimeError."""
        if self.num_steps > 0:
            raise RuntimeError(
                f"register_comm_hook(): training already ran {self.num_steps} synchronised "
                "step(s); register the hook before the first backward"
            )
        weak_group = self._weak_group
        self.reduction = reduction
        self.late_uses = LateUses(())  # a comm hook sees each parameter's whole gradient in its bucket
        self.flags = self._bind(reduction, self.flags.clock, weak_group)

    def _bind(self, reduction: Reduction, clock: TrainingClock, group: WeakGroup) -> StepFlags:
        tail = reduction.bind(self.buckets, num_flags(len(self.slots)), group, self.probe.watch)
        return StepFlags(tail, len(self.slots), layout_digest(self.buckets, self.sparse.slots), clock)

    def remove_hooks(self) -> None:
        """Detaches the reducer from its parameters (before a re-plan)."""
        for slot in self.slots:
            if slot.hook is not None:
                slot.hook.remove()
                slot.hook = None

    # -- backward: the hot path --------------------------------------------

    def queue_finalize(self) -> None:
        """Starts a synchronised backward: queues its end on the autograd engine, once per backward."""
        lifecycle = self.lifecycle
        # IDLE, or FORWARD: a backward inside the root's forward (torch.autograd.grad there) is a step too
        if (lifecycle.now is TrainingState.IDLE or lifecycle.now is TrainingState.FORWARD) and self.sync.on:
            lifecycle.now = TrainingState.BACKWARD
            self.probe.backward(self.num_steps)
            queue_end_of_backward_callback(self._finalize)

    def _on_grad_accumulated(self, slot: ParamSlot, param: nn.Parameter) -> None:
        # Runs after every accumulation into param.grad: keep it short. The
        # unusual cases (a profiler recording, compiled autograd tracing this
        # hook) branch off after two cheap checks.
        if PROFILER._is_profiler_enabled or is_compiling():
            self._unusual_hook(slot, param)
            return
        self._accumulated(slot, param)

    def _accumulated(self, slot: ParamSlot, param: nn.Parameter) -> None:
        grad = param.grad
        if grad is None:
            return  # an undefined gradient (a Function returned None): nothing accumulated
        if len(param._post_accumulate_grad_hooks) != 1:  # ours and no other (torch_internals.num_post_...): 90 ns
            raise foreign_hook_error(slot)  # registered after replicate() (before: refused at set-up)
        if not self.sync.on:
            self.layout.keep_local(slot)
            return
        if grad.dtype is not slot.dtype:
            raise changed_since_plan(slot, grad)
        if grad.requires_grad:  # backward(create_graph=True): the average cannot keep the graph
            warn_create_graph()
            with torch.no_grad():
                self._take(slot)
            return
        self._take(slot)

    def _unusual_hook(self, slot: ParamSlot, param: nn.Parameter) -> None:
        if is_compiling():
            self._traced_reduce(param)  # traced by compiled autograd: [Note: compiled autograd] in reduction.py
            return
        bucket = getattr(slot, "bucket", None)  # a sparse slot has none
        with self.probe.span("hook", None if bucket is None else bucket.index):
            self._accumulated(slot, param)

    def _take(self, slot: ParamSlot) -> None:
        step = self.step
        if self.lifecycle.now is not TrainingState.BACKWARD:
            self.queue_finalize()
        fired = step.fired[slot.index] + 1
        step.fired[slot.index] = fired
        if fired > slot.expected:
            step.grew = True  # a count to learn at the end of the step
            if fired == 1 and not self.layout_policy.learned:
                step.first_ready.append(slot.index)  # the launch order to learn ([Note: tuning])
                step.first_ready_ns.append(time.perf_counter_ns())
        index = slot.bucket.index
        events = self.probe.events
        if events is not None:
            events.grad(index)
        if index < step.num_launched:
            step.late = True  # the fresh .grad is reduced by the late round
            return
        try:
            self.layout.take(slot, step, self.reduction)
        except RuntimeError as error:
            grad = slot.param.grad
            if grad is not None and (
                grad.is_sparse or grad.device != slot.bucket.buffer.device or local(grad).shape != slot.view.shape
            ):
                raise changed_since_plan(slot, grad) from error
            raise
        if fired == slot.expected:
            bucket = slot.bucket
            bucket.pending -= 1
            if bucket.pending == 0:
                self._launch_ready(step)

    def _traced_reduce(self, param: nn.Parameter) -> None:
        # Traced by compiled autograd: [Note: compiled autograd] in reduction.py.
        if not self.sync.on:
            return
        grad = param.grad
        if grad is None:
            return
        grad.copy_(self.reduction.traced(grad, self._weak_group.name))

    def _on_sparse_grad(self, slot: ParamSlot, param: nn.Parameter) -> None:
        # A sparse gradient stays in .grad until the end of backward (sparse.py).
        if self.sync.on and self.lifecycle.now is not TrainingState.BACKWARD:
            self.queue_finalize()

    def _launch_ready(self, step: StepState) -> None:
        # Launch, in index order, every ready bucket but the last ([Note: one
        # collective sequence]).
        last = len(self.buckets) - 1
        while step.num_launched < last and self.buckets[step.num_launched].pending == 0:
            bucket = self.buckets[step.num_launched]
            self.layout.detach(bucket, step, self.reduction)
            self.launch(bucket, step)
            self.probe.launched(bucket.index, True)

    def launch(self, bucket: Bucket, step: StepState) -> None:
        """Launches ``bucket``, the next in index order ([Note: one collective sequence])."""
        assert bucket.index == step.num_launched, "buckets launch in index order"
        with self.probe.span("launch", bucket.index):
            step.num_launched += 1
            self.reduction.finish_absorbing(bucket, step)
            try:
                self.reduction.launch(bucket, step)
            except (TypeError, ValueError) as error:
                raise_with_place(error, self.where(bucket))

    # -- end of backward ---------------------------------------------------

    @labelled("finalize")
    @torch.no_grad()
    def _finalize(self) -> None:
        # The autograd engine's end-of-backward callback ([Note: end of backward] in step.py).
        step = self.step
        self.lifecycle.now = TrainingState.ENDING
        end_ns = time.perf_counter_ns()
        try:
            late = end_backward(self, step)
            self._learn(step, end_ns)
            self.probe.step_end(self.num_steps - 1, self.wire_bytes(late=late))
            step_in_backward_optimizers(self.in_backward_optimizer_slots)  # every .grad is final now
        except RuntimeError as error:
            watch = self.probe.watch
            if watch is None or not is_transport_error(error):
                raise
            raise watch.diagnose(f"{watch.phase} of step {self.num_steps}", error) from error
        finally:
            self._new_step()
            self.lifecycle.now = TrainingState.IDLE

    def abandon_step(self) -> None:
        """Ends a synchronised backward that raised before its end ran: waits for what it launched, starts clean.

        Every rank raised alike (otherwise the others wait in their end of
        backward and the watchdog names this rank), so the launched buckets'
        collectives are matched; their results are dropped with the step.
        """
        step = self.step
        for bucket in self.buckets[: step.num_launched]:
            if bucket.work is not None:
                self.reduction.wait(bucket, step)
        self._new_step()
        self.lifecycle.now = TrainingState.IDLE

    @torch.no_grad()
    def shadow_step(self) -> None:
        """A joined rank's part of one synchronised backward: the same collectives, zeros ([Note: join])."""
        assert self.lifecycle.now is TrainingState.SHADOWING, "run from Join's main_hook only"
        flags = real_view(self.reduction.shadow(self.buckets, num_flags(len(self.slots))))
        end = self.step_end(FlagSums(frozenset(), flags[len(self.slots)].item() > 0), {})  # the others' late flag
        for round_ in self.rounds:
            round_.shadow(end)
        self.num_steps += 1  # the ranks still training count this step: the layout learning follows it
        self.learn_layout(())
        self._new_step()

    def _new_step(self) -> None:
        # The one reset at a step's end: its StepState and each bucket's count.
        self.step = StepState(len(self.slots))
        for bucket in self.buckets:
            bucket.pending = len(bucket.slots)

    def _learn(self, step: StepState, end_ns: int) -> None:
        # After a synchronised step: the firing counts ([Note: when is a
        # parameter ready], a running maximum), the step number, the layout.
        if step.grew:
            for slot, fired in zip(self.slots, step.fired, strict=True):
                slot.expected = max(slot.expected, fired)  # never a sparse slot's: its hook counts nothing
        self.num_steps += 1
        self.learn_layout(step.first_ready, step.first_ready_ns, end_ns)

    def learn_layout(self, first_ready: Sequence[int], ready_ns: Sequence[int] = (), end_ns: int = 0) -> None:
        """After a synchronised step (or its shadow, on a rank that joined), on every rank: the first
        learns launch order, cap and schedule from ``first_ready`` (slot indices) and ``ready_ns``
        (``time.perf_counter_ns()`` of each, until ``end_ns``); every ``RETUNE_EVERY``-th measures
        the link again; the buckets follow ([Note: tuning])."""
        policy, like = self.layout_policy, self.buckets[-1].buffer
        if not policy.learned:
            rebuild = learn_layout(policy, first_ready, self.group, like, ready_ns, end_ns, self.late_uses.round_ns)
            if settle_tied(policy, self.late_uses):  # the split dropped: the forward stops detaching
                self.late_uses, rebuild = LateUses(()), True
        else:
            due = policy.tune_cap and self.num_steps % tuning.RETUNE_EVERY == 0  # read here: tests shorten it
            rebuild = due and retune_cap(policy, self.group, like)
        if rebuild:
            self._rebuild_buckets()

    def _rebuild_buckets(self) -> None:
        # A new layout from the policy; .grad moves from the old buckets into the new.
        self.buckets = build_buckets(self.layout_policy, num_flags(len(self.slots)), self.slots[0].param.device)
        self.layout.take_over_grads(self.layout_policy.dense)
        self.flags = self._bind(self.reduction, self.flags.clock, self._weak_group)
        self._view = None
