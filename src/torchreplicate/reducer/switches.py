"""Small objects a module's state shares with each reducer it builds.

The state outlives its reducers (a re-plan builds a new one), so what must
survive a re-plan or be set from outside lives here, stored once: the
gradient-sync switch and what a reducer learned (the training clock, also
shared, is flags.py's).
"""

from __future__ import annotations

from typing import NamedTuple


class SyncSwitch:
    """Whether backwards average gradients; shared by a module's state and its reducers.

    One fact, stored once: ``set_requires_gradient_sync`` flips it, every
    reducer built for the module (also after a re-plan) reads it at backward.
    """

    __slots__ = ("on",)

    def __init__(self, on: bool = True) -> None:
        self.on = on


class Learned(NamedTuple):
    """What a reducer learned, handed to its successor on a re-plan.

    Attributes:
        expected: firings per backward, by ``id`` of the parameter (read
            while those parameters are alive).
        num_steps: synchronised backwards completed.
    """

    expected: dict[int, int]
    num_steps: int
