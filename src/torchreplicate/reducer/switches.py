"""Small objects a module's state shares with each reducer it builds.

The state outlives its reducers (a re-plan builds a new one), so what must
survive a re-plan or be set from outside lives here, stored once: the
gradient-sync switch, the training clock, and what a reducer learned.
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


class TrainingClock:
    """A module's training clock: optimizer steps over its parameters ([Note: desync detection]).

    Shared by the module's state (which sets the parameters to watch at each
    plan) and its reducers (which send the clock with the flags); the
    registry's optimizer hook advances it.
    """

    __slots__ = ("steps", "param_ids")

    def __init__(self) -> None:
        self.steps = 0  # optimizer steps that touched the module's replicated parameters
        self.param_ids: frozenset[int] = frozenset()  # ids of those parameters, as planned

    def note_step(self, optimizer_param_ids: frozenset[int]) -> None:
        """Counts an optimizer step if it holds one of the module's parameters."""
        if not self.param_ids.isdisjoint(optimizer_param_ids):
            self.steps += 1


class Learned(NamedTuple):
    """What a reducer learned, handed to its successor on a re-plan.

    Attributes:
        expected: firings per backward, by ``id`` of the parameter (read
            while those parameters are alive).
        num_steps: synchronised backwards completed.
    """

    expected: dict[int, int]
    num_steps: int
