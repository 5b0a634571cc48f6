"""The one instrumentation interface of a step: where the reducer is, said once.

At each point of a synchronised backward the reducer (and, before it, the
forward hooks) makes one ``Probe`` call: ``emit(event, a, b)`` for what an
observer hears (``StepEvent``), ``at(place)`` for where the rank is
between them. The probe feeds the three listeners from that one call:

- the module's watch, the note of where this rank is (a ``Place``): what a
  failing rank's error says about the others where the stall watchdog runs
  (watchdog.py), kept by the plain watch too (faults/wire.py);
- an observer of the step's timeline (``StepObserver``: one callable that
  takes the event and two ints; timeline.py's recorder is the one
  ``log_summary()`` attaches), off by default;
- the profiler: ``span(phase, bucket)`` runs a phase under
  ``record_function("torchreplicate::<phase> (bucket k)")`` while a torch
  profiler records, so a trace (``trace()`` runs one) shows each phase and
  bucket by name.

[Note: observer cost]
With no observer and no profiler, a point costs one or two attribute
checks and the watch's note (a few attribute writes). The gradient hook,
once per parameter per step, checks the observer inline (``probe.events``)
instead of calling ``emit``. Every event is one call, one clock read and a
store (timeline.py); measured in
benchmarks/option_cost/bench_observe.py.
"""

from __future__ import annotations

import contextlib
import enum
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
    Sequence,
    TypeVar,
)

import torch
from torch.autograd.profiler import record_function

from torchreplicate.faults.place import Place
from torchreplicate.faults.wire import Watch
from torchreplicate.lifecycle import TrainingState
from torchreplicate.torch_internals import profiler_active

if TYPE_CHECKING:
    from torchreplicate.reducer.bucket import Bucket

F = TypeVar("F", bound=Callable[..., Any])

PREFIX = "torchreplicate::"
PHASES = ("pre_forward", "post_forward", "hook", "launch", "wait", "finalize", "late_round", "tied_rows")
_NO_SPAN = contextlib.nullcontext()  # reusable: entering it does nothing


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
            if not profiler_active():
                return fn(*args, **kwargs)
            with record_function(name):
                return fn(*args, **kwargs)

        return wrapper  # type: ignore[return-value]

    return decorate


class StepEvent(enum.Enum):
    """What a step's observer hears: ``observer(event, a, b)``, two ints whose meaning each member says.

    Within one synchronised backward, in this order: ``BACKWARD`` once (the
    first gradient hook or output hook of the backward), ``GRAD`` at every
    accumulation into a slot of a bucket (so the first per bucket is its
    first gradient), ``LAUNCH`` when a bucket's collective starts,
    ``FINALIZE`` when the end-of-backward work starts, ``WAITING`` and
    ``DONE`` around each bucket's wait (the wait is exposed communication),
    ``LATE_ROUND`` around a late round, and ``STEP_END``; ``REPLAN``
    between steps.
    """

    BACKWARD = "backward"  # a: the step
    GRAD = "grad"  # a: the bucket
    LAUNCH = "launch"  # a: the bucket; b: 1 from a gradient hook (overlapped with backward), 0 from the end
    FINALIZE = "finalize"  # a: the step
    WAITING = "waiting"  # a: the bucket
    DONE = "done"  # a: the bucket, whose reduced gradients are in place
    LATE_ROUND = "late_round"  # a: 1 started, 0 ended
    STEP_END = "step_end"  # a: the step, complete; b: the bytes it handed to collectives
    REPLAN = "replan"  # a: the step the module re-planned before


StepObserver = Callable[[StepEvent, int, int], None]  # an observer of every synchronised backward

# Where an event moves the rank, for the watch's note: (its TrainingState, the step's offset from ``a``)
_MOVES = {
    StepEvent.BACKWARD: (TrainingState.BACKWARD, 0),
    StepEvent.STEP_END: (TrainingState.IDLE, 1),  # back in user code, before the next step
    StepEvent.REPLAN: (TrainingState.FORWARD, 0),  # the forward goes on, outside our collectives again
}


class Probe:
    """Where a replicated module's step is, for the watch, an observer and the profiler.

    One per module, shared by its state and every reducer it builds, so an
    observer attached once stays attached across re-plans.
    """

    __slots__ = ("watch", "events")

    def __init__(self) -> None:
        # every host wait on a peer and where this rank is: the stall watchdog (watchdog.py), at world
        # size > 1 unless turned off, else a plain watch (faults/wire.py)
        self.watch = Watch()
        self.events: Optional[StepObserver] = None  # an observer of every step's timeline, or None

    def at(self, place: Place, detail: str = "") -> None:
        """This rank is at ``place`` (a forward, a re-plan, the flags' collective, ...).

        Args:
            place: where the rank is ([Note: stall watchdog] in watchdog.py).
            detail: the bucket's parameters, or what a re-plan changed, for
                messages only. Default "".
        """
        self.watch.at(place, detail)

    def emit(self, event: StepEvent, a: int = 0, b: int = 0) -> None:
        """``event`` happened (``a``, ``b``: as ``StepEvent`` says): the watch's note where it moves the rank,
        then the observer, if one is attached."""
        move = _MOVES.get(event)
        if move is not None:
            self.watch.at(Place(move[0], a + move[1]))
        if self.events is not None:
            self.events(event, a, b)

    def span(self, phase: str, bucket: Optional[int] = None) -> ContextManager[Any]:
        """A context that labels ``phase`` (of ``bucket``) for the profiler while one records."""
        return record_function(label(phase, bucket)) if profiler_active() else _NO_SPAN

    @contextlib.contextmanager
    def launching(self, bucket: int, from_hook: bool) -> Iterator[None]:
        """Around the launch of ``bucket``'s collective, from a gradient hook or from the end of backward."""
        with self.span("launch", bucket):
            yield
        if self.events is not None:
            self.events(StepEvent.LAUNCH, bucket, int(from_hook))

    @contextlib.contextmanager
    def waiting(self, bucket: int, what: str, step: int) -> Iterator[None]:
        """Around the end of backward's wait for ``bucket`` (``what``: its parameters, for the watch's note)."""
        self.watch.at(Place(TrainingState.FINALIZING, step, bucket), what)
        if self.events is not None:
            self.events(StepEvent.WAITING, bucket, 0)
        with self.span("wait", bucket):
            yield
        if self.events is not None:
            self.events(StepEvent.DONE, bucket, 0)


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
