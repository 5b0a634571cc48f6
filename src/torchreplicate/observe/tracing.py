"""``trace()``: every rank's ``torch.profiler`` profile, merged into one Chrome trace file, and a plot.

While the context is open each rank runs a ``torch.profiler.profile`` (CPU,
and CUDA where there is one): torch records its own ops and collectives, and
the reducer's phases by the labels reducer/probe.py gives them
(``torchreplicate::launch (bucket 3)``, ``torchreplicate::finalize``, ...).
At exit each rank exports its profile; the ranks' events are gathered to rank
0 (one ``all_gather_object``), which merges them into one file with one
process per rank (trace_format.py) and writes a PNG of the exposed
communication per step per rank, as the step recorder measured it on the
rank's clock ([Note: one clock for the observers] in timeline.py: the
same figure ``log_summary()`` reports, from the device on an accelerator).

[Note: trace clocks]
Each rank's profiler has its own clock, whose origin differs from rank to
rank, so the ranks agree on an origin once: ``trace()`` starts the profiler,
runs a barrier on the model's process group, and right after it records a
``torchreplicate::trace start`` event; the merged file counts every rank's
time from that event. The ranks' origins then differ by how far apart they
left the barrier (tens of microseconds on one host, about one network
latency across hosts) plus the drift of their clocks over the trace (parts
per million). Enough to see which rank is late by a millisecond, not to
order microsecond events across ranks.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import warnings
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import ProfilerActivity, profile, record_function

from torchreplicate.core.registry import get_state
from torchreplicate.faults.wire import gather_objects
from torchreplicate.observe.timeline import StepRecord, StepRecorder, subscribe, unsubscribe
from torchreplicate.observe.trace_format import START, Event, chrome_trace, plot_trace, rank_events
from torchreplicate.reducer.probe import BucketInfo
from torchreplicate.torch_internals import FEATURES, profiler_active
from torchreplicate.version import __version__

logger = logging.getLogger("torchreplicate")


def trace(
    path: Union[str, os.PathLike[str]],
    *,
    model: nn.Module,
    plot: Union[bool, str, os.PathLike[str]] = True,
    max_steps: Optional[int] = 1000,
) -> Tracer:
    """Profiles every rank with ``torch.profiler`` while the context is open, into one trace file.

    ::

        with torchreplicate.trace("run.json", model=model):
            for batch in data:
                model(batch).sum().backward(); optimizer.step(); optimizer.zero_grad()
        # rank 0 wrote run.json (open it in https://ui.perfetto.dev) and run.png

    Each rank runs a ``torch.profiler.profile`` (CPU activity, plus CUDA
    where CUDA is available), so the file holds torch's own ops and
    collectives and the reducer's labelled phases: for every bucket its
    gradient hooks (``torchreplicate::hook (bucket k)``), its launch (inside
    a hook: overlapped with backward; inside ``torchreplicate::finalize``:
    from the end of backward), the end of backward's wait for it (the
    exposed communication), late rounds, and the forward hooks. What torch's
    own export lacks is added: one process per rank named "rank r", one
    clock origin ([Note: trace clocks]), each labelled event's synchronised
    step in its ``args``, and under ``"otherData"`` the bucket layout at
    exit (each bucket's index, parameter names, elements and bytes) and
    each rank's exposed communication per step (``"exposed_ms"``, from the
    step recorder: the device's clock on an accelerator). Enter and leave the context at the
    same point on every rank: entry runs a barrier and a clean exit one
    ``all_gather_object`` to rank 0, which writes the files. If the block
    raises, no collective runs: each rank writes its own events to
    ``<path stem>.rank<r>.json`` and the exception propagates. At world size
    1 there is no reducer: the file holds torch's ops only.

    Limits: torch runs one profiler at a time (a second one started takes
    the events from the first), so trace() refuses to start while another
    torch profiler records, and a profiler started inside the block leaves
    trace() nothing to write (an error at exit); the profiler keeps every
    event in memory until exit, whatever ``max_steps``.

    Args:
        path: the Chrome trace JSON file rank 0 writes.
        model: a module ``replicate()`` was applied to.
        plot: write a PNG of the exposed communication per step per rank and
            of one step's timeline: True (default) next to ``path`` with the
            suffix ``.png``; a path; or False. Needs matplotlib (skipped,
            with a warning, without it).
        max_steps: keep the last this many synchronised steps of each rank
            in the file. Default 1000; None: all.

    Returns:
        The ``Tracer``; after exit, ``tracer.profiler`` is this rank's
        ``torch.profiler.profile`` (``tracer.profiler.key_averages()``),
        ``tracer.events`` this rank's events as they went into the file, and
        ``tracer.written`` the files this rank wrote.

    Raises:
        ValueError: ``model`` is not replicated, or ``max_steps`` < 1.
        TypeError: ``path`` or ``plot`` has the wrong type.
        RuntimeError: at entry, another torch profiler is recording; at
            exit, one was started inside the block.
    """
    return Tracer(path, model=model, plot=plot, max_steps=max_steps)


class Tracer:
    """The context manager ``trace()`` returns; see there.

    Args:
        path: the trace file.
        model: the replicated module.
        plot: True, a path, or False.
        max_steps: steps kept, or None.
    """

    def __init__(
        self,
        path: Union[str, os.PathLike[str]],
        *,
        model: nn.Module,
        plot: Union[bool, str, os.PathLike[str]] = True,
        max_steps: Optional[int] = 1000,
    ) -> None:
        # - trace()'s arguments, refused at the call rather than at entry or exit
        if not (flag := FEATURES["profiler_flag"]).present:
            raise RuntimeError(
                f"trace(): this torch has no torch.autograd.profiler._is_profiler_enabled: {flag.without}"
            )
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"trace(): path must be a str or os.PathLike, got {type(path).__name__}")
        if max_steps is not None and (isinstance(max_steps, bool) or not isinstance(max_steps, int) or max_steps < 1):
            raise ValueError(f"trace(): max_steps must be a positive int or None, got {max_steps!r}")
        if not isinstance(plot, (bool, str, os.PathLike)):
            raise TypeError(f"trace(): plot must be a bool or a path, got {type(plot).__name__}")
        try:
            get_state(model)
        except ValueError as error:
            raise ValueError(f"trace(): {error}") from None
        # - Configuration
        self.path = os.fspath(path)
        # True: next to the trace file, with the suffix .png; False: no plot
        self.plot_path: Optional[str] = (
            None if plot is False else os.path.splitext(self.path)[0] + ".png" if plot is True else os.fspath(plot)
        )
        self.max_steps = max_steps
        self._model: Optional[nn.Module] = model  # held while the context is open only
        # - This rank's recording
        self.profiler: Optional[profile] = None  # torch's profiler, from entry on
        self.events: list[Event] = []  # after exit: this rank's events, as merged
        self.exposed_ms: list[float] = []  # this rank's exposed communication per step of the trace (timeline.py)
        self._buckets: list[dict[str, Any]] = []  # at exit: the layout, for the file (torch has no word for it)
        # - After exit
        self.written: list[str] = []  # files this rank wrote

    def __enter__(self) -> Tracer:
        model = self._model
        if model is None or self.profiler is not None:
            raise RuntimeError("trace(): a Tracer can be entered once")
        if profiler_active():  # before the barrier: refused alone, not after the others passed it
            raise RuntimeError(
                "trace(): another torch profiler is recording, and torch runs one at a time; stop it "
                "before trace(), or read the reducer's torchreplicate:: labels in that profiler's own trace"
            )
        state = get_state(model)
        if isinstance(state.events, StepRecorder):
            state.events.flush()  # steps before the trace are not its steps (on a device, one is pending)
        subscribe(model, self._on_step)  # refused (nothing started yet) where another observer is attached
        group = state.group
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        self.profiler = profile(activities=activities)
        self.profiler.start()
        dist.barrier(group=group)  # [Note: trace clocks]
        with record_function(START):
            pass
        return self

    def _on_step(self, record: StepRecord) -> None:
        self.exposed_ms.append(record.exposed_ns / 1e6)

    def __exit__(self, exc_type: Optional[type[BaseException]], *exc_info: object) -> None:
        model, profiler = self._model, self.profiler
        assert model is not None and profiler is not None, "entered"
        self._model = None
        state = get_state(model)
        try:
            if exc_type is None and isinstance(state.events, StepRecorder):
                state.events.flush()  # the last step's record (a subscriber's collective: every rank is here)
        finally:
            unsubscribe(model, self._on_step)
        if not profiler_active():  # torch runs one session: another profiler, started and stopped inside, ended ours
            raise RuntimeError(
                "trace(): another torch profiler was started inside the trace() block and ended its session "
                "(torch runs one at a time), so there is nothing to write; run one profiler at a time"
            )
        profiler.stop()
        group = state.group
        self._buckets = [] if state.reducer is None else [_bucket_entry(b) for b in state.reducer.info.buckets]
        rank, world_size = dist.get_rank(group), dist.get_world_size(group)
        # The profile as torch exports it (Chrome trace JSON), read back: torch
        # writes it to a file only (torch/profiler/profiler.py, export_chrome_trace).
        with tempfile.TemporaryDirectory(prefix="torchreplicate-trace-") as folder:
            exported_path = os.path.join(folder, "profile.json")
            profiler.export_chrome_trace(exported_path)
            with open(exported_path) as file:
                exported: dict[str, Any] = json.load(file)
        self.events = rank_events(rank, world_size, exported, self.max_steps)
        kept = len(self.exposed_ms) if self.max_steps is None else min(self.max_steps, len(self.exposed_ms))
        mine = {len(self.exposed_ms) - kept + i: ms for i, ms in enumerate(self.exposed_ms[-kept:] if kept else [])}
        if exc_type is not None:
            # Another rank may be elsewhere (or dead): no collective, this rank's file only.
            self._write_own_file(rank, mine)
            return None
        gathered = gather_objects((self.events, mine), group, state.device)
        if rank == 0:
            self._write_files([events for events, _ in gathered], {r: e for r, (_, e) in enumerate(gathered) if e})
        return None

    def _write_files(self, ranks: list[list[Event]], exposed: dict[int, dict[int, float]]) -> None:
        # Rank 0, after the gather: the trace of every rank, the plot, and a log line saying where.
        content = chrome_trace(ranks, **self._other_data(len(ranks), exposed))
        self._write_json(self.path, content)
        if self.plot_path is not None:
            try:
                plot_trace(content["traceEvents"], exposed, self.plot_path)
                self.written.append(self.plot_path)
            except ImportError:  # stacklevel 3: the `with` statement, as if warned from __exit__
                warnings.warn(
                    "trace(): matplotlib is not installed, so no plot was written; "
                    'pip install "torchreplicate[plot]" (or plot=False)',
                    stacklevel=3,
                )
        num_steps = max((len(steps) for steps in exposed.values()), default=0)
        logger.info(
            "torchreplicate: trace of %d synchronised step(s) on %d rank(s): %s (open the JSON in "
            "https://ui.perfetto.dev or chrome://tracing)",
            num_steps,
            len(ranks),
            " and ".join(self.written),
        )

    def _write_own_file(self, rank: int, exposed: dict[int, float]) -> None:
        # This rank's events only, to <path stem>.rank<r>.json, when the block raised.
        stem, suffix = os.path.splitext(self.path)
        own = f"{stem}.rank{rank}{suffix or '.json'}"
        try:
            self._write_json(own, chrome_trace([self.events], **self._other_data(1, {rank: exposed})))
        except OSError as error:  # never hide the block's own exception; stacklevel 3: the `with` statement
            warnings.warn(f"trace(): could not write {own}: {error}", stacklevel=3)

    def _other_data(self, num_ranks: int, exposed: dict[int, dict[int, float]]) -> dict[str, Any]:
        return {
            "exposed_ms": {str(rank): {str(step): ms for step, ms in steps.items()} for rank, steps in exposed.items()},
            "producer": f"torchreplicate {__version__} trace(), on torch.profiler (torch {torch.__version__})",
            "num_ranks": num_ranks,
            "clock": f"microseconds since each rank's {START!r} event, recorded right after a barrier",
            "max_steps": self.max_steps,
            "buckets": self._buckets,
        }

    def _write_json(self, path: str, content: dict[str, Any]) -> None:
        directory = os.path.dirname(os.path.abspath(path))
        os.makedirs(directory, exist_ok=True)
        partial = f"{path}.tmp{os.getpid()}"
        with open(partial, "w") as file:
            json.dump(content, file, separators=(",", ":"))
        os.replace(partial, path)
        self.written.append(path)


def _bucket_entry(info: BucketInfo) -> dict[str, Any]:
    # What "(bucket k)" in a label means: the same on every rank ([Note: one collective sequence] in reducer.py).
    return {"index": info.index, "params": list(info.names), "numel": info.numel, "bytes": info.nbytes}
