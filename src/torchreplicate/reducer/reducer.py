"""The gradient reducer: the owner of every synchronised step.

One ``Reducer`` per replicated module (rebuilt on a re-plan). It owns the
buckets (bucket.py: each bucket owns its part of the step in progress, and
where ``.grad`` lives), a post-accumulate-grad hook per parameter, the order
of a step (buckets launch strictly by index), what the step in progress
knows beyond its buckets (launches, late gradients, first-ready order), the
step counter, and what it learns between steps (firing counts, launch order,
bucket cap: layout/policy.py). One step reads top to bottom here: the hooks hand
each gradient to its bucket and launch the ready ones, the end-of-backward
callback launches the rest, waits, reads the flags and runs the rounds after
the buckets (rounds.py). How a bucket travels is the ``Reduction``'s
(reduction.py), bound to the buckets here. Every point of a step is reported
to one ``Probe`` (probe.py).

[Note: one collective sequence]
Every rank must launch the same collectives in the same order, whatever its
own graph did. So buckets are launched strictly by index, each exactly once
per synchronised backward. A rank may launch bucket ``k`` early (from a
gradient hook, overlapping backward) or late (from the end-of-backward
callback); only the timing differs, never the sequence. Anything a rank
knows alone travels as flags (flags.py), in a small all-reduce of their own
right after the last bucket's (the buckets carry DDP's bytes and nothing
else), or, where the layout is not DDP's, in the last bucket itself, which
then always leaves from the callback, once the flags are known: which parameters
this rank holds a gradient for, and whether a gradient arrived after its
bucket was launched. After the last bucket is reduced, every rank reads the same
sums and takes the same decisions: a parameter with no gradient on any rank
keeps ``grad=None``; any late gradient anywhere triggers one more agreed
round ([Note: the late round] in rounds.py). From a reducer's second step
on, at the default ``graph="learned"``, the sums are read at the end of the
next step instead, and no late round runs ([Note: flags read a step late]
in flags.py). The sequence is written once (``_collectives``): the end of
backward runs it with this rank's gradients, and a rank that joined or
whose step raised runs it with zeros (each bucket's reduction launched with
``zeros=True``), so the two can never drift apart.

[Note: a backward that raised]
Every rank must keep running the same collectives even where a step raised
on some ranks only. Four places a step can raise on one rank:

- In its backward (an exception in a hook or an autograd Function, out of
  memory): the engine drops its queued end-of-backward callback, so its
  step never ends: some buckets left, others hold part of this rank's
  gradients. The reducer holds the callback it queued only weakly, so the
  first gradient hook of the next backward (a retry on a retained graph)
  sees it gone; the next forward with gradients sees the module still in
  ``BACKWARD`` outside any backward. Either ends the failed step
  (``finalize_raised_backward``): it waits for the collectives the step
  launched, sets every replicated parameter's ``.grad`` to None, as
  ``zero_grad(set_to_none=True)`` would, with a warning (the partial sums
  are neither this rank's gradients nor their average), and runs the rest
  of the step's collective sequence as a joined rank does (``_shadow``:
  the one sequence, ``_collectives``, with zeros) for the buckets not
  launched, then flags that say "raised on this rank".
- In its forward, after the forward's own collectives (a bad sample, out of
  memory on the longest sequence), caught by the loop, which skips or
  retries the batch while the others go on to backward: the forward's
  always-called hook (``ReplicateState._end_raised_forward``) runs here
  what the others run after their forward: the buffers sent ahead for the
  next forward, then the backward's collectives, zeros, with flags that
  say so (``end_raised_forward``).
- In its end of backward, before its flags left: the same as a raised
  backward, from the first bucket not launched (``_end_failed_step``).
- In its end of backward, after its flags left (the rounds after the
  buckets, the rebuild of the buckets, an optimizer in backward): the rest
  of the step's collectives run as a joined rank's, a layout every rank
  agreed on but this one could not build is built at its next backward's
  start (``rebuild_pending``), and the next step's flags say it raised.

The raising rank leaves a note of what it raised with the stall watchdog
(``StallWatch.note_raised``). The flags' sums tell every rank how many
ranks raised, where the sums are read (at that step's end, or a step
late). Raised on every rank alike: training goes on, the step dropped (the
next step exact: tests/test_patterns.py, tests/test_raised_steps.py).
Raised on some ranks only: the others ended that step on an average that
misses those ranks' gradients, so every rank raises at the same read
(``StepRaisedError``), naming the ranks and what they raised, after one
more collective that brings every training clock to the highest (a rank
that skipped the batch skipped an optimizer step): the group stays usable,
and a job that goes back to a checkpoint trains on as if nothing had
raised. DDP refuses to go on on the raising rank ("Expected to have
finished reduction in the prior iteration"), and the others wait at their
next collective.
"""

