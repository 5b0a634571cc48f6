"""Flat gradient buckets and the parameter slots laid out in them: each bucket owns its step.

A ``Bucket`` is one flat buffer that travels in one collective; each
``ParamSlot`` is one reduced parameter and the view of the bucket that holds
its gradient. As FSDP2's ``FSDPParamGroup`` owns its group's step, a bucket
owns everything one synchronised backward does to it, and every per-step
field of a bucket and of its slots is written here only: counting a
parameter's readiness and absorbing its gradient (``take``), launching its
collective and holding the work (``launch``), filling what no hook brought at
the end of backward (``fill``), waiting (``wait``), pointing ``.grad`` at
the average (``restore``) and clearing the step (``reset``). The collective
itself is the reduction's (reduction.py), bound once per bucket layout:
the bucket hands it only its index, and holds the scale the reduction wants
its gradients multiplied by on the way in ([Note: the mean is taken on the
way in] in reduction.py).

Where ``.grad`` lives is fixed when the buckets are built: a ``ViewBucket``
(``gradient_as_bucket_view=True``, the default) keeps every ``.grad`` a view
of its slot between steps, so gradients take no memory beyond the buckets; a
``CopyBucket`` keeps ``.grad`` separate and copies it into the slot at
launch and back after the reduction. The reducer calls the same methods on
either, at the same points of a step.

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
(``Bucket.launch``), so a late accumulation lands in a fresh tensor, which
the late round reduces. Between the first and the expected firing,
autograd sums the accumulations in ``.grad`` and the bucket takes the sum
once, as DDP's reducer does with ``static_graph=True``; the first step,
which has learned nothing yet, takes each accumulation as it comes.

[Note: batched buckets]
A hook is a Python call per parameter, and each tensor operation from
Python costs about a microsecond of host time whatever its size, which is
what a model of many small tensors pays per step (DDP's reducer makes the
same calls from C++). A bucket whose parameters average fewer than
``BATCH_NUMEL`` elements is batched: its hooks only count, and its launch
gathers every gradient into the buffer in one multi-tensor copy
(``torch_internals.copy_into``), then scales the whole buffer in one pass.
The bytes are DDP's: a copy is exact, and one multiply of the copy by the
scale is the multiply DDP's reducer fuses into its copy, element by
element. A bucket of larger parameters takes each gradient when it is
ready, scaled on the way (one pass per tensor, where a second would cost
more than the call it saves). The fresh gradients of a batched bucket stay
alive until it launches: at most the bucket's bytes, of small tensors.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from typing import TYPE_CHECKING, Any, NamedTuple, Optional, Sequence

import torch
from torch import nn

from torchreplicate.errors import changed_since_plan, foreign_hook_error, some_names
from torchreplicate.reducer.dtensors import grad_wrapper, is_dtensor, local, local_grad
from torchreplicate.torch_internals import (
    copy_into,
    in_backward_optimizers,
    num_post_accumulate_grad_hooks,
    remove_in_backward_optimizer_hooks,
)

if TYPE_CHECKING:
    from torchreplicate.reducer.reduction import Reduction


class BucketSpec(NamedTuple):
    """One planned bucket: what the layout (layout/plan.py) returns and ``build_buckets`` builds.

    Attributes:
        param_indices: indices into the reducer's parameter list, in the order
            their gradients are laid out in the flat buffer.
        dtype: dtype of every parameter in the bucket.
        device: device of every parameter in the bucket.
        numel: total number of gradient elements in the bucket.
    """

    param_indices: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    numel: int


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
        *("index", "param", "name", "dtype", "distributed", "bucket", "view", "grad_obj", "expected"),
        *("optimizers", "hook", "fired", "absorbed", "moved", "held"),
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
        self.view: torch.Tensor  # this parameter's (local) gradient in the bucket, shaped and strided like it
        self.grad_obj: torch.Tensor  # what .grad is set to: the view, or a DTensor around it
        # torch's optimizer-in-backward: stepped by the reducer once the average is in .grad
        self.optimizers = in_backward_optimizers(param)
        self.hook: Any = None  # the reducer's post-accumulate-grad hook handle, while registered
        # - Learned across synchronised backwards: how many accumulations into
        #   .grad one backward brings ([Note: when is a parameter ready])
        self.expected = expected
        # - Per synchronised backward, written by its bucket only (Bucket.reset clears them)
        self.fired = 0  # accumulations into .grad seen
        # the view holds this rank's contribution as the reduction wants it
        # (scaled on the way in), so nothing is left to do before launch
        self.absorbed = False
        # the view holds a gradient moved in from a .grad of its own (no_sync, the end of backward):
        # DDP would have copied it in, multiplied, where it divides a .grad that is its view in place
        self.moved = False
        self.held: Optional[torch.Tensor] = None  # copy layout: .grad set aside while the bucket is in flight

    def plain(self, grad: torch.Tensor) -> torch.Tensor:
        """A gradient of this parameter as a plain tensor shaped like the view."""
        return local_grad(grad, self.param) if self.distributed else grad

    def changed(self, grad: torch.Tensor) -> RuntimeError:
        """The error for a gradient that no longer fits this slot (dtype, device, shape or layout)."""
        return changed_since_plan(self.name, self.param.shape, grad, self.bucket.buffer)


def _view_strides(shard: torch.Tensor) -> tuple[int, ...]:
    """``shard``'s strides where its elements fill their span in some order of its dimensions (row-major,
    channels_last: torch's ``is_non_overlapping_and_dense``, no public name), else row-major ones."""
    dims = sorted((st, n) for st, n in zip(shard.stride(), shard.shape, strict=True) if n != 1)
    dense = [st for st, _ in dims] == [math.prod(n for _, n in dims[:i]) for i in range(len(dims))]
    return shard.stride() if dense else torch.empty(shard.shape, device="meta").stride()


