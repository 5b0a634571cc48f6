"""The one instrumentation interface of a step: where the reducer is, said once.

At each point of a synchronised backward the reducer (and, before it, the
forward hooks) makes one ``Probe`` call. The probe feeds the three listeners
from that one call:

- the module's watch, the note of where this rank is (a ``Place``): what a
  failing rank's error says about the others where the stall watchdog runs
  (watchdog.py), kept by the plain watch too (faults/wire.py);
- an observer of the step's timeline (``StepEvents``; timeline.py's recorder
  is the one ``log_summary()`` attaches), off by default;
- the profiler: ``span(phase, bucket)`` runs a phase under
  ``record_function("torchreplicate::<phase> (bucket k)")`` while a torch
  profiler records, so a trace (``trace()`` runs one) shows each phase and
  bucket by name.

[Note: observer cost]
With no observer and no profiler, a point costs one or two attribute
checks and the watch's note (a few attribute writes). The gradient hook, once per parameter per step, checks the
observer inline (``probe.events``) instead of calling ``grad``. Every
event is one call, one clock read and a store (timeline.py); measured in
benchmarks/option_cost/bench_observe.py.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import (
    TYPE_CHECKING,
    Any,
    Callable,
    ContextManager,
    Iterator,
    NamedTuple,
    Optional,
    Protocol,
    Sequence,
    TypeVar,
)

import torch
from torch.autograd.profiler import record_function

from torchreplicate.faults.place import Collective, Place
from torchreplicate.faults.wire import Watch
from torchreplicate.lifecycle import TrainingState
from torchreplicate.torch_internals import profiler_active

if TYPE_CHECKING:
    from torchreplicate.reducer.bucket import Bucket

F = TypeVar("F", bound=Callable[..., Any])

PREFIX = "torchreplicate::"
PHASES = ("pre_forward", "post_forward", "hook", "launch", "wait", "finalize", "late_round", "tied_rows")
_NO_SPAN = contextlib.nullcontext()  # reusable: entering it does nothing


def _recording() -> bool:
    # Whether a profiler records: the one place this file asks torch_internals.py (whose name is private torch's).
    return profiler_active()


def label(phase: str, bucket: Optional[int] = None) -> str:
    """The profiler label of ``phase`` (of bucket ``bucket``): ``torchreplicate::launch (bucket 3)``."""
    assert phase in PHASES, phase
    return PREFIX + phase if bucket is None else f"{PREFIX}{phase} (bucket {bucket})"


def labelled(phase: str) -> Callable[[F], F]:
    """Decorator: runs the function under ``record_function(label(phase))`` while a profiler records."""
    name = label(phase)

    def decorate(fn: F) -> F:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if not _recording():
                return fn(*args, **kwargs)
            with record_function(name):
                return fn(*args, **kwargs)

        return wrapper  # type: ignore[return-value]

    return decorate


class StepEvents(Protocol):
    """An observer of every synchronised backward; every argument is plain data.

    Called in this order within one synchronised backward: ``backward`` once
    (the first gradient hook or output hook of the backward), ``grad`` at
    every accumulation into a slot of bucket ``b`` (so the first call per
    bucket is its first gradient), ``launch`` when a bucket's collective
    starts (``from_hook``: overlapped with backward, else from the end of
    backward), ``finalize`` when the end-of-backward work starts,
    ``waiting``/``done`` around each bucket's wait (the wait is exposed
    communication), ``late_round`` around a late round, and ``step_end``
    with the bytes the step put on the wire; ``replan`` between steps.
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


