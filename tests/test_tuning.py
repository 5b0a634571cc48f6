"""Launch order and bucket size learned in the first step ([Note: tuning] in layout/policy.py)."""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch
from torch import nn

from parity import assert_grads_match, assert_replicas_identical, assert_same_on_every_rank, seeded, sgd_step
from torchreplicate import replicate
from torchreplicate.reducer.layout.link import (
    CALIBRATION_BYTES,
    CALIBRATION_REPEATS,
    TIMINGS_BYTES,
    LinkModel,
    calibration_sizes,
    choose_cap,
    fit_link,
)
from torchreplicate.reducer.layout.plan import MAX_CAP, MIN_CAP
from torchreplicate.reducer.layout.policy import LayoutPolicy, readiness_order, schedule

DIM = 16


def test_fit_recovers_a_line():
    sizes = [1_000, 100_000, 1_000_000]
    link = fit_link(sizes, [0.001 + s / 1e8 for s in sizes])
    assert abs(link.latency_s - 0.001) < 1e-9 and abs(link.bytes_per_s - 1e8) / 1e8 < 1e-9


def test_fit_reads_latency_off_the_smallest_size():
    # the large sizes' noise (2 MiB measured fast) must not move the latency
    sizes = [4096, 2 * 2**20, 8 * 2**20]
    link = fit_link(sizes, [0.0005, 0.0015, 0.0085])
    slope = (0.0085 - 0.0015) / (sizes[2] - sizes[1])
    assert abs(link.bytes_per_s - 1 / slope) / link.bytes_per_s < 1e-9
    assert abs(link.latency_s - (0.0005 - slope * 4096)) < 1e-12 and link.latency_s > 0.00049


def test_cap_follows_the_link():
    slow = choose_cap(LinkModel(latency_s=0.0003, bytes_per_s=125e6))  # 1 Gbit/s
    fast = choose_cap(LinkModel(latency_s=0.0003, bytes_per_s=10e9))
    assert MIN_CAP <= slow < fast <= MAX_CAP, (slow, fast)


def test_readiness_order_keeps_every_parameter_once():
    assert readiness_order([2, 0], 4) == [2, 0, 3, 1]


