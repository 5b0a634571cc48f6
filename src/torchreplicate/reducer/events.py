"""What the reducer tells an observer of its steps (the recorder of timeline.py).

The reducer calls these at the points of a synchronised backward where a
timeline needs a timestamp. With no observer attached (``Reducer.events is
None``, the default) each point costs one attribute check; see timeline.py for
the observer that records them.
"""

from __future__ import annotations

from typing import Protocol


class StepEvents(Protocol):
    """Callbacks at the points of a step; every argument is plain data.

    The reducer calls, in this order within one synchronised backward:
    ``backward`` once (the first gradient hook or output hook of the
    backward), ``grad`` at every accumulation into a slot of bucket ``b``
    (so the first call per bucket is its first gradient), ``launch`` when a
    bucket's collective starts (``from_hook``: overlapped with backward, else
    from the end of backward), ``finalize`` when the end-of-backward work
    starts, ``waiting``/``done`` around each bucket's wait (the wait is
    exposed communication), ``late_round`` around a late round, and
    ``step_end`` with the bytes the step put on the wire.
    """

    def backward(self, step: int) -> None:
        """The synchronised backward of ``step`` started (its first hook ran)."""

    def grad(self, bucket: int) -> None:
        """A gradient was accumulated into a slot of ``bucket``."""

    def launch(self, bucket: int, from_hook: bool) -> None:
        """``bucket``'s collective was launched."""

    def finalize(self, step: int) -> None:
        """The end-of-backward work of ``step`` started."""

    def waiting(self, bucket: int) -> None:
        """The end of backward starts waiting for ``bucket``."""

    def done(self, bucket: int) -> None:
        """``bucket``'s reduced gradients are in place."""

    def late_round(self, started: bool) -> None:
        """A late round started (``started``) or ended."""

    def step_end(self, step: int, wire_bytes: int) -> None:
        """``step`` is complete; ``wire_bytes`` were handed to collectives."""

    def replan(self, step: int) -> None:
        """The module re-planned before ``step`` (state.py)."""
