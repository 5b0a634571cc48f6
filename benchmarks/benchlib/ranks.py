"""Starting the rank processes of a benchmark phase, and what each rank does first."""

from __future__ import annotations

import os
import time
from typing import Any, Callable, Mapping, Optional

import torch
import torch.distributed as dist

import torchreplicate
from local_ranks import launch


def init_rank(threads: int = 1) -> tuple[int, int]:
    """Joins the gloo process group with ``threads`` intra-op threads; returns (rank, world size)."""
    torch.set_num_threads(threads)
    dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size()


def rank_record() -> dict[str, Any]:
    """What every rank's result starts with: its rank, the world size and which torchreplicate it imported."""
    return {
        "rank": dist.get_rank(),
        "world_size": dist.get_world_size(),
        "torchreplicate_file": torchreplicate.__file__,
    }


def launch_phase(
    label: str,
    worker: Callable[[dict], Any],
    cfg: dict,
    *,
    nprocs: int,
    timeout_s: float,
    env: Optional[Mapping[str, str]] = None,
    tag: str = "bench",
) -> list[Any]:
    """Runs ``worker(cfg)`` in ``nprocs`` fresh processes, one thread each; returns the results by rank.

    Args:
        label: what the phase is, for the progress lines.
        worker: a module-level function (spawn imports it).
        cfg: its only argument.
        nprocs: number of ranks.
        timeout_s: the launch's timeout.
        env: environment variables the ranks start with (set in this process
            for the launch, then restored). Default: none.
        tag: prefix of the progress lines. Default ``bench``.
    """
    print(f"[{tag}] {label} ...", flush=True)
    started = time.time()
    saved = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})
    try:
        result = launch(worker, nprocs=nprocs, args=(cfg,), timeout_s=timeout_s, threads_per_rank=1)
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    print(f"[{tag}] {label} done in {time.time() - started:.0f} s", flush=True)
    return result