class OutOfOrder(nn.Module):
    """Registered a, b, c, d; run d, c, b, a in forward, so backward readies a first."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c, self.d = (nn.Linear(DIM, DIM) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(torch.tanh(self.b(torch.tanh(self.c(torch.tanh(self.d(x)))))))


class Tuned(NamedTuple):
    first_bucket: list[str]  # names in bucket 0 after the first step
    buckets_before: int
    buckets_after: int
    cap_bytes: int  # the bucket cap after the steps (measured, or pinned)


def tuned(rank: int, world_size: int, cap_mb: float | None) -> Tuned:
    # None: tuned; 0: the defaults (DDP's 25 MiB, nothing measured); else pinned
    options: dict = {"bucket_layout": "tuned"} if cap_mb is None else {}
    if cap_mb:
        options = {"bucket_cap_mb": cap_mb, "first_bucket_cap_mb": cap_mb / 2}
    model = replicate(seeded(OutOfOrder, 1 + rank), **options)
    reference = seeded(OutOfOrder, 1)
    before = len(replicate.state(model).reducer.buckets)
    for step in range(4):
        x = [torch.randn(4, DIM, generator=torch.Generator().manual_seed(10 * step + r)) for r in range(world_size)]
        model(x[rank]).pow(2).mean().backward()
        torch.stack([reference(xr).pow(2).mean() for xr in x]).mean().backward()
        assert_grads_match(model, reference, f"rank {rank} step {step}")
        sgd_step(model, reference)
        assert_replicas_identical(model, f"rank {rank} after step {step}")
    reducer = replicate.state(model).reducer
    policy = reducer.layout_policy
    assert policy.learned, f"rank {rank}: the first step learned nothing"
    if cap_mb is None:  # measured in the first step
        assert policy.tune_cap and MIN_CAP <= policy.cap_bytes <= MAX_CAP, (
            f"rank {rank}: the chosen cap {policy.cap_bytes} is outside [{MIN_CAP}, {MAX_CAP}]"
        )
    else:  # pinned, or DDP's 25 MiB by default: never measured
        assert not policy.tune_cap and policy.link is None, f"rank {rank}: the link was measured"
        assert policy.cap_bytes == int((cap_mb or 25) * 1024 * 1024), (
            f"rank {rank}: the pinned cap became {policy.cap_bytes}"
        )
    buckets = reducer.buckets
    return Tuned([s.name for s in buckets[0].slots], before, len(buckets), policy.cap_bytes)


@pytest.mark.parametrize("cap_mb", [None, 0.001, 0], ids=["tuned-cap", "pinned-tiny-cap", "default-cap"])
def test_first_step_learns_the_launch_order(pools, cap_mb):
    results = pools.run(2, tuned, cap_mb)
    assert results[0] == results[1], f"the ranks chose different layouts or caps: {results}"
    r = results[0]
    if cap_mb is None:
        assert MIN_CAP <= r.cap_bytes <= MAX_CAP, r
    elif cap_mb == 0:
        # by default: learned order, DDP's cap; the launch order puts a's gradient (ready first) first
        assert r.cap_bytes == 25 * 2**20 and r.first_bucket[0].startswith("a."), r
    else:
        # tiny buckets: the first bucket holds what backward readies first, a's; DDP's first step
        # reduced one bucket, and its rebuild laid out several
        assert r.first_bucket[0].startswith("a."), r
        assert r.buckets_before == 1 and r.buckets_after > 1, r


class Chosen(NamedTuple):
    cap_bytes: int
    layout: list[list[str]]


def skewed_clocks(rank: int, world_size: int) -> Chosen:
    """Each rank's clock runs at its own speed: the ranks must still choose the same buckets.

    WideStack: its layout changes with the cap, so the link is measured.
    """
    import time

    from torchreplicate.reducer.layout import link

    real = time.perf_counter
    speed = 1.0 + 4.0 * rank  # rank 1 measures every all-reduce 5x slower

    class SkewedTime:
        @staticmethod
        def perf_counter() -> float:
            return real() * speed

    link.time = SkewedTime  # type: ignore[assignment]
    try:
        model = replicate(seeded(WideStack, 1), bucket_layout="tuned")
        reference = seeded(WideStack, 1)
        for step in range(2):
            x = [
                torch.randn(4, WIDE, generator=torch.Generator().manual_seed(10 * step + r)) for r in range(world_size)
            ]
            model(x[rank]).pow(2).mean().backward()  # each rank its own data
            torch.stack([reference(xr).pow(2).mean() for xr in x]).mean().backward()
            assert_grads_match(model, reference, f"rank {rank} step {step}")
            for name, p in model.named_parameters():
                assert_same_on_every_rank(p.grad, f"step {step} {name}.grad")
            model.zero_grad()
            reference.zero_grad()
    finally:
        link.time = time  # type: ignore[assignment]
    reducer = replicate.state(model).reducer
    assert reducer.layout_policy.link is not None, f"rank {rank}: the link was not measured"
    return Chosen(reducer.layout_policy.cap_bytes, [[s.name for s in b.slots] for b in reducer.buckets])


def test_ranks_with_different_timings_choose_the_same_plan(pools):
    results = pools.run(2, skewed_clocks)
    assert results[0] == results[1], results
    assert MIN_CAP <= results[0].cap_bytes <= MAX_CAP, results


class Regimes(NamedTuple):
    caps: list[int]  # the cap after each step
    layouts: list[int]  # bucket count after each step


def regime_change(rank: int, world_size: int) -> Regimes:
    """The link measures fast, then (from the 3rd measurement) slow: the buckets follow, exactly."""
    from torchreplicate.reducer.layout import policy as tuning

    measured = []

    def fake_measure(group, dtype, device, budget_bytes, waiter=None):
        measured.append(1)
        slow = len(measured) > 1
        return LinkModel(latency_s=0.0003, bytes_per_s=125e6 if slow else 20e9)

    saved = (tuning.measure_link, tuning.RETUNE_EVERY, tuning.schedule)
    # the cap's plan only: what this checks is that a retune rebuilds the buckets (the schedule's
    # own layouts: test_buckets.py, test_parity.py's wide model)
    tuning.measure_link, tuning.RETUNE_EVERY, tuning.schedule = fake_measure, 3, lambda policy: None
    try:
        model = replicate(seeded(WideStack, 1 + rank), bucket_layout="tuned")
        reference = seeded(WideStack, 1)
        caps, layouts = [], []
        for step in range(7):
            x = [
                torch.randn(4, WIDE, generator=torch.Generator().manual_seed(10 * step + r)) for r in range(world_size)
            ]
            model(x[rank]).pow(2).mean().backward()
            torch.stack([reference(xr).pow(2).mean() for xr in x]).mean().backward()
            assert_grads_match(model, reference, f"rank {rank} step {step}")
            sgd_step(model, reference, lr=0.01)
            assert_replicas_identical(model, f"rank {rank} after step {step}")
            reducer = replicate.state(model).reducer
            caps.append(reducer.layout_policy.cap_bytes)
            layouts.append(len(reducer.buckets))
    finally:
        tuning.measure_link, tuning.RETUNE_EVERY, tuning.schedule = saved
    return Regimes(caps, layouts)


WIDE = 512


class WideStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(*[nn.Linear(WIDE, WIDE) for _ in range(4)])  # 1 MiB weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def test_a_regime_change_retunes_the_buckets(pools):
    results = pools.run(2, regime_change)
    assert results[0] == results[1], results
    caps, layouts = results[0]
    assert caps[0] == caps[1] > caps[2], f"no retune at step 3: {caps}"  # measured at steps 1 and 3
    assert layouts[2] > layouts[0], f"the buckets did not follow: {layouts}"


@pytest.mark.parametrize("budget", [300_000, 4 * 2**20, 33 * 2**20, 10**9])
def test_calibration_sends_at_most_its_budget(budget):
    sizes = calibration_sizes(budget, 4)
    sent = (CALIBRATION_REPEATS + 1) * 4 * sum(sizes) + TIMINGS_BYTES
    assert sent <= budget and sizes == sorted(set(sizes)), (budget, sizes, sent)
    if budget >= (CALIBRATION_REPEATS + 1) * sum(CALIBRATION_BYTES) + TIMINGS_BYTES:
        assert [4 * n for n in sizes] == list(CALIBRATION_BYTES), sizes  # today's sizes where the model allows
    else:
        assert sent > 0.9 * budget, (budget, sent)  # scaled down, not thrown away


class Calibrated(NamedTuple):
    grad_bytes: int
    measurements: list[int]  # bytes each measurement of the link sent (all-reduces inside measure_link)
    cap_bytes: int


def calibration_traffic(rank: int, world_size: int, model_name: str) -> Calibrated:
    """Counts what every measurement of the link sends over 7 steps (one retune at 6), with parity."""
    import torch.distributed as dist

    from torchreplicate.reducer.layout import policy as tuning

    model_class, width = (WideStack, WIDE) if model_name == "wide" else (OutOfOrder, DIM)
    measurements: list[int] = []
    measure, all_reduce = tuning.measure_link, dist.all_reduce

    def counting_all_reduce(tensor, *args, **kwargs):
        measurements[-1] += tensor.numel() * tensor.element_size()
        return all_reduce(tensor, *args, **kwargs)

    def measuring(*args, **kwargs):
        measurements.append(0)
        dist.all_reduce = counting_all_reduce  # only while the link is measured
        try:
            return measure(*args, **kwargs)
        finally:
            dist.all_reduce = all_reduce

    saved = tuning.RETUNE_EVERY
    tuning.measure_link, tuning.RETUNE_EVERY = measuring, 6
    try:
        model = replicate(seeded(model_class, 1 + rank), bucket_layout="tuned")
        reference = seeded(model_class, 1)
        for step in range(7):
            x = [torch.randn(4, width, generator=torch.Generator().manual_seed(10 * step + r)) for r in range(2)]
            model(x[rank]).pow(2).mean().backward()
            torch.stack([reference(xr).pow(2).mean() for xr in x]).mean().backward()
            assert_grads_match(model, reference, f"rank {rank} step {step}")
            sgd_step(model, reference, lr=0.01)
            assert_replicas_identical(model, f"rank {rank} after step {step}")
    finally:
        tuning.measure_link, tuning.RETUNE_EVERY = measure, saved
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return Calibrated(grad_bytes, measurements, replicate.state(model).reducer.layout_policy.cap_bytes)


@pytest.mark.parametrize("model_name", ["tiny", "wide"])
def test_calibration_sends_at_most_the_models_gradient_bytes(pools, model_name):
    results = pools.run(2, calibration_traffic, model_name)
    assert results[0] == results[1], f"the ranks measured or chose differently: {results}"
    r = results[0]
    if model_name == "tiny":  # one bucket at every cap: nothing to measure, then or at the retune
        assert r.measurements == [], r
    else:  # the first step and the retune at step 6, each within one step's traffic
        assert len(r.measurements) == 2 and all(0 < sent <= r.grad_bytes for sent in r.measurements), r
        assert MIN_CAP <= r.cap_bytes <= MAX_CAP, r


def _gpt_like_policy(bytes_per_s: float) -> LayoutPolicy:
    # A tied table (8 MiB, position 0) ready first with the split, then 18 layers of 1 MiB over
    # 120 ms of backward: the first step as the forward's detached lookup makes it.
    from torchreplicate.reducer.bucket import make_slots

    params = [nn.Parameter(torch.zeros(2 * 2**20))] + [nn.Parameter(torch.zeros(2**18)) for _ in range(18)]
    policy = LayoutPolicy(make_slots(params, [f"p{i}" for i in range(19)], {}), None, None, 2**20, layout="tuned")
    policy.learned = True
    policy.order = list(range(19))
    policy.ready_s = [0.0] + [0.12 * (i + 1) / 18 for i in range(18)]
    policy.end_s = 0.121
    policy.link = LinkModel(latency_s=0.0005, bytes_per_s=bytes_per_s)
    policy.cap_bytes = choose_cap(policy.link)  # as learn_layout does
    policy.lengths = schedule(policy)
    return policy


@pytest.mark.parametrize(
    "bytes_per_s,pays",
    [
        (12.5e6, False),  # 100 Mbit: the link is the step; rows sent after it are bytes sent twice
        (1.25e9, True),  # 10 Gbit: backward is the step; the table would wait for its end
    ],
)
def test_the_tied_split_is_kept_only_where_it_pays(bytes_per_s, pays):
    from torchreplicate.reducer.layout.policy import keep_whole, split_pays

    policy = _gpt_like_policy(bytes_per_s)
    rows_bytes = 512 * 1024  # the rows the batch's tokens touched
    assert split_pays(policy, [0], rows_bytes) is pays
    keep_whole(policy, [0])
    assert policy.order[-1] == 0 and policy.ready_s[-1] == policy.end_s, "the table last, ready at the end"
    # the schedule where the link is the step, else the cap's plan (None)
    assert (policy.lengths is None) is pays, policy.lengths
    assert policy.lengths is None or sum(policy.lengths) == 19
