"""Buffers of a replicated module: when every rank takes one rank's values, and how.

[Note: buffer sync]
The rules are DDP 2.13's, so that BatchNorm statistics and every other
buffer hold on each rank what they would hold under DDP on the same job:

- At set-up, buffers are broadcast from rank 0 with the parameters, unless
  ``broadcast_buffers=False`` was given without ``forward_sync_buffers``
  (DDP's deprecated spelling also skips the set-up broadcast;
  ``forward_sync_buffers=False`` keeps it): ``BufferSync.at_set_up``.
- Before a forward with gradients enabled, buffers are broadcast from rank 0
  (from the highest rank still training, inside a ``Join``) when
  ``before_forward`` (DDP's ``forward_sync_buffers``; ``model.broadcast_buffers
  = False`` turns it off at run time, as on DDP) and ``due`` (DDP's
  ``require_forward_param_sync``): the previous forward with gradients ran
  with gradient sync on. Under ``no_sync()`` accumulation only the first
  micro-batch's forward broadcasts, as under DDP; the others keep each
  rank's own statistics.
- A forward with gradients disabled runs no collective (one rank may
  evaluate alone) and leaves ``due`` as it was. DDP broadcasts there too
  when ``due``, and clears it: where ranks' buffers differ, an evaluation
  forward under ``torch.no_grad()`` on rank >= 1 sees its own statistics
  where DDP's sees rank 0's (docs/migration.md).
- The broadcast writes into the buffers in place, so a reference a user
  holds (``rm = bn.running_mean``, an EMA of buffers, an optimizer over
  them) sees the new values. An in-place write bumps a tensor's version
  counter, and a graph still pending from an earlier forward may have saved
  the buffer: BatchNorm saves its running statistics for backward, so two
  forwards before one backward would fail in that backward. As DDP's
  ``_sync_buffers`` does, the broadcast keeps each buffer's version counter
  (``torch_internals.preserved_versions``). That is safe where the pending
  backward does not read the values, or the broadcast does not change them:
  BatchNorm's backward in training reads the batch's statistics, not the
  running ones (checked on 2.13), and in evaluation the running ones do not
  change, so a broadcast after the first writes the same values. Otherwise (a
  buffer a pending backward reads, which the broadcast changes on this rank)
  that backward reads the broadcast values, exactly as under DDP.

How one rank's values reach the others is ``broadcast_coalesced``: one
broadcast per device for tensors of every dtype, which the set-up (the
parameters) and a ``Join``'s end (core/join.py) use too.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Optional, Sequence, cast

import torch
import torch.distributed as dist
from torch import nn

from torchreplicate.config import ReplicateConfig
from torchreplicate.faults.watchdog import diagnosing
from torchreplicate.reducer.reduction import Waiter, WeakGroup, wait_for
from torchreplicate.torch_internals import preserved_versions

if TYPE_CHECKING:
    from torchreplicate.reducer.probe import Probe


BufferRef = tuple["weakref.ref[nn.Module]", str]  # owner (held weakly: the root is often one) and name


def values_of(refs: Sequence[BufferRef]) -> list[torch.Tensor]:
    """The buffers' current tensors, read from their owners (a child's ``.to()`` swaps them)."""
    values = []
    for owner, name in refs:
        module = owner()
        assert module is not None, "a buffer's owner outlives the plan while the root lives"
        values.append(getattr(module, name))
    return values


class BufferSync:
    """When and how a replicated module's buffers are broadcast ([Note: buffer sync]); ``state.buffer_sync``.

    Args:
        config: the module's options.
    """

    def __init__(self, config: ReplicateConfig) -> None:
        # broadcast at set-up and to buffers new to a re-plan; fixed at replicate()
        self.at_set_up = config.init_sync_buffers
        # before forwards (DDP's forward_sync_buffers); the model's broadcast_buffers attribute sets it
        self.before_forward = config.broadcast_buffers
        # DDP's require_forward_param_sync: the last forward with gradients ran with gradient sync on.
        # The forward hook writes it after each forward with gradients: the next one broadcasts
        # only if this one's backward syncs.
        self.due = True
        # - From the plan (``install``): the buffers to broadcast, none without
        #   other ranks; the group and the probe (whose watchdog waits each broadcast)
        self.refs: tuple[BufferRef, ...] = ()
        self._group: Optional[WeakGroup] = None
        self._probe: Optional[Probe] = None

    def install(self, refs: Sequence[BufferRef], group: WeakGroup, probe: Probe) -> None:
        """At each plan: the replicated buffers (none at world size 1), the group, the module's probe."""
        self.refs = tuple(refs)
        self._group = group
        self._probe = probe

    @property
    def wanted(self) -> bool:
        """Whether the next forward with gradients broadcasts (``before_forward`` and ``due``)."""
        return self.before_forward and self.due

    def broadcast(self, source: int) -> None:
        """Gives every rank the replicated buffers of group rank ``source``, in place ([Note: buffer sync]).

        Every rank calls it at the same point (the forward pre-hook, or a joined
        rank's join hook); it does nothing without buffers or other ranks.
        """
        if not self.refs:
            return
        assert self._group is not None and self._probe is not None, "installed with the refs"
        values = values_of(self.refs)
        watch = self._probe.watch
        with diagnosing(watch, before="the buffer broadcast"), preserved_versions(values):
            broadcast_coalesced(values, self._group.get(), src_rank=source, waiter=watch)


