"""Which library files one realistic synchronised step runs through, and which calls cross files.

Runs tests/test_step_shape.py's measurement on 2 local gloo ranks (the tests'
launcher, tests/local_ranks.py): a model with BatchNorm in 3 buckets at the
default options, 3 warm-up steps, then one traced step (forward, backward,
optimizer step) under ``sys.setprofile``. Prints, for rank 0, the library
files whose Python functions ran and every distinct (caller file, callee
file:function) pair across files. A reading aid for the layout
(docs/architecture.md), not a benchmark.

    .venv/bin/python scripts/step_files.py
"""

from __future__ import annotations

import os
import sys

import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
from local_ranks import launch  # noqa: E402  (tests/: the tests' launcher, a deadline that kills every rank)
from test_step_shape import StepShape, shape_of_one_step  # noqa: E402


def traced() -> StepShape:
    dist.init_process_group("gloo")
    shape = shape_of_one_step(dist.get_rank(), dist.get_world_size())
    dist.barrier()
    dist.destroy_process_group()
    return shape


def main() -> None:
    shape = launch(traced, 2, timeout_s=300)[0]
    print(
        f"one synchronised step (rank 0, {shape.num_buckets} buckets, {shape.num_launched_from_hooks} launched "
        f"from hooks): {len(shape.files)} library files, {len(shape.pairs)} distinct cross-file calls"
    )
    for name in shape.files:
        print(f"  {name}")
    for caller, callee in shape.pairs:
        print(f"    {caller} -> {callee}")


if __name__ == "__main__":
    main()
