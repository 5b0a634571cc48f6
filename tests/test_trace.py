"""See inside a step: the merged profile (trace()), the straggler summary (log_summary()).

Pure tests feed the step recorder and the merge by hand; the multi-process
ones trace real gloo ranks with tiny buckets (a known bucket plan), read the
file back, and check it against the library's own step recorder.
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import NamedTuple

import pytest
import torch
from torch import nn

import torchreplicate
from harness import TORCHRUN, run_command
from models import DIM, data
from models import TINY_DIM_BUCKETS as TINY
from parity import seeded
from test_dynamic_graphs import Reused, reused_growing
from torchreplicate import replicate
from torchreplicate.observe import timeline
from torchreplicate.observe.summary import summarize
from torchreplicate.observe.timeline import StepRecorder
from torchreplicate.observe.trace_format import chrome_trace, rank_events
from torchreplicate.reducer.probe import StepEvent as E


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh(), nn.Linear(DIM, DIM), nn.Tanh(), nn.Linear(DIM, 2))


# -- pure: the recorder and the merge -----------------------------------------------


def test_recorder_builds_one_record_per_step():
    recorder = StepRecorder()
    records = []
    recorder.subscribers.append(records.append)
    recorder(E.REPLAN, 3, 0)
    recorder(E.BACKWARD, 3, 0)
    recorder(E.GRAD, 0, 0)
    recorder(E.GRAD, 0, 0)  # only the first gradient of a bucket is timed
    recorder(E.LAUNCH, 0, 1)
    recorder(E.GRAD, 1, 0)
    recorder(E.FINALIZE, 3, 0)
    recorder(E.LAUNCH, 1, 0)
    for bucket in (0, 1):
        recorder(E.WAITING, bucket, 0)
        recorder(E.DONE, bucket, 0)
    recorder(E.LATE_ROUND, 1, 0)
    recorder(E.LATE_ROUND, 0, 0)
    recorder(E.STEP_END, 3, 1234)
    (record,) = records
    assert record.step == 3 and record.wire_bytes == 1234 and record.replan_ns is not None
    b0, b1 = record.buckets
    assert b0.from_hook and b0.ready_ns == b0.launch_ns, "launched from a hook: ready then"
    assert not b1.from_hook and b1.ready_ns == record.finalize_ns, "launched at the end: ready at finalize"
    assert b0.first_grad_ns <= b0.launch_ns < b0.done_ns <= record.end_ns
    assert len(record.late_rounds) == 1
    assert record.exposed_ns == b0.exposed_ns + b1.exposed_ns + (record.late_rounds[0][1] - record.late_rounds[0][0])
    recorder(E.BACKWARD, 4, 0)  # the next step starts clean, without the re-plan
    recorder(E.FINALIZE, 4, 0)
    recorder(E.STEP_END, 4, 0)
    assert records[1].replan_ns is None and records[1].buckets == ()


class _DelayedClock(timeline.HostClock):
    """The host's clock with a device clock's schedule ([Note: one clock for the observers]): each
    record is built at the next step's end. Counts the marks it resolves."""

    delay = 1

    def __init__(self) -> None:
        self.resolved = 0

    def ns(self, mark: object) -> int:
        self.resolved += 1
        return super().ns(mark)


def test_on_a_device_each_record_comes_at_the_next_steps_end_and_flush_brings_the_rest():
    clock = _DelayedClock()
    recorder = StepRecorder(clock)
    records = []
    recorder.subscribers.append(records.append)
    for step in range(3):
        recorder(E.BACKWARD, step, 0)
        recorder(E.LAUNCH, 0, 1)
        recorder(E.FINALIZE, step, 0)
        recorder(E.WAITING, 0, 0)
        recorder(E.DONE, 0, 0)
        recorder(E.STEP_END, step, 8)
        assert [r.step for r in records] == list(range(step)), "one step late, in order"
    assert clock.resolved == 2 * 6, "only delivered steps read their marks (6 each)"
    recorder.flush()
    assert [r.step for r in records] == [0, 1, 2] and recorder.flush() is None
    for record in records:
        (bucket,) = record.buckets
        assert record.backward_ns <= bucket.launch_ns <= record.finalize_ns <= bucket.wait_ns <= bucket.done_ns
        assert record.exposed_ns == bucket.done_ns - bucket.wait_ns


