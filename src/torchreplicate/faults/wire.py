"""The wire: the group, every host wait on a peer, the collectives outside the buckets, works kept past a step.

Everything a rank does that waits for another rank, outside a bucket's own
collective, goes through this file:

- the process group, held weakly (``WeakGroup``);
- one ``Watch`` per replicated module, never None: every host wait on a
  peer (``wait``, ``wait_event``, ``wait_on_host``, ``read_on_host``) and
  where this rank is (``at``). The plain ``Watch`` (world size 1,
  ``stall_timeout=None``, a nested module) waits plainly; the stall
  watchdog (``StallWatch``, watchdog.py) is a ``Watch`` that also looks at
  its peers when a wait lasts ([Note: stall watchdog] in watchdog.py), and
  names them when a collective fails (``diagnosing``);
- the collectives outside the buckets (``all_reduce`` with an op,
  ``broadcast``, ``all_gather``, ``gather_objects``) and the ``digest`` the
  ranks compare;
- the works kept past their step (``HeldWorks``).

[Note: works kept past a step]
Two collectives of a step are launched without waiting and are done long
before anything reads them: rank 0's buffers sent ahead at the end of a
forward (core/buffers.py) and, on the host, the flags' sums read a step
late (reducer/flags.py). Their works, and nothing else, are kept past the
step in the module's one ``HeldWorks`` (the staged buffers and flags keep
their data); one loop (``release``: wait, done by then, and let go)
releases them: at the next forward, at the next synchronised
backward, at an optimizer step over the module's parameters, whatever
updates the weights (a manual update, a custom optimizer), so what the
library holds does not grow with the steps; and what is left at
interpreter exit is dropped while the interpreter is whole. A gloo work kept
until after ``destroy_process_group()`` aborted the process as it was freed
("Resource deadlock avoided", torch 2.13: the PowerSGD example), so the
release comes as early as a step allows.
"""

from __future__ import annotations

import contextlib
import hashlib
import time
import weakref
from datetime import timedelta
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence, cast

import torch
import torch.distributed as dist

from torchreplicate.faults.place import Place
from torchreplicate.lifecycle import TrainingState


class WeakGroup(weakref.ref["dist.ProcessGroup"]):
    """A process group held weakly: calling it returns the group or None (a C call, no Python frame, on
    the step's hot path: ``weak() or weak.get()``); ``get()`` returns it or raises.

    ``destroy_process_group()`` frees a group only when nothing else holds
    it. A model (often alive until interpreter exit) that held its group
    would keep gloo's worker threads running into interpreter finalization,
    where a thread releasing a finished work's tensors needs the GIL and
    aborts the process ("terminate called without an active exception"; seen
    under torch 2.13 one exit in ~20, see pytorch/pytorch#179291).

    Args:
        group: the process group.
    """

    __slots__ = ("name",)

    def __init__(self, group: dist.ProcessGroup) -> None:  # weakref.ref's __new__ took the group
        self.name = group.group_name  # how traced code names it ([Note: compiled autograd] in reducer/reduction.py)

    def get(self) -> dist.ProcessGroup:
        """The group; RuntimeError if it was destroyed."""
        group = self()
        if group is None:
            raise RuntimeError(
                "replicate(): the module's process group was destroyed "
                "(torch.distributed.destroy_process_group()); a replicated module runs "
                "forward and backward only while its group exists"
            )
        return group


