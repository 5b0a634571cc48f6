"""When things happen inside a step: phase times of any engine, and our reducer's per-bucket timeline.

``trace_steps`` runs an engine's steps outside the timed rounds, stamping the
end of the forward (loss computed), of ``backward()`` and of the optimizer
step. For our engines it also subscribes to the library's public step
timeline (``torchreplicate.observe.timeline.subscribe``: one ``StepRecord`` per
synchronised backward) for the first gradient hook of the backward, each
bucket's launch (from a hook, or from the end of backward), the start of the
end-of-backward work, each bucket's wait and the step's end. Every time is in
ms from the start of the step, on ``time.perf_counter_ns`` (the clock the
records use).

``line_rate_schedule`` then says when the buckets' bytes would have crossed a
link of a given rate had each started at its launch (one link, buckets in
order): the gap between that and the floor is launch delay, the gap between
it and the observed end of the waits is transfer below line rate.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from benchlib.engines import Engine
from benchlib.models import loss_of
from torchreplicate import ReplicateModule, replicate
from torchreplicate.observe.timeline import StepRecord, subscribe, unsubscribe


def step_marks(record: StepRecord, t0_ns: int) -> dict[str, Any]:
    """A ``StepRecord``'s times in ms from ``t0_ns``, buckets keyed by index."""

    def ms(ns: int) -> float:
        return (ns - t0_ns) / 1e6

    return {
        "backward_ms": ms(record.backward_ns),
        "finalize_ms": ms(record.finalize_ns),
        "step_end_ms": ms(record.end_ns),
        "launch_ms": {b.index: ms(b.launch_ns) for b in record.buckets},
        "from_hook": {b.index: b.from_hook for b in record.buckets},
        "waiting_ms": {b.index: ms(b.wait_ns) for b in record.buckets},
        "done_ms": {b.index: ms(b.done_ns) for b in record.buckets},
        "grad_first_ms": {b.index: ms(b.first_grad_ns) for b in record.buckets if b.first_grad_ns is not None},
        "late_round": bool(record.late_rounds),
        "replan": record.replan_ns is not None,
        "wire_bytes": record.wire_bytes,
    }


def bucket_wire_bytes(engine: Engine) -> Optional[list[int]]:
    """Bytes each of our buckets hands to its all-reduce, in launch order (None without our reducer).

    The wire buffers of the reduction where it has them (``reduce_dtype``:
    narrower than the gradients; the last one carries the flags), else the
    buckets' buffers, as ``Reducer.wire_bytes`` counts them.
    """
    reducer = engine.reducer
    if reducer is None:
        return None
    wires = getattr(reducer.reduction, "wires", None) or [b.buffer for b in reducer.buckets]
    return [int(w.numel() * w.element_size()) for w in wires]


def trace_steps(engine: Engine, batch: tuple[torch.Tensor, torch.Tensor], steps: int) -> list[dict]:
    """Runs ``steps`` steps of ``engine`` (as ``Engine.step``), stamping its phases; one dict per step.

    Keys (ms from the step's start): ``forward_ms``, ``backward_return_ms``,
    ``step_ms``; for our engines also the ``step_marks`` of the step's
    ``StepRecord``. Every rank must trace the same engine the same number of
    steps (they hold collectives).
    """
    finished: list[StepRecord] = []

    def note(record: StepRecord) -> None:
        finished.append(record)

    observed = isinstance(engine.module, ReplicateModule) and replicate.state(engine.module).reducer is not None
    if observed:
        subscribe(engine.module, note)
    x, y = batch
    records = []
    try:
        dist.barrier()
        for _ in range(steps):
            finished.clear()
            t0 = time.perf_counter_ns()
            loss = loss_of(engine.model_name, engine.module(x), y)
            t_forward = time.perf_counter_ns()
            loss.backward()
            t_backward = time.perf_counter_ns()
            engine.opt.step()
            engine.opt.zero_grad(set_to_none=True)
            t_end = time.perf_counter_ns()
            record: dict[str, Any] = step_marks(finished[-1], t0) if finished else {}
            record.update(
                forward_ms=(t_forward - t0) / 1e6,
                backward_return_ms=(t_backward - t0) / 1e6,
                step_ms=(t_end - t0) / 1e6,
            )
            records.append(record)
    finally:
        if observed:
            unsubscribe(engine.module, note)
    return records


def line_rate_schedule(launch_ms: Sequence[float], wire_bytes: Sequence[int], rate_bps: float) -> float:
    """When the last bucket would be through a link of ``rate_bps``, each bucket starting at its launch.

    One link, buckets in launch order, each sent at the full rate once the
    link is free and the bucket launched (a 2-rank ring all-reduce sends the
    payload once per rank, so the bytes are the payload).
    """
    free = 0.0
    for start, size in zip(launch_ms, wire_bytes, strict=True):
        free = max(start, free) + size * 8 / rate_bps * 1e3
    return free


def summarize_trace(records: list[dict], wire_bytes: Optional[Sequence[int]], rate_bps: float) -> dict:
    """Medians over the traced steps of one rank: phase times, launches, waits, and the line-rate schedule."""

    def median(values: list[float]) -> Optional[float]:
        return statistics.median(values) if values else None

    out: dict[str, Any] = {
        key: median([r[key] for r in records]) for key in ("forward_ms", "backward_return_ms", "step_ms")
    }
    out["optimizer_ms"] = median([r["step_ms"] - r["backward_return_ms"] for r in records])
    if not records or "launch_ms" not in records[0] or not wire_bytes:
        return out
    num_buckets = len(wire_bytes)
    out["num_buckets"] = num_buckets
    out["bucket_wire_bytes"] = list(wire_bytes)
    out["from_hook"] = [bool(records[-1]["from_hook"].get(b)) for b in range(num_buckets)]
    for key in ("backward_ms", "finalize_ms", "step_end_ms"):
        out[key] = median([r[key] for r in records if key in r])
    for key in ("launch_ms", "waiting_ms", "done_ms", "grad_first_ms"):
        out[key] = [median([r[key][b] for r in records if b in r[key]]) for b in range(num_buckets)]
    out["wait_ms"] = [
        median([r["done_ms"][b] - r["waiting_ms"][b] for r in records if b in r["done_ms"]]) for b in range(num_buckets)
    ]
    schedules = [
        line_rate_schedule([r["launch_ms"][b] for b in range(num_buckets)], wire_bytes, rate_bps)
        for r in records
        if len(r["launch_ms"]) == num_buckets
    ]
    out["line_rate_done_ms"] = median(schedules)
    out["late_round_steps"] = sum(1 for r in records if r.get("late_round"))
    return out
