"""The trace file of ``trace()``: Chrome trace events from step records, and its plot (pure functions).

The format is Chrome's Trace Event Format (JSON object form), which
https://ui.perfetto.dev and ``chrome://tracing`` open: ``"traceEvents"``
holds complete events (``"ph": "X"``, ``ts`` and ``dur`` in microseconds),
instants (``"i"``) and metadata (``"M"``: the names of rows). One process per
rank (``pid`` = group rank, named "rank r") with these rows (``tid``):

- 0, "step": ``forward`` spans; ``backward`` (first hook to end of step,
  args: step, wire bytes, exposed ms), inside it ``end of backward``
  (finalize to end), inside that ``wait bucket k`` and ``late round`` (the
  exposed communication); ``re-plan`` instants.
- 1 + k, "bucket k: <first parameters>": ``bucket k gradients`` (first
  gradient to ready) and ``bucket k reduce`` (launch to done; args: step,
  launched from a hook or from the end of backward, bytes, parameters).

Times are microseconds since the rank's own t0, taken right after a barrier
at trace start ([Note: trace clocks] in tracing.py).
"""

from __future__ import annotations

import statistics
from typing import Any, NamedTuple, Optional, Sequence

from torchreplicate.observe.timeline import BucketTimes, StepRecord
from torchreplicate.reducer.probe import BucketInfo

STEP_ROW = 0  # tid of a rank's step row; bucket k is row 1 + k


class ForwardSpan(NamedTuple):
    """One forward of the traced module (``perf_counter_ns``), with or without gradients."""

    start_ns: int
    end_ns: int
    grad_enabled: bool


class RankTrace(NamedTuple):
    """What one rank sends to rank 0 at the end of a trace (picklable, plain data).

    Attributes:
        rank: the group rank (the ``pid`` of its events).
        events: its Chrome trace events.
        exposed_ms: (step, exposed communication in ms) for every recorded step.
        num_dropped: synchronised steps not kept (over ``max_steps``).
    """

    rank: int
    events: list[dict[str, Any]]
    exposed_ms: list[tuple[int, float]]
    num_dropped: int


def rank_events(
    rank: int,
    t0_ns: int,
    records: Sequence[StepRecord],
    layouts: Sequence[tuple[int, Sequence[BucketInfo]]],
    forwards: Sequence[ForwardSpan] = (),
) -> list[dict[str, Any]]:
    """The Chrome trace events of one rank.

    Args:
        rank: its group rank (``pid``).
        t0_ns: its clock's origin (``perf_counter_ns`` after the start barrier).
        records: its step records, in step order.
        layouts: (first step, buckets) of each bucket layout the steps ran
            with, in step order.
        forwards: its forward spans.
    """
    spans = _Spans(rank, t0_ns)
    events = _row_names(rank, records, layouts)
    for forward in forwards:
        name = "forward" if forward.grad_enabled else "forward (no grad)"
        events.append(spans.span(name, "forward", STEP_ROW, forward.start_ns, forward.end_ns))
    for record in records:
        events += _step_events(spans, record, _layout_of(record.step, layouts))
    return events


class _Spans:
    # Complete ("X") events of one rank, in microseconds from its t0.
    def __init__(self, rank: int, t0_ns: int) -> None:
        self.rank = rank
        self.t0_ns = t0_ns

    def us(self, ns: int) -> float:
        return (ns - self.t0_ns) / 1000.0

    def span(self, name: str, cat: str, tid: int, start_ns: int, end_ns: int, **args: Any) -> dict[str, Any]:
        return {
            "name": name,
            "cat": cat,
            "ph": "X",
            "pid": self.rank,
            "tid": tid,
            "ts": self.us(start_ns),
            "dur": max(0, end_ns - start_ns) / 1000.0,
            "args": args,
        }


