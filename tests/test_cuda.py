"""On a CUDA GPU: NCCL at world size 1, and 2 gloo ranks sharing the GPU with CUDA tensors.

Marked ``cuda`` (``pytest -m cuda`` runs them; scripts/gpu_check.sh runs this
file alone). Each trains a model whose gradients span several buckets through
a reducer that exists (at world size 1 it is forced: ``replicate()`` builds
none there), and the first step's bucket rebuild is run on a side stream
while the default stream reuses memory. On a machine without a GPU they
skip, saying so; the CPU suite covers the same reducer on gloo.
"""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist
from torch import nn

from local_ranks import launch
from parity import assert_grads_match, assert_replicas_identical, seeded, sgd_step
from torchreplicate import replicate

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; this machine has none"),
]

CAP_MB = 0.25  # a Linear(256, 256)'s weight: one bucket per layer or so
MIN_BUCKETS = 3
SLEEP_CYCLES = 50_000_000  # torch.cuda._sleep: ~25 ms at 2 GHz
LAUNCH_S = 60  # each test's ranks (scripts/gpu_check.py limits each test to less with pytest-timeout)


class Wide(nn.Module):
    """An MLP whose gradients (4 x 256 KiB of weights) span at least ``MIN_BUCKETS`` buckets at ``CAP_MB``."""

    def __init__(self) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Linear(64, 256), nn.ReLU()]
        for _ in range(4):
            layers += [nn.Linear(256, 256), nn.ReLU()]
        self.layers = nn.Sequential(*layers, nn.Linear(256, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def batch(rank: int, step: int) -> torch.Tensor:
    """Rank ``rank``'s input at ``step`` (the reference sees every rank's)."""
    return torch.randn(16, 64, generator=torch.Generator().manual_seed(100 * step + rank))


class Trained(NamedTuple):
    rank: int
    steps: int
    buckets: int  # the reducer's buckets after the last step


def replicated(rank: int, device: torch.device, **options: object) -> nn.Module:
    """``replicate()`` of rank ``rank``'s ``Wide`` (rank 0's values are broadcast) at ``CAP_MB``, with its
    reducer installed even at world size 1."""
    model = replicate(seeded(Wide, 1 + rank).to(device), bucket_cap_mb=CAP_MB, **options)
    state = replicate.state(model)
    if state.reducer is None:
        state.make_reducer()
    return model


def bucket_count(model: nn.Module) -> int:
    """How many buckets the model's reducer has now."""
    reducer = replicate.state(model).reducer
    assert reducer is not None, "no reducer"
    return len(reducer.buckets)


def train_against_reference(backend: str) -> Trained:
    """Every rank trains on its own batches; the reference sees them all; grads and replicas compared."""
    dist.init_process_group(backend)  # launch() set the rank, world size and address
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    model = replicated(rank, device)
    reference = seeded(Wide, 1).to(device)
    for step in range(4):
        xs = [batch(r, step).to(device) for r in range(world_size)]
        model(xs[rank]).pow(2).mean().backward()
        torch.stack([reference(x).pow(2).mean() for x in xs]).mean().backward()
        assert_grads_match(model, reference, f"rank {rank} step {step}")
        sgd_step(model, reference, lr=0.1)
        assert_replicas_identical(model, f"rank {rank} after step {step}")
    buckets = bucket_count(model)
    dist.destroy_process_group()
    return Trained(rank, 4, buckets)


def slow_rebuild(model: nn.Module) -> None:
    """Keeps the current stream busy (``torch.cuda._sleep``) right before the reducer's bucket rebuild
    queues its copies from the old buckets: the copies surely run after the default stream has had
    the chance to reuse the old buffers' memory (without it, the host's waits at the end of the first
    backward may let the side stream drain first and hide the race)."""
    reducer = replicate.state(model).reducer
    assert reducer is not None and hasattr(reducer, "_rebuild_buckets"), "the reducer's rebuild moved"
    rebuild = reducer._rebuild_buckets

    def sleep_then_rebuild() -> None:
        torch.cuda._sleep(SLEEP_CYCLES)
        rebuild()

    reducer._rebuild_buckets = sleep_then_rebuild  # type: ignore[method-assign]


def scribble(sizes: list[tuple[int, torch.dtype]], device: torch.device) -> list[torch.Tensor]:
    """On the default stream: new tensors of the given sizes (each 4 times), filled with NaN: where the
    caching allocator hands out a freed bucket buffer before its last reader ran, that reader sees NaN."""
    with torch.cuda.stream(torch.cuda.default_stream(device)):
        return [torch.full((n,), float("nan"), dtype=dtype, device=device) for n, dtype in sizes * 4]


def rebuild_on_a_side_stream(backend: str) -> Trained:
    """``gradient_as_bucket_view=True``, ``replicate()`` on the default stream, then every step on a side
    stream that sleeps before backward; the first step's rebuild (its copies delayed, ``slow_rebuild``)
    frees the old buckets, allocated on the default stream, while the default stream scribbles NaN over
    whatever memory it gets, after backward and after the optimizer step: ``.grad`` still the reference's."""
    dist.init_process_group(backend)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    model = replicated(rank, device, gradient_as_bucket_view=True)
    reference = seeded(Wide, 1).to(device)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference)]
    slow_rebuild(model)
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    for step in range(4):
        reducer = replicate.state(model).reducer
        assert reducer is not None
        sizes = [(bucket.buffer.numel(), bucket.buffer.dtype) for bucket in reducer.buckets]  # no reference kept
        del reducer
        with torch.cuda.stream(side):
            xs = [batch(r, step).to(device) for r in range(world_size)]
            torch.cuda._sleep(SLEEP_CYCLES)
            model(xs[rank]).pow(2).mean().backward()
            junk = scribble(sizes, device)
            torch.stack([reference(x).pow(2).mean() for x in xs]).mean().backward()
            for optimizer in optimizers:
                optimizer.step()  # lets go of what the step held (TrainingClock.held)
            junk += scribble(sizes, device)
        side.synchronize()
        torch.cuda.synchronize(device)
        del junk
        assert_grads_match(model, reference, f"rank {rank} step {step} on a side stream")
        assert_replicas_identical(model, f"rank {rank} after step {step} on a side stream")
        for optimizer in optimizers:
            optimizer.zero_grad()
    buckets = bucket_count(model)
    dist.destroy_process_group()
    return Trained(rank, 4, buckets)


def test_nccl_world_size_one_with_a_reducer_over_several_buckets_trains_like_local():
    [trained] = launch(train_against_reference, 1, ("nccl",), timeout_s=LAUNCH_S)
    assert trained[:2] == (0, 4) and trained.buckets >= MIN_BUCKETS, trained


def test_two_gloo_ranks_share_the_gpu_with_cuda_tensors_over_several_buckets():
    results = launch(train_against_reference, 2, ("gloo",), timeout_s=LAUNCH_S)
    assert [r[:2] for r in results] == [(0, 4), (1, 4)], results
    assert all(r.buckets >= MIN_BUCKETS for r in results), results


def test_the_first_steps_rebuild_on_a_side_stream_survives_the_default_stream_reusing_memory():
    # issue 59 item 4: the old buckets' buffers are kept (record_stream) until the side stream copied them
    results = launch(rebuild_on_a_side_stream, 2, ("gloo",), timeout_s=LAUNCH_S)
    assert [r[:2] for r in results] == [(0, 4), (1, 4)], results
    assert all(r.buckets >= MIN_BUCKETS for r in results), results
