"""The roll call after a failed collective: every rank's note, read once for the whole group.

[Note: roll call]
When a collective fails, every surviving rank wants to know who is where
(watchdog.py). Reading the notes costs store requests, and all survivors
ask at the same moment against the one store, so the roll call is done once:

- The first rank to fail claims it (one ``add`` on a claim key) and reads
  every note with one ``multi_get``. A rank is settled at once when its note
  says it failed or left (its last note at exit says so, with its count of
  synchronised backwards), or when it ran on this host and its process no
  longer exists (its pid and start time are in its note: a process that
  ended needs no heartbeat to confirm it). The others are read again, with
  one ``multi_get`` of the unsettled ones every ``period / 5``, until each
  counter moved (alive) or two heartbeat periods passed (gone, or frozen).
- It publishes the result, compressed, under one key. Every other survivor
  waits for that key and reads it: three requests per survivor, whatever the
  world size. A survivor that waits two periods (and a margin) in vain does
  the roll call itself.

A survivor replaces its own entry with where it is now. Measured and
modelled against the earlier protocol (every survivor read every counter
twice) in benchmarks/failure_cost/bench_watchdog.py.
"""

from __future__ import annotations

import json
import os
import time
import zlib
from datetime import timedelta
from typing import Any, NamedTuple, Optional

from torchreplicate.faults.place import Place

CLAIM_KEY = "roll-call/claim"
VERDICT_KEY = "roll-call/verdict"
VERDICT_GRACE_S = 3.0  # past the claimer's two periods, before a survivor does the roll call itself


class Note(NamedTuple):
    """Where a rank said it was, read from the store.

    Attributes:
        rank: the group rank.
        place: where it was (its state, bucket or collective, and step: place.py's ``Place``).
        detail: the bucket's parameters, or what its re-plan changed: for messages only.
        seconds: how long it had been at that place, by its own clock, when it wrote.
        failed: it had given up after a failed collective (its heartbeat stopped then).
        host: its host name.
        pid: its process id.
        beats: its heartbeat counter, at the first read.
        alive: whether its counter moved between two reads.
        left: how it stopped watching ("exited", "released its replica", ...), or "".
        ended: its process ran on the reader's host and no longer exists.
    """

    rank: int
    place: Place
    detail: str
    seconds: float
    failed: bool
    host: str
    pid: int
    beats: int
    alive: bool
    left: str = ""
    ended: bool = False


def note_key(rank: int) -> str:
    """The store key of ``rank``'s note."""
    return f"note/{rank}"


