"""``run_rounds``: engines timed side by side in interleaved rounds (runs in every rank)."""

from __future__ import annotations

import time
from typing import Any, Callable, Mapping, Optional, Protocol

import torch
import torch.distributed as dist

# How run_rounds times its engines, for the reports' "method" entries.
ROUNDS_METHOD = {
    "step_time": "benchlib.rounds.run_rounds: median over rounds of block wall time / K, slowest rank; engines interleaved, order rotated each round",
    "ratio": "per round: engine block / reference block in the same round; median, quartiles, min, max",
}


class Steppable(Protocol):
    def step(self, batch: Any) -> None: ...


def run_rounds(
    engines: Mapping[str, Steppable],
    batch: Any,
    cfg: Mapping[str, Any],
    progress: Optional[Callable[[int, int], None]] = None,
) -> dict:
    """Warms up, then times interleaved blocks of K steps of every engine.

    Per round, every engine runs a block of K steps after a
    ``dist.barrier()``; the engine order rotates by one each round, so slow
    drifts of the machine hit every engine alike. K comes from rank 0's
    slowest warm step (about ``cfg["block_s"]`` per block, at least
    ``cfg["min_steps"]``, or ``cfg["steps"]`` if set) and is broadcast, so
    every rank runs the same steps.

    Args:
        engines: name -> anything with ``step(batch)``.
        batch: what every step gets.
        cfg: ``warmup``, ``rounds``, ``steps`` (None: from ``block_s``),
            ``block_s``, ``min_steps``.
        progress: called with (rounds done, K) after every round, e.g. to
            print progress. Default: none.

    Returns:
        What ``benchlib.stats.aggregate_timing`` reads: ``steps_per_block``,
        ``rounds``, ``orders``, ``per_step_s`` [engine][round][step],
        ``block_s`` and ``cpu_block_s`` (training-thread CPU time) [engine][round].
    """
    # warm-up, interleaved; DDP rebuilds buckets after step 1, ours learns
    # its schedule in step 1
    for _ in range(cfg["warmup"]):
        for engine in engines.values():
            engine.step(batch)
    # block size K: from rank 0's slowest engine, the same on every rank
    dist.barrier()
    slowest = 0.0
    for engine in engines.values():
        t0 = time.perf_counter()
        engine.step(batch)
        slowest = max(slowest, time.perf_counter() - t0)
    k = cfg["steps"] or max(cfg["min_steps"], min(200, int(round(cfg["block_s"] / max(slowest, 1e-4)))))
    k = _broadcast_int(k)
    kinds = list(engines)
    per_step: dict[str, list[list[float]]] = {kind: [] for kind in kinds}
    blocks: dict[str, list[float]] = {kind: [] for kind in kinds}
    cpu_blocks: dict[str, list[float]] = {kind: [] for kind in kinds}
    orders = []
    for r in range(cfg["rounds"]):
        order = kinds[r % len(kinds) :] + kinds[: r % len(kinds)]
        orders.append(order)
        for kind in order:
            engine = engines[kind]
            dist.barrier()
            steps = []
            c_block = time.thread_time()
            t_block = time.perf_counter()
            for _ in range(k):
                t0 = time.perf_counter()
                engine.step(batch)
                steps.append(time.perf_counter() - t0)
            blocks[kind].append(time.perf_counter() - t_block)
            cpu_blocks[kind].append(time.thread_time() - c_block)
            per_step[kind].append(steps)
        if progress is not None:
            progress(r + 1, k)
    return {
        "steps_per_block": k,
        "rounds": cfg["rounds"],
        "orders": orders,
        "per_step_s": per_step,
        "block_s": blocks,
        "cpu_block_s": cpu_blocks,
    }


def _broadcast_int(value: int) -> int:
    t = torch.tensor([value], dtype=torch.int64)
    dist.broadcast(t, src=0)
    return int(t.item())
