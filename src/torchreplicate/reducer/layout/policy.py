"""Launch order and bucket sizes, learned by the reducer in its first synchronised step.

[Note: tuning]
Where the network is slower than compute, a step cannot be shorter than its
communication plus the part of compute that cannot overlap it; what decides
how close it gets is how early the first collective starts and how busy the
link stays. Two things, learned once, at the end of the first synchronised
backward, by every rank at the same point:

- Launch order (always, unless the layout is fixed): the order in which
  parameters' gradients became ready in that backward (on group rank 0,
  broadcast: one collective), so buckets fill in the order backward really
  produces them; registration order can differ (tied weights, modules
  registered out of execution order). The order is a fact of the graph, not
  of timing: the same job gets the same order, and so the same buckets, on
  every run. At the default ``bucket_layout="learned"`` this is DDP's own
  rebuild, with DDP's caps ([Note: DDP's buckets] in layout/plan.py); with
  ``static_graph=True`` it is learned from the second step, as DDP's; with
  ``find_unused_parameters=True`` DDP never rebuilds, nor does this.
- Bucket size, only with ``bucket_layout="tuned"`` (opt-in, as
  ``torch.backends.cudnn.benchmark``): a few all-reduces of known sizes are
  timed (the median of a few each; the slowest rank's times count: one
  all-reduce of the timings), a line ``time = latency + bytes / bandwidth``
  is fitted, and the cap is the smallest bucket whose fixed latency costs at
  most ``OVERHEAD`` of its transfer time. Slow links get small buckets (the
  link starts early and stays busy), fast ones large buckets (few
  collectives). Where every dense gradient shares one dtype, device and
  group, the buckets then come from the schedule instead ([Note: buckets
  from the schedule] in layout/plan.py): when each gradient was ready in
  that first backward (group rank 0's, broadcast with the order) against the
  fitted link. Every ``RETUNE_EVERY`` synchronised steps the link is
  measured again (every rank counts the same steps), and the buckets are
  rebuilt if the cap it gives moved by more than ``RETUNE_FACTOR``: a regime
  change (another network, a busier machine).

Why tuning is opt-in: the ring all-reduce (gloo's, NCCL's) sums each element
in an order set by its offset in the bucket, so a cap or a bucket end taken
from a timing changes the last bits of the averaged gradients from one run
of the same seeded job to the next. By default the cap is DDP's 25 MiB
(``bucket_cap_mb`` pins another), nothing is timed, and the same seed gives
the same bits, as under DDP; under ``torch.use_deterministic_algorithms``
tuning is refused (config.py).

The measurement must not cost more than the job. It is skipped where no cap
in ``[MIN_CAP, MAX_CAP]`` can change the layout (``cap_changes_layout``: a
model whose gradients fit one bucket at every cap, the usual small model),
and otherwise it sends at most the model's own gradient bytes, one step's
worth of traffic (``calibration_sizes``: the sizes scaled down, timings
included). A cap larger than the model changes nothing, so sizes up to the
model's are also the ones whose cost decides the choice.

Both go through ``plan_buckets`` to a new bucket layout; slots, learned
counts and ``.grad`` values carry over. Every rank takes the same decision
from the same numbers, so the collective sequence stays one.

The schedule's own code (its layout, pricing the tied split) is layout/policy.py.

[Note: fixed layout]
What the first step learns is agreed among the ranks that took it. A
replica that joins a running job later (torchft: a new replica group heals
from a live peer and starts reducing with it at once) would still be on the
unlearned layout while its peers are on the learned one: buckets of other
sizes in the same all-reduce. ``replicate(bucket_layout="fixed")`` keeps the
layout a pure function of the parameters and the options: reverse
registration order, the caps given (DDP's 25 MiB and a 1 MiB first bucket by
default), no link measurement, no rebuild, ever; the same on every replica
whenever it starts, and in every step: a run resumed from a checkpoint ends
with the bits of an uninterrupted one, which DDP's layout (one bucket in the
first step, then the rebuilt ones) does not give at 3+ ranks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Sequence

import torch
import torch.distributed as dist

from torchreplicate.config import DDP_DEFAULT_CAP_MB, MiB
from torchreplicate.faults.wire import Watch, broadcast
from torchreplicate.reducer.bucket import ParamSlot
from torchreplicate.reducer.dtensors import local
from torchreplicate.reducer.layout.link import LinkModel, choose_cap, measure_link
from torchreplicate.reducer.layout.plan import (
    MAX_CAP,
    MIN_CAP,
    BucketSpec,
    best_schedule,
    ddp_buckets,
    ddp_limits,
    plan_buckets,
)

if TYPE_CHECKING:
    from torchreplicate.reducer.tied_rows import TiedRows

RETUNE_EVERY = 1000  # synchronised steps between two measurements of the link
RETUNE_FACTOR = 2.0  # the cap changes only if the new one differs by more than this


def readiness_order(first_ready: Sequence[int], num_params: int, *, rest_ascending: bool = False) -> list[int]:
    """The launch order: parameters as they became ready, then the rest in reverse registration order
    (``rest_ascending``: in registration order, as DDP appends a static graph's unused parameters)."""
    seen = set(first_ready)
    rest = range(num_params) if rest_ascending else range(num_params - 1, -1, -1)
    return list(first_ready) + [i for i in rest if i not in seen]


@torch.no_grad()
def agree_order(
    order: Sequence[int],
    group: dist.ProcessGroup,
    device: torch.device,
    ready_us: Sequence[int],
    times_us: Sequence[int],
    watch: Watch,
) -> tuple[list[int], list[int], list[int]]:
    """Group rank 0's order, readiness and other times (microseconds), on every rank (one broadcast,
    waited and read through ``watch``)."""
    tensor = torch.tensor([*order, *ready_us, *times_us], dtype=torch.int64, device=device)
    values = [int(i) for i in watch.read_on_host(tensor, broadcast(tensor, group))]
    count = len(order)
    return values[:count], values[count : 2 * count], values[2 * count :]


class LayoutPolicy:
    """How a reducer lays out its buckets, and what its first step still has to learn.

    Args:
        dense: the slots laid out in buckets (sparse ones are not), in registration order.
        groups: per slot index (all slots), its nested-replicate group (layout/plan.py), or None.
        cap_bytes: the bucket cap; None: DDP's (``config.DDP_DEFAULT_CAP_MB``) until the first step measured the link.
        first_cap_bytes: the first bucket's cap.
        layout: ``replicate(bucket_layout=...)``: ``"learned"`` lays out DDP's buckets
            ([Note: DDP's buckets] in layout/plan.py), ``"fixed"`` keeps reverse registration
            order and the caps given and learns nothing ([Note: fixed layout]), ``"tuned"``
            learns the order, the cap and the schedule ([Note: tuning]).
        find_unused: ``find_unused_parameters=True`` with the learned layout: DDP's layout for
            it, filled in registration order and never rebuilt.
        static_graph: ``static_graph=True`` with the learned layout: DDP rebuilds from the
            second iteration's order, not the first's.
    """

    def __init__(
        self,
        dense: Sequence[ParamSlot],
        groups: Optional[Sequence[int]],
        cap_bytes: Optional[int],
        first_cap_bytes: int,
        *,
        layout: str = "learned",
        find_unused: bool = False,
        static_graph: bool = False,
    ) -> None:
        # - Configuration
        self.dense = list(dense)
        self.groups = None if groups is None else [groups[slot.index] for slot in self.dense]  # per dense slot
        assert layout == "tuned" or cap_bytes is not None, "config.py gives every layout but the tuned one a cap"
        self.tune_cap = cap_bytes is None  # measure the link in the first step and choose the cap
        self.ddp = layout == "learned"  # DDP's buckets ([Note: DDP's buckets])
        self.find_unused = self.ddp and find_unused and not static_graph  # DDP's layout for it, never rebuilt
        # synchronised steps to pass before the one whose readiness order the layout is learned
        # from: DDP with static_graph=True learns from its second iteration ([Note: DDP's buckets])
        self.steps_before_learning = 1 if self.ddp and static_graph else 0
        # - Learned in the first synchronised step ([Note: tuning]); a fixed layout, or DDP's
        #   for find_unused_parameters, starts out learned, so it never learns or rebuilds
        self.learned = layout == "fixed" or self.find_unused
        self.cap_bytes = DDP_DEFAULT_CAP_MB * MiB if cap_bytes is None else cap_bytes
        self.first_cap_bytes = first_cap_bytes
        self.order: Optional[list[int]] = None  # positions in `dense`, launch order; None: reverse registration
        self.cap_changes_layout = True  # False once learned that no cap in [MIN_CAP, MAX_CAP] does: never measured
        self.link: Optional[LinkModel] = None  # the fitted link, when measured
        # when each dense slot was ready in the first backward, in launch order, and when it
        # ended (seconds from the first; group rank 0's), for the schedule's buckets
        self.ready_s: Optional[list[float]] = None
        self.end_s = 0.0
        self.rows_s = 0.0  # how long the first step's rows round of tied parameters took (tied_rows.py)
        self.lengths: Optional[list[int]] = None  # bucket lengths along `order` from the schedule, or None

    def plan(self) -> list[BucketSpec]:
        """The buckets of this policy as it stands (before or after it learned), bar the schedule's."""
        if not self.ddp:
            return plan_layout(self, self.cap_bytes, self.first_cap_bytes)
        limits = ddp_limits(
            self.cap_bytes, self.first_cap_bytes, rebuilt=self.order is not None, find_unused=self.find_unused
        )
        return ddp_buckets(*self.sizes(), limits, order=self.order, groups=self.groups)

    def sizes(self) -> tuple[list[int], list[torch.dtype], list[torch.device]]:
        """Each dense slot's gradient elements, dtype and device (its local shard's): what the plans lay out."""
        params = [local(slot.param) for slot in self.dense]
        return [p.numel() for p in params], [p.dtype for p in params], [p.device for p in params]

    @property
    def grad_bytes(self) -> int:
        """The dense gradients' bytes: one step's traffic, the most one measurement of the link sends."""
        return sum(p.numel() * p.element_size() for p in (local(slot.param) for slot in self.dense))


def layout_specs(policy: LayoutPolicy) -> list[BucketSpec]:
    """The buckets ``policy`` lays out now, as specs (bucket.py's ``build_buckets`` makes them); none where
    no slot is dense (only sparse gradients)."""
    return (scheduled_layout(policy) or policy.plan()) if policy.dense else []


def plan_layout(policy: LayoutPolicy, cap_bytes: int, first_cap_bytes: int) -> list[BucketSpec]:
    """The buckets ``policy``'s dense slots get in its order, at these caps (``plan_buckets``)."""
    return plan_buckets(
        *policy.sizes(), order=policy.order, cap_bytes=cap_bytes, first_cap_bytes=first_cap_bytes, groups=policy.groups
    )


def cap_changes_layout(policy: LayoutPolicy) -> bool:
    """Whether any cap ``choose_cap`` can give lays ``policy``'s slots out otherwise than another.

    The layouts at ``MIN_CAP`` and at ``MAX_CAP`` are compared: where they
    agree, every cap between gives the same one (checked on random plans in
    test_buckets.py). Pure in the policy: every rank decides alike, without
    a collective.
    """

    def layout(cap: int) -> list[tuple[int, ...]]:
        return [spec.param_indices for spec in plan_layout(policy, cap, min(policy.first_cap_bytes, cap))]

    return layout(MIN_CAP) != layout(MAX_CAP)


def learn_layout(
    policy: LayoutPolicy,
    first_ready: Sequence[int],
    group: dist.ProcessGroup,
    like: torch.Tensor,
    watch: Watch,
    ready_ns: Sequence[int] = (),
    end_ns: int = 0,
    rows_ns: int = 0,
) -> bool:
    """Fills ``policy`` with the agreed launch order and, when tuned, the cap and schedule; whether to rebuild.

    Args:
        policy: the reducer's layout policy (``learned`` after this).
        first_ready: slot indices in the order they first got a gradient on this rank.
        group: the process group (the agreement collectives run on it).
        like: a tensor on the device and of the dtype the buckets use.
        watch: waits and reads the agreement's collectives (the module's: the stall watchdog, or plain).
        ready_ns: ``time.perf_counter_ns()`` of each of ``first_ready`` (empty: not known here).
        end_ns: the same clock when backward ended.
        rows_ns: how long the tied parameters' rows round took (tied_rows.py), or 0.
    """
    policy.learned = True
    if not policy.dense:
        return False
    position = {slot.index: i for i, slot in enumerate(policy.dense)}
    when = {position[i]: t for i, t in zip(first_ready, ready_ns, strict=False) if i in position}  # no times: a shadow
    ready = [position[i] for i in first_ready if i in position]
    order = readiness_order(ready, len(policy.dense), rest_ascending=policy.ddp)
    start = min(when.values(), default=end_ns)
    ready_us = [(when.get(i, end_ns) - start) // 1000 if when else 0 for i in order]
    policy.order, agreed_us, (end_us, rows_us) = agree_order(
        order, group, like.device, ready_us, [(end_ns - start) // 1000, rows_ns // 1000], watch
    )
    policy.ready_s, policy.end_s, policy.rows_s = [t * 1e-6 for t in agreed_us], end_us * 1e-6, rows_us * 1e-6
    policy.cap_changes_layout = policy.tune_cap and cap_changes_layout(policy)
    if policy.tune_cap and policy.cap_changes_layout:
        policy.link = measure_link(group, like.dtype, like.device, policy.grad_bytes, watch)
        policy.cap_bytes = choose_cap(policy.link)
        policy.first_cap_bytes = min(policy.first_cap_bytes, policy.cap_bytes)
        policy.lengths = schedule(policy)
    return True


def retune_cap(policy: LayoutPolicy, group: dist.ProcessGroup, like: torch.Tensor, watch: Watch) -> bool:
    """Measures the link again; whether the cap moved enough to rebuild (then ``policy`` holds it).

    Never measures where no cap changes the layout (``cap_changes_layout``).
    """
    if not policy.cap_changes_layout:
        return False
    link = measure_link(group, like.dtype, like.device, policy.grad_bytes, watch)
    cap = choose_cap(link)
    if max(cap, policy.cap_bytes) / min(cap, policy.cap_bytes) <= RETUNE_FACTOR:
        return False
    policy.link, policy.cap_bytes, policy.first_cap_bytes = link, cap, min(policy.first_cap_bytes, cap)
    policy.lengths = schedule(policy)
    return True


# -- The schedule's buckets and the tied split's price --------------------
# The schedule plans for a backward this much slower than the first one measured: a
# bucket that waits for a late gradient idles the link for its whole wait, while one
# bucket more costs one latency, so the plan errs towards more buckets.
SCHEDULE_SLACK = 2.0


def scheduled_layout(policy: LayoutPolicy) -> Optional[list[BucketSpec]]:
    """The buckets of ``policy.lengths`` along its order, or None when the schedule did not choose them."""
    if policy.lengths is None or policy.order is None:
        return None
    numels, dtypes, devices = policy.sizes()
    specs, start = [], 0
    for length in policy.lengths:
        indices = tuple(policy.order[start : start + length])
        start += length
        specs.append(BucketSpec(indices, dtypes[indices[0]], devices[indices[0]], sum(numels[i] for i in indices)))
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
    link, slack = policy.link, SCHEDULE_SLACK
    ready = [t * slack for t in ready_s]
    return best_schedule(nbytes, ready, policy.end_s * slack, link.latency_s, link.bytes_per_s, MAX_CAP, MIN_CAP)


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
