"""Where ``.grad`` lives: a view into its bucket, or a tensor of its own.

``ViewLayout`` (``gradient_as_bucket_view=True``, the default) keeps every
``.grad`` a view of its slot between steps, so gradients take no memory
beyond the buckets. ``CopyLayout`` keeps ``.grad`` separate and copies it
into the slot at launch and back after the reduction. The reducer calls the
same methods on either, at the same points of a step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import torch

from torchreplicate.reducer.bucket import Bucket, ParamSlot
from torchreplicate.reducer.dtensors import grad_wrapper, local
from torchreplicate.reducer.flags import FlagSums
from torchreplicate.reducer.reduction import Reduction

if TYPE_CHECKING:
    from torchreplicate.reducer.step import StepState

LateGrads = dict[int, torch.Tensor]  # slot index -> a gradient that arrived after its bucket left


class GradLayout:
    """The interface; see the two implementations."""

    def take_over_grads(self, slots: Sequence[ParamSlot]) -> None:
        """At set-up and after the buckets were rebuilt: takes over the ``.grad`` the parameters already have."""

    def keep_local(self, slot: ParamSlot) -> None:
        """After an accumulation with gradient sync off (``no_sync``)."""

    def take(self, slot: ParamSlot, step: StepState, reduction: Reduction) -> None:
        """After an accumulation in a synchronised backward, before the bucket left."""

    def detach(self, bucket: Bucket, step: StepState, reduction: Reduction) -> None:
        """At a launch from a hook: frees ``.grad`` from the bucket in flight.

        Every slot of ``bucket`` reached its expected count, so each has a
        gradient. A further accumulation then lands in a fresh ``.grad``,
        which the late round reduces ([Note: when is a parameter ready]).
        """
        raise NotImplementedError

    def fill(self, slot: ParamSlot, step: StepState, reduction: Reduction) -> bool:
        """At the end of backward, for a bucket not launched yet: makes the slot hold
        this rank's contribution. Returns whether this rank has a gradient for it."""
        raise NotImplementedError

    def restore(self, buckets: Sequence[Bucket], step: StepState, sums: FlagSums, num_early: int) -> LateGrads:
        """After the reduction: points every ``.grad`` at its average; returns the late gradients.

        ``num_early`` buckets (a prefix) were launched from hooks, so their
        parameters' ``.grad`` were detached and may hold late gradients.
        """
        raise NotImplementedError


class ViewLayout(GradLayout):
    """``.grad`` is its slot's view whenever no backward is running."""

    def take_over_grads(self, slots: Sequence[ParamSlot]) -> None:
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

    def take(self, slot: ParamSlot, step: StepState, reduction: Reduction) -> None:
        # The hot path (once per parameter per step): no asserts, calls inlined.
        param = slot.param
        grad = param.grad
        if grad is slot.grad_obj:
            return  # accumulated in place: finish_absorbing handles it at launch
        if slot.distributed:
            grad = slot.plain(grad)  # type: ignore[arg-type]  # the reducer's hook checked it is set
        index = slot.index
        if step.absorbed[index]:
            reduction.fold(grad, slot)  # type: ignore[arg-type]  # a further accumulation in this backward
        else:
            reduction.absorb(grad, slot)  # type: ignore[arg-type]
            step.absorbed[index] = True
        param.grad = None

    def detach(self, bucket: Bucket, step: StepState, reduction: Reduction) -> None:
        for slot in bucket.slots:
            slot.param.grad = None

    def fill(self, slot: ParamSlot, step: StepState, reduction: Reduction) -> bool:
        if step.fired[slot.index]:
            return True  # take() already put it in the slot
        grad = slot.param.grad
        if grad is None:
            slot.view.zero_()
            return False
        if grad is not slot.grad_obj:
            slot.view.copy_(slot.plain(grad))  # brought to the absorbed form with the bucket at launch
        return True

    def restore(self, buckets: Sequence[Bucket], step: StepState, sums: FlagSums, num_early: int) -> LateGrads:
        late: LateGrads = {}
        if not sums.unused_everywhere and not sums.any_late:
            for bucket in buckets:  # the ordinary step
                for slot in bucket.slots:
                    slot.param.grad = slot.grad_obj
            return late
        for bucket in buckets:
            early = bucket.index < num_early
            for slot in bucket.slots:
                param = slot.param
                if early:
                    if param.grad is not None:
                        late[slot.index] = slot.plain(param.grad)
                    param.grad = slot.grad_obj
                elif slot.index in sums.unused_everywhere:
                    param.grad = None
                elif param.grad is not slot.grad_obj:
                    param.grad = slot.grad_obj
        return late


class CopyLayout(GradLayout):
    """``.grad`` is a tensor of its own: copied in at launch, the average copied back."""

    def detach(self, bucket: Bucket, step: StepState, reduction: Reduction) -> None:
        for slot in bucket.slots:
            grad = slot.param.grad
            assert grad is not None, "a bucket launches from a hook only once every slot has a gradient"
            reduction.absorb(slot.plain(grad), slot)  # the copy into the slot is the scaling pass
            step.absorbed[slot.index] = True
            step.held[slot.index] = grad
            slot.param.grad = None

    def fill(self, slot: ParamSlot, step: StepState, reduction: Reduction) -> bool:
        grad = slot.param.grad
        if grad is None:
            slot.view.zero_()
            step.absorbed[slot.index] = True
            return False
        reduction.absorb(slot.plain(grad), slot)
        step.absorbed[slot.index] = True
        return True

    def restore(self, buckets: Sequence[Bucket], step: StepState, sums: FlagSums, num_early: int) -> LateGrads:
        late: LateGrads = {}
        for bucket in buckets:
            early = bucket.index < num_early
            for slot in bucket.slots:
                param = slot.param
                if early:
                    if param.grad is not None:
                        late[slot.index] = slot.plain(param.grad)
                    held = step.held.pop(slot.index)
                    local(held).copy_(slot.view)
                    param.grad = held
                elif slot.index in sums.unused_everywhere:
                    param.grad = None
                elif param.grad is None:
                    param.grad = grad_wrapper(slot.view.clone(), param)
                else:
                    local(param.grad).copy_(slot.view)
        return late


def grad_layout(gradient_as_bucket_view: bool) -> GradLayout:
    """The layout ``replicate(gradient_as_bucket_view=...)`` asks for."""
    return ViewLayout() if gradient_as_bucket_view else CopyLayout()
