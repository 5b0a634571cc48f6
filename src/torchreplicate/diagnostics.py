"""Error messages for cross-rank problems: pure functions, tested alone."""

from __future__ import annotations

from typing import Sequence

ParamDescription = Sequence[tuple[str, tuple[int, ...], str]]


def format_param_mismatch(per_rank: Sequence[ParamDescription], this_rank: int) -> str:
    """Explains how the ranks' parameters differ, naming the first difference.

    Args:
        per_rank: each rank's list of (fully qualified name, shape, dtype).
        this_rank: the rank raising, named in the message.
    """
    counts = [len(d) for d in per_rank]
    head = (
        f"replicate(): rank {this_rank}: the ranks hold different parameters, so their gradients cannot be averaged. "
    )
    fix = " Build the same model on every rank before calling replicate()."
    width = min(counts)
    for position in range(width):
        entries = [d[position] for d in per_rank]
        if len(set(entries)) == 1:
            continue
        names = {name for name, _, _ in entries}
        if len(names) > 1:
            listing = ", ".join(f"rank {r}: {e[0]!r}" for r, e in enumerate(entries))
            return f"{head}Parameter #{position} has different names: {listing}.{fix}"
        name = entries[0][0]
        listing = ", ".join(f"rank {r}: shape {list(shape)} {dtype}" for r, (_, shape, dtype) in enumerate(entries))
        return f"{head}Parameter {name!r} differs: {listing}.{fix}"
    listing = ", ".join(f"rank {r}: {c}" for r, c in enumerate(counts))
    extra = []
    for r, d in enumerate(per_rank):
        if len(d) > width:
            extra.append(f"rank {r} also has {d[width][0]!r}")
    return f"{head}Different numbers of parameters ({listing}); {'; '.join(extra)}.{fix}"
