"""Host reads of tensor values in a steady-state step, counted on the CPU (issue 39).

On a GPU, each ``.item()``, ``.tolist()``, ``bool(tensor)``, ``.cpu()`` ...
is a synchronisation: the CPU stops queueing work (the optimizer step, the
next forward) until the GPU has caught up. DDP at its defaults makes none in
a step. Here every such call made from the library's own code during steady
steps is counted, by wrapping the methods for the duration, in the patterns
a GPU job runs: a plain MLP, BatchNorm (buffers broadcast), gradient
accumulation under ``no_sync``, mixed precision, a comm hook, copied
gradients (``gradient_as_bucket_view=False``) and a tied embedding (reduced
whole in its bucket at default options, as DDP's): none.
``nonzero``, an event's ``synchronize`` and ``torch.tensor(..., device=)``
(a copy from pageable host memory, which on a GPU waits for the host) are
counted too (the sync-debug mode sees none of the latter two).

The summed flags are read a step late, from a host copy made without waiting
([Note: flags read a step late] in reducer/flags.py). What still reads, and
when: a rank that holds no gradient for some parameter reads those
parameters' counts in that step (as DDP with ``find_unused_parameters=True``),
``graph="dynamic"`` reads the flags at the end of every step, and the tied
split (``tied_split=True``, an opt-in) reads the summed rows mask once per
step, after the buckets: the rows round's size depends on the batch.
"""

from __future__ import annotations

import collections
import contextlib
import os
from typing import Any, Callable, Iterator

import pytest
import torch
from torch import nn

import torchreplicate
from torchreplicate import replicate

PACKAGE = os.path.dirname(torchreplicate.__file__)
READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy", "nonzero")
# waits the sync-debug mode does not see: an event's host wait. torch.cuda.Event is a Python class and
# is counted; torch.Event is a C type that cannot be patched (the library's staged flags use it on an
# accelerator only, where scripts/gpu_check.py counts synchronisations)
EVENTS = (torch.cuda.Event,)


@contextlib.contextmanager
def counting_reads() -> Iterator[collections.Counter[str]]:
    """Counts host reads made from library code, by "file:function"."""
    import sys

    counts: collections.Counter[str] = collections.Counter()
    originals: dict[str, Any] = {name: getattr(torch.Tensor, name) for name in READS}
    original_equal, original_nonzero, original_tensor = torch.equal, torch.nonzero, torch.tensor
    event_waits = {cls: cls.synchronize for cls in EVENTS}

    def counted(name: str, fn: Callable[..., Any], when: Callable[..., bool] = lambda **k: True) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            frame = sys._getframe(1)
            if frame.f_code.co_filename.startswith(PACKAGE) and when(**kwargs):
                where = os.path.relpath(frame.f_code.co_filename, PACKAGE)
                counts[f"{where}:{frame.f_code.co_name} ({name})"] += 1
            return fn(*args, **kwargs)

        return wrapper

    for name, fn in originals.items():
        setattr(torch.Tensor, name, counted(name, fn))
    torch.equal = counted("torch.equal", original_equal)  # type: ignore[assignment]
    torch.nonzero = counted("torch.nonzero", original_nonzero)  # type: ignore[assignment]
    torch.tensor = counted("torch.tensor to a device", original_tensor, lambda **k: k.get("device") is not None)
    for cls, fn in event_waits.items():
        cls.synchronize = counted("Event.synchronize", fn)  # type: ignore[method-assign]
    try:
        yield counts
    finally:
        for name, fn in originals.items():
            setattr(torch.Tensor, name, fn)
        torch.equal = original_equal  # type: ignore[assignment]
        torch.nonzero = original_nonzero  # type: ignore[assignment]
        torch.tensor = original_tensor
        for cls, fn in event_waits.items():
            cls.synchronize = fn  # type: ignore[method-assign]