def digest(data: Any) -> int:
    """A 64-bit digest (signed, as an int64 holds it) of bytes or any buffer (a NumPy array): equal iff the
    data are, but for collisions. The one digest ranks compare: layouts, set-up descriptions, tensors."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little", signed=True)


_TRANSPORT_WORDS = ("gloo", "Gloo", "NCCL", "Connection", "connection", "Timed out", "timed out", "pair closure")


class Watch:
    """Every host wait of one replicated module on its peers, and where this rank is.

    The plain watch waits plainly and names nobody; ``StallWatch``
    (watchdog.py) looks at the peers when a wait lasts and names them when a
    collective fails ([Note: stall watchdog] in watchdog.py).
    """

    sliced = False  # waits in slices, looking at the peers between them (the stall watchdog, on gloo)
    timeout_s = float("inf")  # the first look at the peers
    failed = False  # a collective of this module failed here (the group is gone)

    def __init__(self) -> None:
        self.place = Place(TrainingState.IDLE, 0)  # the set-up: no forward yet
        self.detail = ""  # the bucket's parameters or the re-plan's change, for messages only
        self.entered = time.monotonic()

    def at(self, place: Place, detail: str = "") -> None:
        """Notes where this rank is now (main thread; a few attribute writes).

        Args:
            place: where the rank is (``Place``).
            detail: the bucket's parameters, or what a re-plan changed, for
                messages only ("" elsewhere). Default "".
        """
        self.place, self.detail, self.entered = place, detail, time.monotonic()

    def wait(self, work: dist.Work) -> None:
        """Waits for ``work`` (a collective of ours); sliced, looks at the peers at ``timeout_s``, then at x2.

        The work's own error (a closed connection, the group's timeout) is
        raised as it is, for ``diagnose``.
        """
        if not self.sliced:
            work.wait()
            return
        started, look_at = time.monotonic(), self.timeout_s
        while True:
            try:
                work.wait(timedelta(seconds=max(0.001, look_at - (time.monotonic() - started))))
                return
            except RuntimeError as error:
                if _TIMED_OUT not in str(error):
                    raise  # the work's own error
            if work.is_completed():
                work.wait()  # finished meanwhile: its result, or its error
                return
            waited = time.monotonic() - started
            if waited >= look_at:
                self.look_at_peers(waited)
                look_at *= 2

    def wait_until(self, done: Callable[[], bool]) -> None:
        """Returns once ``done()`` is true (an accelerator event's ``query``), polling without spinning a core
        (naps of 0.1 to 10 ms), and looks at the peers at ``timeout_s``, then at x2, as ``wait`` does on
        gloo: on NCCL a hung peer is named from the notes before NCCL's own abort. Done at once: no nap."""
        started, look_at, nap = time.monotonic(), self.timeout_s, 1e-4
        while not done():
            time.sleep(nap)
            nap = min(2 * nap, 0.01)
            if (waited := time.monotonic() - started) >= look_at:
                self.look_at_peers(waited)
                look_at *= 2

    def wait_on_host(
        self, tensor: torch.Tensor, work: Optional[dist.Work] = None, ready: Optional[torch.Event] = None
    ) -> None:
        """Returns once ``tensor``'s collective (``work``, None: one already waited for) is done, on the host too.

        On an accelerator the host would block in a read until the device is done: where a peer hangs, past
        the stall watchdog, until NCCL's own timeout. So the stream waits for ``work``, then an event
        (``ready``, one the caller keeps, or a new one) is waited for (``wait_event``: the stall watchdog
        polls it): a read after this one does not block.
        """
        if work is not None:
            self.wait(work)
        if ready is not None or tensor.device.type != "cpu":  # a kept event: an accelerator's
            ready = torch.Event(tensor.device) if ready is None else ready
            ready.record(torch.accelerator.current_stream(tensor.device))
            self.wait_event(ready)

    def read_on_host(self, tensor: torch.Tensor, work: Optional[dist.Work] = None) -> list[Any]:
        """``tensor.tolist()`` once its collective is done (``wait_on_host``)."""
        self.wait_on_host(tensor, work)
        return tensor.tolist()

    def wait_event(self, event: torch.Event) -> None:
        """Returns once ``event`` (recorded on an accelerator's stream) completed: the plain watch blocks in it,
        names nobody; the stall watchdog polls it (``wait_until``), looking at the peers meanwhile."""
        event.synchronize()

    def look_at_peers(self, waited: float) -> None:
        """Where a wait lasts ``waited`` s: the stall watchdog looks at the peers; the plain watch waits on."""

    def note_raised(self, step: int, what: str) -> None:
        """Notes that this rank raised in ``step`` (``what``: the exception), for the others' error."""

    def raised_notes(self, ranks: Iterable[int]) -> dict[int, str]:
        """What ``ranks`` noted they raised (``note_raised``), where they left a note."""
        return {}

    def diagnose(self, error: BaseException, before: str = "") -> BaseException:
        """The error to raise when a collective of ours failed with ``error`` at this rank's place."""
        return error

    def stop(self) -> None:
        """Stops watching (the stall watchdog's heartbeat)."""

    def leave(self, how: str) -> None:
        """Stops watching and says so: this rank ``how`` (e.g. "exited")."""

    @contextlib.contextmanager
    def diagnosing(self, before: str = "") -> Iterator[None]:
        """Turns a transport error of a collective inside into this watch's ``diagnose``; any other error,
        or any error under the plain watch, passes unchanged.

        Args:
            before: a collective run before the place, not at it (the buffer
                broadcast before a forward), named first. Default "".
        """
        try:
            yield
        except RuntimeError as error:
            # a transport error: the collective failed there (a peer late, gone, or its connection broken)
            text = str(error)
            if text.startswith("replicate()") or not any(word in text for word in _TRANSPORT_WORDS):
                raise
            diagnosed = self.diagnose(error, before)
            if diagnosed is error:
                raise
            raise diagnosed from error


_TIMED_OUT = "Operation timed out!"  # what Work.wait(timeout) raises when the slice ends first (torch 2.13)


def all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup, *, op: Any = dist.ReduceOp.SUM) -> dist.Work:
    """Launches ``dist.all_reduce`` (``op``: a sum by default) under the group's own timeout, as DDP's; returns
    its work, not waited: ``watch.wait(work)``, or ``watch.read_on_host(tensor, work)``."""
    return cast(dist.Work, dist.all_reduce(tensor, op=op, group=group, async_op=True))


