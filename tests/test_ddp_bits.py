"""DDP's bits at default options: the same seeded job under DDP and under ``replicate()`` ends bit for bit equal.

A team moving a job from DDP diffs the checkpoints. At 2 ranks that proves
nothing (a sum of two is the same in any order), so every job here runs at 3
and at 4 ranks, each engine in fresh processes, and the final parameters
(and buffers) are compared bit for bit. Each job feeds every rank its own
inputs (and its own dropout stream), so a missing or doubled average fails
too. The options are DDP's, passed alike to both: ``replicate(model, **opts)``
against ``DistributedDataParallel(model, **opts)``, at DDP's defaults and
with ``gradient_as_bucket_view=True``, with ``zero_grad()`` at its default and
with ``set_to_none=False``. What breaks the promise is listed in
docs/migration.md (nested ``replicate()``, the opt-in layouts).
"""

from __future__ import annotations

import hashlib
import math
import time
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
from torch import nn

from local_ranks import launch
from torchreplicate.reducer.flags import num_flags

STEPS = 7  # past DDP's first iteration and its rebuild, and a few steps on the rebuilt buckets
VOCAB, CONTEXT, WIDTH = 96, 8, 32


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.attn = nn.MultiheadAttention(WIDTH, 2, dropout=0.1, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH), nn.Dropout(0.1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(x)


class TiedGPT(nn.Module):
    """Two blocks, the LM head tied to the token embedding (GPT-2's), dropout 0.1."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, WIDTH)
        self.wpe = nn.Embedding(CONTEXT, WIDTH)
        self.drop = nn.Dropout(0.1)
        self.blocks = nn.Sequential(Block(), Block())
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1])))
        return self.head(self.norm(self.blocks(x)))


class Unused(nn.Module):
    """A trunk and two heads; the aux head runs on some steps only, on some ranks only."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(24, 64), nn.Tanh(), nn.Linear(64, 64))
        self.head = nn.Linear(64, 4)
        self.aux = nn.Linear(64, 4)

    def forward(self, x: torch.Tensor, use_aux: bool = False) -> torch.Tensor:
        h = torch.tanh(self.trunk(x))
        return self.head(h) + (self.aux(h) if use_aux else 0)


def layer_norm_stack() -> nn.Module:
    return nn.Sequential(*[nn.Sequential(nn.Linear(128, 128), nn.LayerNorm(128)) for _ in range(64)])


def mlp(width: int = 512, depth: int = 6) -> nn.Module:
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(depth)])


