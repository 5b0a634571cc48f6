"""The stall watchdog: where every rank is, so a stuck or broken collective names who is missing.

[Note: stall watchdog]
A collective waits for every rank of its group. When one rank is late (stuck
in user code, waiting somewhere else) or gone (crashed, killed), the others
used to wait the whole process-group timeout (30 minutes on gloo), then
print gloo's text with no rank, step or parameter. Three pieces fix that:

- Every collective the reducer launches carries its own timeout,
  ``stall_timeout`` (gloo's per-operation option). gloo then ends the
  operation itself, so the process can still exit; a wait with a timeout of
  its own (``Work.wait(timeout)``, polling) would leave the operation in
  flight, and exit would block until the peer arrives (measured on torch
  2.13). A dead peer needs no timeout: gloo reports the closed connection at
  once.
- The main thread notes where it is (``StallWatch.at``: forward, backward,
  bucket k, finalize, and the step), a few attribute writes per step.
- A heartbeat thread copies that note into the process group's own store
  every ``period`` seconds, with a counter it increments. It adds no
  collective, runs off the hot path, and stops with the process group, at
  interpreter exit (a thread inside a store call at exit aborts the process)
  and when a collective failed.

When a reducer collective fails (timeout or closed connection), the rank
reads every rank's note twice, two periods apart: a rank whose counter did
not move is gone (or frozen); a rank whose note differs from its own is
elsewhere, and the note says where and for how long. The error names them
all, and keeps gloo's text as its cause. No clocks are compared across
hosts: each rank measures durations with its own clock.
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import threading
import time
import weakref
from datetime import timedelta
from typing import Any, NamedTuple

import torch.distributed as dist


class Note(NamedTuple):
    """Where a rank said it was, read from the store.

    Attributes:
        rank: the group rank.
        phase: what it was doing ("forward", "backward", "bucket 0", "finalize", "idle", ...).
        step: synchronised backwards it had completed.
        seconds: how long it had been in that phase, by its own clock, when it wrote.
        failed: it had given up after a failed collective (its heartbeat stopped then).
        host: its host name.
        pid: its process id.
        beats: its heartbeat counter, at the first read.
        alive: whether its counter moved between two reads.
    """

    rank: int
    phase: str
    step: int
    seconds: float
    failed: bool
    host: str
    pid: int
    beats: int
    alive: bool


class StallWatch:
    """One module's watchdog; see [Note: stall watchdog].

    Args:
        group: the module's process group (its store carries the notes).
        timeout_s: ``stall_timeout`` in seconds.
        key: a name unique to this module in this run, equal on every rank.
    """

    def __init__(self, group: dist.ProcessGroup, timeout_s: float, key: str) -> None:
        # - Configuration
        self.timeout_s = timeout_s
        self.timeout = timedelta(seconds=timeout_s)  # per-operation timeout of every reducer collective
        self.period = min(5.0, max(0.2, timeout_s / 6))  # heartbeat period
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        # - Where this rank is: written by the main thread, read by the heartbeat thread
        self.phase = "set-up"
        self.step = 0
        self.entered = time.monotonic()
        self.failed = False
        # - The store: a clone of the group's, so the heartbeat never waits
        #   behind the main thread's store calls; short timeouts
        base = group.get_group_store().clone()  # type: ignore[attr-defined]  # pybind, missing from the stubs
        base.set_timeout(timedelta(seconds=max(2.0, 2 * self.period)))
        self._store = dist.PrefixStore(f"torchreplicate/{key}/", base)
        self._group_ref = weakref.ref(group)  # stop with the process group
        self._stop = threading.Event()
        self._beat()  # both keys exist before any rank may read them
        self._thread = threading.Thread(target=self._run, name=f"torchreplicate-heartbeat-{key}", daemon=True)
        self._thread.start()
        atexit.register(_stop_at_exit, weakref.ref(self))

    def at(self, phase: str, step: int) -> None:
        """Notes where this rank is now (main thread; a few attribute writes)."""
        self.phase = phase
        self.step = step
        self.entered = time.monotonic()

    def stop(self) -> None:
        """Stops the heartbeat thread and waits for it."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)

    def diagnose(self, what: str, error: BaseException) -> RuntimeError:
        """The error to raise when ``what`` (a collective) failed with ``error``.

        Reads every rank's note twice (about two heartbeat periods apart),
        then stops the heartbeat.
        """
        timed_out = "Timed out" in str(error) or "timed out" in str(error)
        cause = f"waited more than {self.timeout_s:g} s" if timed_out else "failed: a peer's connection broke"
        head = f"replicate(): rank {self.rank}: {what} {cause}"
        try:
            notes = self._read_notes()
            self.failed = True
            self._beat()  # a last note: the others read "stopped after an error", not "gone"
        except Exception as store_error:  # the store lived in a rank that is gone
            self.stop()
            return RuntimeError(
                f"{head}; the others' positions are unknown (the store did not answer: "
                f"{type(store_error).__name__}: {str(store_error).splitlines()[0]}). gloo said: {error}"
            )
        self.stop()
        return RuntimeError(f"{head}. {describe_notes(notes, self.rank, 2 * self.period)}")

    # -- the heartbeat thread -----------------------------------------------

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            if self._group_ref() is None:  # destroy_process_group(): nothing to watch
                return
            try:
                self._beat()
            except Exception:  # the store is gone (its host rank died): nothing left to tell
                return

    def _beat(self) -> None:
        note = {
            "phase": self.phase,
            "step": self.step,
            "seconds": round(time.monotonic() - self.entered, 3),
            "failed": self.failed,
            "host": socket.gethostname(),
            "pid": os.getpid(),
        }
        self._store.set(f"note/{self.rank}", json.dumps(note))
        self._store.add(f"beat/{self.rank}", 1)  # a round trip: a dead store shows up here

    def _read_notes(self) -> list[Note]:
        ranks = range(self.world_size)
        first = [self._store.add(f"beat/{r}", 0) for r in ranks]
        time.sleep(2 * self.period + 0.05)
        second = [self._store.add(f"beat/{r}", 0) for r in ranks]
        raw = self._store.multi_get([f"note/{r}" for r in ranks])
        notes = []
        for r in ranks:
            note: dict[str, Any] = json.loads(raw[r])
            alive = second[r] != first[r] or r == self.rank
            notes.append(
                Note(
                    r,
                    note["phase"],
                    note["step"],
                    note["seconds"],
                    note["failed"],
                    note["host"],
                    note["pid"],
                    first[r],
                    alive,
                )
            )
        return notes


