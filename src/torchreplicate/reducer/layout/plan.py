"""Bucket planning: which parameters travel together in one collective.

Pure functions over sizes, dtypes and devices, so they are tested without a
process group. The reducer turns a plan into flat buffers.
"""

from __future__ import annotations

import sys
from typing import Optional, Sequence

import torch

from torchreplicate.config import DDP_DEFAULT_CAP_MB, MiB
from torchreplicate.reducer.bucket import BucketSpec

MIN_CAP = 512 * 1024  # bytes: below this gloo's per-collective work dominates on CPU
MAX_CAP = 64 * MiB  # no bucket larger (tuned caps, the schedule)


def plan_buckets(
    numels: Sequence[int],
    dtypes: Sequence[torch.dtype],
    devices: Sequence[torch.device],
    *,
    order: Sequence[int] | None = None,
    cap_bytes: int = DDP_DEFAULT_CAP_MB * MiB,
    first_cap_bytes: int = 1 * MiB,
    groups: Sequence[int] | None = None,
) -> list[BucketSpec]:
    """Groups parameters into buckets, in the order their gradients are expected.

    Parameters are visited in ``order`` (default: reverse of their index, since
    backward produces the gradients of the last layers first). A bucket holds
    parameters of one dtype and one device; it is closed once its size reaches
    the cap, or, once half full, before a parameter that would take it past
    the cap (so what is ready early does not wait in the bucket of a large
    parameter ready late, a tied embedding; a small bias still rides with the
    weight after it). The first bucket closed uses ``first_cap_bytes`` so that
    the first collective starts early in backward. A parameter larger than the
    cap gets a bucket of its own. Buckets of different (dtype, device) groups fill in
    parallel, each closed by its own size, so a group never splits another's.

    Args:
        numels: number of elements of each parameter.
        dtypes: dtype of each parameter.
        devices: device of each parameter.
        order: visiting order (a permutation of ``range(len(numels))``);
            default reverse index order.
        cap_bytes: bucket size cap in bytes. Default 25 MiB.
        first_cap_bytes: cap of the first bucket closed, in bytes. Default 1 MiB.
        groups: a group id per parameter (nested ``replicate()``: the
            innermost replicated module holding it); a bucket never holds two
            groups: every open bucket closes when the visit moves to another
            group. Default: one group.

    Returns:
        The buckets, in launch order. Every parameter appears in exactly one.
    """
    order = _checked_order(numels, dtypes, devices, order, groups)
    if cap_bytes <= 0 or first_cap_bytes <= 0:
        raise ValueError(
            f"plan_buckets: caps must be positive, got cap_bytes={cap_bytes}, first_cap_bytes={first_cap_bytes}"
        )
    filler = _Filler(numels, cap_bytes, first_cap_bytes)
    group = None
    for index in order:
        if groups is not None:
            if group is not None and groups[index] != group:
                filler.close_all()
            group = groups[index]
        filler.add(index, (dtypes[index], torch.device(devices[index])))
    # What is left closes in the order the groups first appeared: the same on
    # every rank, since it depends only on the inputs.
    filler.close_all()
    return filler.buckets