def _profile(*spans: tuple[str, float, float], tid: int = 7) -> dict:
    # What export_chrome_trace writes, reduced to what trace() reads: torch's
    # process metadata, a flow, complete events (name, ts, dur) on one thread.
    events = [
        {"name": "process_name", "ph": "M", "pid": 4242, "tid": 0, "args": {"name": "python"}},
        {"name": "thread_name", "ph": "M", "pid": 4242, "tid": tid, "args": {"name": "thread 7 (python)"}},
        {"name": "fwdbwd", "ph": "s", "cat": "fwdbwd", "id": 5, "pid": 4242, "tid": tid, "ts": 1000.0},
    ]
    for name, ts, dur in spans:
        span = {"name": name, "ph": "X", "cat": "user_annotation", "pid": 4242, "tid": tid, "ts": ts, "dur": dur}
        events.append(span)
    return {"traceEvents": events, "schemaVersion": 1}


def test_rank_events_merge_one_process_per_rank_with_steps():
    p = "torchreplicate::"
    steps = []
    for step, t in enumerate((1100.0, 1200.0, 1300.0)):
        steps += [
            (p + "pre_forward", t, 1.0),
            (p + "hook (bucket 0)", t + 10, 5.0),
            (p + "launch (bucket 0)", t + 11, 2.0),  # from a hook
            (p + "finalize", t + 20, 30.0),
            (p + "launch (bucket 1)", t + 21, 2.0),  # from the end of backward
            (p + "wait (bucket 0)", t + 24, 3.0 + step),
            (p + "wait (bucket 1)", t + 28, 4.0),
            (p + "late_round", t + 40, 5.0),
            ("aten::mm", t + 12, 1.0),
        ]
    exported = _profile((p + "trace start", 1000.0, 2.0), *steps)
    events = rank_events(1, 2, exported, max_steps=None)
    json.dumps(chrome_trace([events]))  # serialisable
    assert all(e["pid"] == 1 for e in events)
    names = [e["args"]["name"] for e in events if e["name"] == "process_name"]
    assert names == ["rank 1"], names  # torch's "python" is replaced
    assert [e["ts"] for e in events if e["name"] == p + "trace start"] == [0.0], "the clock starts at the marker"
    assert next(e for e in events if e["ph"] == "s")["id"] == 5 * 2 + 1, "flow ids unique across ranks"
    labelled = [e for e in events if e["ph"] == "X" and e["name"].startswith(p) and e["name"] != p + "trace start"]
    assert [e["args"]["step"] for e in labelled] == [0] * 8 + [1] * 8 + [2] * 8
    assert "step" not in next(e for e in events if e["name"] == "aten::mm").get("args", {}), "torch's ops: no step"

    last_two = rank_events(0, 2, exported, max_steps=2)
    kept = {e["args"]["step"] for e in last_two if "step" in e.get("args", {})}
    assert kept == {1, 2}, "the first step is dropped"
    assert [e["args"]["name"] for e in last_two if e["name"] == "thread_name"] == ["thread 7 (python)"]
    assert min(e["ts"] for e in last_two if e["ph"] == "X") > 150.0, "nothing of step 0 is kept"


def test_summary_names_the_rank_with_the_most_busy_time():
    # rank 1 works 30 ms more per step; rank 0 waits for it in the end of backward
    ms = 1e6
    rows = [
        [10, 10 * 50 * ms, 10 * 32 * ms, 10 * 1000, 10 * 35 * ms, 100],
        [10, 10 * 50 * ms, 10 * 2 * ms, 10 * 1000, 10 * 5 * ms, 100],
    ]
    summary = summarize(rows, 100, 109)
    assert (summary.slowest_rank, summary.fastest_rank) == (1, 0)
    assert summary.slowest_by_ms == pytest.approx(30.0)
    line = summary.line()
    assert "steps 100-109" in line and "slowest rank 1" in line and "+30.00 ms" in line, line
    assert "1 kB/step" in line and "step 50.00 ms" in line, line


