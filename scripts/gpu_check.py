"""The first-GPU check (scripts/gpu_check.sh runs it): CUDA tests, NCCL overhead at world size 1, a table.

1. ``pytest -m cuda``: the suite's CUDA-marked tests (NCCL at world size 1
   and 2 gloo ranks sharing the GPU with CUDA tensors, each against a
   one-process reference; SyncBatchNorm).
2. World size 1 on NCCL: an MLP (8 x Linear(4096, 4096), batch 256, fp32)
   trained plain, under ``replicate()`` and under DDP, in interleaved
   rounds; step time by CUDA events; ratios to plain local training (goal:
   ours <= 1.02).

Exits 1, saying why, when no CUDA GPU is visible: nothing is skipped.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

from torchreplicate import replicate
from torchreplicate.launcher import launch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WIDTH, DEPTH, BATCH = 4096, 8, 256
ROUNDS, STEPS = 7, 20


def mlp() -> nn.Module:
    torch.manual_seed(0)
    layers = [m for _ in range(DEPTH) for m in (nn.Linear(WIDTH, WIDTH), nn.ReLU())]
    return nn.Sequential(*layers).cuda()


def timed_steps(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(STEPS):
        model(x).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / STEPS


def overhead() -> dict[str, list[float]]:
    """Per-round ms per step of plain, ours and DDP at world size 1 on NCCL (interleaved rounds)."""
    dist.init_process_group("nccl")
    torch.cuda.set_device(0)
    engines = {
        "local": mlp(),
        "ours": replicate(mlp()),
        "ddp": nn.parallel.DistributedDataParallel(mlp(), device_ids=[0]),
    }
    optimizers = {name: torch.optim.SGD(m.parameters(), lr=1e-4) for name, m in engines.items()}
    x = torch.randn(BATCH, WIDTH, device="cuda")
    for name in engines:
        timed_steps(engines[name], optimizers[name], x)  # warm-up: allocator, cuBLAS, DDP's buckets
    times: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(ROUNDS):
        for name in engines:
            times[name].append(timed_steps(engines[name], optimizers[name], x))
    dist.destroy_process_group()
    return times


def main() -> int:
    if not torch.cuda.is_available():
        print("gpu_check: FAILED: no CUDA GPU is visible (torch.cuda.is_available() is False); nothing was checked")
        return 1
    print(f"gpu_check: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    started = time.monotonic()
    tests = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider", "tests"], cwd=ROOT, timeout=300
    )
    tests_s = time.monotonic() - started
    times = launch(overhead, 1, timeout_s=240)[0]
    medians = {name: statistics.median(values) for name, values in times.items()}
    ratios = {
        name: statistics.median(a / b for a, b in zip(values, times["local"], strict=True))
        for name, values in times.items()
    }
    print(f"\n| check | result |\n|---|---|\n| pytest -m cuda | exit {tests.returncode} ({tests_s:.0f} s) |")
    for name in ("local", "ours", "ddp"):
        print(f"| ws1 NCCL {name}: ms/step, ratio to local | {medians[name]:.3f} ms, {ratios[name]:.3f} |")
    verdict = "meets" if ratios["ours"] <= 1.02 else "misses"
    print(f"\nours/local {ratios['ours']:.3f} {verdict} the goal <= 1.02 (median of {ROUNDS} per-round ratios)")
    return 0 if tests.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
