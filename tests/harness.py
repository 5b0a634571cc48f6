"""Multi-process gloo harness for the tests: reusable worker pools.

A ``WorkerPool`` keeps ``world_size`` spawned processes with an initialised
gloo process group and runs test functions on all of them. Pools are reused
across tests (spawning and importing torch costs seconds); a pool whose task
failed or timed out is killed and replaced, since its ranks may be stuck in
mismatched collectives. Starting, collecting and stopping the ranks are the
launcher's own pieces (local_ranks.py), as its ``launch()`` uses them.
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import signal
import subprocess
import sys
from typing import Any, Callable, Mapping, Sequence

from local_ranks import WorkerError, call_and_report, collect_results, start_ranks, stop_ranks

TASK_TIMEOUT_S = 120.0  # one test function on every rank
PG_TIMEOUT_S = 60  # a collective waiting longer fails instead of hanging


def init_rank() -> None:
    """A test rank's set-up, after ``start_ranks``: one thread, gloo from the environment it set."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=PG_TIMEOUT_S))


def _serve(rank: int, results, tasks) -> None:
    init_rank()
    import torch.distributed as dist

    world_size = dist.get_world_size()
    while (task := tasks[rank].get()) is not None:
        fn, args, kwargs = task
        call_and_report(results, rank, fn, rank, world_size, *args, **kwargs)
    dist.destroy_process_group()


class WorkerPool:
    """``world_size`` gloo ranks that run ``fn(rank, world_size, *args)`` on request."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.tasks = [multiprocessing.get_context("spawn").Queue() for _ in range(world_size)]
        self.processes, self.results = start_ranks(_serve, world_size, (self.tasks,))
        self.broken = False

    def run(self, fn: Callable[..., Any], *args: Any, timeout_s: float = TASK_TIMEOUT_S, **kwargs: Any) -> list[Any]:
        """Runs ``fn(rank, world_size, *args, **kwargs)`` on every rank; returns results by rank.

        Raises:
            AssertionError: a rank raised (every failing rank's traceback), died, or timed out.
        """
        for task_queue in self.tasks:
            task_queue.put((fn, args, kwargs))
        try:  # after a failure, the others may be stuck in a collective: a short grace
            return collect_results(self.results, self.processes, timeout_s, grace_s=5)
        except (WorkerError, TimeoutError) as error:
            self.broken = True
            raise AssertionError(f"{fn.__name__}: {error}") from None

    def close(self) -> None:
        """Stops the workers (politely if healthy, else by kill)."""
        if not self.broken:
            for task_queue in self.tasks:
                task_queue.put(None)
        stop_ranks(self.processes, grace_s=0 if self.broken else 10)


class Pools:
    """One live pool per world size, replaced when broken."""

    def __init__(self) -> None:
        self._pools: dict[int, WorkerPool] = {}

    def run(
        self, world_size: int, fn: Callable[..., Any], *args: Any, timeout_s: float = TASK_TIMEOUT_S, **kwargs: Any
    ) -> list[Any]:
        """Runs ``fn(rank, world_size, *args, **kwargs)`` on a pool of ``world_size`` ranks."""
        pool = self._pools.get(world_size)
        if pool is None or pool.broken:
            if pool is not None:
                pool.close()
            pool = self._pools[world_size] = WorkerPool(world_size)
        try:
            return pool.run(fn, *args, timeout_s=timeout_s, **kwargs)
        finally:
            if pool.broken:
                pool.close()

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository
TORCHRUN = (sys.executable, "-m", "torch.distributed.run")  # torchrun, run by this interpreter


def run_command(
    command: Sequence[str], *, env: Mapping[str, str] | None = None, timeout: float = 180
) -> subprocess.CompletedProcess:
    """Runs a command from the repository root in its own session; on timeout kills the whole session.

    Args:
        command: the command line.
        env: variables to add to this process's environment.
        timeout: seconds before every process of the session is killed (then TimeoutExpired).
    """
    process = subprocess.Popen(
        list(command),
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        raise
    return subprocess.CompletedProcess(list(command), process.returncode, stdout, stderr)
