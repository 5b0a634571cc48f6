"""The tests' launcher: runs a function on N local processes, one gloo rank each, and returns its results.

``launch(fn, nprocs=2, args=(...), timeout_s=...)`` runs ``fn(*args)`` on
every rank and returns the results by rank. Each process gets ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` (127.0.0.1) and a free
``MASTER_PORT``, and ``fn`` calls ``init_process_group()`` itself. A failing
rank's traceback is raised in the parent and the other ranks are killed;
workers die with the parent; past ``timeout_s`` every rank is killed and the
ranks still running are named. The test suite's persistent worker pools
(harness.py) are built from the same pieces: ``start_ranks``,
``call_and_report``, ``collect_results`` and ``stop_ranks``. The benchmarks
and scripts/ import it from here too (they put tests/ on ``sys.path``).

It was ``torchreplicate.launch`` until 0.2.0. For users, torch has it:
``torchrun`` for scripts, and ``torch.distributed.launcher.api.elastic_launch``
to run a function on N local processes and get its results by rank (a
failing rank's traceback in its ``ChildFailedError``). What this module adds
is what a test suite needs and elastic_launch lacks: a wall-clock deadline
that kills every rank (no test can hang), threads per rank, ranks that die
with the parent, and reusable pieces for persistent pools.
"""

from __future__ import annotations

import ctypes
import math
import multiprocessing
import os
import pickle
import queue
import signal
import socket
import sys
import time
import traceback
from multiprocessing.process import BaseProcess
from multiprocessing.queues import Queue
from typing import Any, Callable, Mapping, Optional, Sequence, TypeAlias

ResultQueue: TypeAlias = "Queue[tuple[int, bool, Any]]"  # (rank, ok, value): see call_and_report


