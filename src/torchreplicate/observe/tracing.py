"""``trace()``: a per-bucket timeline of every rank's steps, written as one Chrome trace file and a plot.

While the context is open each rank records its synchronised backwards
(timeline.py) and its forwards; at exit the ranks' events are gathered to
rank 0 (one ``all_gather_object``), which writes the trace (trace_format.py)
and a PNG of the exposed communication per step per rank.

[Note: trace clocks]
Each rank measures with its own ``time.perf_counter_ns()``, whose origin is
arbitrary, so the ranks agree on an origin once: ``trace()`` runs a barrier
on the model's process group at entry, and every rank takes its t0 right
after it. Timestamps are relative to that t0. The ranks' origins then differ
by how far apart they left the barrier (tens of microseconds on one host,
about one network latency across hosts) plus the drift of their clocks over
the trace (parts per million). Enough to see which rank is late by a
millisecond, not to order microsecond events across ranks.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import time
import warnings
from types import TracebackType
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from torch import nn

from torchreplicate.core.registry import get_state
from torchreplicate.observe.timeline import StepRecord, subscribe, unsubscribe
from torchreplicate.observe.trace_format import (
    BucketInfo,
    ForwardSpan,
    RankTrace,
    chrome_trace,
    plot_trace,
    rank_events,
)
from torchreplicate.reducer.probe import ReducerInfo
from torchreplicate.version import __version__

logger = logging.getLogger("torchreplicate")


def trace(
    path: Union[str, os.PathLike[str]],
    *,
    model: nn.Module,
    plot: Union[bool, str, os.PathLike[str]] = True,
    max_steps: Optional[int] = 1000,
) -> Tracer:
    """Records a per-bucket timeline of every rank while the context is open.

    ::

        with torchreplicate.trace("run.json", model=model):
            for batch in data:
                model(batch).sum().backward(); optimizer.step(); optimizer.zero_grad()
        # rank 0 wrote run.json (open it in https://ui.perfetto.dev) and run.png

    For every synchronised backward and every bucket: when its first gradient
    came, when it was ready and launched (from a gradient hook, overlapped
    with backward, or from the end of backward), when it was done, and the
    end of backward's waits (the exposed communication), late rounds and
    re-plans; also every forward of ``model``. Enter and leave the context at
    the same point on every rank: entry runs a barrier ([Note: trace
    clocks]) and a clean exit one ``all_gather_object`` to rank 0, which
    writes the files. If the block raises, no collective runs: each rank
    writes its own events to ``<path stem>.rank<r>.json`` and the exception
    propagates. At world size 1 there is no reducer: only forwards are
    recorded.

    Args:
        path: the Chrome trace JSON file rank 0 writes.
        model: a module ``replicate()`` was applied to.
        plot: write a PNG of the exposed communication per step per rank and
            of one step's timeline: True (default) next to ``path`` with the
            suffix ``.png``; a path; or False. Needs matplotlib (skipped,
            with a warning, without it).
        max_steps: keep the last this many synchronised steps (and their
            forwards) in memory. Default 1000; None: all.

    Returns:
        The ``Tracer``; after exit, ``tracer.records`` holds this rank's
        ``StepRecord``s and ``tracer.written`` the files rank 0 wrote.

    Raises:
        ValueError: ``model`` is not replicated, or ``max_steps`` < 1.
        TypeError: ``path`` or ``plot`` has the wrong type.
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
        _check_arguments(path, model, plot, max_steps)
        # - Configuration
        self.path = os.fspath(path)
        self.plot_path: Optional[str] = _plot_path(self.path, plot)
        self.max_steps = max_steps
        self._model: Optional[nn.Module] = model  # held while the context is open only
        # - Recorded on this rank, while open
        self.records: collections.deque[StepRecord] = collections.deque(maxlen=max_steps)
        self._forwards: collections.deque[ForwardSpan] = collections.deque(
            maxlen=None if max_steps is None else 16 * max_steps
        )
        self._layouts: list[tuple[int, tuple[BucketInfo, ...]]] = []  # (first step, buckets)
        self._layout_source: Optional[ReducerInfo] = None  # the reducer's view the last layout came from
        self._num_dropped = 0  # steps pushed out of `records`
        self._dropped_until_ns = 0  # end of the newest dropped step: older forwards go too
        self._forward_start_ns: list[int] = []  # a stack: forwards may nest (a module called inside itself)
        self._t0_ns = 0
        self._rank = 0
        self._hooks: list[Any] = []
        self._open = False
        # - After exit
        self.written: list[str] = []  # files this rank wrote

    # -- the context -----------------------------------------------------------

    def __enter__(self) -> Tracer:
        model = self._model
        if model is None or self._open:
            raise RuntimeError("trace(): a Tracer can be entered once")
        state = get_state(model)
        group = state.group
        self._rank = dist.get_rank(group)
        dist.barrier(group=group)  # [Note: trace clocks]
        self._t0_ns = time.perf_counter_ns()
        subscribe(model, self._on_step)
        self._hooks = [
            model.register_forward_pre_hook(self._forward_started, prepend=True),
            model.register_forward_hook(self._forward_ended),
        ]
        self._open = True
        return self

    def __exit__(
        self,
        exc_type: Optional[type[BaseException]],
        exc: Optional[BaseException],
        traceback: Optional[TracebackType],
    ) -> None:
        model = self._model
        assert model is not None and self._open, "entered"
        self._stop_recording(model)
        group = get_state(model).group
        self._model = None
        mine = self._rank_trace()
        if exc_type is not None:
            # Another rank may be elsewhere (or dead): no collective, this rank's file only.
            self._write_own_file(mine)
            return None
        gathered: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, mine, group=group)
        if self._rank != 0:
            return None
        self._write_files(gathered)
        return None

    def _stop_recording(self, model: nn.Module) -> None:
        self._open = False
        unsubscribe(model, self._on_step)
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()

    # -- recording -------------------------------------------------------------

    def _on_step(self, record: StepRecord) -> None:
        # At the end of every synchronised backward (timeline.py): keep it, and
        # the bucket layout it ran with when that changed (a re-plan).
        model = self._model
        reducer = None if model is None else get_state(model).reducer
        if reducer is not None and reducer.info is not self._layout_source:  # a new reducer, or new buckets
            self._layout_source = reducer.info
            self._layouts.append((record.step, reducer.info.buckets))
        if self.records.maxlen is not None and len(self.records) == self.records.maxlen:
            self._num_dropped += 1
            self._dropped_until_ns = self.records[0].end_ns
        self.records.append(record)

    @torch.compiler.disable  # eager under torch.compile, as replicate()'s own hooks
    def _forward_started(self, module: nn.Module, args: Any) -> None:
        self._forward_start_ns.append(time.perf_counter_ns())

    @torch.compiler.disable
    def _forward_ended(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._forward_start_ns:
            start = self._forward_start_ns.pop()
            self._forwards.append(ForwardSpan(start, time.perf_counter_ns(), torch.is_grad_enabled()))

    # -- output ----------------------------------------------------------------

    def _rank_trace(self) -> RankTrace:
        forwards = [f for f in self._forwards if f.start_ns >= self._dropped_until_ns]
        records = list(self.records)
        return RankTrace(
            rank=self._rank,
            events=rank_events(self._rank, self._t0_ns, records, self._layouts, forwards),
            exposed_ms=[(r.step, r.exposed_ns / 1e6) for r in records],
            num_dropped=self._num_dropped,
        )

    def _write_files(self, ranks: list[RankTrace]) -> None:
        # Rank 0, after the gather: the trace of every rank, the plot, and a log line saying where.
        self._write_json(self.path, chrome_trace(ranks, **self._other_data(len(ranks))))
        if self.plot_path is not None:
            try:
                plot_trace(ranks, self.plot_path)
                self.written.append(self.plot_path)
            except ImportError:  # stacklevel 3: the `with` statement, as if warned from __exit__
                warnings.warn(
                    "trace(): matplotlib is not installed, so no plot was written; "
                    'pip install "torchreplicate[plot]" (or plot=False)',
                    stacklevel=3,
                )
        num_steps = max((len(r.exposed_ms) for r in ranks), default=0)
        logger.info(
            "torchreplicate: trace of %d synchronised step(s) on %d rank(s): %s (open the JSON in "
            "https://ui.perfetto.dev or chrome://tracing)",
            num_steps,
            len(ranks),
            " and ".join(self.written),
        )

    def _write_own_file(self, mine: RankTrace) -> None:
        # This rank's events only, to <path stem>.rank<r>.json, when the block raised.
        stem, suffix = os.path.splitext(self.path)
        own = f"{stem}.rank{self._rank}{suffix or '.json'}"
        try:
            self._write_json(own, chrome_trace([mine], **self._other_data(1)))
        except OSError as error:  # never hide the block's own exception; stacklevel 3: the `with` statement
            warnings.warn(f"trace(): could not write {own}: {error}", stacklevel=3)

    def _other_data(self, num_ranks: int) -> dict[str, Any]:
        return {
            "producer": f"torchreplicate {__version__} trace()",
            "num_ranks": num_ranks,
            "clock": "microseconds since each rank's own t0, taken right after a barrier at trace start",
            "max_steps": self.max_steps,
        }

    def _write_json(self, path: str, content: dict[str, Any]) -> None:
        directory = os.path.dirname(os.path.abspath(path))
        os.makedirs(directory, exist_ok=True)
        partial = f"{path}.tmp{os.getpid()}"
        with open(partial, "w") as file:
            json.dump(content, file, separators=(",", ":"))
        os.replace(partial, path)
        self.written.append(path)


def _check_arguments(
    path: Union[str, os.PathLike[str]],
    model: nn.Module,
    plot: Union[bool, str, os.PathLike[str]],
    max_steps: Optional[int],
) -> None:
    # trace()'s arguments, refused at the call rather than at entry or exit.
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


def _plot_path(path: str, plot: Union[bool, str, os.PathLike[str]]) -> Optional[str]:
    # True: next to the trace file, with the suffix .png; False: no plot.
    if plot is False:
        return None
    return os.path.splitext(path)[0] + ".png" if plot is True else os.fspath(plot)