def ddp_buckets(
    numels: Sequence[int],
    dtypes: Sequence[torch.dtype],
    devices: Sequence[torch.device],
    limits: Sequence[int],
    *,
    order: Optional[Sequence[int]] = None,
    groups: Optional[Sequence[int]] = None,
) -> list[BucketSpec]:
    """DDP 2.13's bucket assignment, so that every all-reduce sums the same bytes at the same offsets.

    [Note: DDP's buckets]
    DDP's reducer (torch/csrc/distributed/c10d/reducer.cpp,
    ``compute_bucket_assignment_by_size``, read at torch 2.13) visits the
    parameters in registration order (or, when it rebuilds, in the order their
    gradients became ready), keeps one open bucket per (dtype, device), each
    with its own walk along ``limits``, and closes a bucket once its bytes
    reach its current limit; the walk then moves to the next limit (staying on
    the last). Buckets still open at the end follow the closed ones. In
    registration order the buckets are sorted by their smallest index and
    DDP's Python side reverses them (the last layers' gradients come first);
    in ready order they stay as closed, the open ones after them in the order
    of the C++ map (libstdc++: the key seen last first). Inside a bucket the
    parameters keep the visiting order. DDP's limits: ``[sys.maxsize]`` for
    the first iteration (one bucket per dtype and device) unless
    ``find_unused_parameters=True``; ``[first, cap]`` when it rebuilds, after
    the first iteration; the first bucket's cap is 1 MiB only where
    ``bucket_cap_mb`` was left at its default, else the cap itself. Nested
    ``replicate()`` groups (``groups``) are part of the key here; DDP has none.

    Args:
        numels: number of elements of each parameter.
        dtypes: dtype of each parameter.
        devices: device of each parameter.
        limits: bucket size limits in bytes, walked per (dtype, device).
        order: the visiting order (a permutation); None: registration order, then reversed.
        groups: a group id per parameter (nested ``replicate()``), or None.

    Returns:
        The buckets, in launch order. Every parameter appears in exactly one.
    """
    _checked_order(numels, dtypes, devices, order, groups)  # validates the inputs only
    visit = range(len(numels)) if order is None else order  # DDP visits in registration order, not reversed
    if not limits or min(limits) <= 0:
        raise ValueError(f"ddp_buckets: limits must be positive, got {list(limits)}")
    open_: dict[tuple[object, ...], tuple[list[int], int]] = {}  # key -> (indices, bytes); first seen first
    walk: dict[tuple[object, ...], int] = {}  # key -> its position in `limits`
    closed: list[list[int]] = []
    for index in visit:
        key = (dtypes[index], torch.device(devices[index]), 0 if groups is None else groups[index])
        indices, size = open_.get(key, ([], 0))
        indices.append(index)
        size += numels[index] * torch.empty((), dtype=dtypes[index]).element_size()
        at = walk.setdefault(key, 0)
        if size >= limits[at]:
            closed.append(indices)
            indices, size = [], 0
            walk[key] = min(at + 1, len(limits) - 1)
        open_[key] = (indices, size)
    still_open = [indices for indices, _ in open_.values() if indices]
    buckets = sorted(closed + still_open, key=min)[::-1] if order is None else closed + still_open[::-1]
    return [BucketSpec(tuple(b), dtypes[b[0]], torch.device(devices[b[0]]), sum(numels[i] for i in b)) for b in buckets]


def ddp_limits(cap_bytes: int, first_cap_bytes: int, *, rebuilt: bool, find_unused: bool) -> list[int]:
    """DDP's size limits ([Note: DDP's buckets]): before its rebuild (``find_unused`` keeps that layout) or after."""
    if rebuilt:
        return [first_cap_bytes, cap_bytes]
    if not find_unused:
        return [sys.maxsize]
    return [first_cap_bytes, cap_bytes] if first_cap_bytes < cap_bytes else [cap_bytes]


def _checked_order(
    numels: Sequence[int],
    dtypes: Sequence[torch.dtype],
    devices: Sequence[torch.device],
    order: Sequence[int] | None,
    groups: Sequence[int] | None,
) -> Sequence[int]:
    # The visiting order, once the per-parameter inputs are known to line up.
    count = len(numels)
    if not (len(dtypes) == len(devices) == count):
        raise ValueError(
            f"plan_buckets: numels, dtypes and devices must have one entry per "
            f"parameter, got {count}, {len(dtypes)} and {len(devices)}"
        )
    if groups is not None and len(groups) != count:
        raise ValueError(f"plan_buckets: groups must have one entry per parameter, got {len(groups)} for {count}")
    if order is None:
        return range(count - 1, -1, -1)
    if sorted(order) != list(range(count)):
        raise ValueError(f"plan_buckets: order must be a permutation of range({count}), got {list(order)}")
    return order


_Key = tuple[torch.dtype, torch.device]


