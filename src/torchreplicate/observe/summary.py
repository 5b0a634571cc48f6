"""``log_summary()``: every N synchronised steps, one log line across ranks (step time, exposed comm, stragglers).

Each rank adds up its own steps' records (timeline.py) between reports. At
every N-th synchronised step (by the reducer's step number, the same on
every rank) the end of that step's backward gathers one small tensor per rank (one
collective), and every rank builds the same ``StepSummary``; rank 0 logs it to the
``"torchreplicate"`` logger. No collective at any other step.

What the numbers mean, per rank and averaged over the window's steps, on
the rank's clock: the host's on the CPU, the device's (timing events on
its stream) on an accelerator ([Note: one clock for the observers] in
timeline.py; there the figures of a step arrive one step later):

- step time: wall time per synchronised step (end of one step's backward to
  the end of the next; the first window starts at ``log_summary()``; a
  report's own all-gather falls in the next window);
- exposed communication: time the end of backward waited for buckets, plus
  late rounds (collectives not hidden behind the backward);
- busy: step time minus exposed communication: what the rank spent on its
  own work. Ranks of a synchronised job share one step time, so the
  straggler is the rank with the most busy time: the others wait for it;
- wire bytes: what each step handed to the reducer's collectives (per rank;
  an all-reduce moves about 2 (n - 1) / n times that over each rank's link);
- effective bandwidth: wire bytes / comm span, the time collectives were in
  flight (first launch to last bucket done). Low when buckets launched early
  wait for a slow rank; compare it with the link's bandwidth.

Limits: waits outside the reducer (a buffer broadcast, the user's own
collectives, a data loader) count as busy on the rank that waits there.
"""

from __future__ import annotations

import logging
from typing import Any, NamedTuple, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from torchreplicate.core.registry import get_state
from torchreplicate.faults.wire import all_reduce
from torchreplicate.observe.timeline import StepRecord, subscribe, unsubscribe

logger = logging.getLogger("torchreplicate")


class RankWindow(NamedTuple):
    """One rank over one summary window (times per step, in ms).

    Attributes:
        rank: group rank.
        num_steps: synchronised steps it completed in the window.
        step_ms: wall time per step.
        exposed_ms: exposed communication per step.
        wire_bytes: bytes per step handed to the reducer's collectives.
        comm_span_ms: time collectives were in flight per step.
    """

    rank: int
    num_steps: int
    step_ms: float
    exposed_ms: float
    wire_bytes: float
    comm_span_ms: float

    @property
    def busy_ms(self) -> float:
        """Step time minus exposed communication: the rank's own work per step."""
        return self.step_ms - self.exposed_ms

    @property
    def bandwidth(self) -> float:
        """Effective bandwidth, bytes per second: wire bytes / comm span (NaN with no span)."""
        return self.wire_bytes / (self.comm_span_ms / 1e3) if self.comm_span_ms > 0 else float("nan")


class StepSummary(NamedTuple):
    """Every rank's figures over one window; the same on every rank.

    Attributes:
        first_step: the window's first synchronised step.
        last_step: its last (the reporting step).
        ranks: per rank, by rank.
    """

    first_step: int
    last_step: int
    ranks: tuple[RankWindow, ...]

    @property
    def step_ms(self) -> float:
        """Wall time per step, mean over ranks."""
        return sum(r.step_ms for r in self.ranks) / len(self.ranks)

    @property
    def exposed_ms(self) -> float:
        """Exposed communication per step, mean over ranks."""
        return sum(r.exposed_ms for r in self.ranks) / len(self.ranks)

    @property
    def slowest_rank(self) -> int:
        """The rank with the most busy time per step (the straggler)."""
        return max(self.ranks, key=lambda r: r.busy_ms).rank

    @property
    def fastest_rank(self) -> int:
        """The rank with the least busy time per step."""
        return min(self.ranks, key=lambda r: r.busy_ms).rank

    @property
    def slowest_by_ms(self) -> float:
        """Busy time per step of the slowest rank minus that of the fastest."""
        return self.ranks[self.slowest_rank].busy_ms - self.ranks[self.fastest_rank].busy_ms

    def line(self) -> str:
        """The one-line log message."""
        ranks = self.ranks
        most_exposed = max(ranks, key=lambda r: r.exposed_ms)
        bandwidths = [r.bandwidth for r in ranks if r.bandwidth == r.bandwidth]
        bandwidth = sum(bandwidths) / len(bandwidths) if bandwidths else float("nan")
        text = (
            f"torchreplicate: steps {self.first_step}-{self.last_step} on {len(ranks)} rank(s): "
            f"step {self.step_ms:.2f} ms, exposed comm {self.exposed_ms:.2f} ms "
            f"(max {most_exposed.exposed_ms:.2f} ms on rank {most_exposed.rank}), "
            f"{_format_bytes(ranks[0].wire_bytes)}/step, {_format_bytes(bandwidth)}/s effective "
            "(bytes / comm span)"
        )
        if len(ranks) > 1:
            slowest, fastest = ranks[self.slowest_rank], ranks[self.fastest_rank]
            share = self.slowest_by_ms / fastest.busy_ms * 100 if fastest.busy_ms > 0 else float("nan")
            text += (
                f"; slowest rank {slowest.rank}: busy {slowest.busy_ms:.2f} ms/step, "
                f"+{self.slowest_by_ms:.2f} ms (+{share:.0f}%) over the fastest (rank {fastest.rank})"
            )
        return text


def _format_bytes(value: float) -> str:
    if value != value:
        return "n/a B"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if value >= scale:
            return f"{value / scale:.3g} {unit}"
    return f"{value:.0f} B"


