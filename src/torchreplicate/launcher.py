"""Runs a function on N local processes, one gloo rank each, and returns its results.

``launch(fn, nprocs=2, args=(...))`` runs ``fn(*args)`` on every rank and
returns the results by rank. Each process gets ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR`` (127.0.0.1) and a free ``MASTER_PORT``, and
``fn`` calls ``init_process_group()`` itself. A failing rank's traceback is
raised in the parent and the other ranks are killed; workers die with the
parent. Scripts run under torchrun instead (``python -m torch.distributed.run
--standalone --nproc-per-node 2 train.py``): this module has no command line.
"""

from __future__ import annotations

import ctypes
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
from typing import Any, Callable, Optional, Sequence


class WorkerError(RuntimeError):
    """A worker process failed; carries its rank and traceback."""

    def __init__(self, rank: int, detail: str) -> None:
        super().__init__(f"rank {rank} failed:\n{detail}")
        self.rank = rank  # the first rank seen failing
        self.detail = detail  # its traceback, or how it exited


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


def _worker(
    rank: int,
    nprocs: int,
    port: int,
    threads: int,
    fn: Callable[..., Any],
    args: Sequence[Any],
    results: "multiprocessing.Queue[tuple[int, bool, Any]]",
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
    import torch

    torch.set_num_threads(threads)
    try:
        value = fn(*args)
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
        sys.exit(1)
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    try:
        pickle.dumps(value)  # the queue pickles in a background thread, where a failure goes unseen
    except Exception as error:
        results.put((rank, False, f"{fn.__name__} returned a value that cannot be pickled: {error!r}"))
        sys.exit(1)
    results.put((rank, True, value))


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
    processes, results = _start_ranks(fn, args, nprocs, threads)
    try:
        values = _collect_results(results, processes, timeout_s)
        for process in processes:
            process.join(timeout=30)
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
            process.join(timeout=5)
    return [values[rank] for rank in range(nprocs)]


def _start_ranks(
    fn: Callable[..., Any], args: Sequence[Any], nprocs: int, threads: int
) -> tuple[list[BaseProcess], "multiprocessing.Queue[tuple[int, bool, Any]]"]:
    # Spawned, not forked: forking a process that has started torch's threads can deadlock.
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    port = free_port()
    processes: list[BaseProcess] = [
        context.Process(target=_worker, args=(rank, nprocs, port, threads, fn, args, results), daemon=False)
        for rank in range(nprocs)
    ]
    for process in processes:
        process.start()
    return processes, results


def _collect_results(
    results: "multiprocessing.Queue[tuple[int, bool, Any]]",
    processes: Sequence[BaseProcess],
    timeout_s: Optional[float],
) -> dict[int, Any]:
    # Every rank's value, as they come; a rank that raised or died, or the deadline, raises.
    values: dict[int, Any] = {}
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while len(values) < len(processes):
        try:
            rank, ok, value = results.get(timeout=0.05)
        except queue.Empty:
            _check_exits(processes, values)
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"launch(): ranks still running after {timeout_s} s; killed them") from None
            continue
        if not ok:
            raise WorkerError(rank, value)
        values[rank] = value
    return values


def _check_exits(processes: Sequence[BaseProcess], values: dict[int, Any]) -> None:
    for rank, process in enumerate(processes):
        if process.exitcode not in (None, 0) and rank not in values:
            time.sleep(0.2)  # its traceback may still be in the queue's pipe
            raise WorkerError(rank, f"exited with code {process.exitcode}")
