"""Flat gradient buckets, the parameter slots laid out in them, and per-step state.

A ``Bucket`` is one flat buffer that travels in one collective; each
``ParamSlot`` is one reduced parameter and the view of the bucket that holds
its gradient. Both keep their facts grouped by lifetime: the layout (fixed
for the reducer's life), what was learned across steps, and per-step state
that ``reset_step`` restores. ``StepState`` holds the per-parameter facts of
one synchronised backward; the reducer replaces it at the end of each.
"""

from __future__ import annotations

import hashlib
from typing import Any, Sequence

import torch
from torch import nn

from torchreplicate.reducer.dtensors import grad_wrapper, is_dtensor, local, local_grad

NEVER = 1 << 60  # firings a bucket waits for when it cannot become ready from hooks


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
        self.optimizers: tuple[torch.optim.Optimizer, ...] = tuple(getattr(param, "_in_backward_optimizers", ()))
        self.hook: Any = None  # the reducer's post-accumulate-grad hook handle, while registered
        # - Learned across synchronised backwards: how many accumulations into
        #   .grad one backward brings ([Note: when is a parameter ready] in reducer.py)
        self.expected = expected

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
        # - Learned: firings to wait for before launching from a hook, derived
        #   from the slots' expected counts; cached because the hook reads it
        self.num_to_wait = self._count_waits()
        # - Per step (reset_step)
        self.pending = self.num_to_wait  # firings still awaited in this backward
        self.num_absorbed = 0  # slots holding their contribution as the reduction wants it
        self.in_flight: Any = None  # what the reduction launched, until it is waited for

    @property
    def numel(self) -> int:
        """Number of gradient elements (the flags' room excluded)."""
        return self.grads.numel()

    def relearn(self) -> None:
        """Recomputes ``num_to_wait`` after the slots' expected counts changed."""
        self.num_to_wait = self._count_waits()

    def reset_step(self) -> None:
        """Forgets the per-step state at the end of a synchronised backward."""
        self.pending = self.num_to_wait
        self.num_absorbed = 0
        self.in_flight = None

    def views_of(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """``flat`` (shaped like ``grads``) cut into one view per slot, each shaped like its gradient."""
        views, offset = [], 0
        for slot in self.slots:
            numel = slot.view.numel()
            views.append(flat[offset : offset + numel].view_as(slot.view))
            offset += numel
        return views

    def describe(self) -> str:
        """The bucket's first parameter names, for error messages."""
        names = [slot.name for slot in self.slots]
        shown = ", ".join(repr(n) for n in names[:3])
        return shown + (f" and {len(names) - 3} more" if len(names) > 3 else "")

    def _count_waits(self) -> int:
        if any(slot.expected == 0 for slot in self.slots):
            return NEVER  # a parameter not seen yet: only the end of backward launches it
        return len(self.slots)


def layout_digest(buckets: Sequence[Bucket], unbucketed: Sequence[ParamSlot]) -> int:
    """A digest of a bucket layout (names, shapes, dtypes in order): equal on ranks whose layouts match.

    Args:
        buckets: the buckets, in launch order.
        unbucketed: the slots reduced outside the buckets (sparse gradients).
    """
    layout = [[(s.name, tuple(s.param.shape), str(s.dtype)) for s in b.slots] for b in buckets]
    layout.append([(s.name, tuple(s.param.shape), str(s.dtype)) for s in unbucketed])
    return int.from_bytes(hashlib.sha256(repr(layout).encode()).digest()[:8], "little")


class StepState:
    """Per-parameter facts of one synchronised backward; replaced at its end.

    Args:
        num_params: number of reduced parameters.
    """

    __slots__ = ("fired", "grew", "first_ready", "absorbed", "held", "num_launched", "late", "finalize_queued")

    def __init__(self, num_params: int) -> None:
        self.fired = [0] * num_params  # accumulations into .grad seen, per parameter
        self.grew = False  # some parameter fired more often than learned so far
        self.first_ready: list[int] = []  # slot indices in the order they first fired (the first step: tuning.py)
        # per parameter: its slot holds its contribution as the reduction wants
        # it (scaled on the way in), so nothing is left to do before launch
        self.absorbed = [False] * num_params
        self.held: dict[int, torch.Tensor] = {}  # copy layout: .grad set aside while its bucket is in flight
        self.num_launched = 0  # buckets launched so far; always a prefix of the launch order
        self.late = False  # a gradient arrived after its bucket was launched
        self.finalize_queued = False  # the end-of-backward work is queued

    def is_launched(self, bucket: Bucket) -> bool:
        """Whether ``bucket`` was launched in this backward (buckets launch in index order)."""
        return bucket.index < self.num_launched
