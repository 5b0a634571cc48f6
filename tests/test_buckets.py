"""Bucket planning, without a process group."""

import pytest
import torch

from torchreplicate.config import MiB
from torchreplicate.reducer.layout.plan import plan_buckets

F32, F16 = torch.float32, torch.float16
CPU = torch.device("cpu")


def plan(numels, dtypes=None, **kw):
    dtypes = dtypes or [F32] * len(numels)
    return plan_buckets(numels, dtypes, [CPU] * len(numels), **kw)


def test_reverse_order_and_every_param_once():
    buckets = plan([10, 20, 30, 40], cap_bytes=10**9, first_cap_bytes=10**9)
    assert [b.param_indices for b in buckets] == [(3, 2, 1, 0)]
    assert buckets[0].numel == 100


def test_small_first_bucket_then_cap():
    # 4-byte floats: first cap 100 B = 25 elements, then 400 B = 100 elements:
    # three 30-element parameters fit, a fourth would pass the cap
    buckets = plan([30] * 8, cap_bytes=400, first_cap_bytes=100)
    assert [b.param_indices for b in buckets] == [(7,), (6, 5, 4), (3, 2, 1), (0,)]
    assert sorted(i for b in buckets for i in b.param_indices) == list(range(8))


def test_param_larger_than_cap_gets_own_bucket():
    # what was ready before it leaves first, not waiting for the large one
    buckets = plan([5, 1000, 5], cap_bytes=40, first_cap_bytes=40)
    assert [b.param_indices for b in buckets] == [(2,), (1,), (0,)]
    assert buckets[1].numel == 1000


@pytest.mark.parametrize(
    "small, expected",
    [
        (4, [((1, 0), 1004)]),  # 16 B < 20 B, not half full: the small one rides with the large one
        (5, [((1,), 5), ((0,), 1000)]),  # 20 B >= 20 B, half full: it leaves before the large one
    ],
    ids=["below-half-rides-along", "half-full-leaves-first"],
)
def test_a_bucket_closes_before_an_overflowing_parameter_only_once_half_full(small, expected):
    # Visited in reverse: the small parameter 1, then the 1000-element one (4000 B,
    # past the 40 B cap). _Filler.add closes the open bucket before a parameter
    # that would overflow it only when 2 * its bytes >= the cap, i.e. at 20 B
    # here; otherwise the parameter joins it and the bucket closes once past the cap.
    buckets = plan([1000, small], cap_bytes=40, first_cap_bytes=40)
    assert [(b.param_indices, b.numel) for b in buckets] == expected


def test_dtypes_never_share_a_bucket():
    buckets = plan([4, 4, 4, 4], [F32, F16, F32, F16], cap_bytes=10**9, first_cap_bytes=10**9)
    assert {b.dtype for b in buckets} == {F32, F16}
    for b in buckets:
        assert all([F32, F16, F32, F16][i] == b.dtype for i in b.param_indices)


def test_cap_counts_bytes_not_elements():
    # 16 fp16 elements = 32 bytes: two of them reach a 64-byte cap
    buckets = plan([16] * 4, [F16] * 4, cap_bytes=64, first_cap_bytes=64)
    assert [b.param_indices for b in buckets] == [(3, 2), (1, 0)]


def test_explicit_order():
    buckets = plan([10, 10, 10], order=[0, 2, 1], cap_bytes=10**9, first_cap_bytes=10**9)
    assert buckets[0].param_indices == (0, 2, 1)


def test_default_caps_are_ddp_like():
    numels = [256 * 256] * 40  # 256 KiB each
    buckets = plan(numels)
    assert buckets[0].numel * 4 >= 1 * MiB and buckets[0].numel * 4 < 2 * MiB
    assert all(b.numel * 4 <= 26 * MiB for b in buckets)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"order": [0, 0, 1]}, "permutation"),
        ({"cap_bytes": 0}, "positive"),
        ({"first_cap_bytes": -1}, "positive"),
    ],
)
def test_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        plan([1, 2, 3], **kwargs)


def test_mismatched_lengths():
    with pytest.raises(ValueError, match="one entry per parameter"):
        plan_buckets([1, 2], [F32], [CPU, CPU])


