"""The flags: what each rank knows alone, summed across ranks with the last bucket.

See [Note: one collective sequence] in reducer.py. The flags are a few
elements that travel in the same all-reduce as the last bucket (or, with a
comm hook, in one all-reduce of their own); every rank reads the same sums,
so every rank takes the same decision.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch


class FlagSums(NamedTuple):
    """What the summed flags say, the same on every rank.

    Attributes:
        unused_everywhere: indices of parameters no rank holds a gradient for.
        any_late: some rank had a gradient arrive after its bucket was launched.
    """

    unused_everywhere: frozenset[int]
    any_late: bool


def num_flags(num_params: int) -> int:
    """How many elements the flags of ``num_params`` parameters take."""
    return num_params + 1


class StepFlags:
    """Writes this rank's flags into ``tail`` and reads the sums back.

    Layout: element ``i < num_params`` is 1 where this rank holds a gradient
    for parameter ``i``; element ``num_params`` is 1 where a gradient arrived
    after its bucket was launched (a late round follows).

    Args:
        tail: where the flags travel (``num_flags(num_params)`` elements).
        num_params: number of reduced parameters.
    """

    def __init__(self, tail: torch.Tensor, num_params: int) -> None:
        assert tail.numel() == num_flags(num_params), (tail.numel(), num_params)
        self.tail = tail  # a view into the last bucket's wire, or the hook path's own tensor
        self.num_params = num_params
        # An ordinary step: a gradient for every parameter, nothing late.
        self.ordinary = torch.ones_like(tail)
        self.ordinary[num_params] = 0

    def write(self, unused_here: Sequence[int], late: bool) -> None:
        """Fills the tail with this rank's flags."""
        tail = self.tail
        tail.copy_(self.ordinary)
        if unused_here:
            tail[torch.tensor(unused_here, device=tail.device)] = 0
        if late:
            tail[self.num_params] = 1

    def read(self, unused_here: Sequence[int]) -> FlagSums:
        """Reads the summed flags (after the all-reduce)."""
        tail = self.tail
        any_late = bool(tail[self.num_params].item() > 0)
        if not unused_here:
            return FlagSums(frozenset(), any_late)  # used here, so used somewhere
        counts = tail[torch.tensor(unused_here, device=tail.device)].tolist()
        return FlagSums(frozenset(i for i, c in zip(unused_here, counts, strict=True) if c == 0), any_late)
