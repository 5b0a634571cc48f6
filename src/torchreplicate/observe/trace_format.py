"""The trace file of ``trace()``: every rank's ``torch.profiler`` events merged into one Chrome trace, and its plot.

Pure functions over Chrome trace events, the JSON that
``torch.profiler.profile.export_chrome_trace`` writes (Chrome's Trace Event
Format, object form, which https://ui.perfetto.dev and ``chrome://tracing``
open): complete events (``"ph": "X"``, ``ts`` and ``dur`` in microseconds),
instants (``"i"``), flows (``"s"``/``"f"``, forward op to its backward) and
metadata (``"M"``: the names of processes and threads).

What torch's per-process export lacks, and this file adds:

- one process per rank: every event of rank r gets ``pid`` r, the process is
  named "rank r" and sorted by rank (torch names it after the OS process);
  flow ids are made unique across ranks, so an arrow never joins two ranks;
- one clock origin: ``ts`` counts from the rank's ``torchreplicate::trace
  start`` event, recorded right after a barrier ([Note: trace clocks] in
  tracing.py);
- step numbers: every ``torchreplicate::`` event (the labels of
  reducer/probe.py) gets ``args["step"]``, the synchronised step it belongs
  to, counted from the trace's start: step i ends with the i-th
  ``torchreplicate::finalize`` (the end of backward);
- a PNG of the exposed communication per step per rank (``StepRecord``'s,
  handed in by tracing.py: one definition, timeline.py) and of one step.
"""

from __future__ import annotations

import bisect
import re
import statistics
from typing import Any, Optional, Sequence

from torchreplicate.reducer.probe import PREFIX

Event = dict[str, Any]

START = PREFIX + "trace start"  # recorded by tracing.py right after the entry barrier: each rank's origin
FINALIZE = PREFIX + "finalize"  # the end of backward: one per synchronised step
_LABEL = re.compile(re.escape(PREFIX) + r"(\w+)(?: \(bucket (\d+)\))?$")  # the inverse of probe.label()
_EXPOSED = ("wait", "late_round")  # the phases the end of backward spends waiting on collectives
_TORCH_PROCESS_METADATA = ("process_name", "process_labels", "process_sort_index")  # replaced by "rank r"