class WorkerError(RuntimeError):
    """Ranks failed: raised an exception, or exited without a result.

    Attributes:
        rank: the first rank seen failing.
        detail: its traceback, or how it exited.
        failures: every failing rank's traceback or exit, by rank.
    """

    def __init__(self, failures: Mapping[int, str]) -> None:
        self.failures = dict(failures)
        self.rank, self.detail = next(iter(self.failures.items()))
        if len(self.failures) == 1:
            message = f"rank {self.rank} failed:\n{self.detail}"
        else:
            reports = "".join(f"\n--- rank {r} ---\n{d}" for r, d in sorted(self.failures.items()))
            message = f"ranks {sorted(self.failures)} failed:{reports}"
        super().__init__(message)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def die_with_parent() -> None:
    """Asks Linux to kill this process when its parent dies (no orphans)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass  # not Linux: the parent's kill on failure still applies


def start_ranks(
    target: Callable[..., None], nprocs: int, args: Sequence[Any] = ()
) -> tuple[list[BaseProcess], ResultQueue]:
    """Spawns ``nprocs`` processes, one rank each, that run ``target(rank, results, *args)``.

    Each process dies with this one and starts with the environment torchrun
    gives a rank: ``RANK`` and ``LOCAL_RANK``, ``WORLD_SIZE`` and
    ``LOCAL_WORLD_SIZE`` (``nprocs``), ``MASTER_ADDR`` (127.0.0.1) and
    ``MASTER_PORT`` (a free port), so ``init_process_group("gloo")`` needs no
    other argument. Spawned, not forked: forking a process that has started
    torch's threads can deadlock.

    Args:
        target: what each process runs; defined at module level (spawn imports it by name).
        nprocs: number of processes.
        args: further arguments for ``target``, picklable. Default none.

    Returns:
        The processes, by rank, and the queue for their results (see ``call_and_report``).
    """
    context = multiprocessing.get_context("spawn")
    results: ResultQueue = context.Queue()
    port = free_port()
    processes: list[BaseProcess] = [
        context.Process(target=_rank_main, args=(rank, nprocs, port, target, results, args)) for rank in range(nprocs)
    ]
    for process in processes:
        process.start()
    return processes, results


def _rank_main(
    rank: int, nprocs: int, port: int, target: Callable[..., None], results: ResultQueue, args: Sequence[Any]
) -> None:
    die_with_parent()
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(nprocs),
        LOCAL_WORLD_SIZE=str(nprocs),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    target(rank, results, *args)


def call_and_report(results: ResultQueue, rank: int, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> bool:
    """Runs ``fn(*args, **kwargs)`` on a rank and sends ``(rank, ok, value)`` on ``results``.

    Args:
        results: the queue from ``start_ranks``.
        rank: this process's rank.
        fn: the function to run.
        *args: its positional arguments.
        **kwargs: its keyword arguments.

    Returns:
        True if ``fn`` returned (``value`` is its return value); False if it
        raised (``value`` is the traceback) or returned a value that cannot
        be pickled (``value`` says so).
    """
    try:
        value = fn(*args, **kwargs)
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
        return False
    try:
        pickle.dumps(value)  # the queue pickles in a background thread, where a failure goes unseen
    except Exception as error:
        results.put((rank, False, f"{fn.__name__} returned a value that cannot be pickled: {error!r}"))
        return False
    results.put((rank, True, value))
    return True


def collect_results(
    results: ResultQueue,
    processes: Sequence[BaseProcess],
    timeout_s: Optional[float] = None,
    *,
    grace_s: float = 0.0,
) -> list[Any]:
    """Waits for one result per rank (as ``call_and_report`` sends them); stops no process.

    Args:
        results: the queue from ``start_ranks``.
        processes: the processes from ``start_ranks``, by rank.
        timeout_s: give up after this many seconds. Default: no limit.
        grace_s: after a first failure, wait this long for the other ranks'
            results or failures, to report them too. Default 0.

    Returns:
        The values, by rank.

    Raises:
        WorkerError: a rank raised, or exited without a result.
        TimeoutError: ``timeout_s`` passed with ranks still running.
    """
    values: dict[int, Any] = {}
    failures: dict[int, str] = {}
    deadline = math.inf if timeout_s is None else time.monotonic() + timeout_s
    exited: list[int] = []
    while len(values) + len(failures) < len(processes):
        try:
            rank, ok, value = results.get(timeout=0.1)
        except queue.Empty:
            done = set(values) | set(failures)
            gone = [r for r, p in enumerate(processes) if p.exitcode is not None and r not in done]
            if (gone and gone == exited) or time.monotonic() > deadline:
                break
            exited = gone  # their last message may still be in the pipe: read once more before deciding
            continue
        if ok:
            values[rank] = value
        else:
            failures[rank] = value
            deadline = min(deadline, time.monotonic() + grace_s)
    for rank, process in enumerate(processes):
        if rank not in values and rank not in failures and process.exitcode is not None:
            failures[rank] = f"exited with code {process.exitcode} without a result"
    if failures:
        raise WorkerError(failures)
    if len(values) < len(processes):
        running = [r for r in range(len(processes)) if r not in values]
        raise TimeoutError(f"ranks {running} still running after {timeout_s} s")
    return [values[rank] for rank in range(len(processes))]


def stop_ranks(processes: Sequence[BaseProcess], grace_s: float = 0.0) -> None:
    """Waits up to ``grace_s`` seconds for the processes to exit, then kills the others and reaps them all.

    Args:
        processes: the processes from ``start_ranks``.
        grace_s: seconds they have, all together, to exit by themselves. Default 0.
    """
    deadline = time.monotonic() + grace_s
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
    for process in processes:
        if process.is_alive():
            process.kill()
        process.join(timeout=5)


def launch(
    fn: Callable[..., Any],
    nprocs: int = 2,
    args: Sequence[Any] = (),
    *,
    timeout_s: Optional[float] = None,
    threads_per_rank: Optional[int] = None,
) -> list[Any]:
    """Runs ``fn(*args)`` in ``nprocs`` local processes, one rank each.

    ``fn`` must be importable (defined at module level) and calls
    ``torch.distributed.init_process_group("gloo")`` itself; the environment
    tells it its rank, the world size and the address.

    Args:
        fn: the function every rank runs.
        nprocs: number of processes (ranks). Default 2.
        args: positional arguments for ``fn``. Default none.
        timeout_s: kill every rank and raise ``TimeoutError`` after this many
            seconds. Default: no limit.
        threads_per_rank: torch intra-op threads per rank. Default: the CPU
            count divided by ``nprocs``, at least 1.

    Returns:
        ``fn``'s return value on each rank, by rank.

    Raises:
        WorkerError: a rank raised or died; the others were killed.
        TimeoutError: ``timeout_s`` passed.
    """
    if not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"launch(): nprocs must be a positive int, got {nprocs!r}")
    threads = threads_per_rank or max(1, (os.cpu_count() or 1) // nprocs)
    processes, results = start_ranks(_launched, nprocs, (fn, args, threads))
    try:
        values = collect_results(results, processes, timeout_s)
    except BaseException:
        stop_ranks(processes)  # at once: the others may wait for the failed rank forever
        raise
    stop_ranks(processes, grace_s=30)  # time to tear their process groups down
    return values


def _launched(rank: int, results: ResultQueue, fn: Callable[..., Any], args: Sequence[Any], threads: int) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    try:
        ok = call_and_report(results, rank, fn, *args)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if not ok:
        sys.exit(1)