class Net(nn.Module):
    """An MLP with an optional BatchNorm and a head a step may leave unused; ``tied``: an embedding
    whose table is also the output projection (GPT-2's tied LM head)."""

    def __init__(self, norm: bool, tied: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(32, 32) if tied else None
        self.inp = nn.Linear(32, 32)
        self.norm = nn.BatchNorm1d(32) if norm else nn.Identity()
        self.out = nn.Linear(32, 32 if tied else 4)
        self.aux = nn.Linear(32, 32 if tied else 4)
        if self.embed is not None:
            self.out.weight = self.embed.weight

    def forward(self, x: torch.Tensor, aux: bool = True) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed((x.abs() * 10).long().clamp(max=31)).mean(1)
        h = torch.relu(self.norm(self.inp(x)))
        return self.out(h) + self.aux(h) if aux else self.out(h)


def reads_by_step(rank: int, world_size: int, pattern: str, **options: Any) -> list[dict[str, int]]:
    """Trains 6 steps; returns the host reads of each of steps 3-5 (the first learns the layout)."""
    options["bucket_cap_mb"] = 0.001  # several buckets, launched from hooks
    if pattern == "bf16":
        from torch.distributed.fsdp import MixedPrecisionPolicy

        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = replicate(
        Net(norm=pattern != "bf16", tied=pattern.startswith("tied")), **options
    )  # (BatchNorm's fp32 statistics refuse bf16)
    if pattern == "copy":
        options["gradient_as_bucket_view"] = False
    if pattern == "hook":
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        model.register_comm_hook(None, allreduce_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    def step(i: int) -> None:
        x = torch.randn(8, 32, generator=torch.Generator().manual_seed(10 * i + rank))
        # rank 1 leaves the head unused at steps 2 and 4: step 4's pattern is one seen before
        aux = not (pattern.endswith("unused") and i in (2, 4) and rank == 1)
        if pattern == "accumulation":
            with model.no_sync():
                model(x).float().pow(2).mean().backward()
        model(x, aux).float().pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()

    for i in range(3):
        step(i)
    per_step = []
    for i in range(3, 6):
        with counting_reads() as counts:
            step(i)
        per_step.append(dict(counts))
    return per_step


@pytest.mark.parametrize("pattern", ["plain", "batchnorm", "accumulation", "bf16", "hook", "copy", "tied"])
def test_no_host_read_in_a_steady_step(pools, pattern):
    for rank, per_step in enumerate(pools.run(2, reads_by_step, pattern)):
        assert per_step == [{}, {}, {}], (
            f"{pattern}, rank {rank}: host reads from library code in steady steps 3-5: {per_step}; "
            "none may appear ([Note: flags read a step late] in reducer/flags.py)"
        )


def test_reads_come_only_where_a_parameter_is_unused_here_or_with_graph_dynamic(pools):
    # step 4: rank 1 leaves the head unused, so it reads the head's counts (does
    # any rank hold a gradient for it?) before setting .grad; rank 0 used it: no read
    for pattern in ("unused", "tied_unused"):
        unused = pools.run(2, reads_by_step, pattern)
        assert unused[0] == [{}, {}, {}], (pattern, unused[0])
        assert unused[1] == [{}, {"reducer/flags.py:unused_everywhere (tolist)": 1}, {}], (pattern, unused[1])
    # the tied split (an opt-in): the rows round's size is data-dependent, so one read per step, on
    # every rank, after the buckets (the summed rows mask's nonzero)
    for per_step in pools.run(2, reads_by_step, "tied", tied_split=True):
        where = [(at.split(":")[0], at.split(" ")[-1], n) for counts in per_step for at, n in counts.items()]
        assert where == [("reducer/tied_rows.py", "(nonzero)", 1)] * 3, per_step  # one tied parameter here
    # graph="dynamic": the flags are read at the end of every step, on every rank
    for per_step in pools.run(2, reads_by_step, "batchnorm", graph="dynamic"):
        assert per_step == [{"reducer/flags.py:read (tolist)": 1}] * 3, per_step
