"""The timeline of every synchronised backward, as plain records: what ``log_summary()`` reads.

``StepRecorder`` is a ``StepEvents`` observer (reducer/probe.py): the
module's probe calls it at the points of a step, it notes a
``time.perf_counter_ns()`` at each, and at the end of the step hands one
``StepRecord`` to its subscribers (the summary of summary.py, and the
benchmarks' timelines: a picture of the steps needs no recorder, ``trace()``
reads the same points from ``torch.profiler``). One recorder per replicated
module (``replicate.state(model).events``), so several subscribers on the
same model share it; it is detached when its last subscriber leaves, so a model
nobody observes pays one attribute check per point ([Note: observer cost] in
probe.py). ``grad``, called once per accumulation into a ``.grad``, reads
the clock only for the first gradient of each bucket. Ready is not an event
of its own: a bucket launched from a gradient hook was ready then; one
launched from the end of backward was ready when the end of backward started.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional

from torch import nn

from torchreplicate.core.registry import get_state

Subscriber = Callable[["StepRecord"], None]


@dataclass(frozen=True)
class BucketTimes:
    """One bucket in one step, in ``time.perf_counter_ns()`` of its rank.

    Attributes:
        index: the bucket's index (its launch order).
        first_grad_ns: the first gradient accumulated into it, or None (no
            parameter of the bucket got a gradient on this rank).
        ready_ns: when it could be launched (at ``launch_ns`` from a hook, or
            when the end of backward started).
        launch_ns: its collective started.
        from_hook: launched from a gradient hook (overlapped with backward),
            or else from the end of backward.
        wait_ns: the end of backward started waiting for it.
        done_ns: its reduced gradients were in place.
    """

    index: int
    first_grad_ns: Optional[int]
    ready_ns: int
    launch_ns: int
    from_hook: bool
    wait_ns: int
    done_ns: int

    @property
    def exposed_ns(self) -> int:
        """Time the end of backward spent waiting for this bucket."""
        return self.done_ns - self.wait_ns


@dataclass(frozen=True)
class StepRecord:
    """One synchronised backward on one rank (``perf_counter_ns`` of that rank).

    Attributes:
        step: the synchronised backward's number (0 for the first; the same
            on every rank).
        backward_ns: its first gradient or output hook ran.
        finalize_ns: the end-of-backward work started.
        end_ns: the step was complete (every ``.grad`` holds the average).
        buckets: per bucket, in index order.
        late_rounds: (start, end) of each late round ([Note: one collective
            sequence] in reducer.py).
        wire_bytes: bytes the step handed to the reducer's collectives.
        replan_ns: the module re-planned before this step (core/setup.py), or None.
    """

    step: int
    backward_ns: int
    finalize_ns: int
    end_ns: int
    buckets: tuple[BucketTimes, ...]
    late_rounds: tuple[tuple[int, int], ...]
    wire_bytes: int
    replan_ns: Optional[int] = None

    @property
    def exposed_ns(self) -> int:
        """Exposed communication: time in the end of backward's waits and late rounds."""
        return sum(b.exposed_ns for b in self.buckets) + sum(end - start for start, end in self.late_rounds)

    @property
    def comm_span_ns(self) -> int:
        """Time collectives were in flight: first launch to last bucket done (or late round end)."""
        if not self.buckets:
            return 0
        last = max([b.done_ns for b in self.buckets] + [end for _, end in self.late_rounds])
        return last - min(b.launch_ns for b in self.buckets)