def broadcast(
    tensor: torch.Tensor, group: dist.ProcessGroup, src_rank: int = 0, held: Optional[HeldWorks] = None
) -> dist.Work:
    """Launches a broadcast of ``tensor`` from group rank ``src_rank``; returns its work, not waited
    (``held``: keeps it past the step, for the next release: [Note: works kept past a step])."""
    src = dist.get_global_rank(group, src_rank)
    work = cast(dist.Work, dist.broadcast(tensor, src=src, group=group, async_op=True))
    if held is not None:
        held.hold(work)
    return work


def all_gather(outputs: Sequence[torch.Tensor], tensor: torch.Tensor, group: dist.ProcessGroup) -> dist.Work:
    """Launches an all-gather of ``tensor`` into ``outputs`` (one per rank); returns its work, not waited."""
    return cast(dist.Work, dist.all_gather(list(outputs), tensor, group=group, async_op=True))


def gather_objects(obj: Any, group: dist.ProcessGroup, device: torch.device) -> list[Any]:
    """``dist.all_gather_object`` of ``obj`` with ``device`` as the current CUDA device while it runs.

    On NCCL, torch serializes the objects onto ``torch.cuda.current_device()``,
    which without the user's ``torch.cuda.set_device`` is cuda:0 on every rank
    ("Duplicate GPU detected", or a hang); here the module's device decides,
    and the current device is as it was after.
    """
    gathered: list[Any] = [None] * dist.get_world_size(group)
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        dist.all_gather_object(gathered, obj, group=group)
    return gathered


GATHER_MAX_NUMEL = 1 << 20  # host sums are all-gathered and summed here up to this many elements, all ranks'


class SummedGather:
    """A sum across ranks on the host (gloo) by an all-gather and a local sum, with a work's ``wait`` and
    ``is_completed``: gloo's all-reduce of a few hundred elements is a ring of eight small messages per
    rank, its all-gather one exchange per peer, and the sums of small integers are exact in any order
    (measured on 2 gloo ranks: 563 against 251 us of process CPU per call, 931 against 460 us wall).

    Args:
        tensor: what to sum (the sums land there once the gather is waited for).
        group: the process group.
    """

    def __init__(self, tensor: torch.Tensor, group: dist.ProcessGroup) -> None:
        self.tensor = tensor
        self.gathered = torch.empty(dist.get_world_size(group), tensor.numel(), dtype=tensor.dtype)
        self.work = all_gather(self.gathered.unbind(0), tensor, group)
        self.summed = False

    def is_completed(self) -> bool:
        """Whether the gather is done."""
        return bool(self.work.is_completed())

    def wait(self, timeout: Any = None) -> bool:
        """Waits for the gather (``timeout``: as ``Work.wait``'s), then writes the sums into the tensor."""
        done = self.work.wait() if timeout is None else self.work.wait(timeout)
        if not self.summed:
            torch.sum(self.gathered, 0, out=self.tensor)
            self.summed = True
        return bool(done)


def all_reduce_small(tensor: torch.Tensor, group: dist.ProcessGroup) -> dist.Work:
    """Launches a sum of a few small integers across ranks (the flags): on the host an all-gather and a
    local sum (``SummedGather``), elsewhere an all-reduce; returns its work, not waited."""
    if tensor.device.type == "cpu" and dist.get_world_size(group) * tensor.numel() <= GATHER_MAX_NUMEL:
        return SummedGather(tensor, group)  # type: ignore[return-value]  # a Work's wait and is_completed
    return all_reduce(tensor, group)


class HeldWorks:
    """A module's works kept past their step, and the one loop that waits for them and lets them go
    ([Note: works kept past a step]).

    Their holders (the staged buffers, the staged flags) keep the data; the
    works are here alone, so one release waits for them all, whoever
    launched them.
    """

    __slots__ = ("works", "watch")

    def __init__(self) -> None:
        self.works: list[dist.Work] = []  # launched by every rank a step ago at most, in launch order
        self.watch = Watch()  # the module's, set at each plan: waits each work released

    def hold(self, work: dist.Work) -> None:
        """Keeps ``work`` until the next release."""
        self.works.append(work)

    def release(self) -> None:
        """Waits for every work kept (done by then: every rank launched them) and lets go of them: at the next
        forward, at the end of the next synchronised backward, at an optimizer step."""
        if self.works:
            works, self.works = self.works, []
            for work in works:
                self.watch.wait(work)

    def let_go(self) -> None:
        """Drops every work kept without waiting (at interpreter exit)."""
        self.works = []
