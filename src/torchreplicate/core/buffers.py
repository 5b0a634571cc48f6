"""Buffers of a replicated module: when every rank takes one rank's values, and how.

[Note: buffer sync]
The rules are DDP 2.13's, so that BatchNorm statistics and every other
buffer hold on each rank what they would hold under DDP on the same job,
in training and in evaluation:

- At set-up, buffers are broadcast from rank 0 with the parameters, unless
  ``broadcast_buffers=False`` was given without ``forward_sync_buffers``
  (DDP's deprecated spelling also skips the set-up broadcast;
  ``forward_sync_buffers=False`` keeps it): ``BufferSync.at_set_up``.
- Before a forward, with or without gradients, every rank takes rank 0's
  buffers (the highest rank still training's, inside a ``Join``) when
  ``before_forward`` (DDP's ``forward_sync_buffers``; ``model.broadcast_buffers
  = False`` turns it off at run time, as on DDP) and ``due`` (DDP's
  ``require_forward_param_sync``): the previous forward ran with gradients
  and with gradient sync on. After every forward ``due`` is set again, as
  DDP's ``_post_forward`` does: an evaluation forward under ``no_grad``
  (or one under ``no_sync()``) clears it. Under ``no_sync()`` accumulation
  only the first micro-batch's forward takes rank 0's values; the others
  keep each rank's own statistics.
- What DDP broadcasts at a forward is rank 0's buffers as its previous
  forward left them. So that a rank may evaluate alone (rank 0 alone under
  ``no_grad``) with no collective that could hang, those values travel at
  the end of the forward that leaves ``due`` set, which every rank runs in
  step: a broadcast launched without waiting into a staging buffer
  (``StagedBuffers``), which the next forward, with gradients or without,
  waits for and copies in: one collective per step, as before, moved from
  the start of a forward to the end of the one before. Where nothing was
  staged (the first forward, inside a ``Join``, after ``broadcast_buffers``
  was switched on) a forward with gradients broadcasts at its start, as
  DDP's does, and one without gradients keeps each rank's values. A rank
  whose own buffers changed between the staging and the next forward
  (``load_state_dict`` on every rank, a reset) keeps them: the staged
  values are older. Change buffers between steps on every rank alike: DDP
  would give every rank rank 0's changed values.
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
from typing import TYPE_CHECKING, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from torchreplicate.config import ReplicateConfig
from torchreplicate.faults.wire import HeldWorks, Watch, WeakGroup, broadcast
from torchreplicate.torch_internals import preserved_versions, version_of

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
        # DDP's require_forward_param_sync: the last forward ran with gradients and gradient sync on.
        # Written after every forward (``after``), so an evaluation under no_grad on one rank clears
        # it there only; ``agreed_due`` is the same fact as the last forward with gradients left it,
        # every rank alike, which decides every collective
        self.due = self.agreed_due = True
        self.sent = False  # the last forward with gradients sent rank 0's buffers ahead (every rank alike)
        # - From the plan (``install``): the buffers to broadcast, none without
        #   other ranks; the group and the probe (whose watchdog waits each broadcast)
        self.refs: tuple[BufferRef, ...] = ()
        self._group: Optional[WeakGroup] = None
        self._probe: Optional[Probe] = None
        self._held = HeldWorks()  # the module's works kept past a step (the clock's, from ``install``)
        # - Rank 0's buffers on their way, sent at the end of the last forward with gradients
        self.staged: Optional[StagedBuffers] = None

    def install(self, refs: Sequence[BufferRef], group: WeakGroup, probe: Probe, held: HeldWorks) -> None:
        """At each plan: the replicated buffers (none at world size 1), the group, the module's probe, and
        its works kept past a step (the broadcast sent ahead is one: [Note: works kept past a step] in
        faults/wire.py)."""
        self.staged = None  # staged for the old plan's buffers (their works are kept: held)
        self.sent = False
        self.refs = tuple(refs)
        self._group = group
        self._probe = probe
        self._held = held

    @property
    def wanted(self) -> bool:
        """Whether the next forward takes rank 0's buffers (``before_forward`` and ``due``: DDP's rule)."""
        return self.before_forward and self.due

    @property
    def agreed(self) -> bool:
        """``wanted`` as the last forward with gradients left it: every rank alike (a Join's round reads it)."""
        return self.before_forward and self.agreed_due

    def set_due(self, due: bool) -> None:
        """DDP's ``require_forward_param_sync`` set by hand (on every rank, as on DDP)."""
        self.due = self.agreed_due = due

    def before(self, grad_enabled: bool, source: Optional[int] = None) -> None:
        """Before a forward ([Note: buffer sync]): rank 0's buffers as its last forward left them, where due:
        those sent ahead (no collective); else, with gradients, where nothing was sent ahead and every
        rank's last forward with gradients left it due, a broadcast now (inside a ``Join``: from group
        rank ``source``, where the join round said so: ``agreed``). First the module's works kept past the
        last step are released ([Note: works kept past a step] in faults/wire.py): the broadcast sent
        ahead is done then, whatever updates the weights."""
        with self.watch.diagnosing(before="the buffer broadcast"):
            self._held.release()
        if not self.refs:
            return
        if source is None and self.staged is not None and self.wanted:
            staged, self.staged = self.staged, None
            staged.copy_into(values_of(self.refs))
            return
        self.staged = None  # taken by no forward (its works are released)
        if grad_enabled and self.agreed and (source is not None or not self.sent):
            self.broadcast(0 if source is None else source)

    def after(self, grad_enabled: bool, sync_on: bool, joining: bool) -> None:
        """After a forward (one that raised too): DDP's ``require_forward_param_sync``, and after one with
        gradients rank 0's buffers sent ahead to the next forward where it will take them (not in a Join)."""
        self.due = grad_enabled and sync_on
        if not grad_enabled:
            return
        self.agreed_due = self.due
        self.staged = None  # sent ahead for a forward that did not take it (its works are kept: held)
        self.sent = bool(self.refs) and self.agreed and not joining and self._group is not None
        if self.sent:
            assert self._group is not None
            with self.watch.diagnosing(before="the buffer broadcast"):
                group = self._group() or self._group.get()  # the weak reference's call; get() raises
                self.staged = StagedBuffers(values_of(self.refs), group, self._held)

    @property
    def watch(self) -> Watch:
        """The module's watch, which waits each broadcast (a plain one before the plan)."""
        return _PLAIN if self._probe is None else self._probe.watch

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
        with watch.diagnosing(before="the buffer broadcast"), preserved_versions(values):
            broadcast_coalesced(values, self._group.get(), watch, src_rank=source)


class StagedBuffers:
    """Rank 0's buffers on their way to every rank, launched without waiting at the end of a forward
    ([Note: buffer sync]); the next forward waits for them (their works are kept past the step in
    ``held``) and copies them in (``copy_into``).

    Args:
        values: the buffers, as they are now (rank 0's are sent).
        group: the process group.
        held: the module's works kept past a step, which keeps each broadcast's work.
    """

    def __init__(self, values: Sequence[torch.Tensor], group: dist.ProcessGroup, held: HeldWorks) -> None:
        self.values = list(values)
        self.versions = _versions(self.values)  # a change after this one is the rank's own
        self.source = dist.get_rank(group) == 0
        self.chunks: list[tuple[torch.Tensor, list[torch.Tensor]]] = []  # (flat, members)
        with torch.no_grad():
            for members in _pieces(self.values):
                flat = (
                    _pack_bytes(members)
                    if self.source
                    else torch.empty(_packed(members), dtype=torch.uint8, device=members[0].device)
                )
                broadcast(flat, group, held=held)
                self.chunks.append((flat, members))

    @torch.no_grad()
    def copy_into(self, current: Sequence[torch.Tensor]) -> None:
        """Copies rank 0's values into ``current`` (the buffers now), in place and keeping their version
        counters, once the broadcast's works were released (waited); a buffer this rank changed or replaced
        since the staging keeps its own value."""
        if self.source:
            return  # rank 0's own values: nothing to copy
        pairs = zip(self.values, current, self.versions, _versions(current), strict=True)
        unchanged = {id(v) for v, c, then, now in pairs if v is c and then == now}
        kept = [v for v in self.values if id(v) in unchanged]
        with preserved_versions(kept):
            for flat, members in self.chunks:
                _unpack_bytes(flat, members, only=unchanged)


@torch.no_grad()
def broadcast_coalesced(
    tensors: Sequence[torch.Tensor], group: dist.ProcessGroup, watch: Watch, *, src_rank: int = 0
) -> None:
    """Broadcasts tensors from ``src_rank`` in one collective per device and 250 MiB (DDP's chunk at set-up).

    Tensors of every dtype travel together as bytes, so a BatchNorm's float
    statistics and its int64 counter cost one broadcast, not two.

    Args:
        tensors: what to broadcast; the same shapes and dtypes on every rank.
        group: the process group.
        watch: waits each broadcast (the module's: the stall watchdog, or plain).
        src_rank: group rank whose values everyone takes. Default 0.

    Every tensor takes the broadcast value in place.
    """
    for members in _pieces(tensors):
        flat = _pack_bytes(members)
        watch.wait(broadcast(flat, group, src_rank))
        _unpack_bytes(flat, members)


_PLAIN = Watch()  # before the plan: no broadcast runs


def _versions(tensors: Sequence[torch.Tensor]) -> list[int]:
    # Each tensor's count of in-place writes (torch_internals.version_of), read in one place.
    return [version_of(tensor) for tensor in tensors]


def _pieces(tensors: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
    # What one broadcast carries: in order, by device, in runs of at most CHUNK_BYTES (the tensors
    # themselves: every caller writes them under no_grad).
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for tensor in tensors:
        by_device.setdefault(tensor.device, []).append(tensor)
    return [chunk for on_device in by_device.values() for chunk in _chunks(on_device)]


def _unpack_bytes(flat: torch.Tensor, members: Sequence[torch.Tensor], only: Optional[set[int]] = None) -> None:
    # Each member takes its piece of ``flat`` (``_pack_bytes``' layout); ``only``: the ids of those that do.
    offset = 0
    for tensor in members:
        nbytes = tensor.numel() * tensor.element_size()
        if only is None or id(tensor) in only:
            tensor.copy_(flat[offset : offset + nbytes].view(tensor.dtype).view(tensor.shape))
        offset += _padded(nbytes)


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


def _packed(tensors: Sequence[torch.Tensor]) -> int:
    return sum(_padded(t.numel() * t.element_size()) for t in tensors)


def _pack_bytes(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    flat = torch.empty(_packed(tensors), dtype=torch.uint8, device=tensors[0].device)
    offset = 0
    for tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        flat[offset : offset + nbytes].copy_(tensor.contiguous().reshape(-1).view(torch.uint8))
        offset += _padded(nbytes)
    return flat
