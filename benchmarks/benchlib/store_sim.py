"""Simulated ranks against one TCPStore: the watchdog's heartbeats and its diagnosis, before and after.

Each simulated rank is a thread with its own store connection (the store
calls release the GIL). "before" is the protocol of torchreplicate up to
issue 22, copied here since the library no longer has it: two requests per
heartbeat (``set`` the note, ``add`` the counter), and on a failure every
survivor reads every counter twice (``add(key, 0)``, one round trip each)
two periods apart, then every note (``multi_get``). "after" is the library's
(roll_call.py): one ``set`` per heartbeat, and one roll call for the group.
"""

from __future__ import annotations

import json
import threading
import time
from datetime import timedelta
from typing import Any, Callable

import torch.distributed as dist

from torchreplicate.faults.roll_call import gather_notes, note_key

HOST = "sim-host"  # the notes' host: not this one, so no process check (the cross-host case)


def connect(port: int, count: int) -> list[Any]:
    """``count`` store clients, each with its own connection."""
    return [dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=120)) for _ in range(count)]


def served_per_s(clients: list[Any], op: str, duration_s: float) -> float:
    """Requests per second the store served with every client in a tight loop of ``op`` ("set" or "add")."""
    counts = [0] * len(clients)
    end = time.monotonic() + duration_s

    def hammer(i: int) -> None:
        store, n = clients[i], 0
        while time.monotonic() < end:
            if op == "set":
                store.set(f"cap-set/{i}", "x" * 160)
            else:
                store.add(f"cap-add/{i}", 1)
            n += 1
        if op == "set":
            store.add(f"cap-flush/{i}", 0)  # a round trip: every set before it was served
        counts[i] = n

    start = time.monotonic()
    _run_all([lambda i=i: hammer(i) for i in range(len(clients))])
    return sum(counts) / (time.monotonic() - start)


def _run_all(jobs: list[Callable[[], None]]) -> None:
    threads = [threading.Thread(target=job) for job in jobs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def note_value(rank: int, beat: int, protocol: str) -> str:
    """A note as the protocol writes it (the size matters: what the store carries)."""
    note = {"place": ["FINALIZING", 1234, 0, None], "detail": "'layers.0.weight', 'layers.0.bias' and 2 more"}
    note["seconds"] = 12.345
    note.update({"failed": False, "host": HOST, "pid": 100000 + rank})
    if protocol == "after":
        note.update({"left": "", "ns": "pid:[4026531836]", "start": 123456789, "beat": beat})
    return json.dumps(note)


def beat(store: Any, rank: int, beats: int, protocol: str) -> int:
    """One heartbeat of ``rank``; returns the store requests it made."""
    store.set(note_key(rank), note_value(rank, beats, protocol))
    if protocol == "before":
        store.add(f"beat/{rank}", 1)
        return 2
    return 1


class Beaters:
    """The live simulated ranks' heartbeat threads, every ``period`` seconds, in ``num_threads`` threads."""

    def __init__(self, clients: list[Any], prefix: str, ranks: list[int], period: float, protocol: str) -> None:
        self.requests = 0  # store requests made, all threads together
        self._stop = threading.Event()
        self._lock = threading.Lock()
        groups = [ranks[i :: len(clients)] for i in range(len(clients))]
        self._threads = [
            threading.Thread(target=self._run, args=(dist.PrefixStore(prefix, c), g, period, protocol))
            for c, g in zip(clients, groups, strict=True)
        ]
        for thread in self._threads:
            thread.start()

    def _run(self, store: Any, ranks: list[int], period: float, protocol: str) -> None:
        beats = 1
        offset = period * (ranks[0] % 10) / 10 if ranks else 0.0  # spread over the period, like real ranks
        if self._stop.wait(offset):
            return
        while True:
            start = time.monotonic()
            beats += 1
            made = sum(beat(store, r, beats, protocol) for r in ranks)
            with self._lock:
                self.requests += made
            if self._stop.wait(max(0.0, period - (time.monotonic() - start))):
                return

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join()


def diagnose_before(store: Any, rank: int, world_size: int, period: float) -> int:
    """The pre-issue-22 diagnosis of one survivor; returns its store requests."""
    ranks = range(world_size)
    first = [store.add(f"beat/{r}", 0) for r in ranks]
    time.sleep(2 * period + 0.05)
    second = [store.add(f"beat/{r}", 0) for r in ranks]
    raw = store.multi_get([note_key(r) for r in ranks])
    alive = [a != b for a, b in zip(first, second, strict=True)]
    assert len(raw) == world_size and any(alive)
    return 2 * world_size + 1


def diagnose_after(store: Any, rank: int, world_size: int, period: float) -> int:
    """The library's diagnosis of one survivor (roll_call.gather_notes); returns 0 (counted by the caller)."""
    notes = gather_notes(store, rank, world_size, period, "this-host", "")
    assert not notes[world_size - 1].alive, "the dead rank must be named"
    return 0


def failure(clients: list[Any], world_size: int, protocol: str, period: float) -> dict:
    """``world_size`` simulated ranks; the last one dies; every other one diagnoses at once.

    Returns the seconds each survivor took (from the common start), and the store requests.
    """
    prefix = f"{protocol}/{world_size}/{time.monotonic_ns()}/"
    setup = dist.PrefixStore(prefix, clients[0])
    for r in range(world_size):
        beat(setup, r, 1, protocol)
    survivors = list(range(world_size - 1))
    beaters = Beaters(clients[-4:], prefix, survivors, period, protocol)  # their own connections
    time.sleep(period)  # steady state first
    diagnose = diagnose_before if protocol == "before" else diagnose_after
    assert len(clients) >= len(survivors) + 4, "one connection per survivor"
    stores = [dist.PrefixStore(prefix, clients[r]) for r in survivors]
    done = [0.0] * len(survivors)
    requests = [0] * len(survivors)
    gate = threading.Barrier(len(survivors))

    def survivor(r: int) -> None:
        gate.wait()
        start = time.monotonic()
        requests[r] = diagnose(stores[r], r, world_size, period)
        done[r] = time.monotonic() - start

    _run_all([lambda r=r: survivor(r) for r in survivors])
    beaters.stop()
    if protocol == "after":  # claim, wait, get per survivor; the claimer's polls (10 at most) and publication
        requests = [3] * (len(survivors) - 1) + [1 + 11 + 2]
    return {"seconds": sorted(done), "requests": sum(requests)}
