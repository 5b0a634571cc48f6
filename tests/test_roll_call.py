"""The watchdog's roll call ([Note: roll call] in roll_call.py) without a process group."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from typing import Any

from torchreplicate.faults.place import Collective, Place
from torchreplicate.faults.roll_call import (
    CLAIM_KEY,
    Note,
    decode_notes,
    describe_notes,
    encode_notes,
    gather_notes,
    note_key,
    ordinal,
    pid_namespace,
    process_ended,
    roll_call,
    start_time,
)
from torchreplicate.faults.watchdog import heartbeat_period
from torchreplicate.lifecycle import TrainingState

HOST = "hostA"


class FakeStore:
    """The store calls the roll call makes, on a dict; counts them."""

    def __init__(self) -> None:
        self.values: dict[str, Any] = {}
        self.requests = 0
        self.lock = threading.Condition()

    def set(self, key: str, value: Any) -> None:
        with self.lock:
            self.requests += 1
            self.values[key] = value
            self.lock.notify_all()

    def add(self, key: str, amount: int) -> int:
        with self.lock:
            self.requests += 1
            self.values[key] = self.values.get(key, 0) + amount
            return self.values[key]

    def get(self, key: str) -> Any:
        with self.lock:
            self.requests += 1
            return self.values[key]

    def multi_get(self, keys: list[str]) -> list[Any]:
        with self.lock:
            self.requests += 1
            return [self.values[key] for key in keys]

    def wait(self, keys: list[str], timeout: Any) -> None:
        with self.lock:
            if not self.lock.wait_for(lambda: all(k in self.values for k in keys), timeout.total_seconds()):
                raise RuntimeError("wait timed out")


BUCKET_0 = Place(TrainingState.FINALIZING, 3, 0)


def note(rank: int, place: Place = BUCKET_0, beat: int = 1, **fields: Any) -> str:
    detail = "'w'" if place.bucket is not None else ""
    raw = {"place": place.to_json(), "detail": detail, "seconds": 1.0, "failed": False, "left": "", "host": HOST}
    raw["ns"] = "n"
    raw.update({"pid": 10_000_000 + rank, "start": 0, "beat": beat}, **fields)  # pids beyond pid_max: ended
    return json.dumps(raw)


def test_the_period_is_a_few_seconds_at_most_and_grows_with_thousands_of_ranks():
    assert heartbeat_period(3.0, 2) == 0.5
    assert heartbeat_period(0.5, 2) == 0.2
    assert heartbeat_period(60.0, 8) == 1.5  # was 5 s: a peer on another host named within 3 s
    assert heartbeat_period(60.0, 1000) == 2.5  # 400 heartbeats a second at most
    assert heartbeat_period(60.0, 10_000) == 25.0


def test_ended_settled_and_left_ranks_are_named_without_waiting_for_heartbeats():
    store = FakeStore()
    store.set(note_key(0), note(0, host="elsewhere", pid=os.getpid()))
    store.set(note_key(1), note(1, host=HOST, ns="n"))  # this host, its process gone
    store.set(note_key(2), note(2, Place(TrainingState.IDLE, 2), host="elsewhere", left="exited"))
    store.set(note_key(3), note(3, host="elsewhere", failed=True))
    start = time.monotonic()
    notes = roll_call(store, 0, 4, period=5.0, host=HOST, namespace="n")
    assert time.monotonic() - start < 1.0, "nothing to wait for: every rank is settled at the first read"
    assert [n.ended for n in notes] == [False, True, False, False], notes
    sentence = describe_notes(notes, 0, silence_s=10.0)
    assert "rank 1 is gone (its process, pid 10000001 on hostA, has ended; its last report" in sentence, sentence
    assert "rank 2 exited after 2 synchronised backwards" in sentence, sentence
    assert sentence.endswith(
        "ranks 0, 3 wait in bucket 0 ('w') of step 3, its 4th synchronised backward: "
        "the ranks ran different numbers of backward passes"
    ), sentence


def test_a_silent_remote_rank_is_gone_after_two_periods_and_a_beating_one_is_alive():
    store = FakeStore()
    for rank in range(3):
        store.set(note_key(rank), note(rank, host="elsewhere", pid=os.getpid()))
    stop = threading.Event()

    def beat() -> None:  # rank 2 beats; rank 1 is silent
        beats = 1
        while not stop.wait(0.05):
            beats += 1
            store.set(
                note_key(2), note(2, Place(TrainingState.FORWARD, 3), host="elsewhere", pid=os.getpid(), beat=beats)
            )

    thread = threading.Thread(target=beat)
    thread.start()
    start = time.monotonic()
    try:
        notes = roll_call(store, 0, 3, period=0.2, host=HOST, namespace="n")
    finally:
        stop.set()
        thread.join()
    assert 0.35 < time.monotonic() - start < 2.0
    assert [n.alive for n in notes] == [True, False, True], notes
    sentence = describe_notes(notes, 0, silence_s=0.4)
    assert "rank 1 is gone (its process, pid" in sentence and "sent no heartbeat in 0.4 s" in sentence, sentence
    assert "rank 2 has been in forward of step 3" in sentence, sentence


def test_one_rank_reads_the_notes_and_the_others_read_its_result():
    store = FakeStore()
    world = 50
    for rank in range(world):
        store.set(note_key(rank), note(rank, failed=rank != 7))  # rank 7 is gone (ended, this host)
    before = store.requests
    results: list[list[Note]] = [[] for _ in range(world)]

    def diagnose(rank: int) -> None:
        results[rank] = gather_notes(store, rank, world, 0.2, HOST, "n")

    threads = [threading.Thread(target=diagnose, args=(r,)) for r in range(world) if r != 7]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert store.values[CLAIM_KEY] == world - 1
    # one roll call (a multi_get) and its publication, then three requests per survivor
    assert store.requests - before <= 3 * (world - 1) + 2, store.requests - before
    for rank in range(world):
        if rank != 7:
            assert results[rank][7].ended and not results[rank][7].alive, results[rank][7]


def test_notes_travel_compressed_and_come_back_equal():
    notes = [Note(r, Place(TrainingState.FINALIZING, 12, 0), "'w'", 1.5, r % 2 == 0, HOST, 100 + r, 7, True, "", False)
             for r in range(1000)]  # fmt: skip
    value = encode_notes(notes)
    assert decode_notes(value) == notes
    assert len(value) < 20 * len(notes), len(value)


def test_every_place_reads_as_one_text_decides_by_its_fields_and_travels_as_json():
    idle, forward, backward, ending = (TrainingState.IDLE, TrainingState.FORWARD, TrainingState.BACKWARD,
                                       TrainingState.FINALIZING)  # fmt: skip
    places = {  # place, detail -> its words, outside our collectives, in a backward
        (Place(idle, 0), ""): ("set-up of step 0", True, False),
        (Place(forward, 2), ""): ("forward of step 2", True, False),
        (Place(forward, 2, collective=Collective.REPLAN), "'0.weight' frozen"): (
            "a re-plan ('0.weight' frozen: every rank must make the same change at the same step) of step 2",
            False,
            False,
        ),
        (Place(backward, 2), ""): ("backward of step 2", True, True),
        (Place(ending, 2, 3), "fc1.weight, fc1.bias"): ("bucket 3 (fc1.weight, fc1.bias) of step 2", False, True),
        (Place(ending, 2, collective=Collective.FLAGS), ""): ("the flags' all-reduce of step 2", False, True),
        (Place(ending, 2, collective=Collective.LATE_ROUND), ""): ("late round of step 2", False, True),
        (Place(ending, 2, collective=Collective.SPARSE), ""): ("sparse gradients of step 2", False, True),
        (Place(ending, 2, collective=Collective.TIED_ROWS), ""): ("the tied parameters' rows of step 2", False, True),
        (Place(idle, 3), ""): ("user code after the backward of step 3", True, False),
    }
    for (place, detail), (words, outside, in_backward) in places.items():
        assert (place.describe(detail), place.outside, place.in_backward) == (words, outside, in_backward), place
        assert Place.from_json(json.loads(json.dumps(place.to_json()))) == place
    assert Place(ending, 2, 0) != Place(ending, 2, 1) and Place(ending, 2, 0) != Place(ending, 3, 0)


def test_a_process_that_ended_is_known_without_a_heartbeat():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    started = start_time(child.pid)
    assert not process_ended(os.getpid(), start_time(os.getpid()))
    child.wait(30)
    assert process_ended(child.pid, started)
    assert process_ended(os.getpid(), start_time(os.getpid()) + 1), "a reused pid is another process"
    assert pid_namespace() == pid_namespace()


def test_ordinals():
    assert [ordinal(n) for n in (1, 2, 3, 4, 11, 12, 13, 21, 22, 101, 111)] == [
        "1st", "2nd", "3rd", "4th", "11th", "12th", "13th", "21st", "22nd", "101st", "111th",
    ]  # fmt: skip