class _Filler:
    # The open buckets, one per (dtype, device), filling in parallel.

    def __init__(self, numels: Sequence[int], cap_bytes: int, first_cap_bytes: int) -> None:
        self.numels, self.cap_bytes, self.first_cap_bytes = numels, cap_bytes, first_cap_bytes
        self.buckets: list[BucketSpec] = []  # closed, in launch order
        self.open: dict[_Key, tuple[list[int], int]] = {}  # key -> (parameter indices, numel)

    def add(self, index: int, key: _Key) -> None:
        element_size = torch.empty((), dtype=key[0]).element_size()
        cap = self.first_cap_bytes if not self.buckets else self.cap_bytes
        indices, numel = self.open.get(key, ([], 0))
        if indices and 2 * numel * element_size >= cap and (numel + self.numels[index]) * element_size > cap:
            self.close(key)  # half full, and this parameter would overflow it: it leaves without it
            cap = self.cap_bytes
            indices, numel = [], 0
        indices.append(index)
        numel += self.numels[index]
        self.open[key] = (indices, numel)
        if numel * element_size >= cap:
            self.close(key)

    def close(self, key: _Key) -> None:
        indices, numel = self.open.pop(key)
        self.buckets.append(BucketSpec(tuple(indices), key[0], key[1], numel))

    def close_all(self) -> None:
        for key in list(self.open):
            self.close(key)


def best_schedule(
    nbytes: Sequence[int],
    ready_s: Sequence[float],
    end_s: float,
    latency_s: float,
    bytes_per_s: float,
    max_bytes: int,
    min_bytes: int = 0,
) -> tuple[list[int], float]:
    """Bucket lengths along the launch order that finish the last transfer soonest; pure.

    [Note: buckets from the schedule]
    The cap alone trades a bucket's fixed latency against starting the link
    early, but not against what the link is doing: on a link slower than
    backward, every bucket after the first waits for the link anyway, and
    each one more costs its latency on the critical path; on a fast link,
    small buckets overlap more. So, given when each parameter's gradient was
    ready in the first synchronised backward (``ready_s``, in launch order;
    the last bucket leaves at the end of backward, ``end_s``) and the fitted
    link (``time = latency + bytes / bandwidth``, one collective at a time),
    a dynamic program over where buckets end picks the layout whose last
    collective ends first (ties: fewer buckets). A bucket leaves when its
    last parameter is ready and the link is free.

    Args:
        nbytes: bytes of each parameter's gradient, in launch order.
        ready_s: when each became ready, in launch order (seconds from the first).
        end_s: when backward ended (the last bucket leaves then at the earliest).
        latency_s: the link's fixed cost per collective.
        bytes_per_s: the link's bandwidth.
        max_bytes: no bucket larger, unless one parameter is.
        min_bytes: no bucket smaller but the first (a collective's CPU work, which
            the fitted latency does not show, competes with backward on the CPU).

    Returns:
        The number of parameters in each bucket, in launch order (sums to
        ``len(nbytes)``), and when the last transfer ends (seconds).
    """
    import numpy as np

    count = len(nbytes)
    if count == 0:
        return [], end_s
    ready = np.maximum.accumulate(np.asarray(ready_s, dtype=np.float64))
    sizes = np.concatenate([[0.0], np.cumsum(np.asarray(nbytes, dtype=np.float64))])
    finish = np.zeros(count + 1)  # finish[i]: soonest end of the buckets holding the first i parameters
    buckets = np.zeros(count + 1, dtype=np.int64)
    start_of = np.zeros(count + 1, dtype=np.int64)
    for i in range(1, count + 1):
        leaves = max(ready[i - 1], end_s) if i == count else ready[i - 1]
        first = min(int(np.searchsorted(sizes, sizes[i] - max_bytes, side="left")), i - 1)  # the largest bucket allowed
        ends = np.maximum(leaves, finish[first:i]) + latency_s + (sizes[i] - sizes[first:i]) / bytes_per_s
        small = sizes[i] - sizes[first:i] < min_bytes
        if first == 0:
            small[0] = False  # a bucket from the start may be small
        if not small.all():
            ends[small] = np.inf
        best = ends.min()
        near = np.flatnonzero(ends <= best + 1e-6)  # within a microsecond: the fewest buckets
        pick = first + int(near[np.argmin(buckets[first + near])])
        finish[i], buckets[i], start_of[i] = ends[pick - first], buckets[pick] + 1, pick
    lengths, i = [], count
    while i > 0:
        lengths.append(i - int(start_of[i]))
        i = int(start_of[i])
    return lengths[::-1], float(finish[count])