class StepRecorder:
    """The step observer (probe.py's ``StepEvents``) that turns the reducer's events into ``StepRecord``s.

    Attach it with ``subscribe(model, fn)``, which shares one recorder per
    module; ``fn(record)`` runs at the end of every synchronised backward, on
    the training thread, inside the reducer's end-of-backward callback (a
    collective there is fine if every rank makes it at the same step).
    """

    def __init__(self) -> None:
        # - Who hears about finished steps
        self.subscribers: list[Subscriber] = []
        # - The step in progress ([Note: observer cost] in probe.py): reset at `backward`
        self._step = -1
        self._backward_ns = 0
        self._finalize_ns = 0
        self._first_grad: dict[int, int] = {}  # bucket -> first gradient
        self._launch: dict[int, tuple[int, bool]] = {}  # bucket -> (launched, from a hook)
        self._wait: dict[int, int] = {}  # bucket -> the end of backward started waiting
        self._done: dict[int, int] = {}  # bucket -> reduced gradients in place
        self._late: list[int] = []  # late round starts and ends, alternating
        self._replan_ns: Optional[int] = None  # a re-plan before this step

    # -- probe.StepEvents ----------------------------------------------------

    def backward(self, step: int) -> None:
        """The synchronised backward of ``step`` started."""
        self._backward_ns = time.perf_counter_ns()
        self._step = step
        self._finalize_ns = 0
        self._first_grad, self._launch, self._wait, self._done, self._late = {}, {}, {}, {}, []

    def grad(self, bucket: int) -> None:
        """A gradient was accumulated into ``bucket``; only the first one per step is timed."""
        if bucket not in self._first_grad:
            self._first_grad[bucket] = time.perf_counter_ns()

    def launch(self, bucket: int, from_hook: bool) -> None:
        """``bucket``'s collective started."""
        self._launch[bucket] = (time.perf_counter_ns(), from_hook)

    def finalize(self, step: int) -> None:
        """The end-of-backward work started."""
        self._finalize_ns = time.perf_counter_ns()

    def waiting(self, bucket: int) -> None:
        """The end of backward started waiting for ``bucket``."""
        self._wait[bucket] = time.perf_counter_ns()

    def done(self, bucket: int) -> None:
        """``bucket``'s reduced gradients are in place."""
        self._done[bucket] = time.perf_counter_ns()

    def late_round(self, started: bool) -> None:
        """A late round started or ended."""
        self._late.append(time.perf_counter_ns())

    def replan(self, step: int) -> None:
        """The module re-planned before ``step``."""
        self._replan_ns = time.perf_counter_ns()

    def step_end(self, step: int, wire_bytes: int) -> None:
        """``step`` is complete: builds its record and hands it to every subscriber."""
        end_ns = time.perf_counter_ns()
        finalize_ns = self._finalize_ns or end_ns
        backward_ns = self._backward_ns if self._step == step else finalize_ns
        buckets = tuple(
            BucketTimes(i, self._first_grad.get(i), t if hook else finalize_ns, t, hook, self._wait.get(i, done), done)
            for i, done in sorted(self._done.items())
            for t, hook in [self._launch.get(i, (finalize_ns, False))]  # (launched, from a hook)
        )
        late = self._late
        late_rounds = tuple((late[i], late[i + 1]) for i in range(0, len(late) - 1, 2))
        record = StepRecord(step, backward_ns, finalize_ns, end_ns, buckets, late_rounds, wire_bytes, self._replan_ns)
        self._replan_ns = None
        for subscriber in list(self.subscribers):
            subscriber(record)


def subscribe(model: nn.Module, subscriber: Subscriber) -> StepRecorder:
    """Calls ``subscriber(record)`` at the end of every synchronised backward of ``model``.

    Attaches the module's ``StepRecorder`` if none is attached yet.

    Args:
        model: a module ``replicate()`` was applied to.
        subscriber: called with each ``StepRecord``.

    Raises:
        ValueError: ``model`` is not replicated.
        RuntimeError: another observer was attached with ``set_events``.
    """
    state = get_state(model)
    recorder = state.events
    if recorder is None:
        recorder = StepRecorder()
        state.set_events(recorder)
    elif not isinstance(recorder, StepRecorder):
        raise RuntimeError(
            f"torchreplicate: another step observer ({type(recorder).__name__}) is attached to this "
            "model through replicate.state(model).set_events(); detach it (set_events(None)) first"
        )
    recorder.subscribers.append(subscriber)
    return recorder


def unsubscribe(model: nn.Module, subscriber: Subscriber) -> None:
    """Stops calling ``subscriber``; detaches the recorder when nobody listens any more."""
    state = get_state(model)
    recorder = state.events
    if not isinstance(recorder, StepRecorder):
        return  # detached by hand already
    if subscriber in recorder.subscribers:
        recorder.subscribers.remove(subscriber)
    if not recorder.subscribers:
        state.set_events(None)