def pid_namespace() -> str:
    """This process's pid namespace ("" where /proc has none): pids compare only within one."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def start_time(pid: int) -> int:
    """When process ``pid`` started, in clock ticks since boot (0 where /proc has no answer)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return int(stat.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return 0


def process_ended(pid: int, started: int) -> bool:
    """Whether process ``pid`` (started at ``started`` ticks, 0: unknown) has ended (a zombie has)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return True
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except (ProcessLookupError, PermissionError) as error:
            return isinstance(error, ProcessLookupError)  # not ours to signal: it exists
        return False
    return fields[0] in ("Z", "X") or (started != 0 and int(fields[19]) != started)  # pid reused


def _ended_here(raw: dict[str, Any], host: str, namespace: str) -> bool:
    return raw["host"] == host and raw["ns"] == namespace and process_ended(raw["pid"], raw["start"])


def roll_call(
    store: Any, rank: int, world_size: int, period: float, host: str, namespace: str, place: Optional[Place] = None
) -> list[Note]:
    """Every rank's note, each settled (failed, left, ended, alive) or silent for two periods.

    Args:
        store: the watchdog's store (notes under ``note_key(r)``).
        rank: the reading rank (alive by definition).
        world_size: ranks in the group.
        period: the heartbeat period in seconds.
        host: this host's name (``socket.gethostname()``).
        namespace: this process's pid namespace (``pid_namespace()``).
        place: the reading rank's ``Place``: an alive rank elsewhere is
            watched the two periods (it may arrive late), not just until it beats.
    """
    keys = [note_key(r) for r in range(world_size)]
    first = [json.loads(value) for value in store.multi_get(keys)]
    latest, ended = list(first), [_ended_here(raw, host, namespace) for raw in first]

    def settled(r: int) -> bool:  # failed or left (its last note: no heartbeat follows), or its process ended
        return bool(latest[r]["failed"] or latest[r]["left"]) or ended[r]

    def moved(r: int) -> bool:  # its counter moved, at the reader's place when one is given
        return latest[r]["beat"] != first[r]["beat"] and place in (None, Place.from_json(latest[r]["place"]))

    deadline = time.monotonic() + 2 * period + 0.05
    waiting = [r for r in range(world_size) if r != rank and not settled(r)]
    while waiting and time.monotonic() < deadline:
        time.sleep(max(0.0, min(period / 5, deadline - time.monotonic())))
        for r, value in zip(waiting, store.multi_get([keys[r] for r in waiting]), strict=True):
            latest[r] = json.loads(value)
            ended[r] = _ended_here(latest[r], host, namespace)
        waiting = [r for r in waiting if not (moved(r) or settled(r))]
    # alive: the reader itself, or a counter that moved (in a process that did not end)
    return [
        Note(
            r, Place.from_json(raw["place"]), raw["detail"], raw["seconds"], raw["failed"], raw["host"], raw["pid"],
            first[r]["beat"], r == rank or (raw["beat"] != first[r]["beat"] and not ended[r]), raw["left"], ended[r],
        )
        for r, raw in enumerate(latest)
    ]  # fmt: skip


def gather_notes(
    store: Any, rank: int, world_size: int, period: float, host: str, namespace: str, place: Optional[Place] = None
) -> list[Note]:
    """The roll call, done once for the group: claim it and publish it, or read what the claimer published.

    Arguments as ``roll_call``; see [Note: roll call]. Raises what the store
    raises when it does not answer.
    """
    if store.add(CLAIM_KEY, 1) == 1:
        notes = roll_call(store, rank, world_size, period, host, namespace, place)
        store.set(VERDICT_KEY, encode_notes(notes))
        return notes
    try:
        store.wait([VERDICT_KEY], timedelta(seconds=2 * period + VERDICT_GRACE_S))
    except RuntimeError:  # the claimer is gone or stuck: read for ourselves
        return roll_call(store, rank, world_size, period, host, namespace, place)
    return decode_notes(store.get(VERDICT_KEY))


def encode_notes(notes: list[Note]) -> bytes:
    """Notes as one compact value (JSON rows, each place as ``Place.to_json`` writes it, zlib)."""
    rows = [[note.rank, note.place.to_json(), *note[2:]] for note in notes]
    return zlib.compress(json.dumps(rows, separators=(",", ":")).encode())


def decode_notes(value: bytes) -> list[Note]:
    """The inverse of ``encode_notes``."""
    return [Note(row[0], Place.from_json(row[1]), *row[2:]) for row in json.loads(zlib.decompress(value))]


def ordinal(n: int) -> str:
    """1st, 2nd, 3rd, 4th, 11th, 21st, ..."""
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


def describe_notes(notes: list[Note], this_rank: int, silence_s: float) -> str:
    """Who is where, as a sentence for the error (pure: tested alone).

    Args:
        notes: every rank's note, by rank.
        this_rank: the rank raising.
        silence_s: how long a gone rank's heartbeat was watched without moving.
    """
    mine = notes[this_rank]
    # waiting where this rank waits (or having given up there, like this rank)
    with_me = sorted({this_rank, *(n.rank for n in notes if (n.alive or n.failed) and n.place == mine.place)})
    parts = [_describe(note, silence_s) for note in notes if note.rank not in with_me]
    label = "rank {} waits" if len(with_me) == 1 else "ranks {} wait"
    place = f"{label.format(', '.join(map(str, with_me)))} in {mine.place.describe(mine.detail)}"
    if any(note.left for note in notes if note.rank not in with_me):
        if mine.place.in_backward:
            place += f", its {ordinal(mine.place.step + 1)} synchronised backward: "
            place += "the ranks ran different numbers of backward passes"
        else:
            place += ": the ranks ran different numbers of forward passes"
    return "; ".join([*parts, place])


def _describe(note: Note, silence_s: float) -> str:
    # One rank that is not where the raising rank is.
    step, where = note.place.step, note.place.describe(note.detail)
    backwards = f"{step} synchronised backward{'' if step == 1 else 's'}"
    if note.left:
        return f"rank {note.rank} {'exited' if note.ended else note.left} after {backwards}"
    if note.failed:
        return f"rank {note.rank} stopped after an error in {where}"
    if note.ended or not note.alive:
        why = "has ended" if note.ended else f"sent no heartbeat in {silence_s:.1f} s"
        return (
            f"rank {note.rank} is gone (its process, pid {note.pid} on {note.host}, {why}; its last report, "
            f"at most one heartbeat old, was {where})"
        )
    return f"rank {note.rank} has been in {where} for {note.seconds:.0f} s"