class MixedDtypes(nn.Module):
    """An fp32 trunk and an fp64 head: DDP keeps one bucket list per dtype, each with its own first cap."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = mlp(256, 5)
        self.head = nn.Sequential(nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 256)).double()
        self.tail = nn.Linear(256, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tail(self.head(self.trunk(x).double()).float())


def batch_norm_net() -> nn.Module:
    return nn.Sequential(nn.Linear(24, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 64), nn.BatchNorm1d(64))


def floats(width: int) -> Callable[[torch.Generator], torch.Tensor]:
    return lambda g: torch.randn(6, width, generator=g)


def tokens(g: torch.Generator) -> torch.Tensor:
    return torch.randint(0, VOCAB, (4, CONTEXT), generator=g)


def lm_loss(model: nn.Module, x: torch.Tensor, step: int, rank: int) -> torch.Tensor:
    logits = model(x)
    return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), x[:, 1:].reshape(-1))


def square_loss(model: nn.Module, x: torch.Tensor, step: int, rank: int) -> torch.Tensor:
    return model(x).pow(2).mean()


def unused_loss(model: nn.Module, x: torch.Tensor, step: int, rank: int) -> torch.Tensor:
    return model(x, use_aux=(step + rank) % 3 == 0).pow(2).mean()  # aux: used by some ranks, some steps


def adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1)


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


# name: (model, batch, loss, optimizer, options for both engines, micro-batches per step, clip)
JOBS: dict[str, tuple[Callable[[], nn.Module], Callable, Callable, Callable, dict[str, Any], int, bool]] = {
    "tied_gpt": (TiedGPT, tokens, lm_loss, adamw, {}, 1, False),
    "layer_norm_stack": (layer_norm_stack, floats(128), square_loss, sgd, {}, 1, False),
    "mlp_adamw_clipped": (mlp, floats(512), square_loss, adamw, {}, 1, True),
    "batch_norm": (batch_norm_net, floats(24), square_loss, sgd, {}, 1, False),
    "unused_some_steps": (Unused, floats(24), unused_loss, adamw, {"find_unused_parameters": True}, 1, False),
    "bucket_cap_mb": (mlp, floats(512), square_loss, sgd, {"bucket_cap_mb": 1.5}, 1, False),
    "no_sync_accumulation": (layer_norm_stack, floats(128), square_loss, adamw, {}, 3, False),
    "static_graph": (mlp, floats(512), square_loss, adamw, {"static_graph": True, "bucket_cap_mb": 1}, 1, False),
    "mixed_dtypes": (MixedDtypes, floats(256), square_loss, sgd, {"bucket_cap_mb": 0.5}, 1, False),
}
VARIANTS = [  # (DDP's gradient_as_bucket_view, zero_grad's set_to_none)
    (False, True),
    (False, False),
    (True, True),
    (True, False),
]


def digest(tensors: Any) -> str:
    h = hashlib.sha256()
    for tensor in tensors:
        h.update(tensor.detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def run_job(name: str, engine: str, gbv: bool, set_to_none: bool) -> str:
    build, make_batch, loss_fn, make_optimizer, options, micro, clip = JOBS[name]
    rank = dist.get_rank()
    torch.manual_seed(1234)
    model = build()
    initial = digest(model.parameters())
    options = {**options, **({"gradient_as_bucket_view": True} if gbv else {})}
    if engine == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        wrapped = DDP(model, **options)
    else:
        from torchreplicate import replicate

        wrapped = replicate(model, **options)
    optimizer = make_optimizer(wrapped.parameters())
    torch.manual_seed(77 + rank)  # each rank's own dropout stream
    for step in range(STEPS):
        for k in range(micro):
            x = make_batch(torch.Generator().manual_seed(10_000 * step + 100 * k + rank))
            if k < micro - 1:
                with wrapped.no_sync():
                    loss_fn(wrapped, x, step, rank).backward()
            else:
                loss_fn(wrapped, x, step, rank).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(wrapped.parameters(), 0.5)
        optimizer.step()
        optimizer.zero_grad(set_to_none=set_to_none)
    # the parameters, then the buffers: a rank's BatchNorm statistics are its own after the last forward
    return f"{initial}->{digest(model.parameters())} {digest(model.buffers())}"


def all_reduce_sizes(engine: str, name: str) -> list[int]:
    """The elements of every all-reduce (and all-gather) of one steady step of job ``name`` at default
    options, in order (torch.profiler's ``gloo:`` events: DDP's reducer issues its own from C++)."""
    from torch.profiler import ProfilerActivity, profile

    build, make_batch, loss_fn, make_optimizer, options, _, _ = JOBS[name]
    torch.manual_seed(1234)
    model = build()
    if engine == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        wrapped = DDP(model, **options)
    else:
        from torchreplicate import replicate

        wrapped = replicate(model, **options)
    optimizer = make_optimizer(wrapped.parameters())
    rank = dist.get_rank()

    def step(i: int) -> None:
        loss_fn(wrapped, make_batch(torch.Generator().manual_seed(i + 100 * rank)), i, rank).backward()
        optimizer.step()
        optimizer.zero_grad()

    for i in range(3):
        step(i)
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        step(3)
        # gloo's threads close their all-reduce events after the work completes: a barrier (recorded as
        # gloo:barrier) and a moment, so the profiler stops after them (once seen: none counted, torch 2.9.1)
        dist.barrier()
        time.sleep(0.2)
    # the flags' sums on the host are an all-gather and a local sum (faults/wire.py's SummedGather): counted
    # with the all-reduces, by the elements each rank sends
    return [
        math.prod((event.input_shapes or [[]])[0] or [0])
        for event in prof.events()
        if event.name in ("gloo:all_reduce", "gloo:all_gather")
    ]


COUNTED = ("tied_gpt", "layer_norm_stack")  # the jobs whose steady step's all-reduces are compared


def every_job(engine: str) -> dict[str, Any]:
    """Every job and variant on this rank, in one process; digests by name, then the all-reduces counted."""
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    results: dict[str, Any] = {
        f"{name} gbv={gbv} set_to_none={none}": run_job(name, engine, gbv, none)
        for name in JOBS
        for gbv, none in VARIANTS
    }
    results["all-reduces"] = {name: all_reduce_sizes(engine, name) for name in COUNTED}
    return results


@pytest.fixture(scope="module", params=[3, 4], ids=["3 ranks", "4 ranks"])
def runs(request) -> tuple[int, list[dict[str, str]], list[dict[str, str]]]:
    world_size = request.param
    ddp = launch(every_job, nprocs=world_size, args=("ddp",), timeout_s=240, threads_per_rank=1)
    ours = launch(every_job, nprocs=world_size, args=("ours",), timeout_s=240, threads_per_rank=1)
    return world_size, ddp, ours


def test_every_rank_ends_with_the_same_parameters(runs):
    world_size, ddp, ours = runs
    for engine, results in (("ddp", ddp), ("ours", ours)):
        for rank in range(1, world_size):
            for key, value in results[rank].items():
                if key == "all-reduces":
                    continue
                assert value.split()[0] == results[0][key].split()[0], f"{engine}: rank {rank} differs in {key}"


@pytest.mark.parametrize("job", list(JOBS))
def test_the_job_ends_with_ddps_bits(runs, job):
    world_size, ddp, ours = runs
    differ = sorted(
        {
            key
            for rank in range(world_size)
            for key in ddp[rank]
            if key.startswith(job + " ") and ours[rank][key] != ddp[rank][key]
        }
    )
    assert not differ, f"{world_size} ranks: ours and DDP end with different bits in {differ}"


@pytest.mark.parametrize("job", COUNTED)
def test_a_steady_step_sums_ddps_buckets_and_one_small_all_reduce_of_flags(runs, job):
    """The all-reduces of a steady step: DDP's buckets, of the same sizes (the tied embedding whole, in its
    bucket: no rows round at default options), and one more, the flags' own (flags.py).

    Sizes, not positions: the profiler records each all-reduce on the gloo thread that runs it, and
    the last bucket's and the flags' run side by side, so either may be recorded first.
    """
    world_size, ddp, ours = runs
    flags = num_flags(len(list(JOBS[job][0]().parameters())))
    for rank in range(world_size):
        theirs, mine = ddp[rank]["all-reduces"][job], list(ours[rank]["all-reduces"][job])
        assert theirs, f"{job}: no all-reduce counted under DDP"
        assert flags in mine, f"{job}, rank {rank}: no all-reduce of the flags' {flags} elements in {mine}"
        mine.remove(flags)
        assert sorted(mine) == sorted(theirs), f"{job}, rank {rank}: buckets {mine} where DDP's are {theirs}"


def test_the_comparison_is_not_vacuous(runs):
    """Every job moved its model's weights on both engines."""
    _, ddp, ours = runs
    for results in (ddp[0], ours[0]):
        for key, value in results.items():
            if key == "all-reduces":
                continue
            initial, final = value.split()[0].split("->")
            assert initial != final, f"{key}: the weights did not move"


