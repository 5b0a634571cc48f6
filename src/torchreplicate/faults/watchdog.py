"""The stall watchdog: where every rank is, so a stuck or broken collective names who is missing.

[Note: stall watchdog]
A collective waits for every rank of its group. When one rank is late (busy
in user code, stuck somewhere else) or gone (crashed, killed), DDP's ranks
wait the whole process-group timeout (30 minutes on gloo), then print gloo's
text with no rank, step or parameter. A late rank is often healthy: rank 0
saving a checkpoint, a rank-0-only evaluation, a data-loader hiccup, and DDP
finishes those jobs. So the watchdog tells them apart and ends a job only
where DDP's would end, or where it could never finish:

- Every collective runs under the process group's own timeout, as DDP's do
  (no per-operation option). The waiting rank waits through
  ``Watch.wait`` (wire.py), sliced here: ``Work.wait(timeout)`` in slices (on gloo it raises
  "Operation timed out!" and leaves the operation in flight, unharmed;
  measured on torch 2.13). At ``stall_timeout`` and then at doubling
  intervals (60 s, 120 s, 240 s, ...) it reads every rank's note:
  a peer alive and outside the step (forward, its backward's computation,
  user code) draws a warning (``StallWarning``) naming it, where it is and
  for how long, and the wait goes on until gloo ends the operation at the
  group's timeout, then raises with the roll call as before. A peer gone
  (failed, left, process ended, heartbeat silent for two periods) or alive
  inside another of our collectives (a mismatch that can never complete)
  makes the waiting rank raise at once, naming it; the peer stuck in the
  other collective sees the same at its own wake-up, so every rank raises.
  The operation stays in flight: the processes exit when gloo ends it (the
  group's timeout; at once when a peer's process ends first).
  A dead peer needs no timeout: gloo reports the closed connection at once.
  On NCCL the CPU does not wait in ``Work.wait`` (it orders the stream), so
  the waits are plain and the group's timeout (NCCL's own watchdog) rules.
- The main thread notes where it is (``StallWatch.at``), a few attribute
  writes per step: a ``Place`` (place.py), the module's ``TrainingState``
  with a bucket index or one of our other collectives (``Collective``: the
  re-plan, the flags' all-reduce, the late, sparse and tied rounds), and the
  step. Every decision compares places: a peer is at this rank's place when
  its place equals this rank's; it is outside our collectives when its place
  names no collective in ``IDLE``, ``FORWARD`` or ``BACKWARD``
  (``Place.outside``). The text of a place is made in one function,
  ``Place.describe``, from the place and the bucket's parameters or the
  re-plan's change (kept beside the place, for messages only). The buffer
  broadcast before a forward runs at the forward's place, as a joined rank's
  broadcast runs at its last one: a peer waiting there reads as outside.
- A heartbeat thread copies that note, with a counter it increments, into
  the process group's own store every ``period`` seconds: one ``set`` (a
  one-way message), no collective, off the hot path. It stops with the
  process group, when a collective failed, and at interpreter exit (a
  thread inside a store call at exit aborts the process), and then leaves a
  last note saying that the rank left and after how many synchronised
  backwards.

When a reducer collective fails (group timeout or closed connection), the group
reads every rank's note once ([Note: roll call] in roll_call.py): a rank
that left or failed says so; a rank on this host whose process ended is
named at once; a rank whose counter did not move for two periods is gone
(or frozen); a rank whose note differs from this one's is elsewhere, and
the note says where and for how long. The error names them all, and keeps
gloo's text as its cause. No clocks are compared across hosts: each rank
measures durations with its own clock.

The period is a sixth of the stall timeout, between 0.2 and 1.5 s, so a
peer on another host is named within 3 s; at more than 600 ranks it grows
with the world size, so that the heartbeats stay under 400 a second (1% of
what one TCPStore served on a loaded 2-core machine, benchmarks/failure_cost/bench_watchdog.py).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import socket
import threading
import time
import warnings
import weakref
from datetime import timedelta
from typing import Iterable

import torch
import torch.distributed as dist

from torchreplicate.config import backend_of
from torchreplicate.faults.roll_call import (
    Note,
    describe_notes,
    gather_notes,
    note_key,
    pid_namespace,
    roll_call,
    start_time,
)
from torchreplicate.faults.wire import Watch
from torchreplicate.lifecycle import TrainingState
from torchreplicate.torch_internals import group_store, group_timeout

__all__ = ["MAX_BEATS_PER_S", "Note", "StallWarning", "StallWatch", "describe_notes", "heartbeat_period"]

MAX_BEATS_PER_S = 400.0  # heartbeats of a whole group per second, at most (see the Note)


class StallWarning(UserWarning):
    """A peer is alive but late, outside the step; the collective keeps waiting ([Note: stall watchdog])."""


def where_outside(note: Note) -> str:
    """Where a live peer outside our collectives is, for the warning: "outside the step for 61 s (...)"."""
    where = note.place.describe(note.detail)
    if note.place.state is TrainingState.IDLE:  # the set-up, or user code between steps
        return f"outside the step for {note.seconds:.0f} s ({where})"
    return f"in {where} for {note.seconds:.0f} s"


def heartbeat_period(timeout_s: float, world_size: int) -> float:
    """Seconds between two heartbeats of one rank (pure: tested alone).

    Args:
        timeout_s: ``stall_timeout`` in seconds.
        world_size: ranks in the group.
    """
    return max(min(1.5, max(0.2, timeout_s / 6)), world_size / MAX_BEATS_PER_S)


class StallWatch(Watch):
    """One module's watchdog, a ``Watch`` that looks at its peers; see [Note: stall watchdog].

    Args:
        group: the module's process group (its store carries the notes).
        timeout_s: ``stall_timeout`` in seconds.
        key: a name unique to this module in this run, equal on every rank.
        device_type: where the module's collectives run ("cpu", "cuda"): which of the group's backends waits.
    """

    def __init__(self, group: dist.ProcessGroup, timeout_s: float, key: str, device_type: str = "cpu") -> None:
        super().__init__()  # where this rank is: written by the main thread, read by the heartbeat thread
        # - Configuration
        self.timeout_s = timeout_s  # the first look at the peers, then at doubling intervals
        self.group_timeout_s = group_timeout(group)  # when the backend ends a collective (init_process_group)
        # Waits in slices on gloo only, where Work.wait blocks the CPU and a timed wait leaves the
        # operation unharmed (measured, torch 2.13). NCCL's wait only orders the stream (the CPU
        # never waits there), and its timed wait may abort the communicator: plain waits.
        self.sliced = backend_of(group, device_type) == "gloo"
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.period = heartbeat_period(timeout_s, self.world_size)  # seconds between heartbeats
        self.failed = False
        self.left = ""  # how this rank stopped watching ("exited", ...): its last note says so
        # - Who this rank is: a peer on this host checks the process itself
        self.host = socket.gethostname()
        self.namespace = pid_namespace()
        self.pid = os.getpid()
        self.started = start_time(self.pid)  # tells a reused pid apart
        self.beats = 0  # heartbeat counter, in every note
        # - The store: a clone of the group's, so the heartbeat never waits
        #   behind the main thread's store calls; short timeouts
        base = group_store(group).clone()
        base.set_timeout(timedelta(seconds=max(2.0, 2 * self.period)))
        self._store = dist.PrefixStore(f"torchreplicate/{key}/", base)
        self._group_ref = weakref.ref(group)  # stop with the process group
        self._stop = threading.Event()
        self._beat()  # the note exists before any rank may read it
        self._thread = threading.Thread(target=self._run, name=f"torchreplicate-heartbeat-{key}", daemon=True)
        self._thread.start()
        atexit.register(_leave_at_exit, weakref.ref(self))

    def stop(self) -> None:
        """Stops the heartbeat thread and waits for it."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)

    def leave(self, how: str) -> None:
        """Stops the heartbeat and leaves a last note: this rank ``how`` (e.g. "exited"), and its step."""
        self.stop()
        if self.failed or self.left:
            return  # its last note is written already
        self.left = how
        with contextlib.suppress(Exception):  # the store is gone: nobody is left to read the note
            self._beat()

    def wait_event(self, event: torch.Event) -> None:
        """Polls ``event`` (``wait_until``): on NCCL a hung peer is named from the notes before NCCL's own abort."""
        self.wait_until(event.query)

    def note_raised(self, step: int, what: str) -> None:
        """Leaves a note that this rank raised in ``step`` (``what``: the exception, one line), which the
        others' error names ([Note: a backward that raised] in reducer/reducer.py); one store write."""
        with contextlib.suppress(Exception):  # the store is gone: the others' error names the rank alone
            self._store.set(f"raised/{self.rank}", json.dumps({"step": step, "what": what}))

    def raised_notes(self, ranks: Iterable[int]) -> dict[int, str]:
        """What ``ranks`` noted they raised (``note_raised``), where they left a note: "step 3: ValueError: ..."."""
        notes = {}
        for rank in ranks:
            key = f"raised/{rank}"
            with contextlib.suppress(Exception):
                if self._store.check([key]):
                    note = json.loads(self._store.get(key))
                    notes[rank] = f"step {note['step']}: {note['what']}"
        return notes

    def look_at_peers(self, waited: float) -> None:
        """Warns for each live peer outside the step; raises for a peer gone or in another collective.

        Args:
            waited: seconds this rank has waited in its collective.
        """
        place, here = self.place, self.place.describe(self.detail)
        notes = roll_call(self._store, self.rank, self.world_size, self.period, self.host, self.namespace)
        notes[self.rank] = self._own_note()
        elsewhere = [n for n in notes if n.rank != self.rank and n.place != place]
        fatal = [n for n in elsewhere if n.failed or n.left or n.ended or not n.alive or not n.place.outside]
        if fatal:
            self.failed = True
            self._beat()  # a peer stuck in its own collective reads at its wake-up that this rank gave up
            self.stop()
            raise RuntimeError(
                f"replicate(): rank {self.rank}: {here} waited {waited:.0f} s: a peer is gone or waits in another "
                f"collective, so this one can never complete. {describe_notes(notes, self.rank, 2 * self.period)}"
            )
        for note in elsewhere:
            warnings.warn(
                f"replicate(): rank {self.rank} has waited {waited:.0f} s in {here}: "
                f"rank {note.rank}: {where_outside(note)}, alive. Waiting on, up to the process group's "
                f"timeout ({self.group_timeout_s:.0f} s), as DDP does; next look in {waited:.0f} s "
                "(stall_timeout sets the first)",
                StallWarning,
                stacklevel=2,
            )

    def diagnose(self, error: BaseException, before: str = "") -> RuntimeError:
        """The error to raise when a collective of ours failed with ``error``, at this rank's place.

        Reads every rank's note ([Note: roll call] in roll_call.py), then stops the heartbeat.

        Args:
            error: what the collective raised (gloo's text stays in the message).
            before: a collective run before the place, not at it (the buffer
                broadcast before a forward), named first; "" for the place's
                own. Default "".
        """
        what = (f"{before} before " if before else "") + self.place.describe(self.detail)
        # gloo's words for the work that timed out, and for another in flight whose pair it then
        # closed ("Application timeout caused pair closure": the flags' all-reduce may time out first)
        if any(words in str(error) for words in ("Timed out", "timed out", "timeout caused pair closure")):
            cause = f"waited more than the process group's timeout ({self.group_timeout_s:g} s)"
        else:
            cause = "failed: a peer's connection broke"
        head = f"replicate(): rank {self.rank}: {what} {cause}"
        try:
            # First this rank's own note, where it failed: a survivor that gathers
            # the roll call reads it there now, not a heartbeat late (or as gone).
            self.failed = True
            self._beat()
            notes = gather_notes(
                self._store, self.rank, self.world_size, self.period, self.host, self.namespace, self.place
            )
        except Exception as store_error:  # the store lived in a rank that is gone
            self.stop()
            return RuntimeError(
                f"{head}; the others' positions are unknown (the store did not answer: "
                f"{type(store_error).__name__}: {str(store_error).splitlines()[0]}). gloo said: {error}"
            )
        self.stop()
        notes[self.rank] = self._own_note()  # a published roll call may be older than this rank's failure
        return RuntimeError(f"{head}. {describe_notes(notes, self.rank, 2 * self.period)}")

    # -- the heartbeat thread -----------------------------------------------

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            if self._group_ref() is None:  # destroy_process_group(): nothing to watch
                self.leave("destroyed its process group")
                return
            try:
                self._beat()
            except Exception:  # the store is gone (its host rank died): nothing left to tell
                return

    def _beat(self) -> None:
        self.beats += 1
        note = {
            "place": self.place.to_json(),  # parsed back by the reader (roll_call.py)
            "detail": self.detail,
            "seconds": round(time.monotonic() - self.entered, 3),
            "failed": self.failed,
            "left": self.left,
            "host": self.host,
            "ns": self.namespace,
            "pid": self.pid,
            "start": self.started,
            "beat": self.beats,
        }
        self._store.set(note_key(self.rank), json.dumps(note))  # one one-way message

    def _own_note(self) -> Note:
        seconds = time.monotonic() - self.entered
        return Note(self.rank, self.place, self.detail, seconds, True, self.host, self.pid, self.beats, True)


def _leave_at_exit(ref: weakref.ref[StallWatch]) -> None:
    watch = ref()
    if watch is not None:
        watch.leave("exited")
