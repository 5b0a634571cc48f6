"""Host reads of tensor values in a steady step, counted on the CPU: the counter and the shapes.

Shared by ``tests/test_host_reads.py`` (2 gloo ranks on the CPU) and the GPU
check's sync audit (``scripts/gpu_checks.py``: world size 1 on NCCL, where
``torch.cuda.set_sync_debug_mode`` counts beside this counter). See
test_host_reads.py for what is counted and what may read.
"""

from __future__ import annotations

import collections
import contextlib
import os
import sys
from typing import Any, Callable, Iterator

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


SHAPES = ("plain", "batchnorm", "accumulation", "bf16", "hook", "copy", "tied")  # no read in a steady step
UNUSED_AT = (2, 4, 7)  # the "unused" shapes' unused steps: 4 and 7 repeat step 2's pattern


class Shape:
    """One shape of item 1 (``pattern``, see SHAPES, plus "unused" and "tied_unused"): a replicated
    ``Net`` on ``device`` with its optimizer, and ``step(i)`` on batches made beforehand (a batch's own
    copy to a GPU is not the step's). ``unused_rank`` leaves the head unused at ``UNUSED_AT``;
    ``force_reducer``: install one at world size 1 too (where ``replicate()`` builds none)."""

    def __init__(
        self,
        pattern: str,
        rank: int,
        device: str = "cpu",
        unused_rank: int = 1,
        force_reducer: bool = False,
        **options: Any,
    ) -> None:
        options.setdefault("bucket_cap_mb", 0.001)  # several buckets, launched from hooks
        if pattern == "bf16":
            from torch.distributed.fsdp import MixedPrecisionPolicy

            options["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if pattern == "copy":
            options["gradient_as_bucket_view"] = False
        # (BatchNorm's fp32 statistics refuse bf16)
        net = Net(norm=pattern != "bf16", tied=pattern.startswith("tied")).to(device)
        self.model = replicate(net, **options)
        state = replicate.state(self.model)
        if force_reducer and state.reducer is None:
            state.make_reducer()
        if pattern == "hook":
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

            self.model.register_comm_hook(None, allreduce_hook)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.01)
        self.pattern, self.rank, self.unused_rank = pattern, rank, unused_rank
        self.data = [
            torch.randn(8, 32, generator=torch.Generator().manual_seed(10 * i + rank)).to(device) for i in range(9)
        ]

    def step(self, i: int) -> None:
        """Trains step ``i`` (0 to 8)."""
        model, x = self.model, self.data[i]
        aux = not (self.pattern.endswith("unused") and i in UNUSED_AT and self.rank == self.unused_rank)
        if self.pattern == "accumulation":
            with model.no_sync():
                model(x).float().pow(2).mean().backward()
        model(x, aux).float().pow(2).mean().backward()
        self.optimizer.step()
        self.optimizer.zero_grad()


def expected_reads(pattern: str, step: int, unused_rank: bool, **options: Any) -> dict[str, int]:
    """The host reads library code makes in steady step ``step`` of ``Shape(pattern, ...)``, by file
    and kind (``by_file``): where a read is inherent (test_host_reads.py's docstring), one; elsewhere
    none. ``unused_rank``: this rank is the one that leaves the head unused."""
    if options.get("graph") == "dynamic":
        return {"reducer/flags.py (tolist)": 1}
    if options.get("tied_split") and pattern.startswith("tied"):
        return {"reducer/tied_rows.py (nonzero)": 1}
    if pattern.endswith("unused") and step in UNUSED_AT and unused_rank:
        return {"reducer/flags.py (tolist)": 1}
    return {}


def by_file(counts: dict[str, int]) -> dict[str, int]:
    """``counting_reads``' counts by file and kind ("file (kind)"): a comprehension's frame is named
    ``<listcomp>`` before Python 3.12 and its function's from 3.12 on."""
    merged: collections.Counter[str] = collections.Counter()
    for at, n in counts.items():
        merged[f"{at.split(':')[0]} {at.split(' ', 1)[1]}"] += n
    return dict(merged)


def reads_by_step(rank: int, world_size: int, pattern: str, **options: Any) -> list[dict[str, int]]:
    """Trains 6 steps; returns the host reads of each of steps 3-5 (the first learns the layout)."""
    shape = Shape(pattern, rank, **options)
    for i in range(3):
        shape.step(i)
    per_step = []
    for i in range(3, 6):
        with counting_reads() as counts:
            shape.step(i)
        per_step.append(dict(counts))
    return per_step
