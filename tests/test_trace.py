"""See inside a step: the timeline (trace()), the straggler summary (log_summary()).

Pure tests feed the step recorder by hand; the multi-process ones trace real
gloo ranks with tiny buckets (a known bucket plan) and read the file back.
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
from torchreplicate.observe.summary import summarize
from torchreplicate.observe.timeline import StepRecorder
from torchreplicate.observe.trace_format import BucketInfo, ForwardSpan, RankTrace, chrome_trace, rank_events


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh(), nn.Linear(DIM, DIM), nn.Tanh(), nn.Linear(DIM, 2))


# -- pure: the recorder and the event format ----------------------------------------


def test_recorder_builds_one_record_per_step():
    recorder = StepRecorder()
    records = []
    recorder.subscribers.append(records.append)
    recorder.replan(3)
    recorder.backward(3)
    recorder.grad(0)
    recorder.grad(0)  # only the first gradient of a bucket is timed
    recorder.launch(0, True)
    recorder.grad(1)
    recorder.finalize(3)
    recorder.launch(1, False)
    for bucket in (0, 1):
        recorder.waiting(bucket)
        recorder.done(bucket)
    recorder.late_round(True)
    recorder.late_round(False)
    recorder.step_end(3, 1234)
    (record,) = records
    assert record.step == 3 and record.wire_bytes == 1234 and record.replan_ns is not None
    b0, b1 = record.buckets
    assert b0.from_hook and b0.ready_ns == b0.launch_ns, "launched from a hook: ready then"
    assert not b1.from_hook and b1.ready_ns == record.finalize_ns, "launched at the end: ready at finalize"
    assert b0.first_grad_ns <= b0.launch_ns < b0.done_ns <= record.end_ns
    assert len(record.late_rounds) == 1
    assert record.exposed_ns == b0.exposed_ns + b1.exposed_ns + (record.late_rounds[0][1] - record.late_rounds[0][0])
    recorder.backward(4)  # the next step starts clean, without the re-plan
    recorder.finalize(4)
    recorder.step_end(4, 0)
    assert records[1].replan_ns is None and records[1].buckets == ()

    layout = [(3, (BucketInfo(0, ("a.weight",), 4, 16), BucketInfo(1, ("b.weight", "b.bias"), 6, 24)))]
    events = rank_events(1, record.backward_ns - 1000, records, layout, [ForwardSpan(0, 10, True)])
    trace = chrome_trace([RankTrace(1, events, [], 0)])
    json.dumps(trace)  # serialisable
    names = [e["name"] for e in events if e["ph"] != "M"]
    for name in ("backward", "end of backward", "wait bucket 0", "late round", "re-plan", "bucket 1 reduce"):
        assert name in names, (name, names)
    rows = {e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert rows == {"step", "bucket 0: a.weight", "bucket 1: b.weight, b.bias"}, rows
    reduce_1 = next(e for e in events if e["name"] == "bucket 1 reduce")
    assert reduce_1["args"]["launched_from"] == "end of backward" and reduce_1["args"]["bytes"] == 24
    assert all(e["pid"] == 1 for e in events)


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


class TraceResult(NamedTuple):
    num_buckets: list[int]  # per step, from the reducer
    trace: dict  # the file, read back by rank 0 ({} on the others)
    plot_magic: bytes  # first bytes of the PNG on rank 0
    num_records: int  # steps this rank recorded


def traced(rank: int, world_size: int, folder: str, steps: int) -> TraceResult:
    model = replicate(seeded(_net, rank), **TINY)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    num_buckets = []
    path = os.path.join(folder, "trace.json")
    with torchreplicate.trace(path, model=model) as tracer:
        for step in range(steps):
            if step == 2:  # freeze the middle layer: a re-plan with fewer buckets
                model[2].requires_grad_(False)
            model(data(rank, step)).pow(2).mean().backward()
            reducer = replicate.state(model).reducer
            num_buckets.append(len(reducer.buckets))
            optimizer.step()
            optimizer.zero_grad()
    assert len(tracer.records) == steps, f"rank {rank}: {len(tracer.records)} records"
    if rank != 0:
        assert tracer.written == [], f"rank {rank} wrote {tracer.written}"
        return TraceResult(num_buckets, {}, b"", len(tracer.records))
    assert tracer.written == [path, os.path.join(folder, "trace.png")], tracer.written
    with open(path) as file:
        content = json.load(file)
    with open(tracer.plot_path, "rb") as file:
        magic = file.read(8)
    return TraceResult(num_buckets, content, magic, len(tracer.records))


def test_trace_has_every_bucket_of_every_step(pools, tmp_path):
    steps = 4
    results = pools.run(2, traced, str(tmp_path), steps)
    num_buckets = results[0].num_buckets
    assert num_buckets[0] > 2 and num_buckets[2] < num_buckets[0], f"tiny buckets, then a re-plan: {num_buckets}"
    trace = results[0].trace
    assert results[0].plot_magic == b"\x89PNG\r\n\x1a\n"
    events = trace["traceEvents"]
    assert trace["otherData"]["num_ranks"] == 2
    assert {e["ph"] for e in events} <= {"X", "i", "M"}
    assert {e["pid"] for e in events} == {0, 1}
    for e in events:
        if e["ph"] == "X":
            assert e["dur"] >= 0 and isinstance(e["ts"], float), e
    for rank in (0, 1):
        mine = [e for e in events if e["pid"] == rank and e["ph"] == "X"]
        assert sum(e["name"] == "forward" for e in mine) == steps
        replans = [e for e in events if e["pid"] == rank and e["name"] == "re-plan"]
        assert [e["args"]["step"] for e in replans] == [2], replans
        for step in range(steps):
            at = [e for e in mine if e.get("args", {}).get("step") == step]
            (backward,) = [e for e in at if e["name"] == "backward"]
            (end,) = [e for e in at if e["name"] == "end of backward"]
            assert backward["ts"] <= end["ts"] <= end["ts"] + end["dur"] <= backward["ts"] + backward["dur"] + 1e-3
            for k in range(num_buckets[step]):
                where = f"rank {rank} step {step} bucket {k}"
                launches = [e for e in at if e["name"] == f"bucket {k} reduce"]
                assert len(launches) == 1, f"{where}: {len(launches)} launches"
                (reduce,) = launches
                launch, done = reduce["ts"], reduce["ts"] + reduce["dur"]
                assert launch < done, where
                assert reduce["tid"] == 1 + k, where
                (grads,) = [e for e in at if e["name"] == f"bucket {k} gradients"]
                assert grads["ts"] <= launch, f"{where}: first gradient after launch"
                assert reduce["args"]["first_grad_us"] == grads["ts"]
                assert reduce["args"]["ready_us"] <= launch, where
                (wait,) = [e for e in at if e["name"] == f"wait bucket {k}"]
                assert end["ts"] <= wait["ts"] and wait["ts"] + wait["dur"] == pytest.approx(done, abs=1e-3), where
            others = [e for e in at if e["name"].startswith("bucket ") and e["tid"] > num_buckets[step]]
            assert not others, f"rank {rank} step {step}: events of buckets that do not exist: {others}"
        first_steps = [e for e in mine if e.get("args", {}).get("step") == 1 and e["name"].endswith("reduce")]
        assert any(e["args"]["launched_from"] == "gradient hook" for e in first_steps), "no overlap after step 0"


class LateResult(NamedTuple):
    num_late_rounds: int
    files: list[str]


def traced_late_and_failing(rank: int, world_size: int, folder: str) -> LateResult:
    # A layer reused inside reentrant checkpoints more often than learned: a
    # gradient comes after its bucket left, so a late round runs ([Note: one
    # collective sequence] in reducer.py). Then a block that raises on every rank.
    model = replicate(seeded(lambda: Reused(True), 3), **TINY)
    with torchreplicate.trace(os.path.join(folder, "late.json"), model=model, plot=False) as tracer:
        for step in range(3):
            reused_growing(model, rank, world_size, step).backward()
            model.zero_grad()
    late = sum(len(r.late_rounds) for r in tracer.records)
    failing = torchreplicate.trace(os.path.join(folder, "failed.json"), model=model)
    with pytest.raises(ZeroDivisionError):
        with failing:
            reused_growing(model, rank, world_size, 3).backward()
            raise ZeroDivisionError("every rank")
    return LateResult(late, failing.written)


def test_trace_late_rounds_and_a_failing_block(pools, tmp_path):
    results = pools.run(2, traced_late_and_failing, str(tmp_path))
    assert all(r.num_late_rounds >= 1 for r in results), results
    with open(tmp_path / "late.json") as file:
        names = [e["name"] for e in json.load(file)["traceEvents"]]
    assert names.count("late round") == sum(r.num_late_rounds for r in results)
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
    num_records: int
    names: list[str]


def traced_alone(rank: int, world_size: int, folder: str) -> SingleResult:
    model = replicate(seeded(_net, 0))
    assert replicate.state(model).reducer is None, "world size 1 runs no reducer"
    path = os.path.join(folder, "alone.json")
    with torchreplicate.trace(path, model=model) as tracer, torchreplicate.log_summary(model, every=1):
        for step in range(2):
            model(data(rank, step)).sum().backward()
    assert torchreplicate.verify_replicas(model, grads=True).ok
    with open(path) as file:
        names = [e["name"] for e in json.load(file)["traceEvents"] if e["ph"] != "M"]
    assert os.path.exists(os.path.join(folder, "alone.png"))
    return SingleResult(len(tracer.records), names)


def test_world_size_one_traces_forwards_only(pools, tmp_path):
    (result,) = pools.run(1, traced_alone, str(tmp_path))
    assert result == SingleResult(0, ["forward", "forward"]), result


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
    assert sum(e["name"] == "backward" for e in events) == 2 * 20
    assert {e["name"] for e in events} >= {"bucket 0 reduce", "bucket 1 reduce"}


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
