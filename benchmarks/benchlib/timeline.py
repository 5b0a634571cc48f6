"""When things happen inside a step: phase times of any engine, and our reducer's step events.

``trace_steps`` runs an engine's steps untimed by the rounds, stamping the
end of the forward (loss computed), of ``backward()`` and of the optimizer
step. For our engines it also attaches a ``StepRecorder`` through the
library's public ``replicate.state(m).set_events()`` (events.py), which
stamps the first gradient hook of the backward, each bucket's launch (from a
hook, or from the end-of-backward callback), the start of the end-of-backward
work, each bucket's wait and the step's end. Every time is in ms from the
start of the step, on ``time.perf_counter``.

``line_rate_schedule`` then says when the buckets' bytes would have crossed a
link of a given rate had each started at its launch (one link, buckets in
order): the gap between that and the floor is launch lateness, the gap
between it and the observed end of the waits is transfer below line rate.
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


class StepRecorder:
    """A ``torchreplicate.events.StepEvents`` observer: perf_counter stamps of one step at a time."""

    def __init__(self) -> None:
        self.t0 = 0.0  # perf_counter at the start of the current step
        self.marks: dict[str, Any] = {}  # the current step's stamps, ms from t0

    def start(self, t0: float) -> None:
        """A new step began at ``t0`` (perf_counter)."""
        self.t0 = t0
        self.marks = {"launch_ms": {}, "from_hook": {}, "waiting_ms": {}, "done_ms": {}, "grad_first_ms": {}}

    def _now(self) -> float:
        return (time.perf_counter() - self.t0) * 1e3

    def backward(self, step: int) -> None:
        self.marks.setdefault("backward_ms", self._now())

    def grad(self, bucket: int) -> None:
        self.marks["grad_first_ms"].setdefault(bucket, self._now())

    def launch(self, bucket: int, from_hook: bool) -> None:
        self.marks["launch_ms"][bucket] = self._now()
        self.marks["from_hook"][bucket] = from_hook

    def finalize(self, step: int) -> None:
        self.marks["finalize_ms"] = self._now()

    def waiting(self, bucket: int) -> None:
        self.marks["waiting_ms"][bucket] = self._now()

    def done(self, bucket: int) -> None:
        self.marks["done_ms"][bucket] = self._now()

    def late_round(self, started: bool) -> None:
        self.marks["late_round"] = True

    def step_end(self, step: int, wire_bytes: int) -> None:
        self.marks["step_end_ms"] = self._now()
        self.marks["wire_bytes"] = wire_bytes

    def replan(self, step: int) -> None:
        self.marks["replan"] = True


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
    ``step_ms``; for our engines also the ``StepRecorder`` marks. Every rank
    must trace the same engine the same number of steps (they hold
    collectives).
    """
    recorder: Optional[StepRecorder] = None
    state = replicate.state(engine.module) if isinstance(engine.module, ReplicateModule) else None
    if state is not None and state.reducer is not None:
        recorder = StepRecorder()
        state.set_events(recorder)
    x, y = batch
    records = []
    try:
        dist.barrier()
        for _ in range(steps):
            t0 = time.perf_counter()
            if recorder is not None:
                recorder.start(t0)
            loss = loss_of(engine.model_name, engine.module(x), y)
            t_forward = time.perf_counter()
            loss.backward()
            t_backward = time.perf_counter()
            engine.opt.step()
            engine.opt.zero_grad(set_to_none=True)
            t_end = time.perf_counter()
            record: dict[str, Any] = dict(recorder.marks) if recorder is not None else {}
            record.update(
                forward_ms=(t_forward - t0) * 1e3,
                backward_return_ms=(t_backward - t0) * 1e3,
                step_ms=(t_end - t0) * 1e3,
            )
            records.append(record)
    finally:
        if state is not None:
            state.set_events(None)
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
