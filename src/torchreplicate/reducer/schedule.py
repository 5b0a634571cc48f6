"""The schedule's buckets and the tied split's price: tuning.py's first-step learning, continued.

[Note: buckets from the schedule] (bucket_plan.py) chooses bucket
boundaries from the first backward's readiness and the measured link;
``split_pays`` prices the tied parameters' split ([Note: tied parameters] in
tied_rows.py) with it. Pure functions of a ``LayoutPolicy`` (tuning.py),
whose numbers every rank agreed on, so every rank decides alike.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Sequence

from torchreplicate.reducer.bucket_plan import MAX_CAP, MIN_CAP, BucketSpec, best_schedule
from torchreplicate.reducer.dtensors import local

if TYPE_CHECKING:
    from torchreplicate.reducer.tied_rows import TiedRows
    from torchreplicate.reducer.tuning import LayoutPolicy

# The schedule plans for a backward this much slower than the first one measured: a
# bucket that waits for a late gradient idles the link for its whole wait, while one
# bucket more costs one latency, so the plan errs towards more buckets.
SCHEDULE_SLACK = 2.0


def scheduled_layout(policy: LayoutPolicy) -> Optional[list[BucketSpec]]:
    """The buckets of ``policy.lengths`` along its order, or None when the schedule did not choose them."""
    if policy.lengths is None or policy.order is None:
        return None
    params = [local(slot.param) for slot in policy.dense]
    specs, start = [], 0
    for length in policy.lengths:
        indices = tuple(policy.order[start : start + length])
        start += length
        first = params[indices[0]]
        specs.append(BucketSpec(indices, first.dtype, first.device, sum(params[i].numel() for i in indices)))
    return specs


def schedule(policy: LayoutPolicy) -> Optional[list[int]]:
    """Bucket lengths from the first backward's schedule and the fitted link; None where it does not apply.

    It applies when the cap is tuned, the link measured, the readiness known,
    every dense gradient shares one dtype, device and group (a bucket holds
    one of each; the cap's plan handles mixtures), and the link is the step:
    the gradients take longer on the link than the first backward took.
    Where backward is longer, the link keeps up with the cap's buckets, and
    more or fewer buckets only move a collective's CPU work, which the
    fitted latency does not show (measured on loopback: more buckets cost
    7-14% against DDP), so the cap's plan stays.
    """
    best = _best(policy, policy.order, policy.ready_s, link_bound_only=True)
    return None if best is None else best[0]


def _best(
    policy: LayoutPolicy,
    order: Optional[Sequence[int]],
    ready_s: Optional[Sequence[float]],
    link_bound_only: bool = False,
) -> Optional[tuple[list[int], float]]:
    # The schedule's lengths and finish for this order and readiness, or None where it does not apply.
    if policy.link is None or ready_s is None or order is None or not any(ready_s):
        return None
    params = [local(slot.param) for slot in policy.dense]
    if len({(p.dtype, p.device) for p in params}) != 1 or len(set(policy.groups or [0])) != 1:
        return None
    nbytes = [params[i].numel() * params[i].element_size() for i in order]
    if link_bound_only and sum(nbytes) / policy.link.bytes_per_s <= policy.end_s:
        return None
    return best_schedule(
        nbytes,
        [t * SCHEDULE_SLACK for t in ready_s],
        policy.end_s * SCHEDULE_SLACK,
        policy.link.latency_s,
        policy.link.bytes_per_s,
        MAX_CAP,
        MIN_CAP,
    )


def split_pays(policy: LayoutPolicy, tied: Sequence[int], rows_bytes: int) -> bool:
    """Whether reducing tied parameters' detached uses apart ends the step sooner; pure in agreed numbers.

    [Note: tied parameters] in tied_rows.py. With the split (how the first
    step ran), the tied parameters are ready early and the rows round adds
    two collectives and ``rows_bytes`` after the buckets; without it they
    are ready at the end of backward, whole. The schedule ([Note: buckets
    from the schedule]) prices both on the measured link: on a link slower
    than backward the early bucket only queues, and the rows are bytes sent
    twice. True where the schedule does not apply (nothing to price it with).

    Args:
        policy: the layout policy, learned (order, readiness, link).
        tied: positions in ``policy.dense`` of the tied parameters.
        rows_bytes: bytes the first step's rows round sent (every rank's the same).
    """
    with_split = _best(policy, policy.order, policy.ready_s)
    if with_split is None or policy.order is None or policy.ready_s is None or policy.link is None:
        return True
    whole = _best(policy, *_tied_last(policy, tied))
    assert whole is not None, "the same policy, another order"
    # the round as the link model prices it, or as long as it took in the first step (its CPU
    # work too: the mask over the table, the rows picked and added), whichever is longer
    rows_s = max(2 * policy.link.latency_s + rows_bytes / policy.link.bytes_per_s, policy.rows_s)
    return with_split[1] + rows_s < whole[1]


def keep_whole(policy: LayoutPolicy, tied: Sequence[int]) -> None:
    """Moves the tied parameters to the end of the launch order, ready at the end of backward, and re-plans."""
    policy.order, policy.ready_s = _tied_last(policy, tied)
    policy.lengths = schedule(policy)


def _tied_last(policy: LayoutPolicy, tied: Sequence[int]) -> tuple[list[int], list[float]]:
    # The launch order and readiness without the split: the tied parameters last, ready at the end.
    assert policy.order is not None and policy.ready_s is not None
    late = set(tied)
    kept = [(i, t) for i, t in zip(policy.order, policy.ready_s, strict=True) if i not in late]
    order = [i for i, _ in kept] + [i for i in policy.order if i in late]
    return order, [t for _, t in kept] + [policy.end_s] * (len(order) - len(kept))


def settle_tied(policy: LayoutPolicy, tied_rows: TiedRows) -> bool:
    """After the first step: keeps the tied split only where it pays; whether the layout changed.

    With a tuned layout, the split stays only where the link is the step (the
    schedule applies) and ``split_pays``; otherwise nothing was measured and
    it stays.
    """
    if not tied_rows.slots or not policy.tune_cap or not tied_rows.priced:
        return False
    position = {id(slot): i for i, slot in enumerate(policy.dense)}
    tied = [position[id(slot)] for slot in tied_rows.slots]
    if policy.lengths is not None and split_pays(policy, tied, tied_rows.rows_bytes):
        return False
    keep_whole(policy, tied)
    return True
