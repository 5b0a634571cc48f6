"""The rounds after the buckets at the end of a synchronised backward: one interface.

Once every bucket is back and the flags are summed (``Reducer._finalize``),
a training rank runs each of its reducer's rounds in this order: the late
round (``LateRound``, here), only when the flags say some rank had a late
gradient; then the rounds its plan fixed (``Reducer.rounds``): the sparse
gradients (sparse.py) and the tied parameters' rows (tied_rows.py), each
only where the reducer has such parameters. An ordinary step runs none.
A joined rank runs each round's ``shadow`` in the same order:
the same collectives with zeros ([Note: join] in core/join.py), so every
rank's collective sequence stays one ([Note: one collective sequence] in
reducer.py). Each round keeps its ``reduce`` and its ``shadow`` side by
side, so the two cannot drift apart.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol, Sequence

import torch
import torch.distributed as dist

from torchreplicate.faults.place import Collective, Place
from torchreplicate.faults.wire import all_reduce
from torchreplicate.lifecycle import TrainingState
from torchreplicate.reducer.bucket import Bucket
from torchreplicate.reducer.flags import FlagSums
from torchreplicate.reducer.probe import Probe, StepEvent
from torchreplicate.reducer.reduction import Divisor


class RoundInputs(NamedTuple):
    """What every round at the end of one synchronised backward reads, the same for each.

    Attributes:
        buckets: the reducer's buckets, in launch order.
        group: the process group.
        divisor: the divisor of the sums (the reduction's).
        probe: the module's probe: watchdog notes and profiler labels; its
            ``watch`` waits each collective.
        step: the step's number (the reducer's ``num_steps``).
        sums: what the summed flags say (a joined rank sent zeros, so it
            reads only whether some rank had a late gradient).
        late_grads: this rank's late gradients, by slot index (none on a joined rank).
    """

    buckets: Sequence[Bucket]
    group: dist.ProcessGroup
    divisor: Divisor
    probe: Probe
    step: int
    sums: FlagSums
    late_grads: dict[int, torch.Tensor]


class Round(Protocol):
    """One agreed round after the buckets: every rank runs it, a training rank or a joined one."""

    def reduce(self, end: RoundInputs) -> None:
        """A training rank's part: adds this round's averages to ``.grad``."""

    def shadow(self, end: RoundInputs) -> None:
        """A joined rank's part: the same collectives, zeros; no ``.grad`` changes."""


class LateRound:
    """Gradients that arrived after their bucket left, reduced in one more pass over the buckets.

    [Note: the late round]
    A parameter's hook may fire again after its bucket left (the graph changed
    between steps: [Note: when is a parameter ready] in bucket.py). That
    gradient landed in a fresh, detached ``.grad`` (``Bucket.restore`` hands
    it back), and the flags told every rank that some rank has one. So every
    rank runs one more round, whatever it holds itself: the same collectives,
    in bucket order, zeros where a rank has nothing late.
    """

    def reduce(self, end: RoundInputs) -> None:
        """Adds the mean of every rank's late gradients to the reduced ``.grad``."""
        with end.probe.span("late_round"):
            end.probe.at(Place(TrainingState.FINALIZING, end.step, collective=Collective.LATE_ROUND))
            end.probe.emit(StepEvent.LATE_ROUND, 1)
            for bucket in end.buckets:
                end.probe.watch.wait(all_reduce(extra := bucket.late_sum(end.late_grads), end.group))
                bucket.add_to_grads(end.divisor.divide(extra))
            end.probe.emit(StepEvent.LATE_ROUND, 0)

    def shadow(self, end: RoundInputs) -> None:
        """Zeros for every bucket."""
        for bucket in end.buckets:
            end.probe.watch.wait(all_reduce(torch.zeros_like(bucket.grads), end.group))


LATE_ROUND = LateRound()  # it keeps nothing between steps: one for every reducer
