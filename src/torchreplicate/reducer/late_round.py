"""The late round: gradients that arrived after their bucket was launched.

A parameter's hook may fire again after its bucket left (the graph changed
between steps: [Note: when is a parameter ready] in reducer.py). That
gradient landed in a fresh, detached ``.grad`` (``GradLayout.restore`` hands
it back), and the flags told every rank that some rank has one. So every
rank runs this round, whatever it holds itself: the same collectives, in
bucket order, zeros where a rank has nothing late.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from torchreplicate.reducer.bucket import Bucket
from torchreplicate.reducer.collectives import all_reduce
from torchreplicate.reducer.dtensors import local
from torchreplicate.reducer.grad_layout import LateGrads


def reduce_late(
    buckets: Sequence[Bucket],
    late_grads: LateGrads,
    group: dist.ProcessGroup,
    divide_factor: float,
    timeout: Optional[timedelta] = None,
) -> None:
    """Adds the mean of every rank's late gradients to the reduced ``.grad``.

    Args:
        buckets: the reducer's buckets, in launch order.
        late_grads: this rank's late gradients, by slot index.
        group: the process group.
        divide_factor: the divisor of the sum (the reduction's).
        timeout: per-operation timeout of each all-reduce; None: the group's.
    """
    for bucket in buckets:
        extra = torch.zeros_like(bucket.grads)
        pieces = bucket.views_of(extra)
        for slot, piece in zip(bucket.slots, pieces, strict=True):
            if slot.index in late_grads:
                piece.copy_(late_grads[slot.index])
        all_reduce(extra, group, timeout)
        extra.div_(divide_factor)
        for slot, piece in zip(bucket.slots, pieces, strict=True):
            # A late gradient anywhere means the parameter was used there, so
            # every rank now holds a .grad for it; None means unused
            # everywhere, and nothing late can have arrived for it.
            grad = slot.param.grad
            if grad is not None:
                local(grad).add_(piece)