# -- multi-process: a real trace -----------------------------------------------------


P = "torchreplicate::"  # the reducer's profiler labels (reducer/probe.py)


class TraceResult(NamedTuple):
    num_buckets: list[int]  # per step, from the reducer
    from_hook: list[list[bool]]  # per step per bucket, from the library's own step recorder (timeline.py)
    trace: dict  # the file, read back by rank 0 ({} on the others)
    plot_magic: bytes  # first bytes of the PNG on rank 0
    num_steps: int  # end-of-backward events in this rank's own events
    exposed_ms: list[float]  # per step, from the library's own step recorder


def traced(rank: int, world_size: int, folder: str, steps: int) -> TraceResult:
    model = replicate(seeded(_net, rank), **TINY)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    num_buckets = []
    records: list = []  # an independent witness of each launch's origin
    timeline.subscribe(model, records.append)
    path = os.path.join(folder, "trace.json")
    with torchreplicate.trace(path, model=model) as tracer:
        for step in range(steps):
            if step == 2:  # freeze the middle layer: a re-plan with fewer buckets
                model[2].requires_grad_(False)
            loss = model(data(rank, step)).pow(2).mean()
            num_buckets.append(len(replicate.state(model).reducer.buckets))  # this step's layout
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    timeline.unsubscribe(model, records.append)
    from_hook = [[b.from_hook for b in record.buckets] for record in records]
    exposed = [record.exposed_ns / 1e6 for record in records]
    num_steps = sum(e["name"] == P + "finalize" for e in tracer.events)
    assert tracer.profiler is not None and tracer.profiler.key_averages(), "torch's own profile stays readable"
    if rank != 0:
        assert tracer.written == [], f"rank {rank} wrote {tracer.written}"
        return TraceResult(num_buckets, from_hook, {}, b"", num_steps, exposed)
    assert tracer.written == [path, os.path.join(folder, "trace.png")], tracer.written
    with open(path) as file:
        content = json.load(file)
    with open(tracer.plot_path, "rb") as file:
        magic = file.read(8)
    return TraceResult(num_buckets, from_hook, content, magic, num_steps, exposed)


def _inside(inner: dict, outer: dict) -> bool:
    return outer["ts"] <= inner["ts"] and inner["ts"] + inner["dur"] <= outer["ts"] + outer["dur"] + 1e-3


