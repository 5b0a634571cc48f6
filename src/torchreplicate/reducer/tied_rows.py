"""Tied parameters: the use whose gradient comes last is reduced on its own, by rows.

[Note: tied parameters]
A parameter held by two modules (a GPT's token embedding, tied to its output
projection) accumulates one ``.grad`` per backward, complete only after its
last use's gradient: the embedding lookup's, at the very end of backward. Its
bucket, often the largest (8 MiB for a 8192 x 256 table), would leave only
after backward, and the link would idle until then (measured: 59 ms of launch
delay on a 6-layer GPT at 1 Gbit, benchmarks/results/network.md).

So the forward hands the first module that uses it (the one whose gradient
comes last) a detached copy of the parameter (core/tied.py). The parameter's
own ``.grad`` then holds the other uses' part, ready early: its bucket leaves
during backward like any other. The detached use's gradient is kept here and
reduced at the end of backward in one more agreed round: a mask of the rows
any rank's gradient touched (one all-reduce of one int per row), then only
those rows, added to the reduced ``.grad``. A lookup touches the rows of the
batch's tokens, so the round sends little; a dense detached use sends all
rows, which is what the bucket would have sent.

An opt-in, since it changes which bytes are summed together (DDP reduces a
tied parameter whole, in its bucket, as the default does): with a tuned
layout (``bucket_layout="tuned"``: [Note: tuning] in layout/policy.py), at the end
of the first step the schedule prices the step with and without the split
([Note: buckets from the schedule], ``schedule.split_pays``); where the link
is not the step (loopback: measured 7% slower against DDP with
``gradient_as_bucket_view``, from the rows round's CPU work) or the rows
would be bytes sent twice on a saturated link (100 Mbit), the parameter goes
back to one ``.grad``, whole, in the last bucket. ``replicate(tied_split=True)``
asks for the split with any layout, unpriced: a fact of the model, the same
on every run (reproducible, not DDP's bits); ``tied_split=False`` never
splits, also when tuned. The round makes one host read per step (the summed
mask's ``nonzero``: how many rows travel depends on the batch), after every
bucket has left; DDP, which reduces a tied parameter whole, makes none.

Exact: averaging is linear, so the mean of the two parts is the mean of their
sum. Only the rounding differs from one all-reduce of the sum (the parts are
added after the collective, not before), the same on every rank, so the
replicas stay bitwise equal. Every rank runs the round at every synchronised
backward, zeros where it holds nothing, so the collective sequence stays one
([Note: one collective sequence] in reducer.py); a rank that joined runs it
too (``shadow``).
"""

from __future__ import annotations

import time
from typing import Sequence

import torch
import torch.distributed as dist

from torchreplicate.faults.place import Collective, Place
from torchreplicate.faults.wire import Watch, all_reduce
from torchreplicate.lifecycle import SyncSwitch, TrainingState
from torchreplicate.reducer.bucket import ParamSlot
from torchreplicate.reducer.rounds import RoundInputs


