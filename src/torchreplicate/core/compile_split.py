"""Compiled graphs split at bucket boundaries, so that buckets leave while a compiled backward runs.

[Note: compiled backward split at bucket boundaries]
Under ``torch.compile`` the backward of one compiled graph is one autograd
node: every gradient of the graph appears when that node ends, so no bucket
can leave before the whole backward has been computed, and communication
that eager training hides behind the backward is exposed. DDP avoids this
with dynamo's ``DDPOptimizer`` (torch/_dynamo/backends/distributed.py): a
frame compiled while a DDP forward runs is split into subgraphs at DDP's
bucket boundaries (``bucket_bytes_cap``, the first one at 1 MiB), each with
its own backward node, so the last layers' buckets launch while the earlier
layers' backward runs. No graph break: ``fullgraph=True`` still holds.

Dynamo learns that a DDP forward runs from DDP's class attribute
``_active_ddp_module`` (torch_internals.py's ``swap_active_ddp_module``),
as torch's own composable ``replicate`` sets it around its forward. Ours
sets it to a ``BucketCap`` (the one attribute dynamo reads) from the root's
pre-forward hook until a forward hook that runs also when the forward
raises (``always_call``) hands back what it held, so every frame compiled
inside the forward (the whole model, or each block compiled alone as
torchtitan does) is split at our buckets' cap.
``torch._dynamo.config.optimize_ddp = False`` turns the split off, as for
DDP.

Measured (benchmarks/ddp_compiled/bench_compile.py, 8 x Linear(1024), 8 buckets, two
hosts at 5 Gbit/s): see docs/performance.md, "torch.compile".

Under compiled autograd the gradient hooks are traced into the backward
graph, one functional all-reduce per gradient ([Note: compiled autograd] in
reducer/reduction.py), the nodes DDP's Python reducer makes. DDP turns on
inductor's fusion of those into buckets (``_fuse_ddp_communication``) at
construction, for good. Ours turns it on (at ``bucket_cap_mb``) from a
forward where compiled autograd is on, so the backward compiled after it
fuses, and restores what it held once no replicated module asks for it
(each lets go at its first forward with compiled autograd off, or when it
is collected): a global of torch's compiler, set only while compiled
autograd trains a replicated model.
"""

from __future__ import annotations

import weakref

from torchreplicate.config import DDP_DEFAULT_CAP_MB, MiB, ReplicateConfig
from torchreplicate.torch_internals import swap_ddp_fusion


class BucketCap:
    """What dynamo reads of the DDP module whose forward runs: ``bucket_bytes_cap``.

    Args:
        config: the module's options; the cap is ``bucket_cap_mb`` (DDP's 25
            MiB where ``bucket_layout="tuned"`` measures it), at least 1 MiB:
            ``DDPOptimizer`` refuses a cap below its first bucket's (1 MiB),
            which DDP's own ``bucket_cap_mb < 1`` meets under compile.
    """

    def __init__(self, config: ReplicateConfig) -> None:
        self.bucket_bytes_cap = max(config.cap_bytes or int(DDP_DEFAULT_CAP_MB * MiB), MiB)
        self.outer: object = None  # what the attribute held before this forward (an enclosing forward's)
        self.fusing = False  # this module asked for inductor's fusion (compiled autograd was on at its last forward)
        weakref.finalize(self, _ask_fusion, id(self), False).atexit = False  # a module collected lets go

    def follow(self, compiled_autograd: bool) -> None:
        """Before a forward where compiled autograd turned on or off (``fusing`` differs): inductor's DDP
        fusion on while it is (see the Note), else as it was."""
        self.fusing = compiled_autograd
        _ask_fusion(id(self), compiled_autograd, self.bucket_bytes_cap / MiB)


_FUSING: set[int] = set()  # the BucketCaps (ids) that asked for inductor's fusion and have not let go
_SAVED: list[tuple[bool, float]] = []  # inductor's values before the first of them asked


def _ask_fusion(owner: int, on: bool, cap_mb: float = 0.0) -> None:
    """Inductor's DDP fusion on while any owner asks (at the first one's cap), as it was once none does."""
    if on and owner not in _FUSING:
        if not _FUSING:
            _SAVED[:] = [swap_ddp_fusion((True, cap_mb))]
        _FUSING.add(owner)
    elif not on and owner in _FUSING:
        _FUSING.discard(owner)
        if not _FUSING:
            swap_ddp_fusion(_SAVED.pop())
