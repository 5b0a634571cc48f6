"""Small objects a module's state shares with each reducer it builds.

The state outlives its reducers (a re-plan builds a new one), so what must
survive a re-plan or be set from outside lives here, stored once: where the
module is in its step (``Lifecycle``), the gradient-sync switch and what a
reducer learned (the training clock, also shared, is flags.py's). Beside
them, where a rank says it is for the stall watchdog (``Place``): its
``TrainingState``, a bucket or one of our other collectives, and the step.
"""

from __future__ import annotations

import enum
from typing import NamedTuple


class TrainingState(enum.Enum):
    """Where a replicated module is in its training step (``ReplicateState.training_state``).

    One value per module, held in its ``Lifecycle``; the forward hooks, the
    tied parameters' holder hooks, Join and the reducer all read it.
    """

    IDLE = "idle"  # between steps (also: a forward without gradients, a backward not synchronised)
    FORWARD = "forward"  # inside the root's forward with gradients enabled; tied holders detach only here
    BACKWARD = "backward"  # a synchronised backward: its end is queued on the autograd engine; hooks fill buckets
    # the end-of-backward callback (Reducer._finalize): remaining launches, waits, the flags, the rounds, learning
    FINALIZING = "finalizing"
    SHADOWING = "shadowing"  # a joined rank in Join's main_hook runs the others' collectives with zeros
    # an enclosing replicated module reduces this one ([Note: nested replicate] in core/nested.py); permanent
    NESTED = "nested"


class Lifecycle:
    """The one ``TrainingState`` of a replicated module, shared by its state and every reducer it builds.

    The state moves it through a forward, a joined rank's shadow and
    nesting; its reducer through a synchronised backward (``Reducer``).
    """

    __slots__ = ("now",)

    def __init__(self) -> None:
        self.now = TrainingState.IDLE


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
