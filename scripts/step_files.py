"""Which library files one synchronised training step runs through, and how many calls cross files.

Runs 2 local gloo ranks (the tests' launcher, tests/local_ranks.py); each replicates a
small MLP, trains 3 warm-up steps (the first step learns the layout), then
traces one step (forward, backward, optimizer step) with ``sys.setprofile``
and prints, on rank 0, the library files whose Python functions ran and the
calls from one library file into another. A reading aid for the layout
(docs/architecture.md), not a benchmark.

    .venv/bin/python scripts/step_files.py
"""

from __future__ import annotations

import collections
import os
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import torchreplicate

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
from local_ranks import launch  # noqa: E402  (tests/: the tests' launcher, a deadline that kills every rank)

PACKAGE = os.path.dirname(torchreplicate.__file__)


def one_step(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    model(torch.randn(8, 64)).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def traced_step() -> tuple[list[str], int]:
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torchreplicate.replicate(nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64)), bucket_cap_mb=25)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        one_step(model, optimizer)
    files: collections.Counter[str] = collections.Counter()
    crossings = 0

    def profile(frame: Any, event: str, arg: Any) -> None:
        nonlocal crossings
        if event != "call" or not frame.f_code.co_filename.startswith(PACKAGE):
            return
        here = os.path.relpath(frame.f_code.co_filename, PACKAGE)
        files[here] += 1
        caller = frame.f_back
        if caller is not None and caller.f_code.co_filename.startswith(PACKAGE):
            crossings += os.path.relpath(caller.f_code.co_filename, PACKAGE) != here

    sys.setprofile(profile)
    try:
        one_step(model, optimizer)
    finally:
        sys.setprofile(None)
    return sorted(files), crossings


def main() -> None:
    files, crossings = launch(traced_step, 2, timeout_s=300)[0]
    print(f"one synchronised step (rank 0): functions of {len(files)} library files, {crossings} calls across files")
    for name in files:
        print(f"  {name}")


if __name__ == "__main__":
    main()
