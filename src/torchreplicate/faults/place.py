"""Where a rank is in its step (``Place``), as the stall watchdog's notes say and compare.

A ``Place`` is a ``TrainingState`` (lifecycle.py), the step, and the bucket
or other collective of ours the rank waits in (``Collective``). The reducer
marks places (its probe); the watchdog and the roll call read them.
"""

from __future__ import annotations

import enum
from typing import Any, NamedTuple, Optional, Sequence

from torchreplicate.lifecycle import TrainingState


class Collective(enum.Enum):
    """One of our collectives, named where a ``TrainingState`` and a bucket index cannot tell it apart.

    A ``Place``'s third coordinate ([Note: stall watchdog] in watchdog.py):
    a rank waiting there is inside our collectives, and two ranks in different
    ones wait for each other in vain. The re-plan runs before (or, for a lazy
    module, inside) a forward; the others inside ``FINALIZING``, after the
    buckets' waits. The buckets themselves are named by index, not here.
    Each value is the words the watchdog's messages use (``Place.describe``);
    a note in the store carries the name.
    """

    REPLAN = "a re-plan"  # the plan check and broadcasts of a re-plan (core/state.py's replan_if_changed)
    FLAGS = "the flags' all-reduce"  # their sums read at the step's end, this step's or the last's (flags.py)
    LAYOUT = "the layout's agreement"  # the first step's launch order, the tuned link's timings (layout/policy.py)
    LATE_ROUND = "late round"  # the late round's pass over the buckets (rounds.py)
    SPARSE = "sparse gradients"  # the sparse gradients' all-reduces (sparse.py)
    TIED_ROWS = "the tied parameters' rows"  # tied_rows.py


# outside our collectives when no collective is named (a bucket's wait is FINALIZING's)
_OUTSIDE = frozenset({TrainingState.IDLE, TrainingState.FORWARD, TrainingState.BACKWARD})


class Place(NamedTuple):
    """Where a rank is in its step, as its stall watchdog's note says ([Note: stall watchdog] in watchdog.py).

    Two ranks are at the same place when their places are equal: every
    decision of the watchdog compares these fields, never text. The probe
    marks a place at each point of the step (``Probe.at``), so between two
    points the place is the last one marked: ``FORWARD`` from the forward
    pre-hook until the backward starts, ``IDLE`` after the end of backward
    (user code), or before the first forward (the set-up, at step 0).

    Attributes:
        state: the ``TrainingState`` the rank is in or entering: ``IDLE``,
            ``FORWARD``, ``BACKWARD`` or ``FINALIZING``.
        step: synchronised backwards completed (the step this place belongs to).
        bucket: the bucket whose collective the rank waits for (``FINALIZING``), or None.
        collective: another of our collectives the rank runs, or None.
    """

    state: TrainingState
    step: int
    bucket: Optional[int] = None
    collective: Optional[Collective] = None

    @property
    def outside(self) -> bool:
        """Whether the rank is outside our collectives: the set-up, a forward, a backward's computation, user code."""
        return self.collective is None and self.state in _OUTSIDE

    @property
    def in_backward(self) -> bool:
        """Whether the place is in a synchronised backward (its computation, or the end-of-backward work)."""
        return self.state is TrainingState.BACKWARD or self.state is TrainingState.FINALIZING

    def describe(self, detail: str = "") -> str:
        """The place in words, for every message: "bucket 3 (fc1.weight, ...) of step 12" (pure: tested alone).

        The one place where the text is made.

        Args:
            detail: the bucket's parameters, or what a re-plan changed; "" for
                other places. Default "".
        """
        if self.bucket is not None:
            where = f"bucket {self.bucket} ({detail})"
        elif self.collective is Collective.REPLAN:
            where = f"{self.collective.value} ({detail}: every rank must make the same change at the same step)"
        elif self.collective is not None:
            where = self.collective.value
        elif self.state is TrainingState.IDLE:
            where = "set-up" if self.step == 0 else "user code after the backward"
        else:
            where = self.state.value  # "forward" or "backward"
        return f"{where} of step {self.step}"

    def to_json(self) -> list[Any]:
        """The place as JSON values, for a note in the store: the state's name, the step, the bucket, the
        collective's name (or None)."""
        return [self.state.name, self.step, self.bucket, None if self.collective is None else self.collective.name]

    @classmethod
    def from_json(cls, value: Sequence[Any]) -> Place:
        """The inverse of ``to_json``: the place a peer's note carries."""
        state, step, bucket, collective = value
        return cls(TrainingState[state], step, bucket, None if collective is None else Collective[collective])
