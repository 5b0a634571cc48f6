"""Multi-process gloo harness for the tests: reusable worker pools.

A ``WorkerPool`` keeps ``world_size`` spawned processes with an initialised
gloo process group and runs test functions on all of them. Pools are reused
across tests (spawning and importing torch costs seconds); a pool whose task
failed or timed out is killed and replaced, since its ranks may be stuck in
mismatched collectives.
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import queue
import signal
import subprocess
import sys
import time
import traceback
from typing import Any, Callable, Mapping, Sequence

from torchreplicate.launcher import die_with_parent, free_port

TASK_TIMEOUT_S = 120.0  # one test function on every rank
PG_TIMEOUT_S = 60  # a collective waiting longer fails instead of hanging


def init_rank(rank: int, world_size: int, port: int) -> None:
    """A spawned test rank's set-up: dies with its parent, one thread, gloo on 127.0.0.1:``port``."""
    die_with_parent()
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=PG_TIMEOUT_S),
    )


def _serve(rank: int, world_size: int, port: int, tasks, results) -> None:
    init_rank(rank, world_size, port)
    import torch.distributed as dist

    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args, kwargs = task
        try:
            results.put((rank, True, fn(rank, world_size, *args, **kwargs)))
        except BaseException:
            results.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()


class WorkerError(AssertionError):
    """A rank's test function raised; the message holds every failing rank's traceback."""


class WorkerPool:
    """``world_size`` gloo ranks that run ``fn(rank, world_size, *args)`` on request."""

    def __init__(self, world_size: int) -> None:
        context = multiprocessing.get_context("spawn")
        self.world_size = world_size
        self.results = context.Queue()
        self.tasks = [context.Queue() for _ in range(world_size)]
        port = free_port()
        self.processes = [
            context.Process(target=_serve, args=(rank, world_size, port, self.tasks[rank], self.results))
            for rank in range(world_size)
        ]
        for process in self.processes:
            process.start()
        self.broken = False

    def run(self, fn: Callable[..., Any], *args: Any, timeout_s: float = TASK_TIMEOUT_S, **kwargs: Any) -> list[Any]:
        """Runs ``fn(rank, world_size, *args, **kwargs)`` on every rank; returns results by rank.

        Raises:
            WorkerError: a rank raised (its traceback), died, or timed out.
        """
        for task_queue in self.tasks:
            task_queue.put((fn, args, kwargs))
        values: dict[int, Any] = {}
        failures: dict[int, str] = {}
        deadline = time.monotonic() + timeout_s
        while len(values) + len(failures) < self.world_size:
            if failures:  # the others may be stuck in a collective: short grace
                deadline = min(deadline, time.monotonic() + 5)
            try:
                rank, ok, value = self.results.get(timeout=0.1)
            except queue.Empty:
                dead = [r for r, p in enumerate(self.processes) if not p.is_alive() and r not in values]
                if dead or time.monotonic() > deadline:
                    self.broken = True
                    missing = [r for r in range(self.world_size) if r not in values and r not in failures]
                    reason = "died" if dead else f"did not finish within {timeout_s} s"
                    for r in missing:
                        failures[r] = f"rank {r} {reason}"
                    break
                continue
            if ok:
                values[rank] = value
            else:
                failures[rank] = value
        if failures:
            self.broken = True
            report = "\n".join(f"--- rank {r} ---\n{text}" for r, text in sorted(failures.items()))
            raise WorkerError(f"{fn.__name__} failed on ranks {sorted(failures)}:\n{report}")
        return [values[r] for r in range(self.world_size)]

    def close(self) -> None:
        """Stops the workers (politely if healthy, else by kill)."""
        if not self.broken:
            for task_queue in self.tasks:
                task_queue.put(None)
            for process in self.processes:
                process.join(timeout=10)
        for process in self.processes:
            if process.is_alive():
                process.kill()
            process.join(timeout=5)


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