def rank_events(rank: int, world_size: int, exported: dict[str, Any], max_steps: Optional[int]) -> list[Event]:
    """One rank's profile as it goes into the merged file.

    Args:
        rank: its group rank (the ``pid`` of its events).
        world_size: the group's size (flow ids are made unique across ranks with it).
        exported: what ``export_chrome_trace`` wrote on that rank (the JSON
            object, with ``"traceEvents"`` holding the ``START`` event).
        max_steps: keep the last this many synchronised steps (and what
            follows them); None: all.

    Returns:
        Its events, ``pid`` = rank, ``ts`` in microseconds since its
        ``START``, each ``torchreplicate::`` event numbered with its step;
        metadata first, naming the process "rank r".
    """
    torch_events = exported["traceEvents"]
    origin = next(e["ts"] for e in torch_events if e.get("name") == START)
    events: list[Event] = []
    for event in torch_events:
        if event.get("ph") == "M" and event.get("name") in _TORCH_PROCESS_METADATA:
            continue
        event = {**event, "pid": rank}
        if "ts" in event:
            event["ts"] = float(event["ts"]) - origin
        if isinstance(event.get("id"), int):  # flows: unique per rank in torch's export, so across the merge too
            event["id"] = event["id"] * world_size + rank
        events.append(event)
    step_ends = sorted(e["ts"] + e["dur"] for e in events if e.get("name") == FINALIZE and e.get("ph") == "X")
    for event in events:
        if event.get("ph") == "X" and event["name"].startswith(PREFIX) and event["name"] != START:
            step = bisect.bisect_left(step_ends, event["ts"])  # the first step not over when it started
            if step < len(step_ends):
                event["args"] = {**event.get("args", {}), "step": step}
    if max_steps is not None and len(step_ends) > max_steps:
        cut = step_ends[-max_steps - 1]  # the end of the last step dropped
        events = [e for e in events if e.get("ph") == "M" or e.get("ts", cut) > cut]
    process = [
        {"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}},
        {"name": "process_sort_index", "ph": "M", "pid": rank, "args": {"sort_index": rank}},
    ]
    return process + events


def chrome_trace(ranks: Sequence[Sequence[Event]], **other: Any) -> dict[str, Any]:
    """The trace file's content: every rank's events (``rank_events``), and ``other`` under ``"otherData"``."""
    events = [event for events in ranks for event in events]
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": dict(other)}


def plot_trace(events: Sequence[Event], exposed: dict[int, dict[int, float]], path: str, *, title: str = "") -> None:
    """Writes a PNG: exposed communication per step per rank, and the timeline of one step.

    The step shown is the one with the largest exposed communication on any
    rank among the steps every rank recorded (the most instructive one).
    Uses matplotlib's object API (no pyplot, no global backend change).

    Args:
        events: merged events (``rank_events`` of every rank).
        exposed: {rank: {step: ms}}, each rank's exposed communication per step (the step recorder's).
        path: the PNG to write.
        title: the top panel's title (default: says what it shows).

    Raises:
        ImportError: matplotlib is not installed.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(9, 5.4), dpi=80, layout="constrained")
    FigureCanvasAgg(figure)
    top, bottom = figure.subplots(2, 1, height_ratios=[1, 1])
    for rank in sorted(exposed):
        steps = sorted(exposed[rank])
        values = [exposed[rank][s] for s in steps]
        top.plot(steps, values, marker=".", markersize=3, linewidth=1, label=f"rank {rank}")
    top.set_xlabel("synchronised step")
    top.set_ylabel("exposed comm, ms")
    top.set_title(title or "Exposed communication per step (time in the end of backward's waits)", fontsize=10)
    if exposed:
        top.legend(fontsize=8, loc="upper right")
        top.set_ylim(bottom=0)
    else:
        top.text(0.5, 0.5, "no synchronised step recorded (world size 1?)", ha="center", transform=top.transAxes)
    _plot_one_step(bottom, events, exposed)
    figure.savefig(path)


def _plot_one_step(axes: Any, events: Sequence[Event], exposed: dict[int, dict[int, float]]) -> None:
    # One row per rank: gray its backward (first gradient hook to the end of
    # backward), then three lanes: green the gradient hooks, blue the
    # collectives running (gloo's thread, or NCCL kernels), red the waits.
    ranks = sorted(exposed)
    common = set.intersection(*(set(exposed[r]) for r in ranks)) if ranks else set()
    if not common:
        axes.set_axis_off()
        return
    worst = {s: max(exposed[r][s] for r in ranks) for s in common}
    step = max(sorted(common), key=lambda s: worst[s])
    windows = {r: _backward_window(events, r, step) for r in ranks}
    origin = min(start for start, _ in windows.values())
    lanes = {"hook": (0.3, "tab:green"), "comm": (0.02, "tab:blue"), "wait": (-0.26, "tab:red")}
    for row, rank in enumerate(ranks):
        start, end = windows[rank]
        axes.broken_barh([((start - origin) / 1000.0, (end - start) / 1000.0)], (row - 0.4, 0.8), color="0.88")
        for event in events:
            if event.get("pid") != rank or event.get("ph") != "X" or not start <= event["ts"] <= end:
                continue
            lane = _lane(event)
            if lane is not None:
                offset, color = lanes[lane]
                span = ((event["ts"] - origin) / 1000.0, event["dur"] / 1000.0)
                axes.broken_barh([span], (row - offset - 0.1, 0.2), color=color, alpha=0.85)
    axes.set_yticks(range(len(ranks)), [f"rank {r}" for r in ranks])
    axes.invert_yaxis()
    axes.set_xlabel(f"ms since the backward of step {step} started (earliest rank)")
    median = statistics.median(worst[s] for s in common)
    axes.set_title(
        f"Step {step} (largest exposed comm; median over steps {median:.2f} ms): "
        "gray backward, green gradient hooks, blue collectives, red waits",
        fontsize=9,
    )


def _backward_window(events: Sequence[Event], rank: int, step: int) -> tuple[float, float]:
    # From the step's first gradient hook (or its end of backward, with none) to the end of backward's end.
    mine = [e for e in events if e.get("pid") == rank and e.get("args", {}).get("step") == step]
    (finalize,) = [e for e in mine if e["name"] == FINALIZE]
    hooks = [e["ts"] for e in mine if _lane(e) == "hook"]
    return min(hooks, default=finalize["ts"]), finalize["ts"] + finalize["dur"]


def _lane(event: Event) -> Optional[str]:
    # Which lane of the step plot an event goes to, if any.
    name = event["name"]
    if name.startswith("gloo:") or name.startswith("nccl"):  # gloo's own span, or an NCCL kernel on a stream
        return "comm"
    label = _LABEL.match(name)
    if label is None:
        return None
    phase = label.group(1)
    return "hook" if phase == "hook" else "wait" if phase in _EXPOSED else None