@torch.no_grad()
def broadcast_coalesced(
    tensors: Sequence[torch.Tensor],
    group: dist.ProcessGroup,
    *,
    src_rank: int = 0,
    waiter: Optional[Waiter] = None,
) -> None:
    """Broadcasts tensors from ``src_rank`` in one collective per device and 250 MiB (DDP's chunk at set-up).

    Tensors of every dtype travel together as bytes, so a BatchNorm's float
    statistics and its int64 counter cost one broadcast, not two.

    Args:
        tensors: what to broadcast; the same shapes and dtypes on every rank.
        group: the process group.
        src_rank: group rank whose values everyone takes. Default 0.
        waiter: waits each broadcast (the stall watchdog), or None: a plain wait.

    Every tensor takes the broadcast value in place.
    """
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for tensor in tensors:
        by_device.setdefault(tensor.device, []).append(tensor.detach())
    src = dist.get_global_rank(group, src_rank)
    for members in (chunk for on_device in by_device.values() for chunk in _chunks(on_device)):
        flat = _pack_bytes(members)
        wait_for(cast(dist.Work, dist.broadcast(flat, src=src, group=group, async_op=True)), waiter)
        offset = 0
        for tensor in members:
            nbytes = tensor.numel() * tensor.element_size()
            piece = flat[offset : offset + nbytes].view(tensor.dtype).view(tensor.shape)
            offset += _padded(nbytes)
            tensor.copy_(piece)


_ALIGN = 16  # bytes: every piece starts aligned for any dtype's view
CHUNK_BYTES = 250 * 1024 * 1024  # DDP's broadcast_bucket_size at set-up (distributed.py, _sync_module_states)


def _chunks(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """``tensors`` in order, in runs of at most ``CHUNK_BYTES`` packed (a larger tensor alone): the packed
    copy a broadcast needs stays under DDP's bucket, not the size of the model."""
    chunks: list[list[torch.Tensor]] = [[]]
    size = 0
    for tensor in tensors:
        nbytes = _padded(tensor.numel() * tensor.element_size())
        if chunks[-1] and size + nbytes > CHUNK_BYTES:
            chunks.append([])
            size = 0
        chunks[-1].append(tensor)
        size += nbytes
    return chunks


def _padded(nbytes: int) -> int:
    return (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN


def _pack_bytes(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    total = sum(_padded(t.numel() * t.element_size()) for t in tensors)
    flat = torch.empty(total, dtype=torch.uint8, device=tensors[0].device)
    offset = 0
    for tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        flat[offset : offset + nbytes].copy_(tensor.contiguous().reshape(-1).view(torch.uint8))
        offset += _padded(nbytes)
    return flat
