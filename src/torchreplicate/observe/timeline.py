"""The timeline of every synchronised backward, as plain records: what ``log_summary()`` and ``trace()`` read.

``StepRecorder`` is a ``StepObserver`` (reducer/probe.py): the
module's probe calls it at the points of a step, it marks the time at each
on its clock, and hands one ``StepRecord`` per step to its subscribers (the
summary of summary.py, ``trace()``'s exposed communication per step, and
the benchmarks' timelines). One recorder per replicated module
(``replicate.state(model).events``), so several subscribers on the same
model share it; it is detached when its last subscriber leaves, so a model
nobody observes pays one attribute check per point ([Note: observer cost] in
probe.py). ``grad``, called once per accumulation into a ``.grad``, marks
the time only for the first gradient of each bucket. Ready is not an event
of its own: a bucket launched from a gradient hook was ready then; one
launched from the end of backward was ready when the end of backward started.

[Note: one clock for the observers]
Exposed communication is the time the step waited for its collectives. On
the CPU (gloo) the host waits in them, so the host's clock measures it
(``HostClock``). On an accelerator (NCCL) the host does not wait: a wait
only orders the device's stream, so host time around it reads about 0 and
hides a straggler. There the marks are timing events recorded on the
current stream (``DeviceClock``): "waiting" is when the stream reached the
wait, "done" when it could go on, after the collective; their difference is
the time the device's compute waited. Reading an event's time waits for it,
so on a device each step's record is built one step later, at the end of
the next synchronised step (by then its events are done, unless the device
is more than a step behind the host, when the recorder waits for them),
the same step on every rank, so a subscriber's collective (the summary's)
stays in step; ``flush()`` delivers the rest (``trace()`` at its exit).
Every observer reads exposure from these records: one definition
(``StepRecord.exposed_ns``), one clock per device.
"""

from __future__ import annotations

import collections
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import nn

from torchreplicate.core.registry import get_state
from torchreplicate.faults.wire import Watch
from torchreplicate.reducer.probe import StepEvent

Subscriber = Callable[["StepRecord"], None]


class HostClock:
    """Marks are ``time.perf_counter_ns()``: for the CPU, where gloo's waits block the host."""

    delay = 0  # a step's record is built at its own end

    def mark(self) -> Any:
        """Now."""
        return time.perf_counter_ns()

    def ns(self, mark: Any) -> int:
        """A mark in ns."""
        return int(mark)


class DeviceClock:
    """Marks are timing events on ``device``'s current stream ([Note: one clock for the observers]).

    Args:
        device: the module's collective device (cuda:0, ...).
        watch: returns the module's watch, which waits for a mark not done yet (polled: the stall
            watchdog names a peer that hangs the stream).
    """

    delay = 1  # a step's record is built at the end of the next step

    def __init__(self, device: torch.device, watch: Callable[[], Watch] = Watch) -> None:
        self.device = device
        self.watch = watch
        self.origin: Optional[Any] = None  # the first mark: ns count from it

    def mark(self) -> Any:
        """An event recorded now on the current stream."""
        event = torch.Event(self.device, enable_timing=True)
        event.record(torch.accelerator.current_stream(self.device))
        if self.origin is None:
            self.origin = event
        return event

    def ns(self, mark: Any) -> int:
        """A mark in ns since the origin (waits for the event where it is not done yet: polled through the
        watchdog, which names a peer that hangs the stream, before NCCL's own timeout)."""
        assert self.origin is not None, "a mark was made"
        self.watch().wait_event(mark)
        return round(float(self.origin.elapsed_time(mark)) * 1e6)


def clock_for(device: torch.device, watch: Callable[[], Watch] = Watch) -> Any:
    """The clock of a module whose collectives run on ``device`` (``watch``: ``DeviceClock``'s)."""
    return HostClock() if device.type == "cpu" else DeviceClock(device, watch)


