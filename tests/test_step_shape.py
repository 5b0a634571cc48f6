"""One realistic synchronised step runs code in the files docs/architecture.md names, and few calls cross them.

Issue 37's shape, issue 45's budget: the forward, backward and
``optimizer.step()`` of a model with BatchNorm (its buffers are broadcast
before every forward), laid out at the default options in DDP's two buckets,
both launched from gradient hooks, run library code in the six files a reader follows (the state, the
buffer sync, the reducer, the bucket, the reduction, the flags) and the three
leaves every point reports to (probe, watchdog, torch_internals), and in no
other; and the distinct (caller file, callee file:function) pairs
across those files stay at most ``MAX_PAIRS``. A mode that starts asking
again at every step, or a forwarder into another file, shows here: add the
file to the architecture page's walk-through, or decide the mode at plan
time (core/setup.py).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

import torchreplicate
from torchreplicate import replicate

PACKAGE = os.path.dirname(torchreplicate.__file__)
ARCHITECTURE = Path(__file__).resolve().parent.parent / "docs" / "architecture.md"

READ_IN_ORDER = (
    "core/state.py",
    "core/buffers.py",
    "reducer/reducer.py",
    "reducer/bucket.py",
    "reducer/reduction.py",
    "reducer/flags.py",
)
LEAVES = ("reducer/probe.py", "faults/wire.py", "torch_internals.py")
# issue 45: at most 30 distinct cross-file (caller, callee) function pairs (issue 37: 32); issue 47: 31, the end of
# every forward hands DDP's class attribute back to torch's compiler ([Note: compiled backward split at bucket
# boundaries]): its start reads and sets it in one call, which also tells whether compiled autograd traces
# issue 59: 32, the end of backward names the flags' place before the staged read too (the watchdog's note was the
# last bucket's while it waited on the flags). Issue 63: pairs are counted as (caller file, callee file:function),
# so that no helper exists only to merge pairs; faults/wire.py owns every wait, the collectives outside the
# buckets and the works kept past a step (released at the next forward whatever updates the weights), one observer
# call (probe.emit), the group's weak reference called in C, the forward hooks' profiler label inside them: 31
MAX_PAIRS = 31


class StepShape(NamedTuple):
    files: list[str]  # library files whose functions ran
    pairs: list[tuple[str, str]]  # distinct cross-file (caller file, callee file:function)
    num_buckets: int
    num_launched_from_hooks: int


def realistic_model() -> nn.Module:
    """8 blocks of Linear(1024) + BatchNorm + ReLU and a head: ~33 MB of fp32 gradients, DDP's 2 buckets
    after its rebuild (1 MiB, then 25 MiB: the head and the last block, then the seven others)."""
    blocks: list[nn.Module] = []
    for _ in range(8):
        blocks += [nn.Linear(1024, 1024), nn.BatchNorm1d(1024), nn.ReLU()]
    return nn.Sequential(*blocks, nn.Linear(1024, 10))


def shape_of_one_step(rank: int, world_size: int) -> StepShape:
    """The library files and cross-file calls of one step (forward, backward, optimizer.step), after 3 steps."""
    torch.manual_seed(0)
    model = replicate(realistic_model())  # default options
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    def step() -> None:
        nn.functional.cross_entropy(model(torch.randn(16, 1024)), torch.randint(0, 10, (16,))).backward()
        optimizer.step()
        optimizer.zero_grad()

    for _ in range(3):  # the first learns the launch order and the firing counts
        step()
    files: set[str] = set()
    pairs: set[tuple[str, str]] = set()
    launches: list[bool] = []

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event != "call" or not frame.f_code.co_filename.startswith(PACKAGE):
            return
        here = os.path.relpath(frame.f_code.co_filename, PACKAGE)
        files.add(here)
        if here == "reducer/bucket.py" and frame.f_code.co_name == "launch":
            launches.append(bool(frame.f_locals["from_hook"]))
        caller = frame.f_back
        if caller is not None and caller.f_code.co_filename.startswith(PACKAGE):
            there = os.path.relpath(caller.f_code.co_filename, PACKAGE)
            if there != here:
                pairs.add((there, f"{here}:{frame.f_code.co_name}"))

    sys.setprofile(profile)
    try:
        step()
    finally:
        sys.setprofile(None)
    reducer = replicate.state(model).reducer
    assert reducer is not None
    return StepShape(sorted(files), sorted(pairs), len(reducer.buckets), sum(launches))


def test_one_realistic_step_runs_in_the_documented_files(pools):
    for shape in pools.run(2, shape_of_one_step):
        assert shape.num_buckets == 2, f"the model was meant to fill 2 buckets at the defaults, got {shape.num_buckets}"
        assert shape.num_launched_from_hooks == 2, "both buckets launch from gradient hooks, as DDP's (the flags apart)"
        assert set(shape.files) == set(READ_IN_ORDER + LEAVES), (
            f"one step ran library code in {shape.files}; docs/architecture.md names "
            f"{READ_IN_ORDER} and the leaves {LEAVES}"
        )
        listing = "\n".join(f"  {a} -> {b}" for a, b in shape.pairs)
        assert len(shape.pairs) <= MAX_PAIRS, (
            f"{len(shape.pairs)} cross-file call pairs (at most {MAX_PAIRS}):\n{listing}"
        )
    page = ARCHITECTURE.read_text()
    walk = page[page.index("## One step, as data flows") :]
    assert [walk.index(f"`{name}`") for name in READ_IN_ORDER] == sorted(
        walk.index(f"`{name}`") for name in READ_IN_ORDER
    ), "the architecture page walks the step's files in the order a step runs them"
    for leaf in LEAVES:
        assert f"`{leaf.split('/')[-1]}`" in walk or f"`{leaf}`" in walk, leaf
