"""One ordinary synchronised step runs code in the files docs/architecture.md names.

Issue 29's shape, kept: the forward and backward of a plain model (no tied
parameters, buffers, sparse gradients or comm hook; the layout learned) run
library code in the five files a reader follows (the state, the reducer, the
bucket, the reduction, the flags) and the three leaves every point reports
to (probe, watchdog, torch_internals), and in no other. A mode that starts
asking again at every step, or a forwarder into another file, shows here:
add the file to the architecture page's walk-through, or decide the mode at
plan time (core/setup.py).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

import torchreplicate
from torchreplicate import replicate

PACKAGE = os.path.dirname(torchreplicate.__file__)
ARCHITECTURE = Path(__file__).resolve().parent.parent / "docs" / "architecture.md"

READ_IN_ORDER = ("core/state.py", "reducer/reducer.py", "reducer/bucket.py", "reducer/reduction.py", "reducer/flags.py")
LEAVES = ("reducer/probe.py", "reducer/watchdog.py", "torch_internals.py")


def files_of_one_step(rank: int, world_size: int) -> list[str]:
    """The library files whose functions run in one forward and backward, after 3 steps (rank's thread)."""
    torch.manual_seed(0)
    model = replicate(nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):  # the first learns the layout
        model(torch.randn(8, 16)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    loss = model(torch.randn(8, 16)).pow(2).mean()
    files: set[str] = set()

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code.co_filename.startswith(PACKAGE):
            files.add(os.path.relpath(frame.f_code.co_filename, PACKAGE))

    sys.setprofile(profile)
    try:
        loss.backward()
        model(torch.randn(8, 16))  # the next forward: its hooks are part of the step
    finally:
        sys.setprofile(None)
    return sorted(files)


def test_one_step_runs_in_the_documented_files(pools):
    for files in pools.run(2, files_of_one_step):
        assert set(files) == set(READ_IN_ORDER + LEAVES), (
            f"one ordinary step ran library code in {files}; docs/architecture.md names "
            f"{READ_IN_ORDER} and the leaves {LEAVES}"
        )
    page = ARCHITECTURE.read_text()
    walk = page[page.index("## One step, as data flows") :]
    assert [walk.index(f"`{name}`") for name in READ_IN_ORDER] == sorted(
        walk.index(f"`{name}`") for name in READ_IN_ORDER
    ), "the architecture page walks the step's files in the order a step runs them"
    for leaf in LEAVES:
        assert f"`{leaf.split('/')[-1]}`" in walk or f"`{leaf}`" in walk, leaf
