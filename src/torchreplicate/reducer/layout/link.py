"""The link, measured: a few timed all-reduces and the line fitted through them.

Used only by ``bucket_layout="tuned"`` ([Note: tuning] in layout/policy.py):
``measure_link`` times all-reduces of known sizes within a byte budget, the
slowest rank's times count, ``fit_link`` fits ``time = latency + bytes /
bandwidth`` and ``choose_cap`` turns the line into a bucket cap.
"""

from __future__ import annotations

import time
from typing import NamedTuple, Sequence

import torch
import torch.distributed as dist

from torchreplicate.config import MiB
from torchreplicate.faults.wire import Watch, all_reduce
from torchreplicate.reducer.layout.plan import MAX_CAP, MIN_CAP
from torchreplicate.torch_internals import keep_device_busy

OVERHEAD = 0.1  # the latency a bucket may add, as a share of its transfer time
CALIBRATION_BYTES = (4 * 1024, 2 * MiB, 8 * MiB)  # the sizes timed (at most): latency, then bandwidth
CALIBRATION_REPEATS = 9  # their median counts: a busy machine's typical cost, not its best
TIMINGS_BYTES = 8 * len(CALIBRATION_BYTES)  # the all-reduce of the timings (float64), part of the budget


class LinkModel(NamedTuple):
    """A fitted ``time = latency_s + bytes / bytes_per_s`` for one all-reduce."""

    latency_s: float
    bytes_per_s: float

    def seconds(self, nbytes: int) -> float:
        """Predicted time of one all-reduce of ``nbytes``."""
        return self.latency_s + nbytes / self.bytes_per_s


def fit_link(sizes: Sequence[int], seconds: Sequence[float]) -> LinkModel:
    """``time = latency + bytes / bandwidth`` through measured all-reduces; pure, tested alone.

    The latency is read off the smallest size (whose transfer is nearly
    nothing), the bandwidth off the two largest (the slope between them):
    each from the points that show it. A least-squares line through all of
    them lets the large sizes' noise decide the intercept, which on a busy
    2-core machine swung the chosen cap from 0.5 to 64 MiB between two
    measurements of the same link.
    """
    order = sorted(range(len(sizes)), key=lambda i: sizes[i])
    small, middle, large = order[0], order[-2], order[-1]
    slope = (seconds[large] - seconds[middle]) / (sizes[large] - sizes[middle])
    if slope <= 0:  # noise at the large sizes: their mean rate instead
        slope = seconds[large] / sizes[large]
    slope = max(slope, 1e-13)  # faster than 10 TB/s: noise
    latency = max(seconds[small] - slope * sizes[small], 0.0)
    return LinkModel(latency, 1.0 / slope)


def choose_cap(link: LinkModel) -> int:
    """The bucket cap in bytes: latency at most ``OVERHEAD`` of the transfer, within bounds."""
    return int(min(MAX_CAP, max(MIN_CAP, link.latency_s * link.bytes_per_s / OVERHEAD)))


def calibration_sizes(budget_bytes: int, element_size: int) -> list[int]:
    """Elements of the all-reduces one measurement times, sending at most ``budget_bytes`` in all; pure.

    ``CALIBRATION_BYTES`` where the budget allows them (each timed
    ``CALIBRATION_REPEATS`` times after one warm-up, plus the timings'
    all-reduce), else the same three sizes scaled down alike. At least 1, 2
    and 3 elements (three distinct points for the fit): over budget only for
    a model of a few bytes, whose layout no cap changes (never measured).
    """
    per_round = (budget_bytes - TIMINGS_BYTES) / (CALIBRATION_REPEATS + 1)
    scale = min(1.0, max(0.0, per_round / sum(CALIBRATION_BYTES)))
    return [max(i + 1, int(nbytes * scale) // element_size) for i, nbytes in enumerate(CALIBRATION_BYTES)]


@torch.no_grad()
def measure_link(
    group: dist.ProcessGroup,
    dtype: torch.dtype,
    device: torch.device,
    budget_bytes: int,
    watch: Watch,
) -> LinkModel:
    """Times all-reduces (``calibration_sizes``) on ``group``; the slowest rank's times count. Every wait
    goes through ``watch`` (the stall watchdog names a peer that never comes)."""
    sizes = calibration_sizes(budget_bytes, element := torch.empty((), dtype=dtype).element_size())
    typical = []
    for numel in sizes:
        scratch = torch.zeros(numel, dtype=dtype, device=device)
        watch.wait(all_reduce(scratch, group))  # warm: connections, allocator
        seconds = [_timed_all_reduce(scratch, group, watch) for _ in range(CALIBRATION_REPEATS)]
        typical.append(sorted(seconds)[len(seconds) // 2])
    timings = torch.tensor(typical, dtype=torch.float64, device=device)
    work = all_reduce(timings, group, op=dist.ReduceOp.MAX)  # the same numbers everywhere
    return fit_link([numel * element for numel in sizes], watch.read_on_host(timings, work))


def _timed_all_reduce(scratch: torch.Tensor, group: dist.ProcessGroup, watch: Watch) -> float:
    # Seconds one all-reduce of `scratch` takes. On a GPU the CPU only enqueues
    # it (NCCL's wait orders the stream), so the transfer is timed by CUDA events
    # on the current stream, which waits for it; the calibration is the one
    # place a step synchronises with the host (the tuned opt-in, once). The
    # stream is kept busy first, so the start event runs once the host has
    # enqueued the all-reduce: the sample is the device's, not the enqueue's.
    if scratch.is_cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        keep_device_busy(scratch.device)
        start.record()
        watch.wait(all_reduce(scratch, group))
        end.record()
        watch.wait_event(end)  # the stall watchdog polls: a peer that never comes is named before NCCL's abort
        return float(start.elapsed_time(end)) / 1e3
    started = time.perf_counter()
    watch.wait(all_reduce(scratch, group))
    return time.perf_counter() - started