def test_trace_has_every_bucket_of_every_step(pools, tmp_path):
    steps = 4
    results = pools.run(2, traced, str(tmp_path), steps)
    assert [r.num_steps for r in results] == [steps, steps], "every rank profiled every step"
    num_buckets = results[0].num_buckets
    # DDP's layout: one bucket in a reducer's first step, tiny buckets after it; the re-plan at step 2
    # starts a reducer with fewer parameters, whose first step is one bucket again
    assert num_buckets[:3] == [1, num_buckets[1], 1] and 2 < num_buckets[1], f"tiny buckets: {num_buckets}"
    assert num_buckets[3] < num_buckets[1], f"a re-plan with fewer buckets: {num_buckets}"
    trace = results[0].trace
    assert results[0].plot_magic == b"\x89PNG\r\n\x1a\n"
    events = trace["traceEvents"]
    assert trace["otherData"]["num_ranks"] == 2
    buckets = trace["otherData"]["buckets"]  # the layout at exit, after the re-plan: what "(bucket k)" holds
    assert [b["index"] for b in buckets] == list(range(num_buckets[-1])), buckets
    assert sorted(n for b in buckets for n in b["params"]) == ["0.bias", "0.weight", "4.bias", "4.weight"], buckets
    assert {e["pid"] for e in events} == {0, 1}
    # the exposed communication per step is the step recorder's (one definition: timeline.py), every rank's
    for rank in (0, 1):
        exposed = trace["otherData"]["exposed_ms"][str(rank)]
        assert exposed == {str(i): pytest.approx(ms) for i, ms in enumerate(results[rank].exposed_ms)}, exposed
        assert len(exposed) == steps and all(ms >= 0 for ms in exposed.values()), exposed
    processes = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert processes == {0: "rank 0", 1: "rank 1"}, processes
    assert sum(e["name"] == "process_name" for e in events) == 2, "one process per rank"
    for e in events:
        if e["ph"] == "X":
            assert e["dur"] >= 0 and isinstance(e["ts"], float), e
    for rank in (0, 1):
        mine = [e for e in events if e["pid"] == rank and e["ph"] == "X"]
        (start,) = [e for e in mine if e["name"] == P + "trace start"]
        assert start["ts"] == 0.0, "each rank's clock starts at its marker after the barrier"
        assert sum(e["name"] == P + "pre_forward" for e in mine) == steps
        assert any(e["name"] == "gloo:all_reduce" for e in mine), "torch's own collectives show"
        for step in range(steps):
            at = [e for e in mine if e.get("args", {}).get("step") == step]
            (end,) = [e for e in at if e["name"] == P + "finalize"]
            hooks = [e for e in at if e["name"].startswith(P + "hook")]
            for k in range(num_buckets[step]):
                where = f"rank {rank} step {step} bucket {k}"
                launches = [e for e in at if e["name"] == f"{P}launch (bucket {k})"]
                assert len(launches) == 1, f"{where}: {len(launches)} launches"
                (launch,) = launches
                mine_hooks = [e for e in hooks if e["name"] == f"{P}hook (bucket {k})"]
                assert mine_hooks and min(e["ts"] for e in mine_hooks) <= launch["ts"], f"{where}: no gradient first"
                in_hook = any(_inside(launch, hook) for hook in hooks)
                assert in_hook == results[rank].from_hook[step][k], f"{where}: launched from a hook {in_hook}"
                assert in_hook or _inside(launch, end), f"{where}: launched outside the hooks and the end"
                (wait,) = [e for e in at if e["name"] == f"{P}wait (bucket {k})"]
                assert _inside(wait, end) and launch["ts"] + launch["dur"] <= wait["ts"] + 1e-3, where
            others = [e for e in at if "(bucket " in e["name"] and int(e["name"][:-1].split()[-1]) >= num_buckets[step]]
            assert not others, f"rank {rank} step {step}: events of buckets that do not exist: {others}"
        assert any(results[rank].from_hook[1]), "no overlap after step 0"


class LateResult(NamedTuple):
    num_late_rounds: int  # from the library's own step recorder
    num_late_events: int  # in this rank's profile
    files: list[str]


def traced_late_and_failing(rank: int, world_size: int, folder: str) -> LateResult:
    # A layer reused inside reentrant checkpoints more often than learned: a
    # gradient comes after its bucket left, so a late round runs ([Note: one
    # collective sequence] in reducer.py). Then a block that raises on every rank.
    model = replicate(seeded(lambda: Reused(True), 3), graph="dynamic", **TINY)
    records: list = []
    timeline.subscribe(model, records.append)
    with torchreplicate.trace(os.path.join(folder, "late.json"), model=model, plot=False) as tracer:
        for step in range(3):
            reused_growing(model, rank, world_size, step).backward()
            model.zero_grad()
    timeline.unsubscribe(model, records.append)
    late = sum(len(r.late_rounds) for r in records)
    num_events = sum(e["name"] == P + "late_round" for e in tracer.events)
    failing = torchreplicate.trace(os.path.join(folder, "failed.json"), model=model)
    with pytest.raises(ZeroDivisionError):
        with failing:
            reused_growing(model, rank, world_size, 3).backward()
            raise ZeroDivisionError("every rank")
    return LateResult(late, num_events, failing.written)


