"""Host reads of tensor values in a steady-state step, counted on the CPU (issue 39).

On a GPU, each ``.item()``, ``.tolist()``, ``bool(tensor)``, ``.cpu()`` ...
is a synchronisation: the CPU stops queueing work (the optimizer step, the
next forward) until the GPU has caught up. DDP at its defaults makes none in
a step. Here every such call made from the library's own code during steady
steps is counted, by wrapping the methods for the duration, in the patterns
a GPU job runs: BatchNorm (buffers broadcast), gradient accumulation under
``no_sync``, mixed precision (an MLP) and a comm hook.

What stands today, and the test pins it: exactly one read per synchronised
step, the summed flags (``StepFlags.read``'s ``tolist()``: the late flag and
the training clock's and layout's residues, read before ``.grad`` is final),
and none in a step with gradient sync off. Removing it is issue 39's first
item: the late round must then be decided without the host (see the issue's
note); a new read anywhere else fails here, naming where.
"""

from __future__ import annotations

import collections
import contextlib
import os
from typing import Any, Callable, Iterator

import torch
from torch import nn

import torchreplicate
from torchreplicate import replicate

PACKAGE = os.path.dirname(torchreplicate.__file__)
READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy")


@contextlib.contextmanager
def counting_reads() -> Iterator[collections.Counter[str]]:
    """Counts host reads made from library code, by "file:function"."""
    import sys

    counts: collections.Counter[str] = collections.Counter()
    originals: dict[str, Any] = {name: getattr(torch.Tensor, name) for name in READS}
    original_equal = torch.equal

    def counted(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            frame = sys._getframe(1)
            if frame.f_code.co_filename.startswith(PACKAGE):
                where = os.path.relpath(frame.f_code.co_filename, PACKAGE)
                counts[f"{where}:{frame.f_code.co_name} ({name})"] += 1
            return fn(*args, **kwargs)

        return wrapper

    for name, fn in originals.items():
        setattr(torch.Tensor, name, counted(name, fn))
    torch.equal = counted("torch.equal", original_equal)  # type: ignore[assignment]
    try:
        yield counts
    finally:
        for name, fn in originals.items():
            setattr(torch.Tensor, name, fn)
        torch.equal = original_equal  # type: ignore[assignment]


def bn_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4))


def reads_in_steady_steps(rank: int, world_size: int, pattern: str) -> dict[str, int]:
    options: dict[str, Any] = {"bucket_cap_mb": 0.001}  # several buckets, launched from hooks
    if pattern == "bf16":
        from torch.distributed.fsdp import MixedPrecisionPolicy

        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    module = bn_model() if pattern != "bf16" else nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    model = replicate(module, **options)  # (BatchNorm's fp32 statistics refuse bf16 inputs)
    if pattern == "hook":
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        model.register_comm_hook(None, allreduce_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    def step(i: int) -> None:
        x = torch.randn(8, 32, generator=torch.Generator().manual_seed(10 * i + rank))
        if pattern == "accumulation":
            with model.no_sync():
                model(x).float().pow(2).mean().backward()
        model(x).float().pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()

    for i in range(3):  # the first learns the layout
        step(i)
    with counting_reads() as counts:
        for i in range(3, 6):
            step(i)
    return dict(counts)


def test_one_host_read_per_synchronised_step_and_only_the_flags(pools):
    for pattern in ("batchnorm", "accumulation", "bf16", "hook"):
        for counts in pools.run(2, reads_in_steady_steps, pattern):
            assert counts == {"reducer/flags.py:read (tolist)": 3}, (
                f"{pattern}: host reads from library code in 3 steady steps: {counts}; the one expected is "
                "the summed flags' read per synchronised step (issue 39 is to remove it: no other may appear)"
            )