# -- the opt-in that keeps a resumed run's bits ---------------------------------------------------


def resumed_and_uninterrupted(layout: str) -> tuple[str, str]:
    """6 steps in one go, and 3 steps, a checkpoint, a fresh model and optimizer loading it, 3 more."""
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    from torchreplicate import replicate

    rank = dist.get_rank()

    def train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: range) -> None:
        for step in steps:
            square_loss(model, floats(512)(torch.Generator().manual_seed(100 * step + rank)), step, rank).backward()
            optimizer.step()
            optimizer.zero_grad()

    def fresh(state: Any = None) -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(1234)
        model = mlp()
        if state is not None:
            model.load_state_dict(state[0])
        model = replicate(model, bucket_layout=layout, bucket_cap_mb=1.5)
        optimizer = adamw(model.parameters())
        if state is not None:
            optimizer.load_state_dict(state[1])
        return model, optimizer

    model, optimizer = fresh()
    train(model, optimizer, range(6))
    uninterrupted = digest(model.parameters())
    model, optimizer = fresh()
    train(model, optimizer, range(3))
    checkpoint = (model.state_dict(), optimizer.state_dict())
    model, optimizer = fresh(checkpoint)
    train(model, optimizer, range(3, 6))
    return uninterrupted, digest(model.parameters())


def test_a_fixed_layout_resumes_with_the_bits_of_an_uninterrupted_run():
    """bucket_layout="fixed": one layout from the first step on, so a run resumed from a checkpoint at
    3 ranks ends as the uninterrupted run does (DDP's layout changes after its first step, so a resumed
    DDP run, and ours at default options, need not)."""
    for rank, (uninterrupted, resumed) in enumerate(
        launch(resumed_and_uninterrupted, nprocs=3, args=("fixed",), timeout_s=180, threads_per_rank=1)
    ):
        assert resumed == uninterrupted, f"rank {rank}: the resumed run's bits differ from the uninterrupted run's"
