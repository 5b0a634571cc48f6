"""The installed DDP against DDP 2.13, the release the library's DDP surface follows.

Tests that compare with torch's DDP compare with the installed one where its
behaviour is the same across the declared torch range, and with DDP 2.13's
behaviour where DDP itself changed (each difference below names the source it
was read in). Read from the installed DDP by feature, never by version.
"""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

TORCH_RELEASE = torch.__version__.split("+")[0]
DDP_ARGUMENTS = frozenset(inspect.signature(DDP.__init__).parameters) - {"self", "module"}
# DDP 2.13 renamed broadcast_buffers to forward_sync_buffers (torch/nn/parallel/distributed.py:
# the argument, and ``broadcast_buffers`` a property that reads and writes ``forward_sync_buffers``);
# DDP 2.9 and 2.11 have only broadcast_buffers, with the same meaning.
HAS_FORWARD_SYNC_BUFFERS = "forward_sync_buffers" in DDP_ARGUMENTS
# DDP 2.13's attributes that older DDPs of the range lack (seen on 2.9.1 and 2.11.0), with the release that
# added each; present where the installed DDP has the argument of the same name.
ADDED_BY_213 = {"forward_sync_buffers": "2.13", "batched_grad_copy": "2.13", "bucket_bytes_cap_list": "2.11"}
# DDP 2.13's _sync_buffers broadcasts inside torch.autograd._unsafe_preserve_version_counter (distributed.py,
# DDP._sync_buffers); 2.9 and 2.11 do not, so a second forward before a backward fails there with
# "modified by an inplace operation" where DDP 2.13, and ours, train.
PRESERVES_BUFFER_VERSIONS = "_unsafe_preserve_version_counter" in inspect.getsource(DDP)
# A CUDA build on a machine without a driver (the range's environments here): DDP's mixed_precision makes a
# torch.Stream() at construction (distributed.py, every release of the range), which raises there.
CUDA_BUILD_WITHOUT_GPU = torch.version.cuda is not None and not torch.cuda.is_available()


def skip_unless_ddp_has(*names: str) -> None:
    """Skips the test, saying why, where the installed DDP lacks one of DDP 2.13's arguments ``names``."""
    missing = [name for name in names if name not in DDP_ARGUMENTS]
    if missing:
        pytest.skip(
            f"the installed DDP (torch {TORCH_RELEASE}) has no {', '.join(missing)} argument; the row runs on "
            "the releases whose DDP has it (benchmarks/results/torch_range.json)"
        )


def ddp_213(module: nn.Module, **arguments: Any) -> DDP:
    """``DDP(module, **arguments)`` as DDP 2.13 reads them, on a DDP without ``forward_sync_buffers``.

    2.13 (distributed.py, ``__init__``): ``forward_sync_buffers`` given wins over ``broadcast_buffers``
    and the buffers are still broadcast at construction; only the forwards follow it. On an older
    DDP: construct with ``broadcast_buffers=True`` (the construction's broadcast), then set the
    attribute, which the forwards read.
    """
    forward_sync = arguments.pop("forward_sync_buffers", None)
    if HAS_FORWARD_SYNC_BUFFERS or forward_sync is None:
        return DDP(module, **arguments, **({} if forward_sync is None else {"forward_sync_buffers": forward_sync}))
    wrapped = DDP(module, **{**arguments, "broadcast_buffers": True})
    wrapped.broadcast_buffers = forward_sync
    return wrapped


def ddp_attribute(wrapped: DDP, name: str) -> Any:
    """DDP 2.13's attribute ``name`` on the installed DDP (``forward_sync_buffers``: older ``broadcast_buffers``)."""
    if name == "forward_sync_buffers" and not HAS_FORWARD_SYNC_BUFFERS:
        name = "broadcast_buffers"
    return getattr(wrapped, name)


def set_ddp_attribute(wrapped: DDP, name: str, value: Any) -> None:
    """Sets DDP 2.13's attribute ``name`` on the installed DDP (see ``ddp_attribute``)."""
    if name == "forward_sync_buffers" and not HAS_FORWARD_SYNC_BUFFERS:
        name = "broadcast_buffers"
    setattr(wrapped, name, value)


def run_as_ddp_213(wrapped: DDP, *inputs: Any) -> Any:
    """``wrapped(*inputs)`` with DDP 2.13's buffer sync on a DDP that lacks it.

    Where the installed DDP would broadcast its buffers before this forward
    (``will_sync_module_buffers()``, DDP's public test), the broadcast from
    rank 0 happens here, as 2.13's ``_sync_buffers`` does it (inside
    ``torch.autograd._unsafe_preserve_version_counter``; a broadcast per
    buffer gives the bits of DDP's coalesced one), and DDP's own is skipped
    for this forward (``require_forward_param_sync``, which DDP's
    ``_post_forward`` sets again after every forward). Join is not handled.
    """
    if PRESERVES_BUFFER_VERSIONS or not wrapped.will_sync_module_buffers():
        return wrapped(*inputs)
    buffers = tuple(wrapped.modules_buffers)
    with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(buffers):
        for buffer in buffers:
            dist.broadcast(buffer, 0, group=wrapped.process_group)
    wrapped.require_forward_param_sync = False  # DDP's post-forward sets it again, as after every forward
    return wrapped(*inputs)