class TiedRows:
    """The reducer's tied parameters and the gradients of their detached uses.

    Args:
        slots: the slots of the tied parameters ([Note: tied parameters]).
        sync: the module's gradient-sync switch (``no_sync`` keeps a detached use's gradient local).
        priced: the split stays only where the tuned layout's first step finds it pays
            (``tied_split=None`` under ``bucket_layout="tuned"``); False: ``tied_split=True``, kept.
    """

    def __init__(self, slots: Sequence[ParamSlot], sync: SyncSwitch, *, priced: bool = True) -> None:
        self.slots = list(slots)
        self.sync = sync
        self.priced = priced  # a tuned layout keeps the split only where it pays; False: asked for, kept
        self.by_index = {slot.index: slot for slot in self.slots}
        self.kept: dict[int, torch.Tensor] = {}  # slot index -> this rank's detached uses' gradient, summed
        self.rows_bytes = 0  # what the last round sent in rows (the same on every rank)
        self.round_ns = 0  # how long the last round took here

    def keep(self, index: int, grad: torch.Tensor) -> None:
        """Adds a detached use's gradient of slot ``index`` to what the next round reduces."""
        self.kept[index] = grad.detach() if (kept := self.kept.get(index)) is None else kept + grad.detach()

    @torch.no_grad()
    def arrive(self, index: int, grad: torch.Tensor) -> None:
        """A detached use's gradient of slot ``index``: kept for the rows round, or, with gradient
        sync off (``no_sync``), accumulated into ``.grad`` as the use itself would have been."""
        if self.sync.on:
            self.keep(index, grad)
            return
        slot = self.by_index[index]
        slot.bucket.accumulate(slot, grad)  # where .grad lives is its bucket's

    def mask_bytes(self) -> int:
        """Bytes of the rows mask each round all-reduces."""
        return 4 * sum(_num_rows(slot.param) for slot in self.slots)

    @torch.no_grad()
    def reduce(self, end: RoundInputs) -> None:
        """Adds the mean of every rank's detached uses' gradients to the reduced ``.grad``, by rows.

        A round (rounds.py): on every rank at the end of a synchronised
        backward, after the buckets. Rows no rank touched are not sent.
        """
        end.probe.at(Place(TrainingState.FINALIZING, end.step, collective=Collective.TIED_ROWS))
        with end.probe.span("tied_rows"):
            started = time.perf_counter_ns()
            group, watch, divisor = end.group, end.probe.watch, end.divisor
            kept, self.kept = self.kept, {}
            for slot, picked in zip(self.slots, self._agree_rows(group, watch, kept), strict=True):
                if picked.numel() == 0:
                    continue
                param, grad = slot.param, kept.get(slot.index)
                if grad is None:
                    mean = param.new_zeros((picked.numel(), *_row_shape(param)))
                else:
                    mean = grad.reshape(_num_rows(param), -1).index_select(0, picked).mul_(divisor.scale(grad.dtype))
                # scaled on the way in, as the buckets ([Note: the mean is taken on the way in] in reduction.py)
                watch.wait(all_reduce(mean, group))
                slot.bucket.add_rows(slot, picked, mean)
            self.round_ns = time.perf_counter_ns() - started

    @torch.no_grad()
    def shadow(self, end: RoundInputs) -> None:
        """A joined rank's part (join.py): the same collectives, zeros."""
        for slot, picked in zip(self.slots, self._agree_rows(end.group, end.probe.watch, {}), strict=True):
            if picked.numel():
                zeros = slot.param.new_zeros((picked.numel(), *_row_shape(slot.param)))
                end.probe.watch.wait(all_reduce(zeros, end.group))

    def _agree_rows(self, group: dist.ProcessGroup, watch: Watch, kept: dict[int, torch.Tensor]) -> list[torch.Tensor]:
        # Per slot, the rows some rank's kept gradient touched (ascending), the same on every rank.
        sizes = [_num_rows(slot.param) for slot in self.slots]
        mask = torch.zeros(sum(sizes), dtype=torch.int32, device=self.slots[0].param.device)
        for slot, piece in zip(self.slots, mask.split(sizes), strict=True):
            if (grad := kept.get(slot.index)) is not None:
                piece.copy_((grad.reshape(piece.numel(), -1) != 0).any(dim=1))
        watch.wait_on_host(mask, all_reduce(mask, group))  # waited and polled, not read
        rows = [piece.nonzero().squeeze(1) for piece in mask.split(sizes)]  # the one read: which rows travel
        self.rows_bytes = sum(
            picked.numel() * _row_shape(slot.param)[0] * slot.param.element_size()
            for slot, picked in zip(self.slots, rows, strict=True)
        )
        return rows


def _num_rows(param: torch.Tensor) -> int:
    return param.shape[0] if param.dim() else 1


def _row_shape(param: torch.Tensor) -> tuple[int, ...]:
    return (param[0].numel(),) if param.dim() else (1,)