def test_trace_late_rounds_and_a_failing_block(pools, tmp_path):
    results = pools.run(2, traced_late_and_failing, str(tmp_path))
    assert all(r.num_late_rounds >= 1 for r in results), results
    assert all(r.num_late_events == r.num_late_rounds for r in results), results
    with open(tmp_path / "late.json") as file:
        names = [e["name"] for e in json.load(file)["traceEvents"]]
    assert names.count(P + "late_round") == sum(r.num_late_rounds for r in results)
    for rank, result in enumerate(results):  # no collective after the error: each rank its own file
        assert result.files == [str(tmp_path / f"failed.rank{rank}.json")], result.files
        with open(result.files[0]) as file:
            assert {e["pid"] for e in json.load(file)["traceEvents"]} == {rank}
    assert not (tmp_path / "failed.json").exists()


class SummaryResult(NamedTuple):
    lines: list[str]  # what this rank logged
    slowest: list[int]  # summary.last.slowest_rank after each report
    slowest_by_ms: list[float]


def summarized(rank: int, world_size: int, sleep_s: float) -> SummaryResult:
    model = replicate(seeded(_net, rank), **TINY)
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    log = logging.getLogger("torchreplicate")
    log.addHandler(handler)
    old_level = log.level
    log.setLevel(logging.INFO)
    slowest, by_ms = [], []
    try:
        with torchreplicate.log_summary(model, every=3) as summary:
            for step in range(6):
                if rank == 1:
                    time.sleep(sleep_s)  # the straggler
                model(data(rank, step)).pow(2).mean().backward()
                if (step + 1) % 3 == 0:
                    assert summary.last is not None and summary.last.last_step == step, f"rank {rank} step {step}"
                    slowest.append(summary.last.slowest_rank)
                    by_ms.append(summary.last.slowest_by_ms)
                model.zero_grad()
        model(data(rank, 9)).pow(2).mean().backward()  # stopped: no collective of ours
    finally:
        log.removeHandler(handler)
        log.setLevel(old_level)
    assert replicate.state(model).events is None, f"rank {rank}: the recorder stays attached"
    return SummaryResult(lines, slowest, by_ms)


def summarized_one_step_late(rank: int, world_size: int, sleep_s: float) -> list[tuple[int, int]]:
    # a device's schedule on the CPU: the report for steps 0-2 comes at step 3's end, on every rank alike
    model = replicate(seeded(_net, rank), **TINY)
    replicate.state(model).set_events(StepRecorder(_DelayedClock()))
    reports = []
    with torchreplicate.log_summary(model, every=3, log_rank=None) as summary:
        for step in range(7):
            if rank == 1:
                time.sleep(sleep_s)  # the straggler
            model(data(rank, step)).pow(2).mean().backward()
            last = summary.last
            if last is not None and (not reports or reports[-1][0] != last.last_step):  # a new report
                reports.append((last.last_step, step))  # (its window's last step, the step it came at)
                assert last.slowest_rank == 1, last.line()
            model.zero_grad()
    return reports


def test_summary_on_a_device_schedule_reports_one_step_late_on_every_rank(pools):
    reports = pools.run(2, summarized_one_step_late, 0.05)
    assert reports[0] == reports[1] == [(2, 3), (5, 6)], reports


def test_summary_names_the_slow_rank(pools):
    sleep_s = 0.05
    results = pools.run(2, summarized, sleep_s)
    assert results[1].lines == [], "only rank 0 logs"
    assert len(results[0].lines) == 2, results[0].lines
    assert "steps 0-2 on 2 rank(s)" in results[0].lines[0] and "steps 3-5" in results[0].lines[1]
    for line in results[0].lines:
        assert "slowest rank 1" in line and "over the fastest (rank 0)" in line, line
    for result in results:  # the same report on every rank
        assert result.slowest == [1, 1], result
        assert all(by > 0.5 * sleep_s * 1e3 for by in result.slowest_by_ms), result


class SingleResult(NamedTuple):
    pids: set[int]
    names: set[str]