class Probe:
    """Where a replicated module's step is, for the watchdog, an observer and the profiler.

    One per module, shared by its state and every reducer it builds, so an
    observer attached once stays attached across re-plans.
    """

    __slots__ = ("watch", "events")

    def __init__(self) -> None:
        # every host wait on a peer and where this rank is: the stall watchdog (watchdog.py), at world
        # size > 1 unless turned off, else a plain watch (faults/wire.py)
        self.watch = Watch()
        self.events: Optional[StepEvents] = None  # an observer of every step's timeline, or None

    def at(self, place: Place, detail: str = "") -> None:
        """This rank is at ``place`` (a forward, a re-plan, the flags' all-reduce, ...).

        Args:
            place: where the rank is ([Note: stall watchdog] in watchdog.py).
            detail: the bucket's parameters, or what a re-plan changed, for
                messages only. Default "".
        """
        self.watch.at(place, detail)

    def span(self, phase: str, bucket: Optional[int] = None) -> ContextManager[Any]:
        """A context that labels ``phase`` (of ``bucket``) for the profiler while one records."""
        return record_function(label(phase, bucket)) if _recording() else _NO_SPAN

    def backward(self, step: int) -> None:
        """The synchronised backward of ``step`` started."""
        self.at(Place(TrainingState.BACKWARD, step))
        if self.events is not None:
            self.events.backward(step)

    @contextlib.contextmanager
    def launching(self, bucket: int, from_hook: bool) -> Iterator[None]:
        """Around the launch of ``bucket``'s collective, from a gradient hook or from the end of backward."""
        with self.span("launch", bucket):
            yield
        if self.events is not None:
            self.events.launch(bucket, from_hook)

    def finalize(self, step: int) -> None:
        """The end-of-backward work of ``step`` (``Reducer._finalize``) started."""
        if self.events is not None:
            self.events.finalize(step)

    @contextlib.contextmanager
    def waiting(self, bucket: int, what: str, step: int) -> Iterator[None]:
        """Around the end of backward's wait for ``bucket`` (``what``: its parameters, for the watchdog)."""
        self.at(Place(TrainingState.FINALIZING, step, bucket), what)
        if self.events is not None:
            self.events.waiting(bucket)
        with self.span("wait", bucket):
            yield
        if self.events is not None:
            self.events.done(bucket)

    def late_round(self, started: bool, step: int) -> None:
        """A late round of ``step`` started or ended."""
        if started:
            self.at(Place(TrainingState.FINALIZING, step, collective=Collective.LATE_ROUND))
        if self.events is not None:
            self.events.late_round(started)

    def step_end(self, step: int, wire_bytes: int) -> None:
        """``step`` is complete: the rank is back in user code, before ``step + 1``."""
        self.at(Place(TrainingState.IDLE, step + 1))
        if self.events is not None:
            self.events.step_end(step, wire_bytes)

    def replanned(self, step: int) -> None:
        """The module re-planned before ``step``: the forward goes on, outside our collectives again."""
        self.at(Place(TrainingState.FORWARD, step))
        if self.events is not None:
            self.events.replan(step)


@dataclass(frozen=True)
class BucketInfo:
    """One bucket of the layout a step ran with.

    Attributes:
        index: the bucket's index.
        names: fully qualified names of its parameters, in buffer order.
        numel: gradient elements.
        nbytes: bytes of its gradients.
    """

    index: int
    names: tuple[str, ...]
    numel: int
    nbytes: int


class ReducerInfo(NamedTuple):
    """What observers read of a reducer (``Reducer.info``): plain values, the layout as it is now.

    Attributes:
        device: where the buckets live (an observer's own collectives run there).
        watch: waits the reducer's collectives (the module's: the stall watchdog, or plain).
        buckets: the bucket layout, in launch order.
    """

    device: torch.device
    watch: Watch
    buckets: tuple[BucketInfo, ...]

    @classmethod
    def of(cls, buckets: Sequence[Bucket], watch: Watch) -> ReducerInfo:
        """What observers read of ``buckets`` (a reducer's, in launch order)."""
        infos = tuple(
            BucketInfo(b.index, tuple(s.name for s in b.slots), b.numel, b.numel * b.grads.element_size())
            for b in buckets
        )
        return cls(buckets[0].buffer.device, watch, infos)