def _row_names(
    rank: int, records: Sequence[StepRecord], layouts: Sequence[tuple[int, Sequence[BucketInfo]]]
) -> list[dict[str, Any]]:
    # The process row and one row per bucket, named after the newest layout.
    num_buckets = max((len(buckets) for _, buckets in layouts), default=0)
    num_buckets = max([num_buckets] + [len(r.buckets) for r in records])
    latest = {b.index: b for _, buckets in layouts for b in buckets}
    events: list[dict[str, Any]] = [
        _meta(rank, None, "process_name", {"name": f"rank {rank}"}),
        _meta(rank, None, "process_sort_index", {"sort_index": rank}),
        _meta(rank, STEP_ROW, "thread_name", {"name": "step"}),
        _meta(rank, STEP_ROW, "thread_sort_index", {"sort_index": STEP_ROW}),
    ]
    for k in range(num_buckets):
        info = latest.get(k)
        title = f"bucket {k}" + (f": {info.describe()}" if info is not None and info.names else "")
        events.append(_meta(rank, 1 + k, "thread_name", {"name": title}))
        events.append(_meta(rank, 1 + k, "thread_sort_index", {"sort_index": 1 + k}))
    return events


def _step_events(spans: _Spans, record: StepRecord, layout: dict[int, BucketInfo]) -> list[dict[str, Any]]:
    # One synchronised step: its rows on the step line, then each bucket's.
    events = _step_row_events(spans, record)
    for bucket in record.buckets:
        events += _bucket_row_events(spans, record.step, bucket, layout.get(bucket.index))
    return events


def _step_row_events(spans: _Spans, record: StepRecord) -> list[dict[str, Any]]:
    # The step line: re-plan, backward; inside it the end of backward; inside that the waits and late rounds.
    step = record.step
    events: list[dict[str, Any]] = []
    if record.replan_ns is not None:
        replan = {"name": "re-plan", "cat": "step", "ph": "i", "s": "p", "pid": spans.rank, "tid": STEP_ROW}
        events.append({**replan, "ts": spans.us(record.replan_ns), "args": {"step": step}})
    exposed_ms = round(record.exposed_ns / 1e6, 6)
    events.append(
        spans.span(
            "backward",
            "step",
            STEP_ROW,
            record.backward_ns,
            record.end_ns,
            step=step,
            wire_bytes=record.wire_bytes,
            exposed_ms=exposed_ms,
        )
    )
    events.append(spans.span("end of backward", "step", STEP_ROW, record.finalize_ns, record.end_ns, step=step))
    for bucket in record.buckets:
        events.append(
            spans.span(f"wait bucket {bucket.index}", "exposed", STEP_ROW, bucket.wait_ns, bucket.done_ns, step=step)
        )
    for start_ns, end_ns in record.late_rounds:
        events.append(spans.span("late round", "exposed", STEP_ROW, start_ns, end_ns, step=step))
    return events


def _bucket_row_events(
    spans: _Spans, step: int, bucket: BucketTimes, info: Optional[BucketInfo]
) -> list[dict[str, Any]]:
    # Bucket k's line in one step: its gradients arriving (when seen), then its reduce.
    tid = 1 + bucket.index
    events: list[dict[str, Any]] = []
    if bucket.first_grad_ns is not None and bucket.first_grad_ns <= bucket.ready_ns:
        name = f"bucket {bucket.index} gradients"
        events.append(spans.span(name, "grads", tid, bucket.first_grad_ns, bucket.ready_ns, step=step))
    args: dict[str, Any] = {
        "step": step,
        "launched_from": "gradient hook" if bucket.from_hook else "end of backward",
        "first_grad_us": None if bucket.first_grad_ns is None else spans.us(bucket.first_grad_ns),
        "ready_us": spans.us(bucket.ready_ns),
    }
    if info is not None:
        args.update(bytes=info.nbytes, numel=info.numel, params=list(info.names))
    events.append(spans.span(f"bucket {bucket.index} reduce", "comm", tid, bucket.launch_ns, bucket.done_ns, **args))
    return events


def _meta(rank: int, tid: Optional[int], kind: str, args: dict[str, Any]) -> dict[str, Any]:
    event: dict[str, Any] = {"name": kind, "ph": "M", "pid": rank, "args": args}
    if tid is not None:
        event["tid"] = tid
    return event