LateGrads = dict[int, torch.Tensor]  # slot index -> a gradient that arrived after its bucket left

BATCH_NUMEL = 4096  # a bucket whose parameters average fewer elements is batched ([Note: batched buckets])


class Bucket:
    """One flat gradient buffer, the slots laid out in it, and its part of each synchronised backward.

    The interface and what both layouts share; ``ViewBucket`` and
    ``CopyBucket`` say where ``.grad`` lives (core/setup.py's ``bucket_kind``).

    Args:
        index: position in the launch order.
        slots: the parameters, in buffer order; each gets its ``bucket`` and ``view``.
        dtype: dtype of every gradient in the bucket.
        device: device of every gradient in the bucket.
        room: elements after the gradients in the buffer, which travel with them: the step's flags,
            in the last bucket of a layout that is not DDP's ([Note: the flags carried] in flags.py).
    """

    divides_views = False  # a .grad that is its view is divided in place, as DDP with gradient_as_bucket_view=True
    batches = False  # where .grad lives allows a batched bucket ([Note: batched buckets])

    def __init__(
        self, index: int, slots: Sequence[ParamSlot], dtype: torch.dtype, device: torch.device, room: int = 0
    ) -> None:
        # - Layout
        self.index = index
        self.slots = list(slots)
        numel = sum(local(slot.param).numel() for slot in self.slots)
        self.buffer = torch.zeros(numel + room, dtype=dtype, device=device)  # what the bucket's collective sums
        self.grads = self.buffer[:numel] if room else self.buffer  # what comm hooks and the late round see
        self.offsets = list(itertools.accumulate((local(slot.param).numel() for slot in self.slots), initial=0))
        for slot, view in zip(self.slots, self.pieces(self.grads), strict=False):
            slot.bucket, slot.view, slot.grad_obj = self, view, grad_wrapper(view, slot.param)
        self.params = [slot.param for slot in self.slots]  # what a comm hook's bucket lists
        self.views = [slot.view for slot in self.slots]  # each parameter's gradient in the buffer
        self.description = some_names([slot.name for slot in self.slots], 3)  # its first parameters, for messages
        # hooks only count; the launch gathers every gradient at once ([Note: batched buckets])
        self.batched = self.batches and numel < BATCH_NUMEL * len(self.slots) and not any(s.distributed for s in slots)
        # - Bound to a reduction (bind): how the bucket travels, and the scale
        #   its gradients take on the way in (None: as they are)
        self.reduction: Reduction  # set by bind, before any step
        self.scale: Optional[torch.Tensor] = None
        # - Per synchronised backward (reset). pending: slots still to reach their
        #   learned count before a hook may launch the bucket ([Note: when is a
        #   parameter ready]). A slot not seen yet has learned 0, so it never
        #   counts down, and its bucket waits for the end of backward.
        self.pending = len(self.slots)
        self.launched = False  # its collective started in this backward
        self.from_hook = False  # ... from a gradient hook: .grad was detached, and may hold a late gradient
        self.work: Any = None  # what the reduction launched, until waited for

    @property
    def numel(self) -> int:
        """Number of gradient elements."""
        return self.grads.numel()

    def bind(self, reduction: Reduction, scale: Optional[torch.Tensor]) -> None:
        """Binds the bucket to ``reduction`` (bound to this layout), with the scale it wants on the way in
        (None: as they are; a tensor the reduction changes in place with its divisor)."""
        self.reduction = reduction
        self.scale = scale

    def reset(self) -> None:
        """Clears this bucket's and its slots' per-step state, at the end of a synchronised backward,
        after learning each slot's firing count (a running maximum: [Note: when is a parameter ready])."""
        self.pending = len(self.slots)
        self.launched = self.from_hook = False
        self.work = None
        for slot in self.slots:
            if slot.fired > slot.expected:
                slot.expected = slot.fired
            slot.fired = 0
            slot.absorbed = slot.moved = False
            slot.held = None

    # -- one synchronised backward ------------------------------------------

    def take(self, slot: ParamSlot) -> bool:
        """A gradient accumulated into ``slot``'s ``.grad`` in a synchronised backward.

        Counts the firing; unless the bucket left already (the gradient is
        then late: ``launched``), absorbs it. Returns whether the bucket is
        now ready to launch ([Note: when is a parameter ready]).

        Raises:
            RuntimeError: the gradient no longer fits the plan (naming the parameter).
        """
        fired = slot.fired = slot.fired + 1
        if self.launched:
            return False
        expected = slot.expected
        if fired < expected:
            return False  # more accumulations to come this backward: autograd sums them in .grad
        if not self.batched:
            self._absorb_checked(slot)
        if fired == expected:
            self.pending -= 1
            return self.pending == 0
        return False  # not learned yet (the first step), or more accumulations than learned

    def _absorb_checked(self, slot: ParamSlot) -> None:
        grad = slot.param.grad
        try:
            self._absorb(slot)
        except RuntimeError as error:
            raise self._misfit(error, [(slot, grad)]) from error

    def _misfit(self, error: RuntimeError, taken: Sequence[tuple[ParamSlot, Optional[torch.Tensor]]]) -> RuntimeError:
        # The error for the first gradient that no longer fits its slot (naming the parameter), else ``error``.
        for slot, grad in taken:
            if grad is not None and (
                grad.is_sparse or grad.device != self.buffer.device or local(grad).shape != slot.view.shape
            ):
                return slot.changed(grad)
        return error

    def keep_local(self, slot: ParamSlot) -> None:
        """After an accumulation with gradient sync off (``no_sync``)."""

    def fill(self) -> list[int]:
        """At the end of backward, before a launch from there: makes every slot hold this rank's
        contribution. Returns the indices of the slots this rank has no gradient for."""
        if self.batched:
            return self._gather()
        return [slot.index for slot in self.slots if not self._fill(slot)]

    def launch(self, from_hook: bool) -> None:
        """Starts the bucket's collective: from a gradient hook (every slot reached its expected
        count) or from the end of backward (after ``fill``); the bucket holds the work."""
        if from_hook:
            if self.batched:
                self._gather()
            else:
                self._detach()
        if self.scale is not None:
            self._scale_in_place()
        self.launched, self.from_hook = True, from_hook
        self.work = self.reduction.launch(self.index)

    def wait(self) -> None:
        """Waits for the bucket's collective; its ``grads`` then hold the average."""
        work, self.work = self.work, None
        self.reduction.wait(self.index, work)

    def restore(self, unused_everywhere: frozenset[int], any_late: bool) -> LateGrads:
        """After the reduction: points every ``.grad`` at its average; returns the late gradients.

        A bucket launched from a hook had its parameters' ``.grad`` detached,
        so they may hold late gradients (``any_late``: some rank has one). A
        parameter no rank used (``unused_everywhere``) keeps ``grad=None``.
        """
        late: LateGrads = {}
        for slot in self.slots:
            param = slot.param
            if self.from_hook:
                if param.grad is not None:
                    late[slot.index] = slot.plain(param.grad)
                param.grad = self._early_average(slot)
            elif slot.index in unused_everywhere:
                param.grad = None
            else:
                self._point_at_average(slot)
        return late

    def adopt_grads(self) -> None:
        """At set-up and after the buckets were rebuilt: takes over the ``.grad`` the parameters already have."""

    def retire(self) -> None:
        """Replaced by a rebuilt bucket: on an accelerator, keeps the buffer from the caching allocator
        until the current stream has run the copies queued on it so far (the new buckets' ``adopt_grads``).
        The buffer was allocated on the stream current at ``replicate()`` and goes back to that stream's
        pool when freed: under ``torch.cuda.stream(s)`` it could be handed out again, and written, before
        ``s`` read it (issue 59). ``Tensor.record_stream`` is torch's public way to say so."""
        if self.buffer.device.type != "cpu":
            self.buffer.record_stream(torch.accelerator.current_stream(self.buffer.device))

    def abandon(self) -> None:
        """Ends a backward that raised ([Note: a backward that raised] in reducer.py): waits for the
        collective it launched, if any, and sets every ``.grad`` to None."""
        if self.work is not None:
            with contextlib.suppress(Exception):  # the collective's own error (a comm hook's): the step's is raised
                self.wait()
        self.work = None
        for slot in self.slots:
            slot.param.grad = None

    # -- the rounds after the buckets (rounds.py, tied_rows.py) ------------------

    def late_sum(self, late_grads: LateGrads) -> torch.Tensor:
        """A tensor shaped like ``grads``: this rank's late gradients at their slots, zeros elsewhere."""
        flat = torch.zeros_like(self.grads)
        for slot, piece in zip(self.slots, self.pieces(flat), strict=True):
            if slot.index in late_grads:
                piece.copy_(late_grads[slot.index])
        return flat

    def add_to_grads(self, flat: torch.Tensor) -> None:
        """Adds ``flat`` (shaped like ``grads``) to every ``.grad`` that is set. A late gradient anywhere
        means the parameter was used there, so every rank holds a ``.grad`` for it; None means unused
        everywhere, and nothing late can have arrived for it."""
        for slot, piece in zip(self.slots, self.pieces(flat), strict=True):
            grad = slot.param.grad
            if grad is not None:
                local(grad).add_(piece)

    def accumulate(self, slot: ParamSlot, grad: torch.Tensor) -> None:
        """Accumulates ``grad`` into ``slot``'s ``.grad`` as autograd would, with gradient sync off
        (a tied parameter's detached use under ``no_sync``: tied_rows.py)."""
        param = slot.param
        if param.grad is None:
            param.grad = grad.detach()
        else:
            param.grad.add_(grad)
        self.keep_local(slot)

    def add_rows(self, slot: ParamSlot, picked: torch.Tensor, rows: torch.Tensor) -> None:
        """``grad[picked] += rows`` for ``slot``'s ``.grad`` (zeros first where it has none), in place:
        a view stays a view. The tied parameters' rows round (tied_rows.py)."""
        param = slot.param
        if param.grad is None:  # used only through the detached use, on every rank
            param.grad = torch.zeros_like(param)
        grad = param.grad
        num_rows = grad.shape[0] if grad.dim() else 1
        if grad.is_contiguous():
            grad.view(num_rows, -1).index_add_(0, picked, rows)
        else:
            grad.copy_(grad.reshape(num_rows, -1).index_add(0, picked, rows).view_as(grad))

    def pieces(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """``flat`` (shaped like ``grads``) cut as the slots' views cut the buffer: each shaped and, where dense
        (channels_last too), strided like its parameter, as DDP's bucket views (reducer.cpp)."""
        shards, at = [local(slot.param) for slot in self.slots], flat.storage_offset()
        return [flat.as_strided(s.shape, _view_strides(s), at + o) for s, o in zip(shards, self.offsets, strict=False)]

    def _scale_in_place(self) -> None:
        # At launch, the slots not scaled on the way in ([Note: the mean is taken on the way in] in
        # reduction.py), with DDP's arithmetic: a gradient DDP copies into its bucket view is multiplied
        # by the divisor's reciprocal; one that already is its view (gradient_as_bucket_view=True) is divided.
        scale, divide = self.scale, self.divides_views
        assert scale is not None, "launch scales only where the reduction wants it"
        if not divide and (self.batched or not any(slot.absorbed for slot in self.slots)):
            self.grads.mul_(scale)  # one pass over the bucket: the usual case
            return
        divisor = self.reduction.divisor
        for slot in self.slots:
            if slot.absorbed:
                continue
            if divide and not slot.moved:
                divisor.divide(slot.view)
            else:
                slot.view.mul_(scale)

    # -- where .grad lives: the two layouts -----------------------------------

    def _absorb(self, slot: ParamSlot) -> None:
        # After an accumulation, before the bucket left.
        raise NotImplementedError

    def _detach(self) -> None:
        # At a launch from a hook: frees .grad from the bucket in flight. A
        # further accumulation then lands in a fresh .grad, which the late
        # round reduces ([Note: when is a parameter ready]).
        raise NotImplementedError

    def _fill(self, slot: ParamSlot) -> bool:
        # At the end of backward; whether this rank has a gradient for the slot.
        raise NotImplementedError

    def _early_average(self, slot: ParamSlot) -> torch.Tensor:
        # What .grad becomes for a slot of a bucket launched from a hook.
        raise NotImplementedError

    def _point_at_average(self, slot: ParamSlot) -> None:
        # Points a used slot's .grad (of a bucket launched at the end) at its average.
        raise NotImplementedError

    def _gather(self) -> list[int]:
        # A batched bucket's one pass before its launch ([Note: batched buckets]): every fresh .grad
        # copied into its view in one call, unscaled, and detached (a later accumulation lands apart);
        # a view already holding its gradient stays; no gradient: zeros. Returns the slots with none.
        views: list[torch.Tensor] = []
        grads: list[torch.Tensor] = []
        taken: list[ParamSlot] = []
        unused: list[int] = []
        for slot in self.slots:
            param = slot.param
            grad = param.grad
            if grad is None:
                slot.view.zero_()
                unused.append(slot.index)
            elif grad is not slot.grad_obj:
                views.append(slot.view)
                grads.append(grad)
                taken.append(slot)
                slot.moved = True
                param.grad = None
        if grads:
            try:
                copy_into(views, grads)
            except RuntimeError as error:
                raise self._misfit(error, list(zip(taken, grads, strict=True))) from error
        return unused

    def _scaled_into(self, grad: torch.Tensor, slot: ParamSlot) -> None:
        # This rank's first gradient for the slot, into its view, as the reduction wants it.
        if self.scale is None:
            slot.view.copy_(grad)
        else:
            torch.mul(grad, self.scale, out=slot.view)
        slot.absorbed = True


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


class ViewBucket(Bucket):
    """``.grad`` is its slot's view whenever no backward is running (``gradient_as_bucket_view=True``)."""

    batches = True

    def adopt_grads(self) -> None:
        for slot in self.slots:
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
            slot.moved = True
            param.grad = slot.grad_obj

    def _absorb(self, slot: ParamSlot) -> None:
        # The hot path (once per parameter per step): no asserts, calls inlined.
        param = slot.param
        grad = param.grad
        if grad is slot.grad_obj:
            return  # accumulated in place: scaled at launch
        if slot.distributed:
            grad = slot.plain(grad)  # type: ignore[arg-type]  # the reducer's hook checked it is set
        if not slot.expected:  # nothing learned: the bucket leaves at the end, scaled there; summed as autograd sums
            slot.view.add_(grad) if slot.moved else slot.view.copy_(grad)  # type: ignore[arg-type]
            slot.moved = True
        elif not slot.absorbed:
            self._scaled_into(grad, slot)  # type: ignore[arg-type]
        elif self.scale is None:  # a further accumulation in this backward
            slot.view.add_(grad)  # type: ignore[arg-type]
        else:
            # the divisor as a Python float, as before the bucket owned the step: bitwise in bf16/fp16 too
            slot.view.add_(grad, alpha=1.0 / self.reduction.divisor.value)  # type: ignore[arg-type]
        param.grad = None

    def _detach(self) -> None:
        for slot in self.slots:
            slot.param.grad = None

    def _fill(self, slot: ParamSlot) -> bool:
        if slot.fired:
            return True  # _absorb() already put it in the slot
        grad = slot.param.grad
        if grad is None:
            slot.view.zero_()
            return False
        if grad is not slot.grad_obj:
            slot.view.copy_(slot.plain(grad))  # scaled with the bucket at launch
            slot.moved = True
        return True

    def restore(self, unused_everywhere: frozenset[int], any_late: bool) -> LateGrads:
        if unused_everywhere or any_late:
            return super().restore(unused_everywhere, any_late)
        for slot in self.slots:  # the ordinary case: every .grad is its slot's view
            slot.param.grad = slot.grad_obj
        return {}

    def _early_average(self, slot: ParamSlot) -> torch.Tensor:
        return slot.grad_obj

    def _point_at_average(self, slot: ParamSlot) -> None:
        slot.param.grad = slot.grad_obj


class CopyBucket(Bucket):
    """``.grad`` is a tensor of its own: copied in at launch, the average copied back."""

    def _absorb(self, slot: ParamSlot) -> None:
        pass  # .grad accumulates on its own until the launch copies it in

    def _detach(self) -> None:
        for slot in self.slots:
            grad = slot.param.grad
            assert grad is not None, "a bucket launches from a hook only once every slot has a gradient"
            self._scaled_into(slot.plain(grad), slot)  # the copy into the slot is the scaling pass
            slot.held = grad
            slot.param.grad = None

    def _fill(self, slot: ParamSlot) -> bool:
        grad = slot.param.grad
        slot.absorbed = True
        if grad is None:
            slot.view.zero_()
            return False
        self._scaled_into(slot.plain(grad), slot)
        return True

    def _early_average(self, slot: ParamSlot) -> torch.Tensor:
        held = slot.held
        assert held is not None, "set aside by _detach()"
        local(held).copy_(slot.view)
        return held

    def _point_at_average(self, slot: ParamSlot) -> None:
        param = slot.param
        if param.grad is None:
            param.grad = grad_wrapper(slot.view.clone(), param)
        else:
            local(param.grad).copy_(slot.view)


class DividingViewBucket(ViewBucket):
    """A ``ViewBucket`` with DDP's ``gradient_as_bucket_view=True`` arithmetic: a ``.grad`` that already
    is its view when the bucket leaves (``zero_grad(set_to_none=False)``) is divided in place."""

    divides_views = True


def make_slots(params: Sequence[nn.Parameter], names: Sequence[str], expected: dict[int, int]) -> list[ParamSlot]:
    """One slot per parameter, with the firing counts an earlier reducer learned (by ``id``).

    Raises:
        ValueError: a parameter carries a post-accumulate-grad hook of its own.
    """
    slots = [ParamSlot(i, p, n, expected.get(id(p), 0)) for i, (p, n) in enumerate(zip(params, names, strict=True))]
    for slot in slots:
        if num_post_accumulate_grad_hooks(slot.param):
            raise foreign_hook_error(slot.name)
    return slots


def bucket_kind(gradient_as_bucket_view: Optional[bool]) -> type[Bucket]:
    """The buckets ``replicate(gradient_as_bucket_view=...)`` asks for: where ``.grad`` lives, and
    DDP's arithmetic for the same argument (None, the default: views, with DDP's default arithmetic)."""
    if gradient_as_bucket_view is None:
        return ViewBucket
    return DividingViewBucket if gradient_as_bucket_view else CopyBucket


def build_buckets(
    kind: type[Bucket], slots: Sequence[ParamSlot], specs: Sequence[BucketSpec], room: int
) -> list[Bucket]:
    """The buckets of a layout: one ``kind`` per spec (``BucketSpec``, from layout/: which of ``slots``,
    in what dtype, where), in launch order.

    Args:
        kind: where ``.grad`` lives (``bucket_kind``).
        slots: the dense slots the specs index.
        specs: the layout.
        room: elements for the step's flags after the last bucket's gradients, given only where that
            bucket sums exactly in float32 or float64 ([Note: the flags carried] in flags.py).
    """
    room = room if specs and specs[-1].dtype in (torch.float32, torch.float64) else 0
    return [
        kind(index, [slots[i] for i in spec.param_indices], spec.dtype, spec.device, room if spec is specs[-1] else 0)
        for index, spec in enumerate(specs)
    ]