def test_a_layout_the_same_at_both_cap_bounds_is_the_same_at_every_cap_between():
    # tuning.cap_changes_layout compares only the layouts at MIN_CAP and MAX_CAP
    import random

    from torchreplicate.reducer.layout.plan import MAX_CAP, MIN_CAP

    rng = random.Random(0)
    caps = [int(MIN_CAP * (MAX_CAP / MIN_CAP) ** (i / 60)) for i in range(61)]
    for _ in range(300):
        numels = [rng.choice([rng.randint(1, 80_000), rng.randint(1, 5 * MiB)]) for _ in range(rng.randint(1, 8))]
        first = rng.choice([MIN_CAP // 4, 1 * MiB, 4 * MiB])

        def layout(cap):
            return [b.param_indices for b in plan(numels, cap_bytes=cap, first_cap_bytes=min(first, cap))]

        if layout(MIN_CAP) == layout(MAX_CAP):
            assert all(layout(cap) == layout(MIN_CAP) for cap in caps), (numels, first)


# -- buckets from the schedule ([Note: buckets from the schedule] in layout/plan.py)


def _simulate(lengths, nbytes, ready, end, latency, bandwidth):
    # The end of the last transfer of a layout: each bucket leaves when its last
    # parameter is ready (the last one not before `end`) and the link is free.
    link_free, start = 0.0, 0
    for k, length in enumerate(lengths):
        stop = start + length
        leaves = max(ready[start:stop])
        if k == len(lengths) - 1:
            leaves = max(leaves, end)
        link_free = max(leaves, link_free) + latency + sum(nbytes[start:stop]) / bandwidth
        start = stop
    return link_free


def _every_layout(count):
    for mask in range(2 ** (count - 1)):
        lengths, run = [], 1
        for i in range(count - 1):
            if mask >> i & 1:
                lengths.append(run)
                run = 1
            else:
                run += 1
        yield lengths + [run]


@pytest.mark.parametrize("seed", range(30))
def test_schedule_is_the_best_layout_of_all(seed):
    # against brute force over every split of up to 8 parameters: no layout ends sooner,
    # and none that ends as soon has fewer buckets
    import random

    from torchreplicate.reducer.layout.plan import best_schedule

    rng = random.Random(seed)
    count = rng.randint(1, 8)
    nbytes = [rng.choice([4, 64, 1024, 4 * MiB]) * rng.randint(1, 4) for _ in range(count)]
    ready = sorted(rng.uniform(0, 0.05) for _ in range(count))
    end = ready[-1] + rng.uniform(0, 0.01)
    latency, bandwidth = rng.choice([1e-5, 1e-3]), rng.choice([125e6, 1.25e9, 12.5e9])
    lengths = best_schedule(nbytes, ready, end, latency, bandwidth, 64 * MiB)[0]
    assert sum(lengths) == count and all(length > 0 for length in lengths)
    got = _simulate(lengths, nbytes, ready, end, latency, bandwidth)
    for other in _every_layout(count):
        best = _simulate(other, nbytes, ready, end, latency, bandwidth)
        assert got <= best + 1e-6, f"{lengths} ends at {got}, {other} at {best}"
        if best <= got + 1e-9:
            assert len(lengths) <= len(other) or got < best + 1e-6


def test_schedule_follows_the_link():
    from torchreplicate.reducer.layout.plan import best_schedule

    nbytes, ready = [4 * MiB] * 8, [0.005 * i for i in range(8)]
    slow = best_schedule(nbytes, ready, 0.04, 1e-3, 125e6, 64 * MiB)[0]  # 1 Gbit: each bucket waits for the link
    fast = best_schedule(nbytes, ready, 0.04, 1e-4, 10e9, 64 * MiB)[0]  # 80 Gbit: the link waits for backward
    assert len(slow) < len(fast) == 8
    assert slow[0] == 1, "the first gradient leaves alone: the link starts as early as it can"
    capped = best_schedule(nbytes, [0.0] * 8, 0.0, 1e-3, 125e6, 8 * MiB)[0]
    assert max(capped) <= 2, "no bucket over max_bytes"
    tiny = best_schedule([64 * 1024] * 64, [0.001 * i for i in range(64)], 0.064, 1e-5, 10e9, 64 * MiB, MiB)[0]
    assert all(length >= 16 for length in tiny[1:]), f"a bucket under min_bytes after the first: {tiny}"


class _NoReduction:
    # A bucket's reduction is only asked to launch and wait; these tests take gradients in.
    def __init__(self, divide_factor: float) -> None:
        from torchreplicate.reducer.reduction import Divisor

        self.divisor = Divisor(divide_factor)

    def launch(self, index: int) -> None:
        raise AssertionError("not launched in this test")

    def wait(self, index: int, handle: object) -> None:
        raise AssertionError("not launched in this test")


def _one_slot_bucket(dtype, divisor, expected, numel=5000):
    from torch import nn

    from torchreplicate.reducer.bucket import BATCH_NUMEL, ViewBucket, make_slots

    param = nn.Parameter(torch.zeros(numel, dtype=dtype))
    (slot,) = make_slots([param], ["w"], {id(param): expected})
    bucket = ViewBucket(0, [slot], dtype, torch.device("cpu"))
    scale = torch.tensor(1.0 / divisor, dtype=torch.float32)
    bucket.bind(_NoReduction(divisor), scale)
    assert bucket.batched == (numel < BATCH_NUMEL)
    return param, slot, bucket, scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("divisor", [2.0, 3.0, 7.0])
def test_two_accumulations_are_summed_then_scaled_as_ddps_static_graph(dtype, divisor):
    """Two accumulations into one parameter in one backward (reentrant checkpointing), learned: the
    bucket takes the sum autograd made in ``.grad`` once both are in, ``(first + second) * (1/d)``, as
    DDP's reducer with ``static_graph=True`` marks a parameter ready once its hooks reached their count."""
    torch.manual_seed(0)
    param, slot, bucket, scale = _one_slot_bucket(dtype, divisor, expected=2)
    first, second = torch.randn(5000, dtype=dtype), torch.randn(5000, dtype=dtype)
    param.grad = first.clone()
    assert not bucket.take(slot), "one of two accumulations: not ready yet"
    assert param.grad is not None and torch.equal(param.grad, first), "left to autograd until the last one"
    param.grad.add_(second)  # autograd accumulates the second in place
    assert bucket.take(slot), "both accumulations in: the bucket is ready"
    assert torch.equal(slot.view, torch.mul(first + second, scale)), (dtype, divisor)
    assert param.grad is None, "the view holds them until the bucket's average is restored"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("divisor", [2.0, 3.0, 7.0])
def test_the_first_step_sums_accumulations_unscaled_and_scales_at_the_launch(dtype, divisor):
    """Nothing learned yet (the first step): each accumulation is taken as it comes (``.grad`` set aside,
    so the next lands fresh), summed as autograd sums, and the launch at the end of backward scales the
    sum: DDP's ``(first + second) * (1/d)`` again."""
    torch.manual_seed(0)
    param, slot, bucket, scale = _one_slot_bucket(dtype, divisor, expected=0)
    first, second = torch.randn(5000, dtype=dtype), torch.randn(5000, dtype=dtype)
    param.grad = first.clone()
    assert not bucket.take(slot)
    assert param.grad is None, "set aside: the next accumulation lands fresh"
    param.grad = second.clone()
    assert not bucket.take(slot), "nothing learned: the bucket waits for the end of backward"
    assert bucket.fill() == [], "the slot holds this rank's gradient"
    bucket._scale_in_place()  # what the launch at the end of backward does first
    assert torch.equal(slot.view, torch.mul(first + second, scale)), (dtype, divisor)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("expected", [0, 1, 2])
def test_a_batched_bucket_gathers_at_its_launch_what_autograd_summed(dtype, expected):
    """A bucket of small parameters ([Note: batched buckets]): its hooks only count (``.grad`` stays
    where autograd put it); the gather before the launch copies every gradient in one call, detaches
    ``.grad`` and scales the whole buffer: ``(first + second) * (1/3)`` again, DDP's bytes."""
    torch.manual_seed(0)
    param, slot, bucket, scale = _one_slot_bucket(dtype, 3.0, expected=expected, numel=1000)
    first, second = torch.randn(1000, dtype=dtype), torch.randn(1000, dtype=dtype)
    param.grad = first.clone()
    for fired in range(1, max(expected, 2) + 1):
        assert bucket.take(slot) == (fired == expected), "ready once every slot reached its count"
        assert param.grad is not None, "left to autograd"
        if fired == 1:
            param.grad.add_(second)  # autograd accumulates the second in place
    assert bucket.fill() == [] and param.grad is None, "gathered into the view; .grad set aside"
    bucket._scale_in_place()
    assert torch.equal(slot.view, torch.mul(first + second, scale)), (dtype, expected)


# -- DDP's assignment ([Note: DDP's buckets]) -------------------------------------------------


def ddp(numels, limits, dtypes=None, **kw):
    from torchreplicate.reducer.layout.plan import ddp_buckets

    dtypes = dtypes or [F32] * len(numels)
    return [b.param_indices for b in ddp_buckets(numels, dtypes, [CPU] * len(numels), limits, **kw)]


def test_ddps_first_iteration_is_one_bucket_in_registration_order():
    import sys

    assert ddp([10, 20, 30], [sys.maxsize]) == [(0, 1, 2)]


def test_ddps_buckets_fill_in_registration_order_then_reverse():
    # 40-byte parameters, limits 40 then 80 B (as read in DDP 2.13's reducer.cpp and checked there):
    # [0] closes at 40 B, [1, 2] and [3, 4] at 80 B; DDP's Python side reverses the list
    assert ddp([10] * 5, [40, 80]) == [(3, 4), (1, 2), (0,)]


def test_ddps_rebuild_keeps_the_ready_order_unsorted():
    assert ddp([10] * 5, [40, 80], order=[4, 2, 0, 1, 3]) == [(4,), (2, 0), (1, 3)]


def test_ddps_limits_walk_per_dtype():
    # the fp16 parameters (2 B each) walk their own limits: their first bucket is a first bucket too
    dtypes = [F32, F16, F32, F16, F32]
    assert ddp([10] * 5, [40, 80], dtypes=dtypes, order=[4, 3, 2, 1, 0]) == [(4,), (3, 1), (2, 0)]


def test_ddps_limits_follow_the_cap_given():
    from torchreplicate.reducer.layout.plan import ddp_limits

    assert ddp_limits(25 * MiB, MiB, rebuilt=True, find_unused=False) == [MiB, 25 * MiB]
    assert ddp_limits(25 * MiB, 25 * MiB, rebuilt=False, find_unused=True) == [25 * MiB]
    assert ddp_limits(25 * MiB, MiB, rebuilt=False, find_unused=True) == [MiB, 25 * MiB]
    assert len(ddp_limits(25 * MiB, MiB, rebuilt=False, find_unused=False)) == 1  # one bucket per dtype