def summarize(rows: Sequence[Sequence[float]], first_step: int, last_step: int) -> StepSummary:
    """A ``StepSummary`` from every rank's sums (pure: testable without a process group).

    Args:
        rows: per rank, by rank: (steps, wall ns, exposed ns, wire bytes,
            comm span ns, first step) summed over the window.
        first_step: the window's first step (used when no rank knows better).
        last_step: the reporting step.
    """
    windows = []
    for rank, row in enumerate(rows):
        n = max(1, int(row[0]))  # steps, as a divisor
        windows.append(RankWindow(rank, int(row[0]), row[1] / n / 1e6, row[2] / n / 1e6, row[3] / n, row[4] / n / 1e6))
    firsts = [int(row[5]) for row in rows if row[0] > 0]
    return StepSummary(min(firsts, default=first_step), last_step, tuple(windows))


def log_summary(
    model: nn.Module,
    *,
    every: int = 100,
    level: int = logging.INFO,
    log_rank: Optional[int] = 0,
) -> SummaryLogger:
    """Logs one line across ranks every ``every`` synchronised steps (logger ``"torchreplicate"``).

    ::

        summary = torchreplicate.log_summary(model, every=100)
        ...  # train; every 100 steps rank 0 logs, e.g.
        # torchreplicate: steps 100-199 on 2 rank(s): step 45.21 ms, exposed comm 6.61 ms
        # (max 12.30 ms on rank 0), 3.36 MB/step, 280 MB/s effective (bytes / comm span);
        # slowest rank 1: busy 44.20 ms/step, +11.30 ms (+34%) over the fastest (rank 0)
        summary.stop()  # or use it as a context manager

    Call it at the same point on every rank: the report is one all-gather at
    the end of the backward of every ``every``-th step (step numbers counted
    by the reducer, the same on every rank), which every rank must reach.
    The figures are defined in summary.py's docstring. At world size 1 there
    are no synchronised steps, so nothing is logged.

    Args:
        model: a module ``replicate()`` was applied to.
        every: steps per report. Default 100.
        level: the logging level of the line. Default ``logging.INFO``.
        log_rank: the group rank that logs; None: every rank. Default 0.

    Returns:
        A ``SummaryLogger``: ``.stop()`` ends it, ``.last`` is the latest
        ``StepSummary`` (on every rank).

    Raises:
        ValueError: ``model`` is not replicated, or ``every`` < 1.
    """
    return SummaryLogger(model, every=every, level=level, log_rank=log_rank)


class SummaryLogger:
    """The handle ``log_summary()`` returns; see there.

    Args:
        model: the replicated module.
        every: steps per report.
        level: logging level.
        log_rank: the rank that logs, or None for all.
    """

    def __init__(self, model: nn.Module, *, every: int, level: int, log_rank: Optional[int]) -> None:
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"log_summary(): every must be a positive int, got {every!r}")
        try:
            state = get_state(model)
        except ValueError as error:
            raise ValueError(f"log_summary(): {error}") from None
        # - Configuration
        self.every = every
        self.level = level
        self.log_rank = log_rank
        self._model: Optional[nn.Module] = model  # until stop()
        self._rank = dist.get_rank(state.group)
        # - Reports
        self.last: Optional[StepSummary] = None  # the latest, on every rank
        # - The window being summed (this rank's own steps), on the recorder's clock
        self._first_step = -1  # none yet
        self._num_steps = self._exposed_ns = self._wire_bytes = self._comm_span_ns = 0
        self._clock = subscribe(model, self._on_step).clock
        self._start: Any = self._clock.mark()  # the first window's start: a mark, read at its report
        self._start_ns: Optional[int] = None  # later windows': the last report's step end

    def stop(self) -> None:
        """Stops reporting (no more collectives). Idempotent."""
        if self._model is not None:
            unsubscribe(self._model, self._on_step)
            self._model = None

    def __enter__(self) -> SummaryLogger:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def _on_step(self, record: StepRecord) -> None:
        if self._start_ns is None and not self._num_steps and record.end_ns < self._clock.ns(self._start):
            return  # a step that ended before log_summary() (on a device, delivered a step late)
        if self._first_step < 0:
            self._first_step = record.step
        self._num_steps += 1
        self._exposed_ns += record.exposed_ns
        self._wire_bytes += record.wire_bytes
        self._comm_span_ns += record.comm_span_ns
        if (record.step + 1) % self.every == 0:
            self._report(record)

    def _report(self, record: StepRecord) -> None:
        # Inside the reporting step's end of backward, on every rank: one all-gather,
        # written as one all-reduce: each rank fills its own row of zeros (float64
        # sums with zeros are exact). The all-reduce is waited through the stall
        # watchdog, as the reducer's collectives are ([Note: stall watchdog] in watchdog.py).
        assert self._model is not None, "subscribed while running"
        state = get_state(self._model)
        assert state.reducer is not None, "a step ended, so a reducer ran it"
        view = state.reducer.info
        start_ns = self._clock.ns(self._start) if self._start_ns is None else self._start_ns
        sums = [self._num_steps, record.end_ns - start_ns, self._exposed_ns, self._wire_bytes]
        mine = torch.tensor(sums + [self._comm_span_ns, self._first_step], dtype=torch.float64, device=view.device)
        table = torch.zeros(dist.get_world_size(state.group), mine.numel(), dtype=mine.dtype, device=mine.device)
        table[self._rank] = mine
        rows = view.watch.read_on_host(table, all_reduce(table, state.group))
        self.last = summary = summarize(rows, self._first_step, record.step)
        if self.log_rank is None or self.log_rank == self._rank:
            logger.log(self.level, summary.line())
        self._start_ns = record.end_ns  # the next window starts at this step's end
        self._first_step = -1
        self._num_steps = self._exposed_ns = self._wire_bytes = self._comm_span_ns = 0