from __future__ import annotations

import contextlib
import functools
import time
import weakref
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.compiler import is_compiling

from torchreplicate.errors import (
    AgreedError,
    describe_error,
    foreign_hook_error,
    graph_capture_error,
    raise_with_place,
    warn_backward_raised,
    warn_create_graph,
    warn_forward_raised,
    warn_late_unreduced,
)
from torchreplicate.faults.place import Collective, Place
from torchreplicate.faults.wire import WeakGroup
from torchreplicate.lifecycle import Learned, Lifecycle, SyncSwitch, TrainingState
from torchreplicate.reducer.bucket import (
    Bucket,
    ParamSlot,
    adopt_in_backward_optimizers,
    build_buckets,
    step_in_backward_optimizers,
)
from torchreplicate.reducer.flags import (
    FlagRoute,
    FlagSums,
    StagedSums,
    StepFlags,
    TrainingClock,
    layout_digest,
    num_flags,
)
from torchreplicate.reducer.layout import policy as layout_policy
from torchreplicate.reducer.layout.policy import LayoutPolicy, layout_specs, learn_layout, retune_cap, settle_tied
from torchreplicate.reducer.probe import Probe, ReducerInfo, StepEvent, labelled
from torchreplicate.reducer.reduction import BucketTensors, Reduction
from torchreplicate.reducer.rounds import LATE_ROUND, Round, RoundInputs
from torchreplicate.reducer.sparse import SparseGrads
from torchreplicate.reducer.tied_rows import TiedRows
from torchreplicate.torch_internals import (
    PROFILER,
    in_backward,
    num_post_accumulate_grad_hooks,
    queue_end_of_backward_callback,
)


