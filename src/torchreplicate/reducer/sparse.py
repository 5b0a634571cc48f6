"""Parameters with sparse gradients (``nn.Embedding(sparse=True)``), reduced outside the buckets.

A sparse gradient cannot live in a flat dense bucket. Each such parameter
gets one sparse ``all_reduce`` (gloo's; NCCL has none, so it is refused at
``replicate()``: core/setup.py's ``refuse_sparse_on``) at the end
of every synchronised backward, after the buckets, in parameter order on
every rank; a rank without a gradient sends an empty sparse tensor. Whether
a rank has one travels in the flags with everything else, so a parameter no
rank used keeps ``grad=None``.
"""

from __future__ import annotations

from typing import Sequence

import torch

from torchreplicate.faults.place import Collective, Place
from torchreplicate.faults.wire import all_reduce
from torchreplicate.lifecycle import TrainingState
from torchreplicate.reducer.bucket import ParamSlot
from torchreplicate.reducer.rounds import RoundInputs


class SparseGrads:
    """The reducer's sparse parameters.

    Args:
        slots: their slots (not laid out in any bucket).
    """

    def __init__(self, slots: Sequence[ParamSlot]) -> None:
        self.slots = list(slots)

    def unused_here(self) -> list[int]:
        """Indices of the sparse parameters this rank has no gradient for."""
        return [slot.index for slot in self.slots if slot.param.grad is None]

    def abandon(self) -> None:
        """Ends a backward that raised ([Note: a backward that raised] in reducer.py): every ``.grad`` None."""
        for slot in self.slots:
            slot.param.grad = None

    def reduce(self, end: RoundInputs) -> None:
        """All-reduces every sparse gradient and writes back its average (or None): a round (rounds.py)."""
        end.probe.at(Place(TrainingState.FINALIZING, end.step, collective=Collective.SPARSE))
        for slot in self.slots:
            param, grad = slot.param, slot.param.grad
            if grad is None:
                grad = _empty_like(param)
            elif not grad.is_sparse:
                raise RuntimeError(
                    f"replicate(): parameter {slot.name!r} was planned for sparse gradients (nn.Embedding(sparse=True))"
                    " but got a dense one; set the module's sparse flag before replicate() and keep it"
                )
            end.probe.watch.wait(all_reduce(summed := grad.coalesce().clone(), end.group))
            param.grad = None if slot.index in end.sums.unused_everywhere else end.divisor.divide(summed).coalesce()

    def shadow(self, end: RoundInputs) -> None:
        """A joined rank's part (join.py): an empty gradient for every sparse parameter."""
        for slot in self.slots:
            end.probe.watch.wait(all_reduce(_empty_like(slot.param), end.group))


def _empty_like(param: torch.Tensor) -> torch.Tensor:
    # No rows: the layout of an embedding's gradient (rows sparse, columns dense).
    return torch.sparse_coo_tensor(
        torch.empty((1, 0), dtype=torch.long, device=param.device),
        torch.empty((0, *param.shape[1:]), dtype=param.dtype, device=param.device),
        param.shape,
        check_invariants=False,
    )