def traced_alone(rank: int, world_size: int, folder: str) -> SingleResult:
    model = replicate(seeded(_net, 0))
    assert replicate.state(model).reducer is None, "world size 1 runs no reducer"
    path = os.path.join(folder, "alone.json")
    with torchreplicate.trace(path, model=model), torchreplicate.log_summary(model, every=1):
        for step in range(2):
            model(data(rank, step)).sum().backward()
    assert torchreplicate.verify_replicas(model, grads=True).ok
    with torch.profiler.profile(), pytest.raises(RuntimeError, match="another torch profiler is recording"):
        torchreplicate.trace(os.path.join(folder, "nested.json"), model=model).__enter__()
    with pytest.raises(RuntimeError, match="another torch profiler was started inside"):
        with torchreplicate.trace(os.path.join(folder, "inside.json"), model=model):
            with torch.profiler.profile():
                model(data(rank, 0))
    state = replicate.state(model)
    assert state.events is None, "trace() left its subscription behind (another profiler ended its session)"
    state.set_events(object())  # another observer attached by hand: refused before the profiler starts
    with pytest.raises(RuntimeError, match="another step observer"):
        torchreplicate.trace(os.path.join(folder, "refused.json"), model=model).__enter__()
    state.set_events(None)
    with torchreplicate.trace(os.path.join(folder, "after.json"), model=model, plot=False):  # no profiler left on
        model(data(rank, 0)).sum().backward()
    with open(path) as file:
        events = [e for e in json.load(file)["traceEvents"] if e["ph"] != "M"]
    assert os.path.exists(os.path.join(folder, "alone.png"))
    return SingleResult({e["pid"] for e in events}, {e["name"] for e in events})


def test_world_size_one_traces_torch_ops_only(pools, tmp_path):
    (result,) = pools.run(1, traced_alone, str(tmp_path))
    assert result.pids == {0}, result.pids
    assert "aten::addmm" in result.names, "the forwards' ops"
    assert P + "finalize" not in result.names, "no reducer, no end of backward"


def test_the_example_traces_summarises_and_checks(tmp_path):
    path = tmp_path / "demo" / "trace.json"
    command = [*TORCHRUN, "--standalone", "--nproc-per-node", "2", "examples/train.py"]
    command += ["--steps", "20", "--bucket-cap-mb", "0.04", "--trace", str(path)]
    command += ["--summary-every", "10", "--verify-every", "10"]
    done = run_command(command, timeout=120)  # on timeout kills torchrun's workers too
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith("replica check: 7 tensors bitwise identical on 2 ranks"), done.stdout
    assert "steps 0-9 on 2 rank(s)" in done.stderr and "steps 10-19 on 2 rank(s)" in done.stderr, done.stderr
    assert f"{path} and {path.with_suffix('.png')}" in done.stderr, done.stderr
    with open(path) as file:
        events = json.load(file)["traceEvents"]
    assert sum(e["name"] == P + "finalize" for e in events) == 2 * 20
    assert {e["name"] for e in events} >= {P + "launch (bucket 0)", P + "launch (bucket 1)"}


@pytest.mark.parametrize(
    "call, error, words",
    [
        (lambda m: torchreplicate.trace(3, model=m), TypeError, "trace(): path must be a str or os.PathLike, got int"),
        (
            lambda m: torchreplicate.trace("t.json", model=m, max_steps=0),
            ValueError,
            "trace(): max_steps must be a positive int or None, got 0",
        ),
        (
            lambda m: torchreplicate.trace("t.json", model=m, plot=1.5),
            TypeError,
            "trace(): plot must be a bool or a path, got float",
        ),
        (lambda m: torchreplicate.trace("t.json", model=m), ValueError, "trace(): replicate.state(): Linear is not"),
        (lambda m: torchreplicate.log_summary(m, every=0), ValueError, "every must be a positive int, got 0"),
        (lambda m: torchreplicate.log_summary(m), ValueError, "log_summary(): replicate.state(): Linear is not"),
        (lambda m: torchreplicate.verify_replicas(m), ValueError, "verify_replicas(): replicate.state(): Linear is"),
    ],
)
def test_observers_refuse_bad_arguments_naming_them(call, error, words):
    with pytest.raises(error) as info:
        call(torch.nn.Linear(2, 2))  # not replicated: the argument checks come first, no collective
    assert words in str(info.value), str(info.value)