def _layout_of(step: int, layouts: Sequence[tuple[int, Sequence[BucketInfo]]]) -> dict[int, BucketInfo]:
    chosen: Sequence[BucketInfo] = ()
    for first_step, buckets in layouts:
        if first_step <= step:
            chosen = buckets
    return {b.index: b for b in chosen}


def chrome_trace(ranks: Sequence[RankTrace], **other: Any) -> dict[str, Any]:
    """The trace file's content: every rank's events, and ``other`` under ``"otherData"``."""
    events = [event for rank in sorted(ranks, key=lambda r: r.rank) for event in rank.events]
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": dict(other)}


def plot_trace(ranks: Sequence[RankTrace], path: str, *, title: str = "") -> None:
    """Writes a PNG: exposed communication per step per rank, and the timeline of one step.

    The step shown is the one with the largest exposed communication on any
    rank among the steps every rank recorded (the most instructive one).
    Uses matplotlib's object API (no pyplot, no global backend change).

    Raises:
        ImportError: matplotlib is not installed.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(9, 5.4), dpi=80, layout="constrained")
    FigureCanvasAgg(figure)
    top, bottom = figure.subplots(2, 1, height_ratios=[1, 1])
    ordered = sorted(ranks, key=lambda r: r.rank)
    for rank in ordered:
        if rank.exposed_ms:
            steps, values = zip(*rank.exposed_ms, strict=True)
            top.plot(steps, values, marker=".", markersize=3, linewidth=1, label=f"rank {rank.rank}")
    top.set_xlabel("synchronised step")
    top.set_ylabel("exposed comm, ms")
    top.set_title(title or "Exposed communication per step (time in the end of backward's waits)", fontsize=10)
    if any(rank.exposed_ms for rank in ordered):
        top.legend(fontsize=8, loc="upper right")
        top.set_ylim(bottom=0)
    else:
        top.text(0.5, 0.5, "no synchronised step recorded (world size 1?)", ha="center", transform=top.transAxes)
    _plot_one_step(bottom, ordered)
    figure.savefig(path)


def _plot_one_step(axes: Any, ranks: Sequence[RankTrace]) -> None:
    common = set.intersection(*(set(s for s, _ in r.exposed_ms) for r in ranks)) if ranks else set()
    if not common:
        axes.set_axis_off()
        return
    exposed = {s: max(dict(r.exposed_ms)[s] for r in ranks) for s in common}
    step = max(sorted(common), key=lambda s: exposed[s])
    chosen = [[e for e in r.events if e.get("ph") == "X" and e["args"].get("step") == step] for r in ranks]
    origin = min(e["ts"] for events in chosen for e in events if e["name"] == "backward")
    colors = {"comm": "tab:blue", "grads": "tab:green", "exposed": "tab:red"}
    for row, events in enumerate(chosen):
        buckets = sorted({e["tid"] for e in events if e["tid"] != STEP_ROW})
        for event in events:
            start, width = (event["ts"] - origin) / 1000.0, event["dur"] / 1000.0
            if event["name"] == "backward":
                axes.broken_barh([(start, width)], (row - 0.4, 0.8), color="0.88")
            elif event["cat"] == "exposed":
                axes.broken_barh([(start, width)], (row - 0.4, 0.16), color=colors["exposed"])
            elif event["cat"] in ("comm", "grads"):
                lane = buckets.index(event["tid"])
                height = 0.56 / max(1, len(buckets))
                y = row - 0.22 + lane * height
                axes.broken_barh([(start, width)], (y, height * 0.9), color=colors[event["cat"]], alpha=0.85)
    axes.set_yticks(range(len(ranks)), [f"rank {r.rank}" for r in ranks])
    axes.invert_yaxis()
    axes.set_xlabel(f"ms since the backward of step {step} started (earliest rank)")
    median = statistics.median(exposed[s] for s in common)
    axes.set_title(
        f"Step {step} (largest exposed comm; median over steps {median:.2f} ms): "
        "gray backward, green gradients arriving, blue bucket reduce, red waits",
        fontsize=9,
    )
