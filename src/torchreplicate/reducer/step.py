"""One synchronised backward: its state, and the collectives that complete it.

``StepState`` holds everything one synchronised backward knows, per
parameter and per bucket; the reducer replaces it at the end of each step
(its one reset).

``Reducer._finalize`` runs ``end_backward`` once the autograd engine is done
(torch_internals.queue_end_of_backward_callback): it launches every bucket the
hooks did not (the last with the flags), waits for all, reads the summed
flags, points ``.grad`` at the averages, then runs the reducer's rounds
(rounds.py: the late round if any rank had a late gradient, sparse
gradients, the tied parameters' rows). Besides the step and ``.grad`` it
drives the reducer's own parts: ``Reducer.launch``, the flags (written, then
summed in place), the tied rows' round (which resets what it kept and
records its size and time); the reducer then learns what the step
taught (firing counts, launch order, bucket cap) and steps torch's
optimizer-in-backward on the average (``step_in_backward_optimizers``).

[Note: end of backward]
The callback is queued from a hook on the forward outputs (the outermost
backward pass reaches them first), or, when no forward hook ran (a method
other than ``forward``), from the first parameter hook of the backward. If
that first hook fires inside a nested pass (reentrant checkpointing around
the last layers, called through such a method), the callback runs when the
nested pass ends, and the rest of the backward queues another: the step is
reduced in two rounds, each agreed, and the second adds the mean of what the
outer pass accumulated. Still exact, as long as every rank's graph has the
same nesting (tests/test_dynamic_graphs.py: other_method_checkpointed).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import torch

from torchreplicate.errors import desync_error, raise_with_place
from torchreplicate.reducer.bucket import Bucket, ParamSlot, layout_digest
from torchreplicate.reducer.collectives import all_reduce
from torchreplicate.reducer.dtensors import local
from torchreplicate.reducer.flags import FlagSums
from torchreplicate.reducer.rounds import StepEnd
from torchreplicate.torch_internals import remove_in_backward_optimizer_hooks

if TYPE_CHECKING:
    from torchreplicate.reducer.reducer import Reducer


class StepState:
    """Everything one synchronised backward knows, per parameter and of its launches; replaced at its end.

    Args:
        num_params: number of reduced parameters.
    """

    __slots__ = (
        "fired",
        "grew",
        "first_ready",
        "first_ready_ns",
        "absorbed",
        "held",
        "num_launched",
        "late",
    )

    def __init__(self, num_params: int) -> None:
        # - Per parameter
        self.fired = [0] * num_params  # accumulations into .grad seen
        self.grew = False  # some parameter fired more often than learned so far
        self.first_ready: list[int] = []  # slot indices in the order they first fired (the first step: tuning.py)
        self.first_ready_ns: list[int] = []  # and when (time.perf_counter_ns())
        # its slot holds its contribution as the reduction wants it (scaled on
        # the way in), so nothing is left to do before launch
        self.absorbed = [False] * num_params
        self.held: dict[int, torch.Tensor] = {}  # copy layout: .grad set aside while its bucket is in flight
        # - Launches
        self.num_launched = 0  # buckets launched so far; always a prefix of the launch order
        self.late = False  # a gradient arrived after its bucket was launched


def end_backward(reducer: Reducer, step: StepState) -> bool:
    """Completes the reduction of one synchronised backward (gradients off: the caller's ``no_grad``).

    Args:
        reducer: the module's reducer; its launches, flags and tied rows' round run here.
        step: the step's state.

    Returns:
        Whether a late round ran (some rank had a gradient after its bucket left).
    """
    num_early = step.num_launched  # launched from hooks, .grad detached
    sums = _reduce_rest(reducer, step)
    end = reducer.step_end(sums, reducer.layout.restore(reducer.buckets, step, sums, num_early))
    for round_ in reducer.rounds:  # the late round, sparse gradients, tied rows ([Note: the late round], rounds.py)
        round_.reduce(end)
    return sums.any_late


def _reduce_rest(reducer: Reducer, step: StepState) -> FlagSums:
    # Launches every bucket the hooks did not (the last with the flags),
    # waits for all, and returns what the summed flags say.
    probe, buckets = reducer.probe, reducer.buckets
    probe.ending(reducer.num_steps)
    unused_here = reducer.sparse.unused_here() if reducer.sparse.slots else []
    for bucket in buckets[step.num_launched :]:
        for slot in bucket.slots:
            if not reducer.layout.fill(slot, step, reducer.reduction):
                unused_here.append(slot.index)
        if bucket is buckets[-1]:
            reducer.flags.write(unused_here, step.late)
        reducer.launch(bucket, step)
        probe.launched(bucket.index, False)
    for bucket in buckets:
        probe.waiting(bucket.index, bucket.description, reducer.num_steps)
        with probe.span("wait", bucket.index):
            _wait(reducer, bucket, step)
        probe.done(bucket.index)
    probe.at("the flags' all-reduce", reducer.num_steps)
    reducer.reduction.reduce_flags()
    sums = reducer.flags.read(unused_here)
    if not (sums.clocks_agree and sums.layouts_agree):
        digest = layout_digest(buckets, reducer.sparse.slots)
        raise desync_error(reducer.group, reducer.flags.clock.steps, digest, reducer.num_steps, sums.clocks_agree)
    return sums


def _wait(reducer: Reducer, bucket: Bucket, step: StepState) -> None:
    try:
        reducer.reduction.wait(bucket, step)
    except (TypeError, ValueError) as error:
        raise_with_place(error, reducer.where(bucket))


class LateRound:
    """Gradients that arrived after their bucket left, reduced in one more pass over the buckets.

    [Note: the late round]
    A parameter's hook may fire again after its bucket left (the graph changed
    between steps: [Note: when is a parameter ready] in reducer.py). That
    gradient landed in a fresh, detached ``.grad`` (``GradLayout.restore`` hands
    it back), and the flags told every rank that some rank has one. So every
    rank runs one more round, whatever it holds itself: the same collectives,
    in bucket order, zeros where a rank has nothing late.
    """

    def reduce(self, end: StepEnd) -> None:
        """Adds the mean of every rank's late gradients to the reduced ``.grad``, if any rank had one."""
        if not end.sums.any_late:
            return
        probe = end.probe
        with probe.span("late_round"):
            probe.late_round(True, end.step)
            for bucket in end.buckets:
                extra = torch.zeros_like(bucket.grads)
                pieces = bucket.views_of(extra)
                for slot, piece in zip(bucket.slots, pieces, strict=True):
                    if slot.index in end.late_grads:
                        piece.copy_(end.late_grads[slot.index])
                all_reduce(extra, end.group, probe.watch)
                extra.div_(end.divide_factor)
                for slot, piece in zip(bucket.slots, pieces, strict=True):
                    # A late gradient anywhere means the parameter was used there, so
                    # every rank now holds a .grad for it; None means unused
                    # everywhere, and nothing late can have arrived for it.
                    grad = slot.param.grad
                    if grad is not None:
                        local(grad).add_(piece)
            probe.late_round(False, end.step)

    def shadow(self, end: StepEnd) -> None:
        """Zeros for every bucket, if some training rank had a late gradient."""
        if end.sums.any_late:
            for bucket in end.buckets:
                all_reduce(torch.zeros_like(bucket.grads), end.group, end.probe.watch)


def take_over_in_backward_optimizers(slots: Sequence[ParamSlot]) -> list[ParamSlot]:
    """The slots whose parameters torch's optimizer-in-backward steps, with its own hooks removed.

    Those hooks would step on the local gradient; the reducer steps the
    optimizers once the average is in ``.grad`` (``step_in_backward_optimizers``).
    """
    taken = [slot for slot in slots if slot.optimizers]
    for slot in taken:
        remove_in_backward_optimizer_hooks(slot.param)
    return taken


def step_in_backward_optimizers(slots: Sequence[ParamSlot]) -> None:
    """Steps torch's optimizer-in-backward on the average, as its own hooks would have on the local gradient."""
    for slot in slots:
        if slot.param.grad is not None:
            for optimizer in slot.optimizers:
                optimizer.step()
            slot.param.grad = None  # as torch's optimizer-in-backward leaves it