@dataclass(frozen=True)
class BucketTimes:
    """One bucket in one step, in ns of its rank's clock (``HostClock``, ``DeviceClock``).

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
    """One synchronised backward on one rank, in ns of that rank's clock (``HostClock``, ``DeviceClock``).

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
    """The step observer (probe.py's ``StepObserver``) that turns the reducer's events into ``StepRecord``s.

    Attach it with ``subscribe(model, fn)``, which shares one recorder per
    module; ``fn(record)`` runs at the end of every synchronised backward
    (on a device, of the next one: [Note: one clock for the observers]), on
    the training thread, inside the reducer's end-of-backward callback (a
    collective there is fine if every rank makes it at the same step).

    Args:
        clock: ``HostClock()`` (default) or ``DeviceClock(device)``.
    """

    def __init__(self, clock: Optional[Any] = None) -> None:
        # - Who hears about finished steps, and the clock of the marks
        self.subscribers: list[Subscriber] = []
        self.clock = clock if clock is not None else HostClock()
        self._pending: collections.deque[tuple[Any, ...]] = collections.deque()  # steps marked, not yet built
        # - The step in progress ([Note: observer cost] in probe.py): reset at `backward`; marks of the clock
        self._step = -1
        self._backward_ns: Any = 0
        self._finalize_ns: Any = 0
        self._first_grad: dict[int, Any] = {}  # bucket -> first gradient
        self._launch: dict[int, tuple[Any, bool]] = {}  # bucket -> (launched, from a hook)
        self._wait: dict[int, Any] = {}  # bucket -> the end of backward started waiting
        self._done: dict[int, Any] = {}  # bucket -> reduced gradients in place
        self._late: list[Any] = []  # late round starts and ends, alternating
        self._replan_ns: Optional[Any] = None  # a re-plan before this step

    # -- the observer (probe.py's StepObserver) --------------------------------

    def __call__(self, event: StepEvent, a: int, b: int) -> None:
        """One point of a step (``StepEvent`` says what ``a`` and ``b`` are): a mark of the clock, kept."""
        if event is StepEvent.GRAD:  # only the first gradient per bucket and step is timed
            if a not in self._first_grad:
                self._first_grad[a] = self.clock.mark()
            return
        mark = self.clock.mark()
        if event is StepEvent.BACKWARD:
            self._backward_ns, self._step, self._finalize_ns = mark, a, 0
            self._fresh()
        elif event is StepEvent.LAUNCH:
            self._launch[a] = (mark, bool(b))
        elif event is StepEvent.FINALIZE:
            self._finalize_ns = mark
        elif event is StepEvent.WAITING:
            self._wait[a] = mark
        elif event is StepEvent.DONE:
            self._done[a] = mark
        elif event is StepEvent.LATE_ROUND:
            self._late.append(mark)
        elif event is StepEvent.REPLAN:
            self._replan_ns = mark
        elif event is StepEvent.STEP_END:
            self.step_end(a, b, mark)

    def _fresh(self) -> None:
        # New containers for a step's marks: a step handed to ``_pending`` keeps the old ones as they are.
        self._first_grad, self._launch, self._wait, self._done, self._late = {}, {}, {}, {}, []

    def step_end(self, step: int, wire_bytes: int, end: Any) -> None:
        """``step`` is complete (at the clock's mark ``end``): its marks wait for their record (built now on
        the host clock, at the next step's end on a device), and every record due is handed to every
        subscriber."""
        finalize = self._finalize_ns if self._finalize_ns else end
        backward = self._backward_ns if self._step == step else finalize
        marks = (step, backward, finalize, end, self._first_grad, self._launch, self._wait, self._done, self._late)
        self._pending.append((*marks, wire_bytes, self._replan_ns))
        self._replan_ns = None
        self._fresh()
        while len(self._pending) > self.clock.delay:
            self._deliver(self._pending.popleft())

    def flush(self) -> None:
        """Builds and hands out every step marked and not delivered yet (on a device, waits for its events)."""
        while self._pending:
            self._deliver(self._pending.popleft())

    def _deliver(self, marked: tuple[Any, ...]) -> None:
        step, backward, finalize, end, first_grad, launch, wait, done, late, wire_bytes, replan = marked
        ns = self.clock.ns
        finalize_ns = ns(finalize)
        buckets = []
        for i, done_mark in sorted(done.items()):
            done_ns = ns(done_mark)
            t, hook = launch.get(i, (finalize, False))  # (launched, from a hook)
            t_ns = ns(t)
            first = first_grad.get(i)
            waited = ns(wait[i]) if i in wait else done_ns
            buckets.append(
                BucketTimes(
                    i, None if first is None else ns(first), t_ns if hook else finalize_ns, t_ns, hook, waited, done_ns
                )
            )
        late_rounds = tuple((ns(late[i]), ns(late[i + 1])) for i in range(0, len(late) - 1, 2))
        replan_ns = None if replan is None else ns(replan)
        record = StepRecord(
            step, ns(backward), finalize_ns, ns(end), tuple(buckets), late_rounds, wire_bytes, replan_ns
        )
        for subscriber in list(self.subscribers):
            subscriber(record)


def _watch_of(held: weakref.ref[Any]) -> Callable[[], Watch]:
    """The current watch of the state ``held`` (weakly: the recorder does not keep it alive)."""

    def watch() -> Watch:
        state = held()
        return Watch() if state is None else state.probe.watch

    return watch


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
        recorder = StepRecorder(clock_for(state.device, _watch_of(weakref.ref(state))))
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