def describe_notes(notes: list[Note], this_rank: int, silence_s: float) -> str:
    """Who is where, as a sentence for the error (pure: tested alone).

    Args:
        notes: every rank's note, by rank.
        this_rank: the rank raising.
        silence_s: how long a gone rank's heartbeat was watched without moving.
    """
    mine = notes[this_rank]
    # waiting where this rank waits (or having given up there, like this rank)
    with_me = [n.rank for n in notes if (n.alive or n.failed) and (n.phase, n.step) == (mine.phase, mine.step)]
    with_me = sorted({*with_me, this_rank})
    parts = []
    for note in notes:
        if note.rank in with_me:
            continue
        if note.failed:
            parts.append(f"rank {note.rank} stopped after an error in {note.phase} of step {note.step}")
        elif not note.alive:
            parts.append(
                f"rank {note.rank} is gone (its process, pid {note.pid} on {note.host}, sent no heartbeat "
                f"in {silence_s:.1f} s; its last report, at most one heartbeat old, was {note.phase} of "
                f"step {note.step})"
            )
        else:
            parts.append(f"rank {note.rank} has been in {note.phase} of step {note.step} for {note.seconds:.0f} s")
    waiting = ", ".join(str(r) for r in with_me)
    label = "rank {} waits" if len(with_me) == 1 else "ranks {} wait"
    parts.append(f"{label.format(waiting)} in {mine.phase} of step {mine.step}")
    return "; ".join(parts)


def _stop_at_exit(ref: weakref.ref[StallWatch]) -> None:
    watch = ref()
    if watch is not None:
        watch.stop()
