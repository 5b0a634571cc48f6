"""Flat gradient buckets, the parameter slots laid out in them, and where ``.grad`` lives.

A ``Bucket`` is one flat buffer that travels in one collective; each
``ParamSlot`` is one reduced parameter and the view of the bucket that holds
its gradient. They hold the layout (fixed until the buckets are rebuilt),
what was learned across steps, and what one synchronised backward knows of
them: a slot its firings, whether it holds its contribution already and
(copy layout) the ``.grad`` set aside; a bucket its slots still to fire and
its launched work. ``Bucket.reset`` clears a bucket's and its slots' step,
the reducer calls it on every bucket at each step's end (its one reset).

``ViewLayout`` (``gradient_as_bucket_view=True``, the default) keeps every
``.grad`` a view of its slot between steps, so gradients take no memory
beyond the buckets. ``CopyLayout`` keeps ``.grad`` separate and copies it
into the slot at launch and back after the reduction. The reducer calls the
same methods on either, at the same points of a step.

[Note: when is a parameter ready]
A post-accumulate-grad hook fires once per accumulation into ``.grad``, which
can be several times in one backward (reentrant checkpointing runs nested
backward passes). The reducer counts firings per parameter
(``ParamSlot.fired``) and learns the count each parameter reached in earlier
synchronised steps (``ParamSlot.expected``, a running maximum). A bucket is
launched from a hook only when every one of its parameters has reached its
expected count (``Bucket.pending`` counts down to 0); until a parameter has
been seen, its expected count is 0 and its bucket waits for the end of
backward. The first step thus reduces everything at the end; later static
steps overlap. If a parameter fires again after its bucket was launched (the
graph changed), the gradient must not race with the collective that reads the
bucket: at launch, each parameter's ``.grad`` is detached from the bucket
(``GradLayout.detach``), so a late accumulation lands in a fresh tensor, which
the late round reduces.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, Optional, Sequence

import torch
from torch import nn

from torchreplicate.errors import refuse_foreign_hooks
from torchreplicate.reducer.dtensors import grad_wrapper, is_dtensor, local, local_grad
from torchreplicate.reducer.flags import FlagSums
from torchreplicate.torch_internals import in_backward_optimizers, remove_in_backward_optimizer_hooks

if TYPE_CHECKING:
    from torchreplicate.reducer.reduction import Reduction, Waiter


class ParamSlot:
    """One reduced parameter and its place in a bucket.

    Args:
        index: position in the reducer's parameter list (and in the flags).
        param: the parameter.
        name: its fully qualified name, for error messages.
        expected: firings per synchronised backward learned so far (a
            re-plan carries it over from the previous reducer).
    """

    __slots__ = (
        "index",
        "param",
        "name",
        "dtype",
        "distributed",
        "bucket",
        "view",
        "grad_obj",
        "expected",
        "optimizers",
        "hook",
        "fired",
        "absorbed",
        "held",
    )

    def __init__(self, index: int, param: nn.Parameter, name: str, expected: int = 0) -> None:
        # - Layout: fixed once the buckets are built
        self.index = index
        self.param = param
        self.name = name
        # planned dtype; not view.dtype: module._apply (a submodule's .double())
        # swaps the data of an existing .grad, which may be the view itself
        self.dtype = param.dtype
        self.distributed = is_dtensor(param)  # a DTensor: the slot holds its local shard (dtensors.py)
        self.bucket: Bucket  # set by Bucket.__init__ (never for a sparse parameter)
        self.view: torch.Tensor  # this parameter's (local) gradient in the bucket, shaped like it
        self.grad_obj: torch.Tensor  # what .grad is set to: the view, or a DTensor around it
        # torch's optimizer-in-backward: stepped by the reducer once the average is in .grad
        self.optimizers = in_backward_optimizers(param)
        self.hook: Any = None  # the reducer's post-accumulate-grad hook handle, while registered
        # - Learned across synchronised backwards: how many accumulations into
        #   .grad one backward brings ([Note: when is a parameter ready])
        self.expected = expected
        # - Per synchronised backward (Bucket.reset)
        self.fired = 0  # accumulations into .grad seen
        # the view holds this rank's contribution as the reduction wants it
        # (scaled on the way in), so nothing is left to do before launch
        self.absorbed = False
        self.held: Optional[torch.Tensor] = None  # copy layout: .grad set aside while the bucket is in flight

    def plain(self, grad: torch.Tensor) -> torch.Tensor:
        """A gradient of this parameter as a plain tensor shaped like the view."""
        return local_grad(grad, self.param) if self.distributed else grad


class Bucket:
    """One flat gradient buffer and the slots laid out in it.

    Args:
        index: position in the launch order.
        slots: the parameters, in buffer order; each gets its ``bucket`` and ``view``.
        dtype: dtype of every gradient in the bucket.
        device: device of every gradient in the bucket.
        extra: elements reserved after the gradients (the flags' room, last
            bucket only: [Note: one collective sequence] in reducer.py).
    """

    def __init__(
        self, index: int, slots: Sequence[ParamSlot], dtype: torch.dtype, device: torch.device, extra: int = 0
    ) -> None:
        # - Layout
        self.index = index
        self.slots = list(slots)
        numel = sum(local(slot.param).numel() for slot in self.slots)
        self.buffer = torch.zeros(numel + extra, dtype=dtype, device=device)  # gradients, then `extra`
        self.grads = self.buffer[:numel]  # the gradient part: what comm hooks and the late round see
        offset = 0
        for slot in self.slots:
            shard = local(slot.param)
            slot.bucket = self
            slot.view = self.grads[offset : offset + shard.numel()].view_as(shard)
            slot.grad_obj = grad_wrapper(slot.view, slot.param)
            offset += shard.numel()
        names = [repr(slot.name) for slot in self.slots]
        more = f" and {len(names) - 3} more" if len(names) > 3 else ""
        self.description = ", ".join(names[:3]) + more  # its first parameters, for messages
        self.indices = [slot.index for slot in self.slots]  # the slots' parameter indices, in buffer order
        # - Per synchronised backward (reset). pending: slots still to reach their
        #   learned count before a hook may launch the bucket ([Note: when is a
        #   parameter ready]). A slot not seen yet has learned 0,
        #   so it never counts down, and its bucket waits for the end of
        #   backward. work: what the reduction launched, until waited for.
        self.pending = len(self.slots)
        self.work: Any = None

    def reset(self) -> None:
        """Clears this bucket's and its slots' per-step state, at the end of a synchronised backward."""
        self.pending = len(self.slots)
        self.work = None
        for slot in self.slots:
            slot.fired = 0
            slot.absorbed = False
            slot.held = None

    @property
    def numel(self) -> int:
        """Number of gradient elements (the flags' room excluded)."""
        return self.grads.numel()

    def views_of(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """``flat`` (shaped like ``grads``) cut into one view per slot, each shaped like its gradient."""
        views, offset = [], 0
        for slot in self.slots:
            numel = slot.view.numel()
            views.append(flat[offset : offset + numel].view_as(slot.view))
            offset += numel
        return views


@dataclass(frozen=True)
class BucketInfo:
    """One bucket of the layout a step ran with.

    Attributes:
        index: the bucket's index.
        names: fully qualified names of its parameters, in buffer order.
        numel: gradient elements.
        nbytes: bytes of its gradients.
    """

    index: int
    names: tuple[str, ...]
    numel: int
    nbytes: int

    def describe(self, max_names: int = 3) -> str:
        """The first parameter names, and how many more."""
        shown = ", ".join(self.names[:max_names])
        more = len(self.names) - max_names
        return shown + (f" and {more} more" if more > 0 else "")


class ReducerInfo(NamedTuple):
    """What observers read of a reducer (``Reducer.info``): plain values, the layout as it is now.

    Attributes:
        device: where the buckets live (an observer's own collectives run there).
        waiter: waits the reducer's collectives (the stall watchdog), or None.
        buckets: the bucket layout, in launch order.
    """

    device: torch.device
    waiter: Optional[Waiter]
    buckets: tuple[BucketInfo, ...]

    @classmethod
    def of(cls, buckets: Sequence[Bucket], waiter: Optional[Waiter]) -> ReducerInfo:
        """The view of ``buckets`` (a reducer's, in launch order)."""
        infos = tuple(
            BucketInfo(b.index, tuple(s.name for s in b.slots), b.numel, b.numel * b.grads.element_size())
            for b in buckets
        )
        return cls(buckets[0].buffer.device, waiter, infos)


def layout_digest(buckets: Sequence[Bucket], unbucketed: Sequence[ParamSlot]) -> int:
    """A digest of a bucket layout (names, shapes, dtypes in order): equal on ranks whose layouts match.

    Args:
        buckets: the buckets, in launch order.
        unbucketed: the slots reduced outside the buckets (sparse gradients).
    """
    layout = [[(s.name, tuple(s.param.shape), str(s.dtype)) for s in b.slots] for b in buckets]
    layout.append([(s.name, tuple(s.param.shape), str(s.dtype)) for s in unbucketed])
    return int.from_bytes(hashlib.sha256(repr(layout).encode()).digest()[:8], "little")


def make_slots(params: Sequence[nn.Parameter], names: Sequence[str], expected: dict[int, int]) -> list[ParamSlot]:
    """One slot per parameter, with the firing counts an earlier reducer learned (by ``id``).

    Raises:
        ValueError: a parameter carries a post-accumulate-grad hook of its own.
    """
    slots = [ParamSlot(i, p, n, expected.get(id(p), 0)) for i, (p, n) in enumerate(zip(params, names, strict=True))]
    refuse_foreign_hooks(slots)
    return slots


def adopt_in_backward_optimizers(slots: Sequence[ParamSlot]) -> list[ParamSlot]:
    """The slots whose parameters torch's optimizer-in-backward steps, with its own hooks removed.

    Those hooks would step on the local gradient; the reducer steps the
    optimizers once the average is in ``.grad`` (``step_in_backward_optimizers``).
    """
    taken = [slot for slot in slots if slot.optimizers]
    for slot in taken:
        remove_in_backward_optimizer_hooks(slot.param)
    return taken


def step_in_backward_optimizers(slots: Sequence[ParamSlot]) -> None:
    """Steps torch's optimizer-in-backward on the average, as its own hooks would have on the local gradient."""
    for slot in slots:
        if slot.param.grad is not None:
            for optimizer in slot.optimizers:
                optimizer.step()
            slot.param.grad = None  # as torch's optimizer-in-backward leaves it


LateGrads = dict[int, torch.Tensor]  # slot index -> a gradient that arrived after its bucket left


class GradLayout:
    """The interface; see the two implementations."""

    def adopt_grads(self, slots: Sequence[ParamSlot]) -> None:
        """At set-up and after the buckets were rebuilt: takes over the ``.grad`` the parameters already have."""

    def keep_local(self, slot: ParamSlot) -> None:
        """After an accumulation with gradient sync off (``no_sync``)."""

    def absorb(self, slot: ParamSlot, reduction: Reduction) -> None:
        """After an accumulation in a synchronised backward, before the bucket left."""

    def detach(self, bucket: Bucket, reduction: Reduction) -> None:
        """At a launch from a hook: frees ``.grad`` from the bucket in flight.

        Every slot of ``bucket`` reached its expected count, so each has a
        gradient. A further accumulation then lands in a fresh ``.grad``,
        which the late round reduces ([Note: when is a parameter ready]).
        """
        raise NotImplementedError

    def fill(self, slot: ParamSlot, reduction: Reduction) -> bool:
        """At the end of backward, for a bucket not launched yet: makes the slot hold
        this rank's contribution. Returns whether this rank has a gradient for it."""
        raise NotImplementedError

    def restore(self, buckets: Sequence[Bucket], sums: FlagSums, num_early: int) -> LateGrads:
        """After the reduction: points every ``.grad`` at its average; returns the late gradients.

        ``num_early`` buckets (a prefix) were launched from hooks, so their
        parameters' ``.grad`` were detached and may hold late gradients.
        A parameter no rank used keeps ``grad=None``.
        """
        late: LateGrads = {}
        for bucket in buckets:
            early = bucket.index < num_early
            for slot in bucket.slots:
                param = slot.param
                if early:
                    if param.grad is not None:
                        late[slot.index] = slot.plain(param.grad)
                    param.grad = self._early_average(slot)
                elif slot.index in sums.unused_everywhere:
                    param.grad = None
                else:
                    self._point_at_average(slot)
        return late

    def _early_average(self, slot: ParamSlot) -> torch.Tensor:
        # What .grad becomes for a slot of a bucket launched from a hook.
        raise NotImplementedError

    def _point_at_average(self, slot: ParamSlot) -> None:
        # Points a used slot's .grad (of a bucket launched at the end) at its average.
        raise NotImplementedError


class ViewLayout(GradLayout):
    """``.grad`` is its slot's view whenever no backward is running."""

    def adopt_grads(self, slots: Sequence[ParamSlot]) -> None:
        for slot in slots:
            if slot.param.grad is not None:
                slot.view.copy_(slot.plain(slot.param.grad))
                slot.param.grad = slot.grad_obj

    def keep_local(self, slot: ParamSlot) -> None:
        # .grad was set to None (zero_grad) or replaced: move it into the bucket
        param = slot.param
        grad = param.grad
        assert grad is not None, "the hook runs after an accumulation into .grad"
        if grad is not slot.grad_obj:
            slot.view.copy_(slot.plain(grad))
            param.grad = slot.grad_obj

    def absorb(self, slot: ParamSlot, reduction: Reduction) -> None:
        # The hot path (once per parameter per step): no asserts, calls inlined.
        param = slot.param
        grad = param.grad
        if grad is slot.grad_obj:
            return  # accumulated in place: finish_absorbing handles it at launch
        if slot.distributed:
            grad = slot.plain(grad)  # type: ignore[arg-type]  # the reducer's hook checked it is set
        if slot.absorbed:
            reduction.fold(grad, slot)  # type: ignore[arg-type]  # a further accumulation in this backward
        else:
            reduction.absorb(grad, slot)  # type: ignore[arg-type]
            slot.absorbed = True
        param.grad = None

    def detach(self, bucket: Bucket, reduction: Reduction) -> None:
        for slot in bucket.slots:
            slot.param.grad = None

    def fill(self, slot: ParamSlot, reduction: Reduction) -> bool:
        if slot.fired:
            return True  # absorb() already put it in the slot
        grad = slot.param.grad
        if grad is None:
            slot.view.zero_()
            return False
        if grad is not slot.grad_obj:
            slot.view.copy_(slot.plain(grad))  # brought to the absorbed form with the bucket at launch
        return True

    def restore(self, buckets: Sequence[Bucket], sums: FlagSums, num_early: int) -> LateGrads:
        if sums.unused_everywhere or sums.any_late:
            return super().restore(buckets, sums, num_early)
        for bucket in buckets:  # the ordinary step: every .grad is its slot's view
            for slot in bucket.slots:
                slot.param.grad = slot.grad_obj
        return {}

    def _early_average(self, slot: ParamSlot) -> torch.Tensor:
        return slot.grad_obj

    def _point_at_average(self, slot: ParamSlot) -> None:
        slot.param.grad = slot.grad_obj


class CopyLayout(GradLayout):
    """``.grad`` is a tensor of its own: copied in at launch, the average copied back."""

    def detach(self, bucket: Bucket, reduction: Reduction) -> None:
        for slot in bucket.slots:
            grad = slot.param.grad
            assert grad is not None, "a bucket launches from a hook only once every slot has a gradient"
            reduction.absorb(slot.plain(grad), slot)  # the copy into the slot is the scaling pass
            slot.absorbed = True
            slot.held = grad
            slot.param.grad = None

    def fill(self, slot: ParamSlot, reduction: Reduction) -> bool:
        grad = slot.param.grad
        slot.absorbed = True
        if grad is None:
            slot.view.zero_()
            return False
        reduction.absorb(slot.plain(grad), slot)
        return True

    def _early_average(self, slot: ParamSlot) -> torch.Tensor:
        held = slot.held
        assert held is not None, "set aside by detach()"
        local(held).copy_(slot.view)
        return held

    def _point_at_average(self, slot: ParamSlot) -> None:
        param = slot.param
        if param.grad is None:
            param.grad = grad_wrapper(slot.view.clone(), param)
        else:
            local(param.grad).copy_(slot.view)


def grad_layout(gradient_as_bucket_view: bool) -> GradLayout:
    """The layout ``replicate(gradient_as_bucket_view=...)`` asks for."""
    return ViewLayout() if gradient_as_bucket_view else CopyLayout()
