"""The end of a synchronised backward: the engine's callback completes the step.

``Reducer._finalize`` runs ``finish_step`` once the autograd engine is done
(torch_internals.queue_end_of_backward_callback): it launches every bucket the
hooks did not (the last with the flags), waits for all, reads the summed
flags, points ``.grad`` at the averages, runs the late round if any rank had
a late gradient, reduces sparse gradients, learns what this step taught
(firing counts, launch order, bucket cap) and steps torch's
optimizer-in-backward on the average.

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

from torchreplicate.errors import desync_error, raise_with_place
from torchreplicate.reducer.bucket import Bucket, ParamSlot, StepState, layout_digest
from torchreplicate.reducer.flags import FlagSums
from torchreplicate.reducer.grad_layout import LateGrads
from torchreplicate.reducer.late_round import reduce_late
from torchreplicate.reducer.profiling import labelled

if TYPE_CHECKING:
    from torchreplicate.reducer.reducer import Reducer


def finish_step(reducer: Reducer, step: StepState) -> None:
    """Completes one synchronised backward (gradients enabled off: the caller's ``no_grad``).

    Args:
        reducer: the module's reducer.
        step: the step's state (the reducer replaces it afterwards).
    """
    num_early = step.num_launched  # launched from hooks, .grad detached
    sums = _reduce_rest(reducer, step)
    late_grads = reducer.layout.restore(reducer.buckets, step, sums, num_early)
    if sums.any_late:
        _late_round(reducer, late_grads)
    watch, events = reducer.watch, reducer.events
    if watch is not None and reducer.sparse.slots:
        watch.at("sparse gradients", reducer.num_steps)
    reducer.sparse.reduce(reducer.group, reducer.reduction.divide_factor, sums.unused_everywhere, reducer.timeout)
    _learn_counts(reducer, step)
    reducer.num_steps += 1
    reducer.learn_layout(step.first_ready)
    if watch is not None:
        watch.at("user code after the backward", reducer.num_steps)
    if events is not None:
        events.step_end(reducer.num_steps - 1, reducer.wire_bytes(late=sums.any_late))
    _step_in_backward_optimizers(reducer.in_backward)  # every .grad is final now


def _reduce_rest(reducer: Reducer, step: StepState) -> FlagSums:
    # Launches every bucket the hooks did not (the last with the flags),
    # waits for all, and returns what the summed flags say.
    events, watch, buckets = reducer.events, reducer.watch, reducer.buckets
    if events is not None:
        events.finalize(reducer.num_steps)
    unused_here = reducer.sparse.unused_here()
    for bucket in buckets[step.num_launched :]:
        for slot in bucket.slots:
            if not reducer.layout.fill(slot, step, reducer.reduction):
                unused_here.append(slot.index)
        if bucket is buckets[-1]:
            reducer.flags.write(unused_here, step.late)
        reducer.launch(bucket, step)
        if events is not None:
            events.launch(bucket.index, False)
    for bucket in buckets:
        if watch is not None:
            watch.at(f"bucket {bucket.index} ({bucket.describe()})", reducer.num_steps)
        if events is not None:
            events.waiting(bucket.index)
        _wait(reducer, bucket)
        if events is not None:
            events.done(bucket.index)
    if watch is not None:
        watch.at("the flags' all-reduce", reducer.num_steps)
    reducer.reduction.reduce_flags()
    sums = reducer.flags.read(unused_here)
    if not (sums.clocks_agree and sums.layouts_agree):
        digest = layout_digest(buckets, reducer.sparse.slots)
        raise desync_error(reducer.group, reducer.flags.clock.steps, digest, reducer.num_steps, sums.clocks_agree)
    return sums


@labelled("wait")
def _wait(reducer: Reducer, bucket: Bucket) -> None:
    try:
        reducer.reduction.wait(bucket)
    except (TypeError, ValueError) as error:
        raise_with_place(error, reducer.where(bucket))


@labelled("late_round")
def _late_round(reducer: Reducer, late_grads: LateGrads) -> None:
    if reducer.watch is not None:
        reducer.watch.at("late round", reducer.num_steps)
    if reducer.events is not None:
        reducer.events.late_round(True)
    reduce_late(reducer.buckets, late_grads, reducer.group, reducer.reduction.divide_factor, reducer.timeout)
    if reducer.events is not None:
        reducer.events.late_round(False)


def _learn_counts(reducer: Reducer, step: StepState) -> None:
    # [Note: when is a parameter ready] in reducer.py: the running maximum.
    if not step.grew:
        return
    changed = set()
    for slot, fired in zip(reducer.slots, step.fired, strict=True):
        if fired > slot.expected:  # never a sparse slot: its hook counts nothing
            slot.expected = fired
            changed.add(slot.bucket.index)
    for index in changed:
        reducer.buckets[index].relearn()


def _step_in_backward_optimizers(slots: Sequence[ParamSlot]) -> None:
    # torch's optimizer-in-backward, stepped on the average (its own hooks were removed).
    for slot in slots:
        if slot.param.grad is not None:
            for optimizer in slot.optimizers:
                optimizer.step()
            slot.param.grad = None  # as torch's optimizer-in-backward leaves it