class Reducer:
    """Averages gradients across ranks after every synchronised backward.

    Built at each plan by ``core/setup.py``'s ``build_reducer``, which decides
    every mode into the parts it hands over (the layout, the reduction, the
    rounds' parameters, the layout policy).

    Args:
        slots: one per parameter to reduce, in registration order (bucket.py's ``make_slots``).
        group: the process group to reduce over.
        policy: how the dense slots are laid out in buckets, and what is still to learn (layout/policy.py).
        sparse: the slots with sparse gradients, reduced outside the buckets (sparse.py).
        tied_rows: the tied parameters split by rows ([Note: tied parameters] in tied_rows.py).
        bucket_kind: where ``.grad`` lives (a bucket.py class: its ``bucket_kind``).
        reduction: how buckets are reduced (reduction.py); bound here.
        lifecycle: where the module is in its step; the reducer moves it through a synchronised backward.
        sync: the module's gradient-sync switch.
        clock: the module's training clock (sent with the flags).
        probe: the module's probe (probe.py): watchdog, observer, profiler labels.
        num_steps: synchronised backwards the module's earlier reducers completed (a re-plan).
        read_every_step: read the summed flags at the end of every step (``graph="dynamic"``);
            else from the second step on, a step late ([Note: flags read a step late] in flags.py).
    """

    def __init__(
        self,
        slots: Sequence[ParamSlot],
        group: dist.ProcessGroup,
        *,
        policy: LayoutPolicy,
        sparse: SparseGrads,
        tied_rows: TiedRows,
        bucket_kind: type[Bucket],
        reduction: Reduction,
        lifecycle: Lifecycle,
        sync: SyncSwitch,
        clock: TrainingClock,
        probe: Probe,
        num_steps: int = 0,
        read_every_step: bool = False,
    ) -> None:
        # - Configuration, fixed for the reducer's life
        self.slots = list(slots)
        self.bucket_kind = bucket_kind
        self.lifecycle = lifecycle  # the module's one TrainingState: BACKWARD and FINALIZING are set here
        self.sync = sync
        self.probe = probe
        self.sparse = sparse
        self.tied_rows = tied_rows
        # - Reduction: how buckets travel (the flags apart, or carried in the last bucket: flags.py)
        self.reduction = reduction
        # how buckets are laid out, and what the first step still has to learn ([Note: tuning])
        self.layout_policy = policy
        self.buckets = self._new_buckets()
        self.in_backward_optimizer_slots = adopt_in_backward_optimizers(self.slots)
        self._group = WeakGroup(group)  # held weakly: faults/wire.py
        self._clock = clock
        self._bind()  # the flags, the rounds, the wire bytes
        # - Across steps
        self.num_steps = num_steps  # synchronised backwards completed
        self.first_step = None if read_every_step else num_steps  # the one step read at once; None: every
        self.staged = StagedSums(self.flags.tail.device)  # the last step's sums, read at this one's end
        self._info: Optional[ReducerInfo] = None  # what observers read; rebuilt after the buckets change
        # - The step in progress, beyond each bucket's and slot's own (Bucket.reset); reset by _new_step
        self.num_launched = 0  # buckets launched so far; always a prefix of the index order
        self.late: list[str] = []  # the parameters whose gradient arrived after their bucket was launched
        self.first_ready: list[int] = []  # slot indices in the order they first fired (the first step: layout/)
        self.first_ready_ns: list[int] = []  # and when (time.perf_counter_ns())
        # the end-of-backward callback queued for this step, held weakly: None once
        # the engine dropped it, with a backward that raised ([Note: a backward that raised])
        self._end: Callable[[], Optional[object]] = _no_callback
        # how far this step's collectives got: where a failed end of backward goes on from
        # ([Note: a backward that raised]); reset by _new_step
        self.flags_sent = self.rounds_done = self.layout_agreed = False
        self.sums = FlagSums(frozenset(), False)  # what this step's flags said, once read
        # - Carried to the next step: a layout the last step agreed on but could not build here
        #   (its buckets built at the next backward's start), and an error raised after the flags left
        #   (sent in the next step's flags)
        self.rebuild_pending = False
        self.raised_earlier = False
        sparse_ids = {id(slot.param) for slot in self.sparse.slots}
        for slot in self.slots:
            hook = self._on_sparse_grad if id(slot.param) in sparse_ids else self._on_grad_accumulated
            slot.hook = slot.param.register_post_accumulate_grad_hook(functools.partial(hook, slot))
        for bucket in self.buckets:
            bucket.adopt_grads()

    # -- derived facts -------------------------------------------------------

    @property
    def group(self) -> dist.ProcessGroup:
        """The process group of the collectives."""
        return self._group.get()

    @property
    def learned(self) -> Learned:
        """What this reducer learned, for its successor after a re-plan."""
        return Learned({id(slot.param): slot.expected for slot in self.slots}, self.num_steps)

    @property
    def info(self) -> ReducerInfo:
        """What observers read (trace(), log_summary()): the same object until the buckets change."""
        if self._info is None:
            self._info = ReducerInfo.of(self.buckets, self.probe.watch)
        return self._info

    def _round_inputs(self, sums: FlagSums, late_grads: dict[int, torch.Tensor]) -> RoundInputs:
        """What the rounds of this step read, once the buckets are back and the flags summed."""
        divisor = self.reduction.divisor
        return RoundInputs(self.buckets, self.group, divisor, self.probe, self.num_steps, sums, late_grads)

    def where(self, bucket: Bucket) -> str:
        """Rank, step and parameters, for errors a user must trace to a layer."""
        rank = dist.get_rank(self.group)
        return f"replicate(): rank {rank}, step {self.num_steps}, bucket {bucket.index} ({bucket.description})"

    def wire_bytes(self, late: bool = False) -> int:
        """Bytes one synchronised backward hands to the reducer's collectives (per rank)."""
        return self._wire_bytes + (sum(b.grads.numel() * b.grads.element_size() for b in self.buckets) if late else 0)

    def set_divide_factor(self, divide_factor: Optional[float]) -> None:
        """The divisor of the sum from now on (a Join: the ranks still training); None: the default."""
        self.reduction.divisor.set(divide_factor)  # its scales, shared with the buckets, change in place

    # -- set-up ----------------------------------------------------------------

    def use_reduction(self, reduction: Reduction) -> None:
        """Switches to another reduction (a comm hook registered); before the first step, else RuntimeError."""
        if self.num_steps > 0:
            raise RuntimeError(
                f"register_comm_hook(): training already ran {self.num_steps} synchronised "
                "step(s); register the hook before the first backward"
            )
        self.reduction = reduction
        self.tied_rows = TiedRows((), self.sync)  # a comm hook sees each whole gradient in its bucket
        self._bind()

    def _bind(self) -> None:
        # After the buckets, the reduction or the tied parameters changed: binds
        # the reduction to the buckets; the flags, the rounds after the buckets
        # the plan fixed (rounds.py: sparse gradients, tied rows; an ordinary
        # plan has none), and the bytes one step sends.
        reduction, buckets = self.reduction, self.buckets
        tensors = [BucketTensors(b.buffer, b.numel, b.params, b.views, [s.name for s in b.slots]) for b in buckets]
        if tensors:
            reduction.bind(tensors, self._group, self.probe.watch)
        for bucket in buckets:
            bucket.bind(reduction, reduction.scale(bucket.index))
        device = buckets[-1].buffer.device if buckets else self.slots[0].param.device
        self.on_cuda = device.type == "cuda"  # a backward under CUDA-graph capture is refused (queue_finalize)
        digest, carrier = layout_digest(buckets, self.sparse.slots), reduction.flags_room() if tensors else None
        self.flags = StepFlags(device, len(self.slots), digest, self._clock, carrier, reduction.flags_after_waits)
        # buckets a gradient hook may launch: all but where the last carries the flags, or a comm hook's
        # futures are waited one at a time ([Note: hooks run one bucket at a time] in reduction.py)
        self._launchable = len(buckets) - (self.flags.route is not FlagRoute.AFTER_LAST)
        self.rounds: tuple[Round, ...] = tuple(r for r in (self.sparse, self.tied_rows) if r.slots)
        wire = reduction.wire_bytes() if tensors else 0
        self._wire_bytes = wire + self.flags.nbytes() + self.tied_rows.mask_bytes()

    def _new_buckets(self) -> list[Bucket]:
        # The buckets the policy lays out now (bucket.py builds them from the layout's specs), with room for
        # the flags in the last: where the layout is not DDP's, whose buckets carry DDP's bytes and nothing
        # else ([Note: the flags carried] in flags.py), and the reduction sums it as it is.
        policy = self.layout_policy
        room = num_flags(len(self.slots)) if not policy.ddp and self.reduction.carries_flags() else 0
        return build_buckets(self.bucket_kind, policy.dense, layout_specs(policy), room)

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
        if self.on_cuda and torch.cuda.is_current_stream_capturing():  # a backward-only capture: no collective yet
            raise graph_capture_error(f"module (parameter {self.slots[0].name!r}, ...)", "backward")
        self.finalize_raised_backward()  # if the last backward raised: [Note: a backward that raised]
        if lifecycle.now is not TrainingState.BACKWARD:
            self._build_agreed_layout()
        # IDLE, or FORWARD: a backward inside the root's forward (torch.autograd.grad there) is a step too
        if (lifecycle.now is TrainingState.IDLE or lifecycle.now is TrainingState.FORWARD) and self.sync.on:
            lifecycle.now = TrainingState.BACKWARD
            self.probe.emit(StepEvent.BACKWARD, self.num_steps)
            end = self._finalize  # one bound method: the engine holds it until the backward ends
            self._end = weakref.ref(end)
            queue_end_of_backward_callback(end)

    def _on_grad_accumulated(self, slot: ParamSlot, param: nn.Parameter) -> None:
        # Runs after every accumulation into param.grad, once per parameter per step: the host time
        # a step pays per tensor ([Note: batched buckets] in bucket.py), so it stays short. The unusual
        # cases (a profiler recording, compiled autograd tracing this hook, gradient sync off, a
        # gradient that changed dtype or keeps a graph) branch off to _accumulated after cheap checks.
        if PROFILER._is_profiler_enabled or is_compiling():
            self._unusual_hook(slot, param)
            return
        grad = param.grad
        # ours and no other hook: the one private torch name read outside torch_internals.py, inline on
        # this path (torch_internals.num_post_accumulate_grad_hooks, which _accumulated calls: 90 ns more)
        hooks = len(param._post_accumulate_grad_hooks)
        if grad is None or hooks != 1 or grad.dtype is not slot.dtype or grad.requires_grad or not self.sync.on:
            self._accumulated(slot, param)
            return
        self._synced_grad(slot)

    def _accumulated(self, slot: ParamSlot, param: nn.Parameter) -> None:
        grad = param.grad
        if grad is None:
            return  # an undefined gradient (a Function returned None): nothing accumulated
        if num_post_accumulate_grad_hooks(param) != 1:  # ours and no other
            raise foreign_hook_error(slot.name)  # registered after replicate() (before: refused at set-up)
        if not self.sync.on:
            slot.bucket.keep_local(slot)
            return
        if grad.dtype is not slot.dtype:
            raise slot.changed(grad)
        if grad.requires_grad:  # backward(create_graph=True): the average cannot keep the graph
            warn_create_graph()
            with torch.no_grad():
                self._synced_grad(slot)
            return
        self._synced_grad(slot)

    def _unusual_hook(self, slot: ParamSlot, param: nn.Parameter) -> None:
        if is_compiling():
            self._traced_reduce(param)  # traced by compiled autograd: [Note: compiled autograd] in reduction.py
            return
        bucket = getattr(slot, "bucket", None)  # a sparse slot has none
        with self.probe.span("hook", None if bucket is None else bucket.index):
            self._accumulated(slot, param)

    def _synced_grad(self, slot: ParamSlot) -> None:
        if self.lifecycle.now is not _BACKWARD or self._end() is None:
            self.queue_finalize()
        bucket = slot.bucket
        if self.probe.events is not None:
            self.probe.events(StepEvent.GRAD, bucket.index, 0)
        if bucket.take(slot):
            self._launch_ready()
        elif bucket.launched:
            self.late.append(slot.name)  # the fresh .grad is reduced by the late round, if any
        if not self.layout_policy.learned and slot.fired == 1:
            self.first_ready.append(slot.index)  # the launch order to learn ([Note: tuning])
            self.first_ready_ns.append(time.perf_counter_ns())

    def _traced_reduce(self, param: nn.Parameter) -> None:
        # Traced by compiled autograd: [Note: compiled autograd] in reduction.py.
        grad = param.grad
        if not self.sync.on or grad is None:
            return
        grad.copy_(self.reduction.traced(grad, self._group.name))

    def _on_sparse_grad(self, slot: ParamSlot, param: nn.Parameter) -> None:
        # A sparse gradient stays in .grad until the end of backward (sparse.py).
        if self.sync.on and (self.lifecycle.now is not TrainingState.BACKWARD or self._end() is None):
            self.queue_finalize()

    def _launch_ready(self) -> None:
        # Launch, in index order, every ready bucket, but the last where it carries the flags ([Note: one
        # collective sequence]): as DDP's, the last leaves from its last gradient's hook, not the callback.
        launchable = self._launchable
        while self.num_launched < launchable and self.buckets[self.num_launched].pending == 0:
            self._launch(self.buckets[self.num_launched], True)

    def _launch(self, bucket: Bucket, from_hook: bool) -> None:
        # Launches `bucket`, the next in index order ([Note: one collective sequence]).
        assert bucket.index == self.num_launched, "buckets launch in index order"
        with self.probe.launching(bucket.index, from_hook):
            self.num_launched += 1
            try:
                bucket.launch(from_hook)
            except (TypeError, ValueError) as error:
                raise_with_place(error, self.where(bucket))

    # -- end of backward ---------------------------------------------------

    @labelled("finalize")
    @torch.no_grad()
    def _finalize(self) -> None:
        # The autograd engine's end-of-backward callback ([Note: end of backward]
        # in core/state.py): the rest of the step's collectives (_collectives),
        # then .grad at the averages, the rounds after the buckets (the late
        # round if any rank had a late gradient, then the plan's: rounds.py),
        # learning.
        self.lifecycle.now = TrainingState.FINALIZING
        end_ns = time.perf_counter_ns()
        try:
            with self.probe.watch.diagnosing():
                sums = self.sums = self._collectives(self.num_launched)
                late_grads: dict[int, torch.Tensor] = {}
                for bucket in self.buckets:
                    late_grads.update(bucket.restore(sums.unused_everywhere, sums.any_late))
                self._rounds(sums, late_grads)
                self.rounds_done = True
                self._learn(self.first_ready, self.first_ready_ns, end_ns)
                self.probe.emit(StepEvent.STEP_END, self.num_steps - 1, self.wire_bytes(late=sums.any_late))
                if self.in_backward_optimizer_slots:
                    step_in_backward_optimizers(self.in_backward_optimizer_slots)  # every .grad is final now
        except Exception as error:
            self._end_failed_step(error)
            raise
        finally:
            self._new_step()
            self.lifecycle.now = TrainingState.IDLE

    def _rounds(self, sums: FlagSums, late_grads: Optional[dict[int, torch.Tensor]] = None) -> None:
        # The rounds after the buckets: the late round where some rank had a late gradient, then the plan's
        # (rounds.py); ``late_grads`` None: a rank that joined or raised, whose part is zeros (``shadow``).
        rounds = (LATE_ROUND, *self.rounds) if sums.any_late else self.rounds
        if rounds:
            inputs = self._round_inputs(sums, late_grads or {})
            for round_ in rounds:
                round_.reduce(inputs) if late_grads is not None else round_.shadow(inputs)

    def _abandon(self) -> None:
        # A backward that raised on this rank: every bucket waits for what it launched, .grad goes to None.
        for bucket in self.buckets:
            bucket.abandon()
        self.sparse.abandon()

    def _end_failed_step(self, error: Exception) -> None:
        # The end of backward raised here ([Note: a backward that raised]): where every rank raised alike
        # (the flags' read) or a collective failed (the group is gone), nothing more; else this rank runs
        # what is left of the step's collectives, as a joined rank does, and says it raised: in this
        # step's flags if they had not left, else in the next step's.
        watch = self.probe.watch
        if isinstance(error, AgreedError) or watch.failed:
            return
        step, what = self.num_steps - self.layout_agreed, describe_error(error)  # _learn counted the step
        watch.note_raised(step, what)
        if not self.flags_sent:
            first = self.num_launched
            self._abandon()
            with contextlib.suppress(AgreedError):  # this rank raises its own error; the others, the agreed one
                self._shadow(first, raised=True)
            return
        self.raised_earlier = True
        if not self.rounds_done:
            self._rounds(self.sums)
        if not self.layout_agreed:
            self._learn()

    def end_raised_forward(self, what: str) -> None:
        """A synchronised forward raised on this rank ([Note: a backward that raised]): the backward the
        other ranks run, as a joined rank's (zeros), with flags that say this rank raised ``what``."""
        warn_forward_raised(self.num_steps)
        self.probe.watch.note_raised(self.num_steps, what)
        self._build_agreed_layout()
        with contextlib.suppress(AgreedError):  # raised here too at an immediate read: this rank has its own
            self._shadow(0, raised=True)

    def finalize_raised_backward(self) -> None:
        """Ends the last synchronised backward if it raised before its end ran ([Note: a backward that raised]).

        Its end is gone when the engine let go of the callback queued for it,
        or when the module is still in ``BACKWARD`` with no backward running.
        Then: waits for the collectives it launched, sets every replicated
        parameter's ``.grad`` to None (with a warning), and runs the rest of
        the step's collective sequence with zeros and flags that say it raised.
        """
        if self.lifecycle.now is not TrainingState.BACKWARD or (self._end() is not None and in_backward()):
            return
        first = self.num_launched
        self._abandon()
        self.lifecycle.now = TrainingState.IDLE
        warn_backward_raised(self.num_steps)
        self._shadow(first, raised=True)

    @torch.no_grad()
    def shadow_step(self) -> None:
        """A joined rank's part of one synchronised backward: the same collectives, zeros ([Note: join])."""
        assert self.lifecycle.now is TrainingState.SHADOWING, "run from Join's main_hook only"
        self._build_agreed_layout()
        self._shadow(0)

    @torch.no_grad()
    def _shadow(self, first: int, raised: bool = False) -> None:
        # A step this rank does not take: a joined rank's (first 0), or one that raised here (the collectives
        # from the first bucket not launched, or all of them after a forward that raised). The same
        # collective sequence as the ranks that train, zeros, with flags that say whether this rank raised
        # (an immediate read raises where a step raised on some ranks only); the rounds after the buckets;
        # learning, as the ranks still training count this step.
        self._new_step()
        try:
            sums = self._collectives(first, zeros=True, raised=raised)
            if sums.raised < dist.get_world_size(self.group):  # on every rank: no rank took it, nothing learned
                self._rounds(sums)
                self._learn()
        finally:
            self._new_step()

    def _build_agreed_layout(self) -> None:
        # The layout every rank agreed on at the last step's end, where it could not be built then.
        if self.rebuild_pending:
            self._rebuild_buckets()

    def _collectives(self, first: int, zeros: bool = False, raised: bool = False) -> FlagSums:
        # [Note: one collective sequence] The step's collectives from bucket `first` on, in the order every
        # rank runs them, whether it trains (this rank's gradients) or not (``zeros``: a rank that joined, or
        # raised, ``raised``): the buckets not launched yet, the flags (in the last bucket's room where it
        # carries them, else right after the last bucket, or after every wait with a comm hook), the waits;
        # then the sums, read now or staged for the next step's end ([Note: flags read a step late]).
        probe, buckets, flags, num_steps = self.probe, self.buckets, self.flags, self.num_steps
        group = self._group() or self._group.get()  # the weak reference's call; get() raises
        unused_here = self.sparse.unused_here() if self.sparse.slots and not zeros else []
        route = flags.route
        work: Optional[dist.Work] = None
        if not zeros:
            probe.emit(StepEvent.FINALIZE, num_steps)

        def send() -> Optional[dist.Work]:
            if zeros:
                return flags.send((), False, group, raised=True) if raised else flags.send_zeros(group)
            self.flags_sent, earlier, self.raised_earlier = True, self.raised_earlier, False
            return flags.send(unused_here, bool(self.late), group, raised_earlier=earlier)

        shadows = []  # a rank that does not train: its zero buckets, each (bucket, the reduction's handle)
        for bucket in buckets[first:]:
            if not zeros:
                unused_here += bucket.fill()
            if route is FlagRoute.CARRIED and bucket is buckets[-1]:
                work = send()  # into the last bucket's room
            if zeros:
                shadows.append((bucket, self.reduction.launch(bucket.index, zeros=True)))
            else:
                self._launch(bucket, False)
        if route is FlagRoute.AFTER_LAST:
            work = send()  # right after the last bucket's
        reduced: Optional[torch.Tensor] = None
        for bucket, handle in shadows:
            reduced = self.reduction.wait(bucket.index, handle)
        for bucket in buckets if not zeros else ():
            with probe.waiting(bucket.index, bucket.description, num_steps):
                try:
                    bucket.wait()
                except (TypeError, ValueError) as error:
                    raise_with_place(error, self.where(bucket))
        if route is FlagRoute.AFTER_WAITS:
            work = send()
        elif route is FlagRoute.CARRIED and buckets:
            flags.landed(None if reduced is None else reduced[buckets[-1].numel :])
        probe.at(Place(TrainingState.FINALIZING, num_steps, collective=Collective.FLAGS))  # this step's, or the last's
        if self.reads_now:
            flags.wait(work, probe.watch)
            return flags.read(unused_here, self._group.get, num_steps, probe.watch)
        if self.late:
            warn_late_unreduced(num_steps, self.late)
        late = () if zeros else self.late
        return flags.stage(self.staged, work, probe.watch, num_steps, unused_here, late, self._group.get)

    @property
    def reads_now(self) -> bool:
        """Whether this step reads the summed flags at its end, else a step late ([Note: flags read a step late])."""
        return self.first_step is None or self.num_steps == self.first_step

    def _new_step(self) -> None:
        # The one reset at a step's end: the reducer's part and each bucket's.
        self.flags_sent = self.rounds_done = self.layout_agreed = False
        self.num_launched = 0
        self.late = []
        self.first_ready, self.first_ready_ns = [], []
        for bucket in self.buckets:
            bucket.reset()

    def _learn(self, first_ready: Sequence[int] = (), ready_ns: Sequence[int] = (), end_ns: int = 0) -> None:
        # After a synchronised step (or its shadow, on a rank that joined), on
        # every rank: the step number (each bucket's reset learns the firing
        # counts: [Note: when is a parameter ready]), then the layout ([Note: tuning]):
        # the first step learns launch order, cap and schedule from first_ready
        # (slot indices) and ready_ns (time.perf_counter_ns() of each, until
        # end_ns); every RETUNE_EVERY-th measures the link again; the buckets follow.
        self.num_steps += 1
        policy = self.layout_policy
        like = self.buckets[-1].buffer if self.buckets else self.flags.tail
        if not policy.learned and policy.steps_before_learning > 0:
            policy.steps_before_learning -= 1  # static_graph: DDP learns from its second iteration
            rebuild = False
        elif not policy.learned:
            self.probe.at(Place(TrainingState.FINALIZING, self.num_steps - 1, collective=Collective.LAYOUT))
            watch, rows_ns = self.probe.watch, self.tied_rows.round_ns
            rebuild = learn_layout(policy, first_ready, self.group, like, watch, ready_ns, end_ns, rows_ns)
            if settle_tied(policy, self.tied_rows):  # the split dropped: the forward stops detaching
                self.tied_rows, rebuild = TiedRows((), self.sync), True
        else:
            due = policy.tune_cap and self.num_steps % layout_policy.RETUNE_EVERY == 0  # read here: tests shorten it
            rebuild = due and retune_cap(policy, self.group, like, self.probe.watch)
        self.layout_agreed = True  # every collective of the step is behind it
        if rebuild:
            self.rebuild_pending = True  # until built: a failure here leaves it for the next backward's start
            self._rebuild_buckets()

    def _rebuild_buckets(self) -> None:
        # A new layout from the policy; .grad moves from the old buckets into the new, on the current
        # stream, which the old buffers are kept for (Bucket.retire).
        old, buckets = self.buckets, self._new_buckets()
        self.buckets = buckets
        for bucket in buckets:
            bucket.adopt_grads()
        for bucket in old:
            bucket.retire()
        self._bind()
        self._info = None
        self.rebuild_pending = False


_BACKWARD = TrainingState.BACKWARD  # read at every gradient hook


def _no_callback() -> None:
    # What Reducer._end holds before its first backward: no callback queued.
    return None
