"""The rounds after the buckets at the end of a synchronised backward: one interface.

Once every bucket is back and the flags are summed (step.py), a training
rank runs each of its reducer's rounds (``Reducer.rounds``) in this order:
the late round (step.py; always there, it runs only when the flags say some
rank had a late gradient), the sparse gradients (sparse.py) and the tied
parameters' rows (late_uses.py), the last two only where the reducer has
such parameters. A joined rank runs each round's ``shadow`` in the same order:
the same collectives with zeros ([Note: join] in core/join.py), so every
rank's collective sequence stays one ([Note: one collective sequence] in
reducer.py). Each round keeps its ``reduce`` and its ``shadow`` side by
side, so the two cannot drift apart.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol, Sequence

import torch
import torch.distributed as dist

from torchreplicate.reducer.bucket import Bucket
from torchreplicate.reducer.flags import FlagSums
from torchreplicate.reducer.probe import Probe


class StepEnd(NamedTuple):
    """What every round at the end of one synchronised backward reads, the same for each.

    Attributes:
        buckets: the reducer's buckets, in launch order.
        group: the process group.
        divide_factor: the divisor of the sum (the reduction's).
        probe: the module's probe: watchdog notes and profiler labels; its
            ``watch`` waits each collective.
        step: the step's number (the reducer's ``num_steps``).
        sums: what the summed flags say (a joined rank sent zeros, so it
            reads only whether some rank had a late gradient).
        late_grads: this rank's late gradients, by slot index (none on a joined rank).
    """

    buckets: Sequence[Bucket]
    group: dist.ProcessGroup
    divide_factor: float
    probe: Probe
    step: int
    sums: FlagSums
    late_grads: dict[int, torch.Tensor]


class Round(Protocol):
    """One agreed round after the buckets: every rank runs it, a training rank or a joined one."""

    def reduce(self, end: StepEnd) -> None:
        """A training rank's part: adds this round's averages to ``.grad``."""

    def shadow(self, end: StepEnd) -> None:
        """A joined rank's part: the same collectives, zeros; no ``.grad`` changes."""
